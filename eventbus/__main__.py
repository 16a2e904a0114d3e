"""``python -m eventbus``: the ``eventbus`` command (:mod:`eventbus.app.cli`).

This module is the program's entry point, not part of the core library: nothing imports
it, and it is the one place under ``eventbus/`` that reaches the application layer.
"""

from __future__ import annotations

import sys

from eventbus.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
