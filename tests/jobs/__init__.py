"""Small training scripts and reactors that the end-to-end tests run under `eventbus run`."""
