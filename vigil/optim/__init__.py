"""Optimizer strategies, selected by ``optimizer.kind`` of the job spec.

Each kind maps to a factory ``factory(model, comm, spec) -> Strategy`` named by an import path, so
that only the chosen method's module is imported.
"""

from __future__ import annotations

import importlib

from torch import nn

from vigil.comm import Comm
from vigil.contract.schemas import OptimizerSpec
from vigil.optim.base import Strategy

REGISTRY: dict[str, str] = {
    "adamw": "vigil.optim.adamw:DDPAdamW",
    "powersgd": "vigil.optim.hooks:PowerSGD",
    "fp16_compress": "vigil.optim.hooks:HalfCompress",
    "local_adamw": "vigil.optim.local:LocalAdamW",
    "slowmo": "vigil.optim.local:SlowMo",
    "dsm": "vigil.optim.dsm:DSMLS",
    "sdp4bit": "vigil.optim.sdp4bit:SDP4Bit",
    "sdp4bit_qw": "vigil.optim.sdp4bit:SDP4Bit",
    "sdp4bit_qwd": "vigil.optim.sdp4bit:SDP4Bit",
    "sdp4bit_tlq": "vigil.optim.sdp4bit:SDP4Bit",
    "sdp4bit_tlq_hs": "vigil.optim.sdp4bit:SDP4Bit",
    "sdp4bit_ulq": "vigil.optim.sdp4bit:SDP4Bit",
    "cser": "vigil.optim.cser:CSER",
    "cser_pl": "vigil.optim.cser:CSER",
    "ef_sgd": "vigil.optim.cser:EFSGD",
    "qsparse_local_sgd": "vigil.optim.cser:QSparseLocalSGD",
    "compressed_adam": "vigil.optim.compressed_adam:CompressedAdamW",
}


def build_strategy(spec: OptimizerSpec, model: nn.Module, comm: Comm) -> Strategy:
    """The strategy for ``spec.kind``; ``ValueError`` naming the kind when it is not available."""
    target = REGISTRY.get(spec.kind)
    if target is None:
        raise ValueError(f"optimizer.kind: unknown kind {spec.kind!r}; known: {sorted(REGISTRY)}")
    module_name, _, attr = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"optimizer.kind: {spec.kind!r} is not available ({exc})") from exc
    return factory(model, comm, spec)


__all__ = ["REGISTRY", "Strategy", "build_strategy"]
