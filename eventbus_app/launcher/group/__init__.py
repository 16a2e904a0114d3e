"""This node's worker group as the agent handles it: its processes (:mod:`.workers`), the
acts on them (:mod:`.processes`), and the order in which they ended (:mod:`.exits`).

Torch-free to import; above the command line's options and console only.
"""
