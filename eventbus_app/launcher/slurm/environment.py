"""``eventbus run`` under SLURM: what torchrun makes a person type, read from SLURM's
environment (docs/slurm.md, "Zero configuration under srun").

Where SLURM launched the agent as a task of an ``srun`` step (``SLURM_JOB_ID`` and a
numbered ``SLURM_STEP_ID`` set), the options not given are derived:

* ``--nnodes``: the step's node count (the job's where the step does not say);
* ``--rdzv-backend c10d`` and ``--rdzv-endpoint ADDR:PORT``: the first node of the step's
  nodelist, at the address SLURM knows it by (its ``NodeAddr`` in ``scontrol show node``,
  the name where that cannot be read), on a port every node computes alike from the job id
  (:func:`rendezvous_port`); the first node hosts its store (``--rdzv-conf is_host=1``,
  ``is_host=0`` on the others, where ``--rdzv-conf`` does not say);
* ``--rdzv-id``: the job id; ``ARRAYJOB_TASK`` for a task of an array job;
* ``--local-addr``: this node's own ``NodeAddr`` (``SLURMD_NODENAME``'s), the address
  the node advertises to the others (rank 0's node as the workers' ``MASTER_ADDR``), where
  torch would take the machine's hostname, which need not resolve to it.

``--standalone`` derives nothing. More than one task on a node is a usage error
(:class:`SlurmUsageError`): the agent is the node's one launcher. An allocation's shell
or a batch script (a job id, no step) derives nothing either; where the job has several
nodes that is said in a line (:func:`not_a_step_line`).

The ledger's side: under SLURM the host is ``SLURMD_NODENAME`` (:func:`node_name`) and a
requeued run keeps its own rows (:func:`ledger_job`).

Pure functions of an environment mapping, with ``scontrol`` injectable; torch-free.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import MutableMapping
from typing import Any

import attrs

from eventbus.app.launcher.slurm.hostlist import HostlistError
from eventbus.app.launcher.slurm.hostlist import expand

__all__ = [
    "DERIVED_DESTS",
    "PORT_BASE",
    "PORT_SPAN",
    "SCONTROL_TIMEOUT_S",
    "Derivation",
    "SlurmStep",
    "SlurmUsageError",
    "check_one_task_per_node",
    "derive",
    "export_node_name",
    "fill_args",
    "LEDGER_JOB_KEY",
    "ledger_job",
    "requeued_run",
    "node_addr",
    "node_name",
    "not_a_step_line",
    "read_step",
    "rendezvous_port",
    "run_scontrol",
    "unset_namespace",
]

#: the rendezvous port is PORT_BASE + the job id modulo PORT_SPAN: 15000-24999, below
#: Linux's ephemeral ports (32768 up); the rule of Lightning's SLURM environment
PORT_BASE = 15000
PORT_SPAN = 10000
#: the longest wait for ``scontrol show node``
SCONTROL_TIMEOUT_S = 10.0
#: SLURM's own step ids (batch script, extern, interactive, pending) start here: a task of
#: such a step is not an ``srun`` step of the job
_SPECIAL_STEP_IDS = 0xFFFFFFFA

#: the torchrun options this module may derive (argparse's dests)
DERIVED_DESTS = ("nnodes", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "local_addr")

_NODE_ADDR = re.compile(r"(?:^|\s)NodeAddr=(\S+)")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


class SlurmUsageError(ValueError):
    """SLURM's environment asks for what ``eventbus run`` cannot do; the text says what to
    set instead."""


class _Unset:
    """The value of a derivable option the command line did not give."""

    def __repr__(self) -> str:
        return "<not given>"


_UNSET = _Unset()


@attrs.frozen
class SlurmStep:
    """What SLURM says about the ``srun`` task this agent is."""

    job_id: str
    step_id: str
    #: the rendezvous id: the job id, ``ARRAYJOB_TASK`` for a task of an array
    rdzv_id: str
    #: the step's nodes, in SLURM's order (the first hosts the rendezvous)
    nodes: tuple[str, ...]
    #: the nodelist as SLURM gave it (compressed)
    nodelist: str
    #: this node's name (``SLURMD_NODENAME``), when SLURM says
    node: str | None
    #: tasks of the step on each node, where SLURM says
    tasks_per_node: tuple[int, ...]
    #: the step's tasks, where SLURM says
    tasks: int | None

    @property
    def nnodes(self) -> int:
        return len(self.nodes)


@attrs.frozen
class Derivation:
    """What was derived (argparse dest -> value) and the console line that says so."""

    values: dict[str, str]
    line: str
    #: whether this node hosts the derived rendezvous's store (torch's ``is_host``
    #: rendezvous setting), where the endpoint was derived and SLURM names this node
    is_host: bool | None = None


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` set (non-empty) in ``env``: (name, value)."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def _count(env: Mapping[str, str], *names: str) -> int | None:
    found = _first(env, *names)
    if found is None:
        return None
    name, value = found
    try:
        number = int(value)
    except ValueError:
        raise SlurmUsageError(f"${name}={value!r} is not a count; is this SLURM's own "
                              "environment?") from None
    if number < 1:
        raise SlurmUsageError(f"${name}={value!r}: expected a count >= 1")
    return number


def _tasks_per_node(text: str, name: str) -> tuple[int, ...]:
    """SLURM's ``2(x3),1`` -> ``(2, 2, 2, 1)``."""
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS.match(part.strip())
        if match is None:
            raise SlurmUsageError(f"${name}={text!r}: expected SLURM's form, e.g. 1(x4) or 2,1")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return tuple(counts)


