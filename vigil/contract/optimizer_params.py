"""Method-specific parameters (``optimizer.params``): one frozen dataclass per optimizer kind.

The single source of truth for what each kind accepts: the job spec (``OptimizerSpec``) parses its
``params`` with :func:`parse_optimizer_params` when it is validated, so ``POST /api/v1/jobs``
refuses a bad value with 422 before anything is stored, and the trainer's strategies take the same
typed instance (``OptimizerSpec.typed_params``) instead of parsing the dict again.

Every class's fields carry the defaults and its ``__post_init__`` checks ranges; :func:`parse_params`
rejects unknown names and wrong types with a ``ValueError`` that names the field
(``optimizer.params.<field> (<kind>): <rule>``). Kinds that share a class (the SDP4Bit ablations,
``cser`` / ``cser_pl``) differ only by data: :data:`KIND_DEFAULTS` and :data:`KIND_FIXED`.

Torch-free on purpose: the controller imports this module (never the trainer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
P = TypeVar("P", bound="OptimizerParams")

_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}
_OPTIONAL = " | None"


class ParamError(ValueError):
    """A range check of one field failed: ``field`` and the ``rule`` it broke (str: ``"<field> <rule>"``)."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field} {rule}")
        self.field = field
        self.rule = rule


def check(condition: bool, field: str, rule: str) -> None:
    """Raise :class:`ParamError` (a ``ValueError``) unless ``condition``; for ``__post_init__`` range checks."""
    if not condition:
        raise ParamError(field, rule)


def _coerce(kind: str, name: str, want: type, value: Any) -> Any:
    if want is bool:
        if isinstance(value, bool):
            return value
    elif want is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif want is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif want is str and isinstance(value, str):
        return value
    raise ValueError(f"optimizer.params.{name} ({kind}): expected {want.__name__}, got {value!r}")


def parse_params(cls: type[T], params: Mapping[str, Any], *, kind: str) -> T:
    """``cls(**params)`` with names and types checked; ``ValueError`` naming the offending field."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(params) - set(fields))
    if unknown:
        names = ", ".join(f"optimizer.params.{u}" for u in unknown)
        accepted = f"accepted: {sorted(fields)}" if fields else "it takes no params"
        raise ValueError(f"{names} ({kind}): unknown parameter; {accepted}")
    values: dict[str, Any] = {}
    for name, value in params.items():
        annotation = fields[name].type
        type_name = annotation if isinstance(annotation, str) else annotation.__name__
        optional = type_name.endswith(_OPTIONAL)
        if optional and value is None:
            values[name] = None
            continue
        want = _TYPES[type_name.removesuffix(_OPTIONAL)]
        values[name] = _coerce(kind, name, want, value)
    try:
        return cls(**values)
    except ParamError as exc:
        raise ValueError(f"optimizer.params.{exc.field} ({kind}): {exc.rule}") from exc
    except ValueError as exc:
        raise ValueError(f"optimizer.params ({kind}): {exc}") from exc


@dataclass(frozen=True)
class OptimizerParams:
    """Base of every kind's ``optimizer.params`` class (no fields of its own)."""


# --------------------------------------------------------------------------------------------------
# DDP AdamW (vigil/optim/adamw.py)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdamWParams(OptimizerParams):
    """``optimizer.params`` of ``adamw``: none (lr, betas, weight_decay and grad_clip are the spec's own
    fields), so any name given is refused rather than silently ignored."""


# --------------------------------------------------------------------------------------------------
# DDP communication hooks (vigil/optim/hooks.py)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PowerSGDParams(OptimizerParams):
    """``optimizer.params`` of ``powersgd`` (names of ``PowerSGDState`` in brackets)."""

    rank: int = 1
    """Rank of the P Q^T approximation (``matrix_approximation_rank``)."""
    start_iter: int = 10
    """Vanilla fp32 all-reduce for this many steps first (``start_powerSGD_iter``; >= 2 with error
    feedback or warm start, because DDP rebuilds its buckets after the first step)."""
    min_compression_rate: float = 2.0
    """Compress a matrix only if (n + m) r x this < n m (``min_compression_rate``)."""
    error_feedback: bool = True
    """Keep the local compression error and add it next step (``use_error_feedback``)."""
    warm_start: bool = True
    """Reuse last step's Q as the start of the power iteration (``warm_start``)."""
    seed: int = 0
    """Seed of the random initial Q, identical on all ranks (``random_seed``)."""
    bucket_cap_mb: float = 25.0
    """DDP bucket size."""

    def __post_init__(self) -> None:
        check(self.rank >= 1, "rank", f"must be >= 1, got {self.rank}")
        check(
            self.start_iter >= 2 or not (self.error_feedback or self.warm_start),
            "start_iter", f"must be >= 2 with error_feedback or warm_start, got {self.start_iter}",
        )
        check(self.min_compression_rate > 0, "min_compression_rate", f"must be > 0, got {self.min_compression_rate}")
        check(self.bucket_cap_mb > 0, "bucket_cap_mb", f"must be > 0, got {self.bucket_cap_mb}")


