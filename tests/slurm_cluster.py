"""A real Slurm cluster for the tests: Debian's slurmctld, slurmd and munged, one controller
and three compute nodes, each node in a network namespace of its own with its own address.

Everything lives in a temporary folder and reaches the daemons and the client commands
through ``SLURM_CONF``; nothing in /etc is written. munged runs with a fresh
key on a private socket (``AuthInfo=socket=...``). Each node ``nK`` is a namespace
``ebslurm<pid>nK`` joined by a veth pair (``eth0`` inside, ``ebv<pid>nK`` outside) to a
bridge ``ebbr<pid>`` in the root namespace; the bridge holds the controller's address
(``.1``), the nodes ``.2``, ``.3``, ``.4`` of a private /24 in 10.64.0.0/10 that no route
of this machine uses. Traffic stays between these namespaces and the root one. Each node
also has its own host name (``nK``, a UTS namespace), and the controller and the nodes
read a copy of /etc/hosts with the nodes' names at their addresses (bound over /etc/hosts
in a mount namespace of each daemon): the controller reaches a job's ``srun`` at the host
name it gave, as on a real cluster.

:func:`slurm_cluster` (session-scoped, registered in tests/conftest.py) starts it once per
pytest session, about 2 s, or skips naming why (no Slurm packages: ``make slurm`` installs
them; not root; no ``ip netns``). Every wait is bounded; teardown cancels every job, stops
the daemons by PID, kills what is left in each namespace and removes the namespaces, the
bridge and the folder.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["KILL_WAIT_S", "SlurmCluster", "SlurmNode", "slurm_cluster", "slurm_cluster_or_skip"]

#: the daemons and clients, all from Debian's slurmctld, slurmd, slurm-client and munge
BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "squeue",
            "scancel", "ip", "nsenter", "unshare", "mount", "hostname")
NODE_NAMES = ("n1", "n2", "n3")
#: CPUs each node declares (SlurmdParameters=config_overrides lets it exceed the machine):
#: four jobs of one CPU side by side per node
NODE_CPUS = 4
SLURMD_PORT = 6818
#: the longest one client command may take
COMMAND_TIMEOUT_S = 30.0
#: the longest the cluster may take to come up
START_TIMEOUT_S = 30.0
#: slurm.conf's KillWait: seconds from SLURM's SIGTERM to its SIGKILL
KILL_WAIT_S = 20
#: job states after which a job never runs again without a requeue
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
            "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@dataclass(frozen=True)
class SlurmNode:
    """One compute node: its Slurm name, address, namespace, and slurmd log."""

    name: str
    addr: str
    netns: str
    host_veth: str
    log: Path


def _missing() -> str | None:
    """Why this machine cannot start the cluster, or None."""
    absent = [b for b in BINARIES if shutil.which(b, path=_path()) is None]
    if absent:
        return (f"no Slurm cluster: {', '.join(absent)} not found (`make slurm` installs "
                "Debian's slurmctld, slurmd, slurm-client, munge and iproute2; CI runs these)")
    if os.geteuid() != 0:
        return "no Slurm cluster: network namespaces and slurmd need root"
    return None


def _path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _run(*args: str, timeout: float = COMMAND_TIMEOUT_S, check: bool = True,
         env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          check=False, env=dict(env) if env is not None else None)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): "
                           f"{done.stdout}{done.stderr}")
    return done


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.64.0.0/10 that overlaps no address or route of this machine, picked
    from the PID so that two sessions side by side take different ones."""
    used = [ipaddress.ip_network(word, strict=False)
            for line in _run("ip", "-4", "route", "show", "table", "all").stdout.splitlines()
            for word in line.split()[:1] if re.match(r"^\d+\.\d+\.\d+\.\d+(/\d+)?$", word)]
    used += [ipaddress.ip_network(word, strict=False)
             for word in re.findall(r"inet (\S+)", _run("ip", "-4", "addr").stdout)]
    block = ipaddress.ip_network("10.64.0.0/10")
    count = 2 ** (24 - block.prefixlen)
    for i in range(count):
        index = (os.getpid() + i * 7919) % count
        net = ipaddress.IPv4Network((int(block.network_address) + (index << 8), 24))
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("no free /24 in 10.64.0.0/10 for the test cluster")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


