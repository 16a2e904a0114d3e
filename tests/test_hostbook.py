"""One node's host faults in a job (eventbus_app/launcher/hosts/book.py): counting, the
eviction at ``--evict-after``, the OOM kill told from a person's ``kill -9`` by the cgroup's
count (a real OOM kill in a real memory cgroup where this machine allows one), and the exit
code table (eventbus_app/launcher/decisions/exit_codes.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eventbus.app.launcher.cli import options
from eventbus.app.launcher.decisions import exit_codes
from eventbus.app.launcher.hosts.book import HostBook
from eventbus.app.launcher.hosts.book import oom_kill_count


class FakeOom:
    def __init__(self) -> None:
        self.count: int | None = 0

    def __call__(self) -> int | None:
        return self.count


def test_two_host_faults_evict_and_script_errors_never_count() -> None:
    book = HostBook("node-3", evict_after=2, oom_kills=FakeOom())
    for _ in range(5):
        assert book.worker_failed(exit_code=1, message="ValueError: bad lr") is None
        book.new_attempt()
    assert book.total == 0 and book.evicted is None
    assert book.worker_failed(exit_code=-11) == "signal"
    assert book.evicted is None
    book.new_attempt()
    assert book.worker_stalled(waiting_on="collective", culprit=False) is None
    assert book.worker_stalled(waiting_on="spinning", culprit=True) == "hang"
    assert book.evicted == "signal, hang"
    assert book.culprits == 1 and dict(book.attempt_faults) == {"hang": 1}


def test_a_sigkill_is_an_oom_kill_only_when_the_cgroup_counted_one() -> None:
    oom = FakeOom()
    book = HostBook("n", evict_after=0, oom_kills=oom)
    assert book.worker_failed(exit_code=-9) is None  # kill -9 by a person
    book.new_attempt()
    oom.count = 1
    assert book.worker_failed(exit_code=-9) == "oom"
    assert book.worker_failed(exit_code=-9, by_agent=True) is None  # the agent's own stop
    oom.count = None  # no readable count: never an OOM kill
    book.new_attempt()
    assert book.worker_failed(exit_code=-9) is None
    assert book.evicted is None and book.total == 1  # 0: never evicts


def test_only_the_nodes_first_failure_is_read_for_its_message() -> None:
    book = HostBook("n", oom_kills=FakeOom())
    nccl = "NCCL error: unhandled system error\nncclSystemError: NET/IB : Got completion"
    assert book.worker_failed(exit_code=1, message="ValueError: x") is None
    assert book.worker_failed(exit_code=1, message=nccl) is None  # second: a consequence
    book.new_attempt()
    assert book.worker_failed(exit_code=1, message=nccl) == "nccl"


def test_a_persistent_straggler_counts_once_per_attempt() -> None:
    book = HostBook("n", evict_after=5, oom_kills=FakeOom())
    kinds = [book.worker_slow(7) for _ in range(6)]
    assert kinds == [None, None, "straggler", None, None, None]
    assert book.stragglers == 1
    book.new_attempt()
    assert [book.worker_slow(7) for _ in range(3)] == [None, None, "straggler"]
    assert book.total == 2


def test_the_exit_codes_are_one_table_of_distinct_codes() -> None:
    codes = {name: row.default for name, row in exit_codes.EXIT_CODES.items()}
    assert len(set(codes.values())) == len(codes)
    assert codes["stop"] == options.DEFAULT_STOP_EXIT_CODE
    assert codes["drain"] == options.DEFAULT_DRAIN_EXIT_CODE
    assert exit_codes.clashes(codes) is None
    clash = exit_codes.clashes({**codes, "bad_host": codes["drain"]})
    assert clash is not None and "--bad-host-exit-code 75 is --drain-exit-code too" in clash
    text = exit_codes.table_text({"bad_host": 9})
    assert "    9  this node's host was evicted" in text and "requeue on other hosts" in text


def _memory_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            found = Path("/sys/fs/cgroup/memory", path.lstrip("/"))
            return found if (found / "memory.oom_control").exists() else None
    return None


def test_a_real_oom_kill_raises_the_count_a_kill_9_does_not(tmp_path: Path) -> None:
    """In a memory cgroup of its own (cgroup v1 here; made and removed by the test, root
    only), a process reads its OOM count, lets a child be killed by `kill -9`, then one be
    killed by the kernel for going past the limit: the count rises by one, once."""
    parent = _memory_cgroup()
    if os.geteuid() != 0 or parent is None or not os.access(parent, os.W_OK):
        pytest.skip("needs root and a writable cgroup v1 memory controller")
    group = parent / f"eventbus-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(64 * 2**20))
        probe = textwrap.dedent(f"""
            import os, signal, subprocess, sys
            open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))
            from eventbus.app.launcher.hosts.book import oom_kill_count
            before = oom_kill_count()
            p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])
            p.send_signal(signal.SIGKILL); p.wait()
            after_kill = oom_kill_count()
            p = subprocess.Popen([sys.executable, '-c', 'x = bytearray(512 * 2**20)'])
            print(before, after_kill, oom_kill_count() if p.wait() == -9 else 'rc', p.returncode)
            """)
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=60, check=False)
        before, after_kill, after_oom, rc = out.stdout.split()
        assert (int(after_kill) - int(before), int(after_oom) - int(before), rc) == (0, 1, "-9")
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:  # the killed processes are still leaving the group
                time.sleep(0.1)


def test_the_count_reads_on_this_machine_or_says_none() -> None:
    count = oom_kill_count()
    assert count is None or count >= 0


def test_the_scripts_own_options_are_never_taken_for_the_launchers() -> None:
    """After SCRIPT every argument is the script's, even one that is a prefix of two of the
    launcher's options (--bad-host: --bad-host-threshold, --bad-host-exit-code) or the
    name of one (--ui); the launcher's own new options parse before SCRIPT."""
    pytest.importorskip("torch")
    from eventbus.app.launcher.command import build_parser

    args = build_parser().parse_args(
        ["--evict-after", "off", "--bad-host-exit-code", "70", "--exclude-bad-hosts",
         "train.py", "--bad-host", "node-c", "--stall", "3", "--ui", "9"])
    assert args.training_script_args == ["--bad-host", "node-c", "--stall", "3", "--ui", "9"]
    assert (args.evict_after, args.bad_host_exit_code, args.exclude_bad_hosts,
            args.ui) == (0, 70, True, None)


