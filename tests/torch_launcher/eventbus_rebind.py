"""pytest plugin (``-p eventbus_rebind``): ``torch.distributed.run.main`` is ``eventbus run``.

PyTorch's own tests of torchrun call ``torch.distributed.run.main(args)`` (looked up at
each call), so rebinding that one name runs every one of their launches through eventbus's
command line, agent and exit handling instead of torchrun's.
:func:`eventbus.app.launcher.torch_main.main` is called as torch's is: None on success,
``ChildFailedError`` on a failed job.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    import torch.distributed.run

    from eventbus.app.launcher import torch_main

    torch.distributed.run.main = torch_main.main  # type: ignore[assignment]
