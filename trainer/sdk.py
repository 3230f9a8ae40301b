"""Compatibility: ``from trainer import sdk`` is :mod:`vigil.sdk` (write ``import vigil`` in new code)."""

from vigil.sdk import *
from vigil.sdk import __all__  # noqa: F401
