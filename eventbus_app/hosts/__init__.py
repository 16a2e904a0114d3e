"""Bad hosts (#43): host faults told apart from script bugs (:mod:`.faults`), and the
host ledger kept across jobs (:mod:`.ledger`; ``eventbus hosts``: :mod:`.report`)."""
