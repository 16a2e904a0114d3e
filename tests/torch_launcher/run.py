"""PyTorch's own tests of torchrun, run with torch's launcher and with ``eventbus run`` in
its place (``make test-torchrun``).

    python tests/torch_launcher/run.py [--source DIR] [--launcher both|torch|eventbus]
                                       [-k EXPR]

The tests are ``test/distributed/launcher/test_run.py`` and its ``bin/`` scripts from
pytorch/pytorch, unchanged; SOURCE.txt names each file, the commit it was read from and its
sha256, and says where to put them (they are PyTorch's code and are not kept here). Nothing
is fetched: the files come from ``--source`` (a PyTorch checkout, or a folder holding
``test_run.py`` and ``bin/``), else ``$PYTORCH_SRC``, else tests/torch_launcher/upstream/.

Each launcher runs the file in a pytest of its own, in a temporary copy of the files:
``torch`` as PyTorch runs it, ``eventbus`` with the eventbus_rebind plugin, which makes
``torch.distributed.run.main`` eventbus's (:mod:`eventbus.app.launcher.torch_main`). The
table gives each test's outcome under both, and the totals with their wall times.

Exit 0 when every test that passes under torch passes under eventbus too, or is one of
KNOWN (a Python-level difference docs/run.md, "Tested with", names); 1 otherwise; 2 when
the files are missing or not the ones SOURCE.txt names (``--any-version`` runs them anyway).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: the folder of test_run.py in a PyTorch checkout
LAUNCHER_DIR = "test/distributed/launcher"

#: tests that fail under eventbus for a reason of Python-level fidelity, not of the launch
#: (docs/run.md, "Tested with"): the name, and why
KNOWN = {
    "test_launch_shutdown":
        "mocks torch.distributed.launcher.api.LocalElasticAgent, the class eventbus's agent "
        "replaces: the mock is never built, a real job runs and the mocked rendezvous "
        "handler is never shut down",
}

#: a pytest.ini of the copy's own, so that the repository's (--strict-markers, its
#: conftest) never applies to PyTorch's file
PYTEST_INI = "[pytest]\naddopts = -p no:cacheprovider\n"


def read_source() -> list[tuple[str, str, str]]:
    """SOURCE.txt's rows: (path in pytorch/pytorch, commit, sha256)."""
    rows = []
    for line in (HERE / "SOURCE.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            path, commit, digest = line.split()
            rows.append((path, commit, digest))
    return rows


def find(root: Path, path: str) -> Path | None:
    """``path`` (a PyTorch checkout's) under ``root``: as in a checkout, or relative to
    the launcher folder."""
    for candidate in (root / path, root / os.path.relpath(path, LAUNCHER_DIR)):
        if candidate.is_file():
            return candidate
    return None


def stage(root: Path, dest: Path, *, any_version: bool) -> str | None:
    """Copy the files SOURCE.txt names from ``root`` into ``dest`` (the launcher folder's
    layout); a sentence saying what is wrong, or None."""
    for path, commit, digest in read_source():
        found = find(root, path)
        if found is None:
            return (f"{path} is not under {root}: put pytorch/pytorch's {path} (commit "
                    f"{commit[:12]}) there unchanged, or pass --source (SOURCE.txt)")
        actual = hashlib.sha256(found.read_bytes()).hexdigest()
        if actual != digest and not any_version:
            return (f"{found}: sha256 {actual[:16]}... is not SOURCE.txt's {digest[:16]}... "
                    f"(another version of {path}; --any-version runs it anyway)")
        target = dest / os.path.relpath(path, LAUNCHER_DIR)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(found, target)
        target.chmod(0o755 if path.endswith(".sh") else 0o644)  # run as --no-python
    return None


def run_pytest(copy: Path, launcher: str, keyword: str | None,
               timeout_s: float) -> tuple[dict[str, str], float, int]:
    """One launcher's pytest of the copy: each test's outcome by name, the wall time, and
    pytest's exit status."""
    report = copy.parent / f"{launcher}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", f"--junitxml={report}",
           f"--timeout={int(timeout_s)}", "test_run.py"]
    if launcher == "eventbus":
        cmd[3:3] = ["-p", "eventbus_rebind"]
    if keyword:
        cmd += ["-k", keyword]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    # the agents' host ledger in the temporary folder, never this machine's (docs/hosts.md)
    env["EVENTBUS_HOST_LEDGER"] = str(copy.parent / "hosts.sqlite")
    env["EVENTBUS_HOST_LEDGER_SPOOL"] = str(copy.parent / "spool.jsonl")
    print(f"== {launcher}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    status = subprocess.call(cmd, cwd=copy, env=env)
    wall_s = time.monotonic() - start
    outcomes: dict[str, str] = {}
    if report.is_file():
        for case in ET.parse(report).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            outcome = ("failed" if "failure" in kinds else "error" if "error" in kinds
                       else "skipped" if "skipped" in kinds else "passed")
            outcomes[case.get("name", "?")] = outcome
    return outcomes, wall_s, status


def summary(outcomes: dict[str, str]) -> str:
    """``22 passed, 3 failed, 1 skipped``."""
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "nothing ran"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests/torch_launcher/run.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=None,
                        help="a PyTorch checkout, or a folder with test_run.py and bin/ "
                             "(default: $PYTORCH_SRC, else tests/torch_launcher/upstream)")
    parser.add_argument("--launcher", choices=["both", "torch", "eventbus"], default="both")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k EXPR")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="pytest-timeout per test, seconds (default 300)")
    parser.add_argument("--any-version", action="store_true",
                        help="run files whose sha256 is not SOURCE.txt's")
    args = parser.parse_args(argv)
    root = args.source or Path(os.environ.get("PYTORCH_SRC") or HERE / "upstream")
    try:
        import expecttest  # noqa: F401  (torch.testing._internal.common_utils needs it)
    except ImportError:
        print("run.py: PyTorch's test helpers need expecttest: pip install expecttest",
              file=sys.stderr)
        return 2
    launchers = ["torch", "eventbus"] if args.launcher == "both" else [args.launcher]
    results: dict[str, tuple[dict[str, str], float, int]] = {}
    with tempfile.TemporaryDirectory(prefix="eventbus-torchrun-tests-") as tmp:
        copy = Path(tmp) / "launcher"
        problem = stage(root, copy, any_version=args.any_version)
        if problem is not None:
            print(f"run.py: {problem}", file=sys.stderr)
            return 2
        (copy / "pytest.ini").write_text(PYTEST_INI)
        for launcher in launchers:
            results[launcher] = run_pytest(copy, launcher, args.keyword, args.timeout)
    names = sorted({name for outcomes, _, _ in results.values() for name in outcomes})
    width = max((len(name) for name in names), default=4)
    print(f"\n{'test':<{width}}  " + "  ".join(f"{x:<8}" for x in launchers))
    for name in names:
        row = "  ".join(f"{results[x][0].get(name, '-'):<8}" for x in launchers)
        note = "  (known: see KNOWN in run.py)" if name in KNOWN and \
            results.get("eventbus", ({}, 0, 0))[0].get(name) not in (None, "passed") else ""
        print(f"{name:<{width}}  {row}{note}")
    for launcher in launchers:
        outcomes, wall_s, _ = results[launcher]
        print(f"{launcher}: {summary(outcomes)} in {wall_s:.0f} s")
    if "eventbus" not in results:
        return 0 if all(status == 0 for _, _, status in results.values()) else 1
    ours = results["eventbus"][0]
    theirs = results["torch"][0] if "torch" in results else None
    expected = [name for name in names
                if (theirs is None and ours.get(name) != "skipped")
                or (theirs is not None and theirs.get(name) == "passed")]
    regressions = [name for name in expected
                   if ours.get(name) != "passed" and name not in KNOWN]
    if regressions:
        print(f"under eventbus, not as under torch: {', '.join(regressions)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
