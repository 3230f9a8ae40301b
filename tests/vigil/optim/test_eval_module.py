"""``eval_module()`` of every strategy: the same synchronised model on every rank.

Needs torch with gloo; one 2-rank run through ``harness.run_ranks`` (127.0.0.1, free port, under a
timeout). Every rank calls ``eval_module`` (some strategies need a collective to build it).
"""

from __future__ import annotations

import pytest
import torch

from tests.vigil.optim.common import flat_params, make, tiny_mlp, train_step
from tests.vigil.optim.harness import run_ranks

TIMEOUT = 120
KINDS: list[tuple[str, dict]] = [
    ("adamw", {}), ("powersgd", {"start_iter": 2}), ("fp16_compress", {}), ("local_adamw", {"tau": 3}),
    ("slowmo", {"tau": 3}), ("dsm", {"tau": 3}), ("dsm", {"tau": 3, "sharded": False}), ("cser", {"rc1": 4}),
    ("cser_pl", {}), ("ef_sgd", {}), ("qsparse_local_sgd", {"H": 3}), ("compressed_adam", {}),
]


def _evals(rank: int, world: int) -> list[dict]:
    out = []
    for kind, params in KINDS:
        strategy = make(kind, tiny_mlp(), **params)
        for step in range(3):
            train_step(strategy, rank, step)
        at_sync = flat_params(strategy.module)
        train_step(strategy, rank, 3)  # one local step past the sync
        module = strategy.eval_module()
        out.append({"eval": flat_params(module), "at_sync": at_sync, "now": flat_params(strategy.module),
                     "is_training_module": module is strategy.module})
    return out


@pytest.mark.timeout(TIMEOUT)
def test_eval_module_is_identical_on_all_ranks() -> None:
    a, b = run_ranks(2, _evals, timeout=TIMEOUT)
    for (kind, params), ra, rb in zip(KINDS, a, b, strict=True):
        assert torch.equal(ra["eval"], rb["eval"]), (kind, params)
        if kind in ("slowmo", "dsm", "qsparse_local_sgd"):
            # the last synchronised model, not a rank's local one
            assert torch.equal(ra["eval"], ra["at_sync"]), kind
            assert not ra["is_training_module"]
        if kind == "local_adamw":
            assert torch.allclose(ra["eval"], (ra["now"] + rb["now"]) / 2, atol=1e-7)
