"""One list of optimizer kinds: the contract's ``OptimizerKind``, the trainer's ``REGISTRY`` and the
params classes of ``vigil.contract.optimizer_params`` name the same kinds, and every strategy takes the
parsed params of its kind.

Needs: torch (imports the trainer); no process group (single rank).
"""

from __future__ import annotations

from typing import get_args

import pytest

from tests.vigil.optim.common import make, tiny_mlp
from vigil.comm import Comm
from vigil.contract.optimizer_params import PARAMS_BY_KIND, AdamWParams
from vigil.contract.schemas import OptimizerKind, OptimizerSpec
from vigil.optim import REGISTRY


def test_kinds_agree() -> None:
    assert set(get_args(OptimizerKind)) == set(REGISTRY) == set(PARAMS_BY_KIND)


@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_strategy_config_is_the_parsed_params(kind: str) -> None:
    """What the strategy runs with is what the controller validated (defaults of the kind included)."""
    strategy = make(kind, tiny_mlp(), Comm())
    # SDP4Bit calls it cfg; DDP AdamW keeps none (it takes no params).
    config = getattr(strategy, "config", None) or getattr(strategy, "cfg", None) or AdamWParams()
    assert config == OptimizerSpec(kind=kind).typed_params()  # type: ignore[arg-type]
