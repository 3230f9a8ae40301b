"""Fixtures of the attack suite: ``env``, a real controller app and database driven one monitor step at a
time (tests/controller/recovery_env.py)."""

from tests.controller.recovery_env import env

__all__ = ["env"]
