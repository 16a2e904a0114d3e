"""This node's worker group as the agent handles it: its processes (:mod:`.workers`), the
acts on them (:mod:`.processes`), the order in which they ended (:mod:`.exits`), and their
log folder when ``--log-dir`` is not given (:mod:`.log_dir`).

Torch-free to import; above the command line's options and console only.
"""
