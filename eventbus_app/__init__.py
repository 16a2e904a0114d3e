"""The application layer of eventbus: what composes the core, the publishers and the
subscribers into programs.

* :mod:`eventbus.app.cli`: the ``eventbus`` command (``python -m eventbus``);
* :mod:`eventbus.app.launcher`: ``eventbus run``, the agent (:mod:`.launcher.agent`) and
  its plugins (:mod:`.launcher.store_transport`);
* :mod:`eventbus.app.readers`: the offline readers of events JSONL files (the job view,
  ``eventbus trace``, ``eventbus plot``, ``eventbus tail``).

Nothing in ``eventbus``, ``publishers`` or ``subscribers`` imports this package (the one
exception is ``python -m eventbus``, whose ``__main__`` is this layer's entry point).
"""

if __name__ != "eventbus.app":
    # The checkout's eventbus_app/ folder on sys.path would be a second copy of every module,
    # with its own state: the one name is eventbus.app (pyproject.toml's package-dir).
    raise ImportError(f"eventbus_app/ is installed as eventbus.app: import that, "
                      f"not {__name__}")
