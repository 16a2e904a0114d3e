"""Shared fixtures: every test leaves the default bus as it found it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import eventbus

ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that must import this tree's packages."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.update(extra)
    return env


def _is_default_log_handler(sub: eventbus.Subscription) -> bool:
    owner = getattr(sub.on_event, "__self__", None)
    return type(owner).__name__ == "EventLoggingHandler"


@pytest.fixture(autouse=True)
def _clean_default_bus() -> Iterator[None]:
    """Cancel subscriptions a test left on the default bus (the default log handler stays)."""
    bus = eventbus.get_default_bus()
    before = {id(s) for s in bus.subscriptions()}
    strict = bus.strict
    yield
    bus.strict = strict
    for sub in bus.subscriptions():
        if id(sub) not in before and not _is_default_log_handler(sub):
            sub.cancel()


@pytest.fixture
def bus() -> eventbus.Bus:
    """A private bus, so a test sees only its own subscribers."""
    return eventbus.Bus("test")
