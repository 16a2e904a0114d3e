"""What the drain asks of SLURM, and the rules it applies to the answers.

The one place ``eventbus run`` calls SLURM's commands (``scontrol``, ``squeue``). Every
call goes through an injectable ``runner(argv, timeout) -> stdout`` (tests pass fakes),
is bounded by :data:`CALL_TIMEOUT_S`, and never raises: a command that fails or is
missing gives None, and the drain goes on as it would without SLURM.

Under SLURM (``SLURM_JOB_ID`` set and ``scontrol`` on ``PATH``):

* **the grace fits SLURM's limits** (:func:`fit_grace`): SLURM SIGKILLs the step
  ``KillWait`` seconds after its SIGTERM (``scontrol show config``), and after a
  ``--signal=USR1@N`` the time limit comes at the job's ``EndTime`` (SLURM does not
  export ``N``); the drain needs its grace, the kill grace and :data:`EXIT_MARGIN_S` for
  the agents' exit within that bound. A grace that does not fit is shortened to fit, and
  one ``eventbus:`` line says so;
* **the time limit without ``--signal``** (:func:`drain_at`): an agent that knows its
  job's ``EndTime`` drains the job that long before it;
* **a drained job requeues itself** (:func:`requeue_after`): ``scontrol requeue`` where
  ``scontrol show job`` says ``Requeue=1`` (``sbatch --requeue``, or the cluster's
  ``JobRequeue=1``) and ``JobState=RUNNING`` (not a ``scancel``: CANCELLED; not a job
  SLURM requeues itself: a preemption, ``scontrol requeue``), by the agent that announced
  the drain, once the drain agreed a stop step and every node ended its drain (SLURM's
  requeue kills every process of the job: a node still saving would lose its
  checkpoint; ``before_requeue`` waits for them, bounded); a bad-host exit first adds
  the node to the job's ``ExcNodeList``, at most :data:`MAX_BAD_HOST_REQUEUES` times
  (``SLURM_RESTART_COUNT``). Torch-free.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence

__all__ = [
    "CALL_TIMEOUT_S",
    "EXIT_MARGIN_S",
    "MAX_BAD_HOST_REQUEUES",
    "REQUEUE_MODES",
    "Runner",
    "Slurm",
    "drain_at",
    "fit_grace",
    "needed_s",
    "parse_requeue",
    "requeue_after",
]

logger = logging.getLogger("eventbus")

#: ``runner(argv, timeout) -> stdout``; raises on a failed command
Runner = Callable[[Sequence[str], float], str]

#: the longest one SLURM command may take
CALL_TIMEOUT_S = 10.0
#: what the agents need after the kill grace to report and exit
EXIT_MARGIN_S = 3.0
#: a grace this close over its bound still fits (the time limit's drain starts exactly
#: one drain's length before the end)
FIT_SLACK_S = 1.0
#: a job requeued this many times (``SLURM_RESTART_COUNT``) is not requeued for a bad host
#: again: a cluster that keeps giving it bad nodes needs a person
MAX_BAD_HOST_REQUEUES = 3
#: ``--requeue``: ``auto`` (requeue a drained job where SLURM allows it) or ``off``
REQUEUE_MODES = ("auto", "off")


def parse_requeue(text: str) -> str:
    """``--requeue``: ``auto`` or ``off``. Raises ``ValueError`` naming the choices."""
    value = text.strip().lower()
    if value not in REQUEUE_MODES:
        raise ValueError(f"expected auto or off, got {text!r}")
    return value


def run_command(argv: Sequence[str], timeout: float) -> str:
    """The real runner: the command's stdout; raises when it fails or times out."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          check=True)
    return str(done.stdout)