SLURM_CONF = """\
ClusterName=ebtest
SlurmctldHost={ctl_host}({ctl_addr})
SlurmctldPort={ctl_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again only once the credentials of its last run have expired:
# the default 120 s would hold every requeue for two minutes
AuthInfo=socket={munge_socket},cred_expire=5
StateSaveLocation={root}/ctld
SlurmctldPidFile={root}/ctld/slurmctld.pid
SlurmctldLogFile={root}/ctld/slurmctld.log
SlurmctldDebug=info
SlurmdSpoolDir={root}/nodes/%n/spool
SlurmdPidFile={root}/nodes/%n/slurmd.pid
SlurmdLogFile={root}/nodes/%n/slurmd.log
SlurmdDebug=info
# the nodes declare more CPUs than this machine has; no cgroups in a test namespace
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
LaunchParameters=use_interactive_step
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=100000
JobRequeue=1
ReturnToService=2
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# SIGTERM to SIGKILL: long enough for a drain with --drain-grace 10 (the grace, the kill
# grace and the agents' exit: 10 + 5 + 3 s) to end before SLURM's SIGKILL, as on a real
# cluster (30 s by default). Only a job whose processes outlive a SIGTERM waits it.
KillWait={kill_wait}
MinJobAge=600
InactiveLimit=0
MessageTimeout=5
SlurmdTimeout=10
SlurmctldTimeout=10
TCPTimeout=2
WaitTime=0
UnkillableStepTimeout=10
{nodes}
PartitionName=low Nodes=ALL Default=YES PriorityTier=1 MaxTime=INFINITE State=UP
PartitionName=high Nodes=ALL PriorityTier=10 MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """One controller, three nodes: start, submit, wait, inspect, kill a node, stop."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="eventbus-slurm-"))
        self.root.chmod(0o755)
        pid = os.getpid()
        self.bridge = f"ebbr{pid}"
        net = _free_subnet()
        hosts = list(net.hosts())
        self.ctl_addr = str(hosts[0])
        self.prefixlen = net.prefixlen
        self.nodes = [
            SlurmNode(name, str(hosts[i + 1]), f"ebslurm{pid}{name}", f"ebv{pid}{name}",
                      self.root / "nodes" / name / "slurmd.log")
            for i, name in enumerate(NODE_NAMES)]
        self.conf = self.root / "slurm.conf"
        self.hosts = self.root / "hosts"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.ctl_log = self.root / "ctld" / "slurmctld.log"
        #: the environment of every client command (and, by sbatch's default --export=ALL,
        #: of every job): this process's, with SLURM_CONF and the Slurm binaries on PATH
        self.env = dict(os.environ)
        self.env.update(SLURM_CONF=str(self.conf), PATH=_path())
        for key in list(self.env):
            if key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SQUEUE_")) and key != "SLURM_CONF":
                del self.env[key]
        self._munged: subprocess.Popen[bytes] | None = None
        self._slurmctld: subprocess.Popen[bytes] | None = None
        self._slurmd: dict[str, subprocess.Popen[bytes]] = {}
        self._netns_made: list[str] = []
        self._bridge_made = False

    # -- start and stop -----------------------------------------------------------------

    def start(self) -> None:
        started = time.monotonic()
        _reap_stale()
        self._network()
        self._munge()
        self._write_conf()
        (self.root / "ctld").mkdir(exist_ok=True)
        self._hosts_file()
        self._slurmctld = _daemon(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f"mount --bind {self.hosts} /etc/hosts && exec slurmctld -D -i"], self.env,
            self.root / "ctld" / "stderr")
        for node in self.nodes:
            self._start_slurmd(node)
        self._wait_nodes_idle(START_TIMEOUT_S - (time.monotonic() - started))
        self.startup_s = time.monotonic() - started

    def _network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        _run("ip", "addr", "add", f"{self.ctl_addr}/{self.prefixlen}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for node in self.nodes:
            _run("ip", "netns", "add", node.netns)
            self._netns_made.append(node.netns)
            _run("ip", "link", "add", node.host_veth, "type", "veth", "peer", "name",
                 f"ebp{os.getpid()}{node.name}")
            _run("ip", "link", "set", f"ebp{os.getpid()}{node.name}", "netns", node.netns)
            _run("ip", "link", "set", node.host_veth, "master", self.bridge)
            _run("ip", "link", "set", node.host_veth, "up")
            inside = ("ip", "netns", "exec", node.netns, "ip")
            _run(*inside, "link", "set", f"ebp{os.getpid()}{node.name}", "name", "eth0")
            _run(*inside, "addr", "add", f"{node.addr}/{self.prefixlen}", "dev", "eth0")
            _run(*inside, "link", "set", "eth0", "up")
            _run(*inside, "link", "set", "lo", "up")

    def _munge(self) -> None:
        folder = self.munge_socket.parent
        folder.mkdir(mode=0o700)
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._munged = _daemon(
            ["munged", "-F", "--force", f"--socket={self.munge_socket}",
             f"--key-file={key}", f"--pid-file={folder / 'munged.pid'}",
             f"--log-file={folder / 'munged.log'}", f"--seed-file={folder / 'munged.seed'}"],
            self.env, folder / "stderr")
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if self._munged.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("munged did not start: "
                                   + (folder / "stderr").read_text(errors="replace"))
            time.sleep(0.02)

    def _write_conf(self) -> None:
        nodes = "\n".join(
            f"NodeName={n.name} NodeAddr={n.addr} NodeHostname={n.name} Port={SLURMD_PORT} "
            f"CPUs={NODE_CPUS} RealMemory=1000 State=UNKNOWN" for n in self.nodes)
        self.conf.write_text(SLURM_CONF.format(
            ctl_host=socket.gethostname().split(".")[0], ctl_addr=self.ctl_addr,
            ctl_port=_free_port(), munge_socket=self.munge_socket, root=self.root,
            nodes=nodes, kill_wait=KILL_WAIT_S))
        # slurmd starts its cgroup plugin whatever the task and proctrack plugins: on a
        # cgroup v2 machine without systemd (a container) it makes its scope by itself
        (self.root / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")

    def _hosts_file(self) -> None:
        """This machine's /etc/hosts with each node's name at its address, for the
        controller and the nodes (each sees it as /etc/hosts in a mount namespace of its
        own): the controller reaches an ``srun`` at the host name it gave (``n1``), e.g.
        to tell it that a node of its step failed."""
        base = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
        self.hosts.write_text(base.rstrip("\n") + "\n" + "".join(
            f"{n.addr} {n.name}\n" for n in self.nodes))
        self.hosts.chmod(0o644)

    def _start_slurmd(self, node: SlurmNode) -> None:
        (self.root / "nodes" / node.name / "spool").mkdir(parents=True, exist_ok=True)
        # nsenter, not `ip netns exec`: that one mounts a sysfs of the namespace over /sys,
        # which hides /sys/fs/cgroup, and slurmd will not start without its cgroup plugin.
        # Its own host name (UTS namespace) and /etc/hosts (mount namespace), which its
        # jobs inherit: a node is a host of its own, as on a real cluster
        self._slurmd[node.name] = _daemon(
            ["nsenter", f"--net=/run/netns/{node.netns}", "unshare", "--mount", "--uts",
             "--propagation", "private", "sh", "-c",
             f"mount --bind {self.hosts} /etc/hosts && hostname {node.name} && "
             f"exec slurmd -D -N {node.name}"],
            self.env, self.root / "nodes" / node.name / "stderr")

    def _wait_nodes_idle(self, timeout: float, names: Iterable[str] = NODE_NAMES) -> None:
        deadline = time.monotonic() + max(timeout, 1.0)
        want = set(names)
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            self._check_daemons()
            done = self.scontrol("show", "node", "-o", check=False)
            states = dict(re.findall(r"NodeName=(\S+) .*?State=(\S+)", done.stdout))
            if all(states.get(n, "").split("+")[0] in ("IDLE", "MIXED", "ALLOCATED")
                   for n in want):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the nodes did not come up in {timeout:.0f} s: {states}\n"
                           + self.ctl_log.read_text(errors="replace")[-3000:])

    def _check_daemons(self) -> None:
        for what, proc in [("munged", self._munged), ("slurmctld", self._slurmctld),
                           *self._slurmd.items()]:
            if proc is not None and proc.poll() is not None:
                logs = [self.ctl_log, *(n.log for n in self.nodes if n.name == what),
                        self.root / "ctld" / "stderr"]
                text = "".join(p.read_text(errors="replace")[-2000:]
                               for p in logs if p.exists())
                raise RuntimeError(f"{what} exited ({proc.returncode}):\n{text}")

    def close(self) -> None:
        """Cancel every job, stop the daemons, remove the namespaces, bridge and folder."""
        try:
            if self._slurmctld is not None and self._slurmctld.poll() is None:
                with contextlib.suppress(Exception):
                    self.run("scancel", "--full", "--signal=KILL", "--user=root", timeout=5)
                    self.run("scancel", "--user=root", timeout=5)
            for proc in [*self._slurmd.values(), self._slurmctld, self._munged]:
                if proc is not None and proc.poll() is None:
                    proc.terminate()
            for proc in [*self._slurmd.values(), self._slurmctld, self._munged]:
                if proc is not None:
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(timeout=5)
            for netns in self._netns_made:
                self._kill_netns(netns)
                _run("ip", "netns", "del", netns, check=False)
            if self._bridge_made:
                _run("ip", "link", "del", self.bridge, check=False)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def _kill_netns(netns: str) -> None:
        """SIGKILL every process in the namespace (slurmstepd and jobs included), bounded."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            pids = [int(p) for p in _run("ip", "netns", "pids", netns, check=False)
                    .stdout.split()]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    # -- what the tests use -------------------------------------------------------------

    def node(self, name: str) -> SlurmNode:
        return next(n for n in self.nodes if n.name == name)

    def run(self, *args: str, timeout: float = COMMAND_TIMEOUT_S, check: bool = True,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A client command (srun, scancel, sinfo...) with the cluster's environment."""
        return _run(*args, timeout=timeout, check=check, env={**self.env, **(env or {})})

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("scontrol", *args, check=check)

    def sbatch(self, script: str | Path, *args: str,
               env: Mapping[str, str] | None = None) -> int:
        """Submit ``script`` (a path, or the script's text) with sbatch's ``args``; the
        job's id. Its working directory is the cluster's folder unless args say."""
        command = ["sbatch", "--parsable", f"--chdir={self.root}", *args]
        if isinstance(script, Path):
            command.append(str(script))
            done = self.run(*command, env=env)
        else:
            done = _run_input(command, script, {**self.env, **(env or {})})
        return int(done.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o``'s fields of the job (its batch part: the first line)."""
        done = self.scontrol("show", "job", "-o", str(job_id))
        line = done.stdout.splitlines()[0]
        return dict(re.findall(r"(\S+?)=(\S*)", line))

    def wait(self, job_id: int, states: Iterable[str] = FINISHED, timeout: float = 60.0,
             poll: float = 0.2) -> dict[str, str]:
        """Poll the job until its JobState is one of ``states``; its info then. Fails
        with the job's info and the logs' tails after ``timeout`` seconds."""
        want = set(states)
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") in want:
                return info
            time.sleep(poll)
        raise AssertionError(f"job {job_id} not in {sorted(want)} after {timeout} s: "
                             f"{info}\n{self.tails()}")

    def tails(self, chars: int = 2000) -> str:
        """The end of the controller's and every slurmd's log, for a failure's message."""
        return "".join(f"--- {p}\n{p.read_text(errors='replace')[-chars:]}\n"
                       for p in [self.ctl_log, *(n.log for n in self.nodes)] if p.exists())

    def kill_node(self, name: str) -> None:
        """The node fails: its slurmd and every process in its namespace are SIGKILLed
        and its link goes down. The controller sees it NOT_RESPONDING after
        SlurmdTimeout; :meth:`restart_node` brings it back."""
        node = self.node(name)
        _run("ip", "link", "set", node.host_veth, "down")
        proc = self._slurmd.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.kill()
        self._kill_netns(node.netns)
        if proc is not None:
            proc.wait(timeout=5)

    def restart_node(self, name: str, timeout: float = 30.0) -> None:
        """Link up, slurmd started again; returns once the node is up (ReturnToService=2)."""
        node = self.node(name)
        _run("ip", "link", "set", node.host_veth, "up")
        self._start_slurmd(node)
        self._wait_nodes_idle(timeout, [name])

    def node_state(self, name: str) -> str:
        """The node's State as scontrol shows it (IDLE, MIXED, DOWN+NOT_RESPONDING...)."""
        done = self.scontrol("show", "node", "-o", name)
        found = re.search(r" State=(\S+)", done.stdout)
        return found.group(1) if found else ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap_stale() -> None:
    """Remove the namespaces and bridges an earlier session of this fixture left behind
    when it was killed before its teardown (their names carry its PID, now gone)."""
    for name in _run("ip", "netns", "list", check=False).stdout.split():
        found = re.fullmatch(r"ebslurm(\d+)n\d+", name)
        if found and not _alive(int(found.group(1))):
            SlurmCluster._kill_netns(name)
            _run("ip", "netns", "del", name, check=False)
    for name in re.findall(r"^\d+: (ebbr\d+)[:@]", _run("ip", "-o", "link").stdout, re.M):
        if not _alive(int(name[len("ebbr"):])):
            _run("ip", "link", "del", name, check=False)


def _daemon(command: list[str], env: Mapping[str, str],
            stderr: Path) -> subprocess.Popen[bytes]:
    """A daemon in the foreground (its PID is the one to stop), stderr to a file."""
    fd = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        return subprocess.Popen(command, env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=fd)
    finally:
        os.close(fd)


def _run_input(command: list[str], text: str,
               env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, input=text, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S, check=False, env=dict(env))
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): "
                           f"{done.stdout}{done.stderr}")
    return done


def slurm_cluster_or_skip() -> None:
    """Skip, naming why, where this machine cannot start the cluster."""
    why = _missing()
    if why is None:
        probe = f"ebslurmprobe{os.getpid()}"
        done = _run("ip", "netns", "add", probe, check=False)
        if done.returncode != 0:
            why = f"no Slurm cluster: `ip netns add` fails here: {done.stderr.strip()}"
        else:
            _run("ip", "netns", "del", probe, check=False)
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """The session's Slurm cluster (three nodes, partitions ``low`` and ``high``)."""
    slurm_cluster_or_skip()
    cluster = SlurmCluster()
    try:
        try:
            cluster.start()
        except RuntimeError as e:
            if "Unable to initialize cgroup plugin" in str(e):
                pytest.skip(f"no Slurm cluster: slurmd cannot start its cgroup plugin on this "
                            f"machine ({str(e)[-300:]})")
            raise
        yield cluster
    finally:
        cluster.close()
