"""Offline readers of events JSONL files: they read what a job wrote, after the fact or
while it runs, and subscribe to nothing.

* :mod:`.records`: lines back as :class:`~.records.Record` (tolerant of torn lines);
* :mod:`.jobview`: the job rebuilt from its records (nodes, attempts, worker runs);
* :mod:`.trace`: ``eventbus trace``, a Chrome/Perfetto trace;
* :mod:`.timeline`: ``eventbus plot``, a timeline PNG;
* :mod:`.tail`: ``eventbus tail``, one line per event, following a growing file.
"""
