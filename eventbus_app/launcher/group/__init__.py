"""This node's worker group as the agent handles it: its processes (:mod:`.workers`), the
acts on them (:mod:`.processes`), the order in which they ended (:mod:`.exits`), their log
folder when ``--log-dir`` is not given (:mod:`.log_dir`), and the exit barrier's check-in
of a group that ended failed (:mod:`.exit_barrier`).

Torch-free to import; above the command line's options and console only.
"""
