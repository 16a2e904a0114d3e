"""What both trainer integrations share: a metrics dict's numeric scalars, and the one
rule for a failure of eventbus inside a trainer's hook (logged once, never raised)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

__all__ = ["HookFailures", "scalars"]

logger = logging.getLogger("eventbus")


def scalars(metrics: Mapping[str, object]) -> dict[str, int | float]:
    """The numeric scalars of ``metrics``: ints and floats as they are, one-element
    tensors and arrays as floats; bools, strings and anything else left out."""
    found: dict[str, int | float] = {}
    for key, value in metrics.items():
        if type(value) is int or type(value) is float:
            found[key] = value
            continue
        if isinstance(value, bool) or not callable(item := getattr(value, "item", None)):
            continue
        try:
            number = item()
        except (TypeError, ValueError, RuntimeError):  # more than one element
            continue
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            found[key] = float(number)
    return found


class HookFailures:
    """A failure of eventbus in a hook of ``trainer``'s callback: the first logged with its
    traceback, the later ones at debug level; the trainer goes on."""

    def __init__(self, trainer: str) -> None:
        self.trainer = trainer
        self.warned = False

    def __call__(self, hook: str) -> None:
        if self.warned:
            logger.debug("eventbus: the %s callback failed in %s", self.trainer, hook,
                         exc_info=True)
            return
        self.warned = True
        logger.warning("eventbus: the %s callback failed in %s; training goes on (later "
                       "failures are logged at debug level)", self.trainer, hook,
                       exc_info=True)