@dataclass(frozen=True)
class HalfCompressParams(OptimizerParams):
    """``optimizer.params`` of ``fp16_compress``."""

    bucket_cap_mb: float = 25.0
    """DDP bucket size."""

    def __post_init__(self) -> None:
        check(self.bucket_cap_mb > 0, "bucket_cap_mb", f"must be > 0, got {self.bucket_cap_mb}")


# --------------------------------------------------------------------------------------------------
# Local steps: Local AdamW, SlowMo (vigil/optim/local.py), DSM-LS (vigil/optim/dsm.py)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalAdamWParams(OptimizerParams):
    """``optimizer.params`` of ``local_adamw``."""

    tau: int = 12
    """Local steps between model averages."""
    sharded: bool = False
    """Average by reduce-scatter + all-gather instead of one all-reduce (same wire bytes)."""

    def __post_init__(self) -> None:
        check(self.tau >= 1, "tau", f"must be >= 1, got {self.tau}")


@dataclass(frozen=True)
class SlowMoParams(OptimizerParams):
    """``optimizer.params`` of ``slowmo`` (defaults: fairscale's slowmo_lr=1, slowmo_momentum=0.5)."""

    tau: int = 12
    """Local steps between synchronisations (``slowmo_frequency``)."""
    alpha: float = 1.0
    """Slow learning rate (``slowmo_lr``)."""
    beta: float = 0.5
    """Slow momentum (``slowmo_momentum``)."""
    sharded: bool = True
    """Outer state sharded 1/N (reduce-scatter + all-gather) instead of replicated (all-reduce)."""

    def __post_init__(self) -> None:
        check(self.tau >= 1, "tau", f"must be >= 1, got {self.tau}")
        check(self.alpha > 0, "alpha", f"must be > 0, got {self.alpha}")
        check(0.0 <= self.beta < 1.0, "beta", f"must be in [0, 1), got {self.beta}")


@dataclass(frozen=True)
class DSMParams(OptimizerParams):
    """``optimizer.params`` of ``dsm`` (defaults: the reference GPT-2 runs)."""

    tau: int = 12
    """Local steps between global steps."""
    gamma: float = 1.0
    """Global step size, in units of the local learning rate."""
    beta1: float = 0.95
    """Interpolation of the sign argument c = beta1*m + (1-beta1)*d."""
    beta2: float = 0.98
    """Decay of the global momentum m."""
    global_wd: float = 0.1
    """Decoupled weight decay of the global step (the reference script's default is 0.2)."""
    sign: str = "sign"
    """``sign`` (deterministic) or ``randomized`` (stochastic, E[s] = c / max|c|)."""
    sharded: bool = True
    """Global state sharded 1/N (reduce-scatter + all-gather) instead of replicated (all-reduce)."""
    seed: int = 0
    """Seed of the randomized sign."""

    def __post_init__(self) -> None:
        check(self.tau >= 1, "tau", f"must be >= 1, got {self.tau}")
        check(self.gamma > 0, "gamma", f"must be > 0, got {self.gamma}")
        check(0.0 <= self.beta1 < 1.0, "beta1", f"must be in [0, 1), got {self.beta1}")
        check(0.0 <= self.beta2 < 1.0, "beta2", f"must be in [0, 1), got {self.beta2}")
        check(self.global_wd >= 0, "global_wd", f"must be >= 0, got {self.global_wd}")
        check(self.sign in ("sign", "randomized"), "sign", f"must be 'sign' or 'randomized', got {self.sign!r}")


# --------------------------------------------------------------------------------------------------
# SDP4Bit (vigil/optim/sdp4bit.py)
# --------------------------------------------------------------------------------------------------

WEIGHT_MODES = ("fp32", "qw", "qwd")
GRAD_MODES = ("fp32", "tlq", "tlq_hs", "ulq")
SDP4BIT_VARIANTS: dict[str, tuple[str, str]] = {
    "sdp4bit": ("qwd", "tlq_hs"),
    "sdp4bit_qw": ("qw", "fp32"),
    "sdp4bit_qwd": ("qwd", "fp32"),
    "sdp4bit_tlq": ("fp32", "tlq"),
    "sdp4bit_tlq_hs": ("fp32", "tlq_hs"),
    "sdp4bit_ulq": ("fp32", "ulq"),
}
"""SDP4Bit and its ablations: kind -> (weights, grads), the defaults of those two params."""


