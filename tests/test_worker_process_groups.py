"""A worker's torch process groups end before its interpreter finalizes (the demo's
abort: eventbus_app/worker/process_groups.py says why).

The child is a real bootstrapped worker with a real 1-rank gloo group (env://, a real
TCPStore) whose script raises, as the demo's rank 1 does. What the test observes runs in
the child's last exit hook: a ``sitecustomize`` on the child's path registers it before
the bootstrap registers anything, so it runs after every other hook, just before the
interpreter finalizes, and writes whether torch's default group is still up.
"""

from __future__ import annotations

import socket
import subprocess
import textwrap
from pathlib import Path

import pytest

from eventbus.app.worker.process_groups import end_process_groups
from tests.conftest import WORKER
from tests.conftest import subprocess_env

dist = pytest.importorskip("torch.distributed")

SITECUSTOMIZE = textwrap.dedent("""
    import atexit, os, sys

    def _last_hook():
        dist = sys.modules.get("torch.distributed")
        up = bool(dist is not None and dist.is_initialized())
        with open(os.environ["PG_REPORT"], "w") as f:
            f.write(f"initialized-at-finalization={up}\\n")

    atexit.register(_last_hook)
""")

SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(8))
    raise RuntimeError("the script fails with its process group up")
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run(tmp_path: Path, *, bootstrap: bool) -> tuple[subprocess.CompletedProcess[str], str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    script = tmp_path / "fails.py"
    script.write_text(SCRIPT)
    report = tmp_path / "report.txt"
    env = subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                         WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1",
                         PG_REPORT=str(report))
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    command = [*WORKER, str(script)] if bootstrap else [WORKER[0], str(script)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    return proc, report.read_text() if report.exists() else ""


@pytest.mark.slow
def test_a_failing_worker_ends_its_process_group_before_finalizing(tmp_path: Path) -> None:
    """Under the bootstrap the failing script's gloo group is gone before the interpreter
    finalizes (no gloo thread left to re-take the GIL there), the exit code is still the
    script's (1), and nothing is said about it."""
    proc, report = _run(tmp_path, bootstrap=True)
    assert proc.returncode == 1, proc.stderr
    assert "the script fails with its process group up" in proc.stderr
    assert report == "initialized-at-finalization=False\n", (report, proc.stderr)
    assert "terminate called" not in proc.stderr
    assert "eventbus:" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_without_the_bootstrap_the_group_is_still_up_at_finalization(tmp_path: Path) -> None:
    """The control: the same script under plain python reaches finalization with its group
    up (what the test above would see without the bootstrap's exit hook)."""
    proc, report = _run(tmp_path, bootstrap=False)
    assert proc.returncode == 1, proc.stderr
    assert report == "initialized-at-finalization=True\n", (report, proc.stderr)


def test_end_process_groups_destroys_an_initialized_group(tmp_path: Path) -> None:
    """The exit hook itself: a real 1-rank gloo group is destroyed; with none, nothing to
    do; both report success."""
    assert end_process_groups() is True  # none initialized here
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert dist.is_initialized()
        assert end_process_groups(timeout=30.0) is True
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
