"""``eventbus run``'s command line as the rest of the launcher sees it: its own options
(defaults and parsers, :mod:`.options`) and its console lines (:mod:`.console`).

The bottom of the launcher: torch-free, importing nothing else of it. The parser itself is
:mod:`eventbus.app.launcher.command`, on top, beside the agent it builds.
"""
