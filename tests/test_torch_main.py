"""``eventbus.app.launcher.torch_main.main``, the stand-in for ``torch.distributed.run.main``
(tests/torch_launcher runs PyTorch's own tests of torchrun with it): None when the job
succeeded, torch's ``ChildFailedError`` when it failed, ``SystemExit(2)`` on a usage
error; the command's own ``main`` still returns 1 for the failed job."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.launcher_helpers import job_env
from tests.launcher_helpers import run_command

pytestmark = pytest.mark.slow

#: run in a process of its own (the job's agent runs in-process): each call's outcome
_PROBE = r"""
import json, sys
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from eventbus.app.launcher import command, torch_main

def outcome(call, argv):
    try:
        return repr(call(argv))
    except ChildFailedError as exc:
        return "ChildFailedError: " + ", ".join(str(f.exitcode) for f in exc.failures.values())
    except SystemExit as exc:
        return f"SystemExit({exc.code})"

common = ["--standalone", "--nproc-per-node", "1", "--max-restart", "0",
          "--monitor-interval", "0.1", "--no-python", sys.executable]
print(json.dumps({
    "ok": outcome(torch_main.main, [*common, "-c", "pass"]),
    "failed": outcome(torch_main.main, [*common, "-c", "raise SystemExit(7)"]),
    "failed_code": outcome(command.main, [*common, "-c", "raise SystemExit(7)"]),
    "usage": outcome(torch_main.main, ["--bad-host", "x.py"]),
}))
"""


def test_torch_main_succeeds_raises_and_refuses_as_torchruns_main(tmp_path: Path) -> None:
    # job_env: the suite's own host ledger (tests/conftest.py), spares off
    done = run_command([sys.executable, "-c", _PROBE], cwd=tmp_path, env=job_env())
    assert done.returncode == 0, done.stderr[-4000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcomes == {"ok": "None", "failed": "ChildFailedError: 7", "failed_code": "1",
                        "usage": "SystemExit(2)"}, done.stderr[-4000:]
    assert "ambiguous option: --bad-host could match" in done.stderr
