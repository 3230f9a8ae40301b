"""Vigil's contract: what every layer shares and nothing else.

The wire models (:mod:`vigil.contract.schemas`), the typed REST client (:mod:`vigil.contract.client`),
settings and shared paths (:mod:`vigil.contract.settings`), optimizer parameters, the checkpoint layout,
waiting for a port (:mod:`vigil.contract.probe`), background loops and link shaping. It imports no
torch, ray, SQLAlchemy or FastAPI, and nothing of Vigil's other packages: the agent and the dashboard
take it without loading the rank runtime (``vigil/__init__.py`` loads that only on first use), the
controller serves it, the ranks speak it. Living under ``vigil`` keeps it out of reach of a job's own
``controller/`` or ``schemas.py``, which a top-level name would let shadow it inside a rank.
"""
