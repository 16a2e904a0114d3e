"""``eventbus run`` under SLURM: what it reads of the job (:mod:`.environment`: the options
it derives under ``srun``, the node's name, a requeued run's ledger key) and SLURM's
hostlist notation both ways (:mod:`.hostlist`).

A bottom room of the launcher: torch-free, importing nothing else of it.
"""
