"""``python -m eventbus.app.worker SCRIPT ARGS...``: the worker bootstrap of ``eventbus
run`` (:func:`eventbus.app.worker.main`)."""

from __future__ import annotations

import sys

from eventbus.app.worker import main

if __name__ == "__main__":
    sys.exit(main())
