"""The job context every event carries: who recorded it, in which job and attempt.

Taken once per process from the variables torchelastic sets for its workers (``RANK``,
``LOCAL_RANK``, ``GROUP_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``ROLE_NAME``,
``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``) plus the hostname and pid, and
taken again in a forked child, whose pid differs. The attempt is ``EVENTBUS_ATTEMPT`` where
``eventbus run``'s agent sets it (the same on every node), else torch's restart count.
``EVENTBUS_HOSTNAME``, when set, is the hostname (containers, whose own name means
nothing; tests that play several nodes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["JobContext", "current_context", "refresh_context", "set_context"]


def _opt_int(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        return None


#: the job-wide attempt ``eventbus run``'s agent gives its workers
#: (launcher/recovery/membership.py): torch's ``TORCHELASTIC_RESTART_COUNT`` counts one
#: node's own restarts, and nodes differ after a restart another node decided (theirs
#: re-form, theirs count none)
ATTEMPT_ENV = "EVENTBUS_ATTEMPT"


def _attempt(env: Mapping[str, str]) -> int | None:
    found = _opt_int(env.get(ATTEMPT_ENV))
    return found if found is not None else _opt_int(env.get("TORCHELASTIC_RESTART_COUNT"))


def _hostname() -> str:
    """``socket.gethostname()``, without importing socket where ``os.uname()`` exists
    (POSIX: the same gethostname(2) name): socket's enum conversions were the largest part
    of ``import eventbus``."""
    uname = getattr(os, "uname", None)
    if uname is not None:
        return str(uname().nodename)
    import socket

    return socket.gethostname()

@attrs.frozen(slots=True)
class JobContext:
    """Where an event comes from. ``None`` where the environment does not say."""

    rank: int | None = None
    local_rank: int | None = None
    group_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    role: str | None = None
    run_id: str | None = None
    restart_count: int | None = None
    hostname: str = ""
    pid: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> JobContext:
        """The context described by ``environ`` (default: ``os.environ``)."""
        env = os.environ if environ is None else environ
        return cls(
            rank=_opt_int(env.get("RANK")),
            local_rank=_opt_int(env.get("LOCAL_RANK")),
            group_rank=_opt_int(env.get("GROUP_RANK")),
            world_size=_opt_int(env.get("WORLD_SIZE")),
            local_world_size=_opt_int(env.get("LOCAL_WORLD_SIZE")),
            role=env.get("ROLE_NAME") or None,
            run_id=env.get("TORCHELASTIC_RUN_ID") or None,
            restart_count=_attempt(env),
            hostname=env.get("EVENTBUS_HOSTNAME") or _hostname(),
            pid=os.getpid(),
        )

    def to_dict(self) -> dict[str, Any]:
        """The context as a plain dict (field name -> value)."""
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "group_rank": self.group_rank,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "role": self.role,
            "run_id": self.run_id,
            "restart_count": self.restart_count,
            "hostname": self.hostname,
            "pid": self.pid,
        }


_INT_FIELDS = ("rank", "local_rank", "group_rank", "world_size", "local_world_size",
               "restart_count")
_STR_FIELDS = ("role", "run_id")


def context_from_dict(raw: object) -> JobContext:
    """A validated ``JobContext`` from decoded JSON; raises ``ValueError``/``TypeError``."""
    if not isinstance(raw, dict):
        raise TypeError(f"context must be an object, got {type(raw).__name__}")
    unknown = set(raw) - set(_INT_FIELDS) - set(_STR_FIELDS) - {"hostname", "pid"}
    if unknown:
        raise TypeError(f"context has unknown field(s) {sorted(unknown)}")
    values: dict[str, Any] = {}
    for name in _INT_FIELDS:
        v = raw.get(name)
        if v is not None and (type(v) is not int):
            raise TypeError(f"context.{name} must be an int or null, got {type(v).__name__}")
        if v is not None and v.bit_length() > 64:
            raise ValueError(f"context.{name} is out of range: {str(v)[:20]}...")
        values[name] = v
    for name in _STR_FIELDS:
        v = raw.get(name)
        if v is not None and type(v) is not str:
            raise TypeError(f"context.{name} must be a string or null, got {type(v).__name__}")
        values[name] = v
    hostname = raw.get("hostname", "")
    if type(hostname) is not str:
        raise TypeError(f"context.hostname must be a string, got {type(hostname).__name__}")
    pid = raw.get("pid", 0)
    if type(pid) is not int:
        raise TypeError(f"context.pid must be an int, got {type(pid).__name__}")
    if pid.bit_length() > 64:
        raise ValueError(f"context.pid is out of range: {str(pid)[:20]}...")
    return JobContext(hostname=hostname, pid=pid, **values)


class _Holder:
    """The process's current context; read on every event, so one attribute away."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = JobContext.from_env()


_holder = _Holder()


def current_context() -> JobContext:
    """The context that events recorded now in this process carry."""
    return _holder.value


def refresh_context() -> JobContext:
    """Read the environment again (after the launcher or a test changed it)."""
    _holder.value = JobContext.from_env()
    return _holder.value


def set_context(**overrides: Any) -> JobContext:
    """Replace fields of the current context, e.g. ``set_context(restart_count=2)``.

    The agent uses it to mark its own events with the attempt they belong to.
    """
    _holder.value = attrs.evolve(_holder.value, **overrides)
    return _holder.value


def _after_fork_in_child() -> None:
    # A forked child is another process: same job, new pid.
    _holder.value = attrs.evolve(_holder.value, pid=os.getpid())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