@dataclass(frozen=True)
class SDP4BitParams(OptimizerParams):
    """``optimizer.params`` of ``sdp4bit`` and its ablations ``sdp4bit_*`` (which only change the
    defaults of ``weights`` and ``grads``: :data:`SDP4BIT_VARIANTS`)."""

    weights: str = "qwd"
    """Weight all-gather: ``fp32`` | ``qw`` (quantized weights) | ``qwd`` (quantized weight differences)."""
    grads: str = "tlq_hs"
    """Gradient reduce-scatter: ``fp32`` | ``tlq`` | ``tlq_hs`` (with Hadamard) | ``ulq`` (4-bit both hops)."""
    weight_group: int = 2048
    """Elements per quantization group of the weights (one fp32 scale each)."""
    grad_group: int = 128
    """Elements per quantization group of the gradients, both hops."""
    hadamard_order: int = 32
    """Block size of the Hadamard transform (a power of two dividing ``grad_group``)."""
    ranks_per_node: int | None = None
    """Pretend ``ranks_per_node`` consecutive ranks share a node (None: discover the real placement)."""
    seed: int = 0
    """Seed of the stochastic-rounding noise streams."""
    compile: bool = False
    """Use ``torch.compile``-fused quantization kernels (falls back to eager if compiling fails)."""

    def __post_init__(self) -> None:
        check(self.weights in WEIGHT_MODES, "weights", f"must be one of {WEIGHT_MODES}, got {self.weights!r}")
        check(self.grads in GRAD_MODES, "grads", f"must be one of {GRAD_MODES}, got {self.grads!r}")
        for name in ("weight_group", "grad_group", "hadamard_order"):
            v = getattr(self, name)
            check(v >= 2 and v % 2 == 0, name, f"must be an even number >= 2, got {v}")
        h = self.hadamard_order
        check((h & (h - 1)) == 0 and self.grad_group % h == 0, "hadamard_order",
              f"must be a power of two dividing grad_group ({self.grad_group}), got {h}")
        check(self.ranks_per_node is None or self.ranks_per_node >= 1, "ranks_per_node",
              f"must be >= 1, got {self.ranks_per_node}")


# --------------------------------------------------------------------------------------------------
# CSER, EF-SGD, QSparse-local-SGD (vigil/optim/cser.py)
# --------------------------------------------------------------------------------------------------


def _check_ratio(name: str, value: float) -> None:
    check(value == 0 or value >= 1, name, f"must be 0 (nothing sent) or >= 1 (1 = identity), got {value}")


@dataclass(frozen=True)
class CSERParams(OptimizerParams):
    """``optimizer.params`` of ``cser`` / ``cser_pl`` (overall ratio R = rc1/2 when H = rc1/rc2)."""

    rc1: float = 32.0
    """Ratio of C1, the per-step partial sync of the update (1 = identity, 0 = nothing; cser_pl: 0)."""
    rc2: float = 4.0
    """Ratio of C2, the error reset (1 = identity, 0 = nothing)."""
    H: int = 8
    """Steps between error resets."""
    momentum: float = 0.9
    """Momentum of the local SGD."""
    nesterov: bool = True
    """Nesterov momentum (the paper's choice)."""
    seed: int = 0
    """Shared seed of the block positions (identical on all ranks)."""

    def __post_init__(self) -> None:
        _check_ratio("rc1", self.rc1)
        _check_ratio("rc2", self.rc2)
        check(self.H >= 1, "H", f"must be >= 1, got {self.H}")
        check(0.0 <= self.momentum < 1.0, "momentum", f"must be in [0, 1), got {self.momentum}")


@dataclass(frozen=True)
class EFSGDParams(OptimizerParams):
    """``optimizer.params`` of ``ef_sgd``: 32/ratio b/p/step."""

    ratio: float = 16.0
    """GRBS ratio of the compressed update (1 = identity: synchronous SGD)."""
    momentum: float = 0.9
    """Momentum of the local SGD (applied before compression)."""
    nesterov: bool = True
    """Nesterov momentum."""
    seed: int = 0
    """Shared seed of the block positions."""

    def __post_init__(self) -> None:
        check(self.ratio >= 1, "ratio", f"must be >= 1, got {self.ratio}")
        check(0.0 <= self.momentum < 1.0, "momentum", f"must be in [0, 1), got {self.momentum}")


@dataclass(frozen=True)
class QSparseParams(OptimizerParams):
    """``optimizer.params`` of ``qsparse_local_sgd``: 32/(H ratio) b/p/step."""

    ratio: float = 2.0
    """GRBS ratio of the synchronised progress (1 = identity: local SGD with period H)."""
    H: int = 8
    """Local steps between synchronisations."""
    momentum: float = 0.9
    """Momentum of the local SGD (buffers stay local)."""
    nesterov: bool = True
    """Nesterov momentum."""
    seed: int = 0
    """Shared seed of the block positions."""

    def __post_init__(self) -> None:
        check(self.ratio >= 1, "ratio", f"must be >= 1, got {self.ratio}")
        check(self.H >= 1, "H", f"must be >= 1, got {self.H}")
        check(0.0 <= self.momentum < 1.0, "momentum", f"must be in [0, 1), got {self.momentum}")


