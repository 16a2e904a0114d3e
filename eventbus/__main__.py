"""``python -m eventbus``: see :mod:`eventbus.cli`."""

from __future__ import annotations

import sys

from eventbus.cli import main

if __name__ == "__main__":
    sys.exit(main())