def test_an_evicted_node_knows_whether_it_serves_the_rendezvous_store() -> None:
    """serves_port reads /proc: a socket this process listens on counts, a port another
    process (or nobody) listens on does not."""
    import socket

    from eventbus.app.launcher.hosts.eviction import serves_port

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert serves_port(port)
    assert not serves_port(port)


def test_an_evicted_store_keeper_waits_until_the_rendezvous_closes() -> None:
    from datetime import datetime
    from datetime import timezone
    from types import SimpleNamespace

    from eventbus.app.launcher.hosts.eviction import keep_serving

    syncs = []
    state = SimpleNamespace(closed=False, last_heartbeats={
        "node-a": datetime.now(timezone.utc)})

    def sync() -> None:
        syncs.append(1)
        state.closed = len(syncs) >= 3

    keep_serving(SimpleNamespace(_state_holder=SimpleNamespace(sync=sync, state=state)),
                 poll_s=0.01)
    assert len(syncs) == 3
    # nobody beats any more: it ends after idle_s on its clock, not at the rendezvous' end
    clock = iter(range(0, 1000, 50))
    state.closed, state.last_heartbeats = False, {}
    syncs.clear()
    keep_serving(SimpleNamespace(_state_holder=SimpleNamespace(sync=lambda: None,
                                                               state=state)),
                 poll_s=0.0, idle_s=120, clock=lambda: float(next(clock)))