# --------------------------------------------------------------------------------------------------
# Compressed AdamW (vigil/optim/compressed_adam.py)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompressedAdamParams(OptimizerParams):
    """``optimizer.params`` of ``compressed_adam``."""

    compressor: str = "onebit"
    """``onebit``, ``randk`` or ``topk``."""
    ratio: float = 0.01
    """k / d for randk and topk (per partition; at least one value)."""
    chunk: int = 0
    """onebit: elements per fp32 scale, a multiple of 8 (0: one scale per tensor piece of each owner partition)."""
    error_feedback: bool = True
    """Keep the worker and owner compression errors (False: the no-feedback ablation)."""
    seed: int = 0
    """Shared seed of the randk positions."""

    def __post_init__(self) -> None:
        check(self.compressor in ("onebit", "randk", "topk"), "compressor",
              f"must be onebit, randk or topk, got {self.compressor!r}")
        check(0.0 < self.ratio <= 1.0, "ratio", f"must be in (0, 1], got {self.ratio}")
        check(self.chunk >= 0 and self.chunk % 8 == 0, "chunk", f"must be 0 or a multiple of 8, got {self.chunk}")


# --------------------------------------------------------------------------------------------------
# Kinds
# --------------------------------------------------------------------------------------------------

PARAMS_BY_KIND: dict[str, type[OptimizerParams]] = {
    "adamw": AdamWParams,
    "powersgd": PowerSGDParams,
    "fp16_compress": HalfCompressParams,
    "local_adamw": LocalAdamWParams,
    "slowmo": SlowMoParams,
    "dsm": DSMParams,
    **dict.fromkeys(SDP4BIT_VARIANTS, SDP4BitParams),
    "cser": CSERParams,
    "cser_pl": CSERParams,
    "ef_sgd": EFSGDParams,
    "qsparse_local_sgd": QSparseParams,
    "compressed_adam": CompressedAdamParams,
}
OPTIMIZER_KINDS: tuple[str, ...] = tuple(PARAMS_BY_KIND)
"""Every optimizer kind, in the order above (the job spec's ``optimizer.kind`` accepts exactly these)."""
"""Every ``optimizer.kind`` -> the class of its ``optimizer.params`` (a test keeps it equal to
``OptimizerKind`` and to the trainer's ``REGISTRY``)."""

KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    kind: {"weights": weights, "grads": grads} for kind, (weights, grads) in SDP4BIT_VARIANTS.items()
}
"""Defaults that depend on the kind, for kinds that share a class: what a param left out means."""

KIND_FIXED: dict[str, dict[str, Any]] = {"cser_pl": {"rc1": 0}}
"""Params a kind pins: may be left out or given that very value, anything else is refused
(``cser_pl`` is CSER with C1 = 0)."""


def parse_optimizer_params(kind: str, params: Mapping[str, Any]) -> OptimizerParams:
    """The typed ``optimizer.params`` of ``kind`` (an instance of ``PARAMS_BY_KIND[kind]``).

    ``ValueError`` naming ``optimizer.params.<field>`` and the rule for an unknown name, a wrong
    type, a value out of range, or a value the kind fixes.
    """
    cls = PARAMS_BY_KIND.get(kind)
    if cls is None:
        raise ValueError(f"optimizer.kind: unknown kind {kind!r}; known: {sorted(PARAMS_BY_KIND)}")
    values = {**KIND_DEFAULTS.get(kind, {}), **params}
    for name, pinned in KIND_FIXED.get(kind, {}).items():
        given = values.get(name, pinned)
        if isinstance(given, bool) or given != pinned:
            raise ValueError(f"optimizer.params.{name} ({kind}): fixed to {pinned!r} by this kind; leave it out, "
                             f"got {given!r}")
        values[name] = pinned
    return parse_params(cls, values, kind=kind)


__all__ = [
    "GRAD_MODES", "KIND_DEFAULTS", "KIND_FIXED", "PARAMS_BY_KIND", "SDP4BIT_VARIANTS", "WEIGHT_MODES",
    "AdamWParams", "CSERParams", "CompressedAdamParams", "DSMParams", "EFSGDParams", "HalfCompressParams",
    "LocalAdamWParams", "OptimizerParams", "ParamError", "PowerSGDParams", "QSparseParams", "SDP4BitParams",
    "SlowMoParams", "check", "parse_optimizer_params", "parse_params",
]
