"""Bad hosts: host faults told apart from script bugs (:mod:`.faults`), one node's count of
them in the job (:mod:`.book`), the agent's eviction of its own node (:mod:`.eviction`),
and the host ledger kept across jobs (:mod:`.host_ledger`, on :mod:`.store`, with
:mod:`.spool` for a locked ledger, :mod:`.score` and :mod:`.history`; ``eventbus hosts``:
:mod:`.report`, in Slurm's :mod:`.hostlist` notation).

Torch-free. The ledger's half (faults, store, score, report) imports nothing of the launcher
but the command line's console; the eviction applies the decider's ending.
"""