def _step_id(env: Mapping[str, str]) -> str | None:
    """The numbered step this task belongs to, or None (no step; a batch script, the
    extern or an interactive step)."""
    found = _first(env, "SLURM_STEP_ID", "SLURM_STEPID")
    if found is None:
        return None
    value = found[1]
    if not value.isdigit() or int(value) >= _SPECIAL_STEP_IDS:
        return None
    return value


def read_step(env: Mapping[str, str]) -> SlurmStep | None:
    """The ``srun`` task of ``env``, or None where SLURM did not start this process as one.
    Raises :class:`SlurmUsageError` for values SLURM would not set."""
    job = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
    step_id = _step_id(env)
    if job is None or step_id is None:
        return None
    job_id = job[1]
    array_job = _first(env, "SLURM_ARRAY_JOB_ID")
    array_task = _first(env, "SLURM_ARRAY_TASK_ID")
    rdzv_id = f"{array_job[1]}_{array_task[1]}" if array_job and array_task else job_id
    listed = _first(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    if listed is None:
        raise SlurmUsageError("SLURM_JOB_ID and SLURM_STEP_ID are set but no nodelist "
                              "(SLURM_STEP_NODELIST, SLURM_JOB_NODELIST): give --nnodes, "
                              "--rdzv-backend, --rdzv-endpoint and --rdzv-id")
    try:
        nodes = tuple(expand(listed[1]))
    except HostlistError as exc:
        raise SlurmUsageError(f"${listed[0]}: {exc}") from None
    if not nodes:
        raise SlurmUsageError(f"${listed[0]}={listed[1]!r} names no node")
    count = _count(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if count is not None and count != len(nodes):
        raise SlurmUsageError(f"${listed[0]}={listed[1]!r} names {len(nodes)} nodes but the "
                              f"step has {count} (SLURM_STEP_NUM_NODES / SLURM_NNODES)")
    per_node = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    tasks_per_node = _tasks_per_node(per_node[1], per_node[0]) if per_node else ()
    return SlurmStep(
        job_id=job_id, step_id=step_id, rdzv_id=rdzv_id, nodes=nodes, nodelist=listed[1],
        node=(env.get("SLURMD_NODENAME") or "").strip() or None,
        tasks_per_node=tasks_per_node,
        tasks=_count(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))


def check_one_task_per_node(step: SlurmStep, env: Mapping[str, str]) -> None:
    """A :class:`SlurmUsageError` where SLURM started more than one task on a node."""
    per_node = _count(env, "SLURM_NTASKS_PER_NODE")
    most = max((per_node or 1, *step.tasks_per_node))
    tasks = step.tasks or 0
    if most <= 1 and tasks <= step.nnodes:
        return
    said = (f"{most} tasks on a node" if most > 1
            else f"{tasks} tasks on {step.nnodes} node{'s' if step.nnodes > 1 else ''}")
    raise SlurmUsageError(
        f"SLURM started {said} (job {step.job_id}, step {step.step_id}); eventbus run is "
        "the node's one launcher and starts --nproc-per-node workers itself: run one task "
        "per node, e.g. srun --ntasks-per-node=1 python -m eventbus run --nproc-per-node "
        "GPUS train.py (in sbatch: #SBATCH --ntasks-per-node=1)")


def rendezvous_port(job_id: str) -> int:
    """The rendezvous port of a job: the same on every node of it, different for jobs
    whose ids differ by less than :data:`PORT_SPAN`."""
    digits = re.sub(r"\D", "", job_id)
    return PORT_BASE + (int(digits) if digits else 0) % PORT_SPAN


def run_scontrol(node: str) -> str | None:
    """``scontrol show node -o NODE``'s output, or None when it cannot be had within
    :data:`SCONTROL_TIMEOUT_S`."""
    try:
        done = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True,
                              text=True, timeout=SCONTROL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def node_addr(node: str, scontrol: Callable[[str], str | None] = run_scontrol) -> str | None:
    """The address SLURM reaches ``node`` at (``NodeAddr=``), or None when ``scontrol``
    does not say."""
    try:
        out = scontrol(node)
    except Exception:
        return None
    match = _NODE_ADDR.search(out or "")
    if match is None or match[1] in ("(null)", "N/A"):
        return None
    return match[1]


def _given_text(given: Mapping[str, str]) -> str:
    return ", ".join("--" + d.replace("_", "-") for d in DERIVED_DESTS if d in given)


def derive(step: SlurmStep, given: Mapping[str, str], *,
           scontrol: Callable[[str], str | None] = run_scontrol) -> Derivation:
    """The options of :data:`DERIVED_DESTS` that ``given`` (dest -> value, as the command
    line or ``PET_*`` set them) lacks, as SLURM's step says. The rendezvous backend is
    derived only with its endpoint (``c10d``); an endpoint is derived for ``c10d`` only."""
    values: dict[str, str] = {}
    notes: list[str] = []
    is_host: bool | None = None
    if "nnodes" not in given:
        values["nnodes"] = str(step.nnodes)
    if "rdzv_backend" not in given and "rdzv_endpoint" not in given:
        values["rdzv_backend"] = "c10d"
    backend = values.get("rdzv_backend", given.get("rdzv_backend", "static"))
    first = step.nodes[0]
    addr: str | None = None
    if "rdzv_endpoint" not in given and backend == "c10d":
        addr = node_addr(first, scontrol)
        host = addr or first
        host = f"[{host}]" if ":" in host else host  # an IPv6 NodeAddr
        values["rdzv_endpoint"] = f"{host}:{rendezvous_port(step.job_id)}"
        notes.append(f"{first}'s NodeAddr" if addr is not None
                     else f"{first}: scontrol gave no NodeAddr, so its name")
        if step.node is not None and step.node in step.nodes:
            is_host = step.node == first
            if is_host:
                notes.append("this node hosts the rendezvous")
    if "rdzv_id" not in given:
        values["rdzv_id"] = step.rdzv_id
    if "local_addr" not in given and step.node is not None and step.node in step.nodes:
        own = addr if step.node == first and addr is not None else node_addr(step.node,
                                                                            scontrol)
        if own is not None:
            values["local_addr"] = own
    shown = " ".join(f"--{d.replace('_', '-')} {values[d]}" for d in DERIVED_DESTS
                     if d in values)
    where = f"{step.nnodes} node{'s' if step.nnodes > 1 else ''} {step.nodelist}"
    line = (f"SLURM job {step.rdzv_id} step {step.step_id} ({where}"
            + (f", this one {step.node}" if step.node else "") + "): "
            + (f"derived {shown}" if values else "nothing derived")
            + (f" ({'; '.join(notes)})" if notes else "")
            + (f"; given: {_given_text(given)}" if given else "")
            + ("; an option given on the command line wins" if values else ""))
    return Derivation(values=values, line=line, is_host=is_host)


def not_a_step_line(env: Mapping[str, str]) -> str | None:
    """Where a job id is set but this is no ``srun`` task of a job with several nodes (an
    ``salloc`` shell, a batch script): the line that says nothing is derived; else None."""
    job = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
    if job is None or _step_id(env) is not None:
        return None
    try:
        nodes = _count(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    except SlurmUsageError:
        return None
    if nodes is None or nodes < 2:
        return None
    return (f"SLURM job {job[1]} has {nodes} nodes but this agent is not an srun task (no "
            "SLURM_STEP_ID): nothing derived, it runs as torchrun would alone; start it "
            "with srun --ntasks-per-node=1 on every node to derive --nnodes and the "
            "rendezvous")


def unset_namespace() -> argparse.Namespace:
    """The namespace to parse ``eventbus run``'s command line into: the derivable options
    start unset, so that :func:`fill_args` tells a given value from a default."""
    return argparse.Namespace(**{dest: _UNSET for dest in DERIVED_DESTS})


def fill_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
              env: Mapping[str, str] | None = None, *,
              scontrol: Callable[[str], str | None] = run_scontrol) -> str | None:
    """Give every derivable option of ``args`` (parsed into :func:`unset_namespace`) its
    value: the command line's, else ``PET_*``'s, else SLURM's, else torchrun's default.
    Returns the console line to print (None: nothing to say). Raises
    :class:`SlurmUsageError`."""
    environ = os.environ if env is None else env
    defaults = {a.dest: a.default for a in parser._actions if a.dest in DERIVED_DESTS}
    given: dict[str, str] = {}
    for dest in DERIVED_DESTS:
        value = getattr(args, dest, _UNSET)
        if value is not _UNSET:
            given[dest] = str(value)
        elif f"PET_{dest.upper()}" in environ:  # torchrun's own environment options
            given[dest] = str(defaults.get(dest))
    line: str | None = None
    derived: dict[str, str] = {}
    if not getattr(args, "standalone", False) and len(given) < len(DERIVED_DESTS):
        step = read_step(environ)
        if step is not None:
            check_one_task_per_node(step, environ)
            derivation = derive(step, given, scontrol=scontrol)
            derived = derivation.values
            line = derivation.line if derived else None
            if derivation.is_host is not None:
                args.rdzv_conf = _with_is_host(getattr(args, "rdzv_conf", "") or "",
                                               derivation.is_host)
        else:
            line = None if "nnodes" in given else not_a_step_line(environ)
    for dest in DERIVED_DESTS:
        if getattr(args, dest, _UNSET) is _UNSET:
            setattr(args, dest, derived.get(dest, defaults.get(dest)))
    return line


def _with_is_host(conf: str, is_host: bool) -> str:
    """torchrun's ``--rdzv-conf`` with ``is_host`` added, unless it says already. The
    first node hosts the store by SLURM's word, not by torch's guess from this machine's
    names and addresses (which misses an address of a second network card, and fails
    where the machine's own name is not in DNS)."""
    keys = {item.partition("=")[0].strip() for item in conf.split(",") if item.strip()}
    if "is_host" in keys:
        return conf
    item = f"is_host={'1' if is_host else '0'}"
    return f"{conf},{item}" if conf.strip() else item


def node_name(env: Mapping[str, str] | None = None) -> str | None:
    """This host's name for the ledger and the events where it is not the machine's:
    ``EVENTBUS_HOSTNAME``, else SLURM's node name (``SLURMD_NODENAME``), else None."""
    environ = os.environ if env is None else env
    for name in ("EVENTBUS_HOSTNAME", "SLURMD_NODENAME"):
        value = (environ.get(name) or "").strip()
        if value:
            return value
    return None


def export_node_name(env: MutableMapping[str, str] | None = None) -> str | None:
    """Under SLURM, without ``EVENTBUS_HOSTNAME``: set it to ``SLURMD_NODENAME`` in
    ``env`` (default: this process's environment, which the workers inherit), so that the
    ledger, the events' context and the workers' name the node as SLURM does. Returns the
    name set, or None."""
    environ = os.environ if env is None else env
    if (environ.get("EVENTBUS_HOSTNAME") or "").strip():
        return None
    name = (environ.get("SLURMD_NODENAME") or "").strip()
    if not name:
        return None
    environ["EVENTBUS_HOSTNAME"] = name
    return name


#: ``AGENT_START.data`` key of a requeued run's ledger key (:func:`ledger_job`), so that
#: ``eventbus hosts --from`` tells the runs of a requeued job apart in its events files
LEDGER_JOB_KEY = "ledger_job"


def ledger_job(run_id: str, env: Mapping[str, str] | None = None) -> str:
    """The ledger's job key of a run: the run id, with ``+requeueN`` after it in the Nth
    requeue of a SLURM job (``SLURM_RESTART_COUNT``), so that a requeued run, same job id
    and same attempts, never overwrites the rows of an earlier run."""
    environ = os.environ if env is None else env
    restarts = (environ.get("SLURM_RESTART_COUNT") or "").strip()
    if restarts.isdigit() and int(restarts) > 0:
        return f"{run_id}+requeue{int(restarts)}"
    return run_id


def requeued_run(run_id: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``AGENT_START``'s extra fields in a requeued run of a SLURM job: ``data`` with the
    run's ledger key (:data:`LEDGER_JOB_KEY`); none in any other run."""
    job = ledger_job(run_id, env)
    return {"data": {LEDGER_JOB_KEY: job}} if job != run_id else {}
