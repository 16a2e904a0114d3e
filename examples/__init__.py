"""Runnable examples: `make demo` (demo.py), the training script it runs (train.py) and its
restart reactor (reactor.py)."""
