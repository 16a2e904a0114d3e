"""Warm spares: the pool (eventbus_app/launcher/recovery/spares.py) with real spare processes
(eventbus_app/worker/spare.py), and a real ``eventbus run`` restart on the spares, where
the script cannot tell a spare from a fresh worker (argv, ``__file__``, ``sys.path[0]``,
cwd, environment, signal dispositions, spawn children, DataLoader workers,
``torch.distributed`` initialised afresh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from eventbus.app.launcher.recovery.spares import PER_ATTEMPT
from eventbus.app.launcher.recovery.spares import SparePool
from eventbus.app.launcher.recovery.spares import interpreter_options
from eventbus.app.launcher.recovery.spares import worker_argv
from tests.launcher_helpers import JOBS
from tests.launcher_helpers import ROOT
from tests.launcher_helpers import job_env
from tests.launcher_helpers import run_command


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVENTBUS_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _capturing(log: Path) -> Any:
    def spawn(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(*args, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                **kwargs)
    return spawn


def test_the_bootstrap_arguments_split_into_options_and_argv() -> None:
    """What a spare is started with (the interpreter's options) and given (the argv)."""
    args = ("-u", "-X", "dev", "-m", "eventbus.app.worker", "train.py", "--lr", "1")
    assert interpreter_options(args) == ("-u", "-X", "dev")
    assert worker_argv(args) == ["train.py", "--lr", "1"]
    assert worker_argv(("-u", "train.py")) is None


def test_a_spare_becomes_the_worker_with_its_env_argv_and_cwd(tmp_path: Path) -> None:
    """A real spare given an assignment runs the script through the bootstrap with the
    worker's environment, argv and cwd, and exits with the script's code."""
    script = tmp_path / "script.py"
    script.write_text("import json, os, sys\n"
                      "print(json.dumps({'argv': sys.argv, 'file': __file__, 'path0': "
                      "sys.path[0], 'rank': os.environ.get('RANK'), 'cwd': os.getcwd(), "
                      "'warm': 'torch' in sys.modules, 'fd': os.environ.get("
                      "'EVENTBUS_SPARE_FD')}))\nsys.exit(7)\n")
    log = tmp_path / "spare.log"
    pool = SparePool(spawn=_capturing(log))
    env = _env(RANK="0")
    assert pool.fill({0: (sys.executable, ("-u",), env)}) == 1
    time.sleep(0.5)
    worker = {**env, "RANK": "3", "TORCHELASTIC_RESTART_COUNT": "1"}
    spare = pool.take(0, sys.executable, worker, os.getcwd())
    assert spare is not None and pool.used == 1
    spare.assign(worker, [str(script), "--x", "1"], os.getcwd())
    assert spare.proc.wait(timeout=120) == 7
    facts = json.loads(log.read_text().strip().splitlines()[-1])
    assert facts == {"argv": [str(script), "--x", "1"], "file": str(script),
                     "path0": str(tmp_path), "rank": "3", "cwd": os.getcwd(), "warm": True,
                     "fd": None}


def test_a_stale_or_dead_spare_is_never_used(tmp_path: Path) -> None:
    """A spare whose environment differs on a variable that is not per attempt is thrown
    away (and says why); one that died is too; a per-attempt change is no staleness. (A
    spare thrown away is killed after 0.2 s here, not the default 2 s: these spares are
    still importing torch, and would be killed at either.)"""
    pool = SparePool(spawn=_capturing(tmp_path / "spares.log"), discard_timeout=0.2)
    env = _env(RANK="0", PYTHONHASHSEED="1")
    pool.fill({0: (sys.executable, ("-u",), env), 1: (sys.executable, ("-u",), env)})
    spare = pool.take(0, sys.executable, {**env, "PYTHONHASHSEED": "2"}, os.getcwd())
    assert spare is None and "PYTHONHASHSEED" in pool.discarded[-1]
    dead = pool._spares[1]
    dead.proc.kill()
    dead.proc.wait(timeout=30)
    assert pool.take(1, sys.executable, env, os.getcwd()) is None
    assert "died" in pool.discarded[-1]
    pool.fill({0: (sys.executable, ("-u",), env)})
    fresh = pool.take(0, sys.executable, {**env, "RANK": "1", "MASTER_PORT": "1234",
                                          "EVENTBUS_STORE_PREFIX": "x"}, os.getcwd())
    assert fresh is not None
    fresh.discard(0.2)
    assert fresh.proc.poll() is not None
    assert {"RANK", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"} <= PER_ATTEMPT
    pool.close()


def test_warm_spares_cuda_asks_each_spare_for_its_local_device(tmp_path: Path) -> None:
    """``--warm-spares cuda``: each spare is asked to make its CUDA context on its local
    rank's device, under the worker's CUDA_VISIBLE_DEVICES (CUDA reads it once, so a worker
    with another value is not this spare's: stale). Here torch has no CUDA: the spare makes
    none, says nothing, and becomes the worker all the same, without the variable."""
    started: list[dict[str, str]] = []
    log = tmp_path / "spare.log"

    def spawn(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(dict(kwargs["env"]))
        return _capturing(log)(*args, **kwargs)

    pool = SparePool(cuda=True, spawn=spawn, discard_timeout=0.2)
    env = _env(RANK="1", LOCAL_RANK="1", CUDA_VISIBLE_DEVICES="0,1")
    pool.fill({1: (sys.executable, ("-u",), env), 0: (sys.executable, ("-u",), env)})
    by_device = {e["EVENTBUS_SPARE_CUDA_DEVICE"]: e for e in started}
    assert set(by_device) == {"0", "1"}
    assert all(e["CUDA_VISIBLE_DEVICES"] == "0,1" for e in started)
    assert pool.take(0, sys.executable, {**env, "CUDA_VISIBLE_DEVICES": "1"},
                     os.getcwd()) is None
    assert "CUDA_VISIBLE_DEVICES changed" in pool.discarded[-1]
    script = tmp_path / "script.py"
    script.write_text("import json, os\nprint(json.dumps(sorted(k for k in os.environ if "
                      "k.startswith('EVENTBUS_SPARE'))))\n")
    spare = pool.take(1, sys.executable, env, os.getcwd())
    assert spare is not None
    spare.assign(env, [str(script)], os.getcwd())
    assert spare.proc.wait(timeout=120) == 0
    lines = log.read_text().strip().splitlines()
    assert lines[-1] == "[]" and not any("CUDA context" in line for line in lines), lines
    pool.close()
    assert SparePool(cuda=True, enabled=False).cuda is False


def test_the_warm_spares_option_takes_on_off_and_cuda() -> None:
    import argparse

    from eventbus.app.launcher.cli.options import parse_warm_spares

    assert [parse_warm_spares(w) for w in ("on", "OFF", " cuda ")] == ["on", "off", "cuda"]
    with pytest.raises(argparse.ArgumentTypeError, match="'on', 'off' or 'cuda'"):
        parse_warm_spares("gpu")


def test_closing_the_pool_ends_every_spare(tmp_path: Path) -> None:
    """close() ends the spares (their pipe closed: they exit; else they are killed after
    its timeout: 0.2 s here, not the default 2 s; spares still importing torch are killed
    at either)."""
    pool = SparePool(spawn=_capturing(tmp_path / "spares.log"))
    pool.fill({0: (sys.executable, ("-u",), _env()), 1: (sys.executable, ("-u",), _env())})
    procs = [s.proc for s in pool._spares.values()]
    pool.close(timeout=0.2)
    assert all(p.poll() is not None for p in procs) and len(pool) == 0


def _probe_job(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str],
                                                    dict[str, dict[str, Any]]]:
    events = tmp_path / "events.jsonl"
    cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events), *args,
           "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           "--max-restarts", "1", str(JOBS / "spare_probe.py")]
    env = {**job_env(), "PROBE_OUT": str(tmp_path)}
    env.pop("EVENTBUS_WARM_SPARES", None)  # the default: on
    done = run_command(cmd, cwd=tmp_path, timeout=300, env=env)
    facts = {p.stem.removeprefix("probe_"): json.loads(p.read_text())
             for p in tmp_path.glob("probe_attempt*_rank*.json")}
    return done, facts


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_restart_on_warm_spares_looks_like_fresh_workers_to_the_script(
        tmp_path: Path) -> None:
    """Attempt 1 runs on the spares (torch was imported at the script's first line), and
    every fact the script can see of itself equals attempt 0's fresh worker's, but the
    variables that change per attempt and the pids."""
    done, facts = _probe_job(tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "eventbus: attempt 1 recovered in" in done.stderr
    for rank in (0, 1):
        fresh, spare = facts[f"attempt0_rank{rank}"], facts[f"attempt1_rank{rank}"]
        assert not fresh["warm"] and spare["warm"], (fresh["warm"], spare["warm"])
        for key in ("argv", "file", "path0", "cwd", "signals", "initialised_before",
                    "world"):
            assert fresh[key] == spare[key], key
        assert spare["spawn_child"] == fresh["spawn_child"]
        assert spare["loader"] == [[spare["pid"], rank]] * 2  # its workers' parent: it
        changed = {k for k in set(fresh["env"]) | set(spare["env"])
                   if fresh["env"].get(k) != spare["env"].get(k)}
        assert all(k in PER_ATTEMPT or k.startswith(("EVENTBUS_", "TORCHELASTIC_"))
                   for k in changed), changed
        assert "EVENTBUS_SPARE_FD" not in spare["env"]


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_warm_spares_cuda_on_a_node_without_cuda_says_so_and_restarts_on_spares(
        tmp_path: Path) -> None:
    """--warm-spares cuda where torch sees no CUDA device (this machine): one line says
    so, and attempt 1 still runs on the spares."""
    done, facts = _probe_job(tmp_path, "--warm-spares", "cuda")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "eventbus: --warm-spares cuda: torch sees no CUDA device on this node" in \
        done.stderr
    assert facts["attempt1_rank0"]["warm"] and facts["attempt1_rank1"]["warm"]
    assert "EVENTBUS_SPARE_CUDA_DEVICE" not in facts["attempt1_rank0"]["env"]


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_warm_spares_off_restarts_on_fresh_workers(tmp_path: Path) -> None:
    """--warm-spares off: attempt 1's workers are fresh processes (torch not imported)."""
    done, facts = _probe_job(tmp_path, "--warm-spares", "off")
    assert done.returncode == 0, done.stderr[-4000:]
    assert not facts["attempt1_rank0"]["warm"] and not facts["attempt1_rank1"]["warm"]
