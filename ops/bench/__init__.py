"""Benchmarks of the controller (``vigil bench ingest``); each module runs with ``python -m``."""