class Slurm:
    """This job as SLURM knows it. ``env``: the agent's environment; ``runner``: how a
    command runs; ``which``: how ``scontrol`` is found; ``clock``: the wall clock."""

    def __init__(self, env: Mapping[str, str] | None = None, *,
                 runner: Runner = run_command,
                 which: Callable[[str], str | None] = shutil.which,
                 clock: Callable[[], float] = time.time) -> None:
        self.env = os.environ if env is None else env
        self.runner = runner
        self.which = which
        self.clock = clock

    @property
    def job_id(self) -> str | None:
        return self.env.get("SLURM_JOB_ID") or None

    def present(self) -> bool:
        """Under SLURM: a job id and ``scontrol`` to ask about it."""
        return self.job_id is not None and self.which("scontrol") is not None

    @property
    def restart_count(self) -> int:
        try:
            return int(self.env.get("SLURM_RESTART_COUNT", "0") or 0)
        except ValueError:
            return 0

    def _run(self, *argv: str) -> str | None:
        try:
            return self.runner(argv, CALL_TIMEOUT_S)
        except Exception as exc:  # missing, failed, timed out: as without SLURM
            logger.debug("eventbus: %s: %s", " ".join(argv), exc)
            return None

    def show_job(self) -> dict[str, str] | None:
        """``scontrol show job -o JOBID`` as its ``Key=Value`` fields, or None."""
        if self.job_id is None:
            return None
        text = self._run("scontrol", "show", "job", "-o", self.job_id)
        if text is None:
            return None
        fields: dict[str, str] = {}
        for token in text.split():
            key, sep, value = token.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields or None

    def kill_wait(self) -> float | None:
        """``KillWait`` from ``scontrol show config``: seconds from SIGTERM to SIGKILL."""
        text = self._run("scontrol", "show", "config")
        if text is None:
            return None
        found = re.search(r"^\s*KillWait\s*=\s*(\d+)", text, re.MULTILINE)
        return float(found.group(1)) if found else None

    def end_time(self) -> float | None:
        """The job's ``EndTime`` (epoch seconds): ``squeue -h -j JOBID -o %e``, else
        ``scontrol show job``; None for no time limit or no answer."""
        if self.job_id is None:
            return None
        text = self._run("squeue", "-h", "-j", self.job_id, "-o", "%e")
        value = _epoch(text.strip()) if text else None
        if value is None:
            job = self.show_job()
            value = _epoch(job.get("EndTime", "")) if job else None
        return value

    def requeueable(self, job: Mapping[str, str] | None = None) -> bool:
        job = self.show_job() if job is None else job
        return job is not None and job.get("Requeue") == "1"

    def requeue(self) -> bool:
        assert self.job_id is not None
        return self._run("scontrol", "requeue", self.job_id) is not None

    def exclude(self, node: str, job: Mapping[str, str] | None = None) -> bool:
        """Add ``node`` to the job's ``ExcNodeList`` (what it had is kept)."""
        assert self.job_id is not None
        job = self.show_job() if job is None else job
        had = (job or {}).get("ExcNodeList", "")
        nodes = [n for n in had.split(",") if n and n != "(null)"]
        if node not in nodes:
            nodes.append(node)
        return self._run("scontrol", "update", f"JobId={self.job_id}",
                         f"ExcNodeList={','.join(nodes)}") is not None


def _epoch(text: str) -> float | None:
    """SLURM's ``2026-12-05T19:00:00`` (the cluster's local time) as epoch seconds."""
    try:
        parsed = time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return None  # Unknown, None, N/A: no end time
    return float(time.mktime(parsed))


def needed_s(grace_s: float, kill_grace_s: float) -> float:
    """What a drain takes at most: the grace, the kill grace and the agents' exit."""
    return grace_s + kill_grace_s + EXIT_MARGIN_S


