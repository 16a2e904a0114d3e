"""Benchmarks of eventbus against its peers: ``python -m benchmarks`` (``make bench``).

Each area is one module with a ``run(*, quick=False)`` function that returns its figures;
``__main__`` runs them all in one process (the memory area spawns one subprocess per size)
and writes ``benchmarks/RESULTS.md``. Figures are medians of interleaved repeats, and the
comparisons are ratios measured in the same run: on a shared machine an absolute time from
one run means little. Nothing here is a test; ``tests/test_benchmarks_smoke.py`` only
checks that every benchmark still runs and produces its table.
"""
