"""Fixtures of the controller tests: ``env``, a controller driven one monitor step at a time
(tests/controller/recovery_env.py; a module's own ``env`` fixture takes precedence)."""

from tests.controller.recovery_env import env

__all__ = ["env"]