def fit_grace(grace_s: float, signal_name: str, *, kill_grace_s: float,
              kill_wait_s: float | None, seconds_to_end: float | None
              ) -> tuple[float, str | None]:
    """The grace a drain on ``signal_name`` gets under SLURM, and the ``eventbus:`` line
    (without the prefix) when it had to be shortened. The bound: ``KillWait`` after a
    SIGTERM (SLURM's SIGKILL follows it), and the time to the job's end for any signal
    (after a ``--signal`` lead, the time limit). At least 1 s is kept."""
    bounds: list[tuple[float, str]] = []
    if signal_name == "SIGTERM" and kill_wait_s is not None:
        bounds.append((kill_wait_s, f"SLURM's KillWait ({kill_wait_s:g} s)"))
    if seconds_to_end is not None:
        bounds.append((seconds_to_end, f"the job's time limit ({seconds_to_end:.0f} s away)"))
    if not bounds:
        return grace_s, None
    bound, what = min(bounds)
    room = bound - kill_grace_s - EXIT_MARGIN_S
    if grace_s <= room + FIT_SLACK_S:
        return grace_s, None
    fitted = max(1.0, round(room, 1))
    return fitted, (f"--drain-grace {grace_s:g} s does not fit {what} with the kill grace "
                    f"({kill_grace_s:g} s) and the agents' exit ({EXIT_MARGIN_S:g} s): this "
                    f"drain's grace is {fitted:g} s")


def drain_at(end_time: float, grace_s: float, kill_grace_s: float) -> float:
    """When an agent drains its job ahead of the time limit (epoch seconds)."""
    return end_time - needed_s(grace_s, kill_grace_s)


def requeue_after(slurm: Slurm, *, drained: bool, announced: bool,
                  bad_host: str | None, mode: str, stop_step: int | None = None,
                  before_requeue: Callable[[], object] | None = None) -> str | None:
    """After the job ended here: requeue it where the rules say (see the module's
    docstring). ``drained``: this agent's job drained; ``announced``: this agent
    announced the drain (only it requeues); ``bad_host``: this node's name when its host
    was evicted; ``stop_step``: the drain's agreed stop step (a drain that agreed none
    left no checkpoint to resume from, and is not requeued: a job signalled before its
    first step would otherwise requeue itself for ever); ``before_requeue``: called just
    before a drained job's ``scontrol requeue`` (the wait for the other nodes' drains).
    Returns the ``eventbus:`` line (without the prefix), or None when there is nothing to
    say."""
    if mode == "off" or not slurm.present() or not (bad_host or (drained and announced)):
        return None
    job = slurm.show_job()
    if job is None:
        return "scontrol show job gave no answer: the job was not requeued"
    state = job.get("JobState", "")
    if state != "RUNNING":  # scancel'd (CANCELLED), or SLURM requeues it itself
        return f"job {slurm.job_id} is {state or 'in no known state'}: not requeued"
    if bad_host is None and stop_step is None:
        return (f"the drain agreed no stop step (no rank's checkpoint to resume from): job "
                f"{slurm.job_id} was not requeued")
    if not slurm.requeueable(job):
        return (f"job {slurm.job_id} is not requeueable (Requeue=0: submit with sbatch "
                "--requeue): not requeued")
    if bad_host is not None:
        count = slurm.restart_count
        if count >= MAX_BAD_HOST_REQUEUES:
            return (f"host {bad_host} was evicted, but job {slurm.job_id} was requeued "
                    f"{count} times already (at most {MAX_BAD_HOST_REQUEUES} for bad hosts): "
                    "not requeued")
        if not slurm.exclude(bad_host, job):
            return f"could not exclude {bad_host} from job {slurm.job_id}: not requeued"
        if not slurm.requeue():
            return f"scontrol requeue {slurm.job_id} failed: not requeued"
        return f"job {slurm.job_id} requeued without {bad_host} (ExcNodeList)"
    if before_requeue is not None:
        before_requeue()
    if not slurm.requeue():
        return f"scontrol requeue {slurm.job_id} failed: not requeued"
    return (f"job {slurm.job_id} requeued: it resumes from the checkpoint of step "
            f"{stop_step}")
