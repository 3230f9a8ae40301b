"""Compatibility: Vigil's rank runtime is the package :mod:`vigil` (``import vigil``).

``from trainer import sdk`` keeps working for code written before the rename; Vigil itself never imports
this package (a user's own ``trainer.py`` in a job's folder would shadow it, which is why it moved).
"""
