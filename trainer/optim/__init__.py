"""Optimizer strategies, selected by ``optimizer.kind`` of the job spec.

Each kind maps to a factory ``factory(model, comm, spec) -> Strategy`` named by an import path, so
that only the chosen method's module is imported.
"""

from __future__ import annotations

import importlib

from torch import nn

from controller.schemas import OptimizerSpec
from trainer.comm import Comm
from trainer.optim.base import Strategy

REGISTRY: dict[str, str] = {
    "adamw": "trainer.optim.adamw:DDPAdamW",
    "powersgd": "trainer.optim.hooks:PowerSGD",
    "fp16_compress": "trainer.optim.hooks:HalfCompress",
    "local_adamw": "trainer.optim.local:LocalAdamW",
    "slowmo": "trainer.optim.local:SlowMo",
    "dsm": "trainer.optim.dsm:DSMLS",
    "sdp4bit": "trainer.optim.sdp4bit:SDP4Bit",
    "sdp4bit_qw": "trainer.optim.sdp4bit:SDP4Bit",
    "sdp4bit_qwd": "trainer.optim.sdp4bit:SDP4Bit",
    "sdp4bit_tlq": "trainer.optim.sdp4bit:SDP4Bit",
    "sdp4bit_tlq_hs": "trainer.optim.sdp4bit:SDP4Bit",
    "sdp4bit_ulq": "trainer.optim.sdp4bit:SDP4Bit",
    "cser": "trainer.optim.cser:CSER",
    "cser_pl": "trainer.optim.cser:CSER",
    "ef_sgd": "trainer.optim.cser:EFSGD",
    "qsparse_local_sgd": "trainer.optim.cser:QSparseLocalSGD",
    "compressed_adam": "trainer.optim.compressed_adam:CompressedAdamW",
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
