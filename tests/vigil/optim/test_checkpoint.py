"""Save -> restore -> continue equals an uninterrupted run, bit for bit, for every strategy of this family.

Needs torch with gloo; each case runs 2 ranks through ``harness.run_ranks`` (processes on
127.0.0.1, free port, under a timeout). The state goes through ``torch.save`` and
``torch.load(weights_only=True)`` as in ``vigil.checkpointing``; the restored model starts from other
weights, so everything must come from the checkpoint. The cut falls in the middle of a period
(tau, H) and after PowerSGD has started compressing.
"""

from __future__ import annotations

import pytest
import torch

from tests.vigil.optim.common import flat_params, make, roundtrip, tiny_mlp, train_step
from tests.vigil.optim.harness import run_ranks

TIMEOUT = 120
TOTAL, CUT = 9, 5

CASES: list[tuple[str, dict]] = [
    ("local_adamw", {"tau": 3}),
    ("slowmo", {"tau": 3}),
    ("dsm", {"tau": 3}),
    ("dsm", {"tau": 3, "sign": "randomized"}),
    ("dsm", {"tau": 3, "sharded": False}),
    ("powersgd", {"start_iter": 2}),
    ("fp16_compress", {}),
    ("cser", {"rc1": 4, "rc2": 2, "H": 2}),
    ("cser_pl", {"rc2": 2, "H": 3}),
    ("ef_sgd", {"ratio": 4}),
    ("qsparse_local_sgd", {"ratio": 2, "H": 3}),
    ("compressed_adam", {"compressor": "onebit"}),
    ("compressed_adam", {"compressor": "randk", "ratio": 0.25}),
    ("compressed_adam", {"compressor": "topk", "ratio": 0.25}),
]


def _resume(rank: int, world: int, kind: str, params: dict) -> dict:
    whole = make(kind, tiny_mlp(), weight_decay=0.05, grad_clip=1.0, **params)
    losses = [train_step(whole, rank, t) for t in range(TOTAL)]
    final = flat_params(whole.module)

    first = make(kind, tiny_mlp(), weight_decay=0.05, grad_clip=1.0, **params)
    for t in range(CUT):
        train_step(first, rank, t)
    saved = roundtrip({"model": first.module.state_dict(), "strategy": first.state_dict()})
    del first

    model = tiny_mlp(seed=123)
    second = make(kind, model, weight_decay=0.05, grad_clip=1.0, **params)
    model.load_state_dict(saved["model"])
    second.load_state_dict(saved["strategy"])
    resumed = [train_step(second, rank, t) for t in range(CUT, TOTAL)]
    return {"losses": losses[CUT:], "resumed": resumed, "final": final, "final_resumed": flat_params(second.module)}


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("kind", "params"), CASES, ids=[f"{k}-{'-'.join(map(str, p.values()))}" for k, p in CASES])
def test_restore_continues_exactly(kind: str, params: dict) -> None:
    for res in run_ranks(2, _resume, kind, params, timeout=TIMEOUT):
        assert res["resumed"] == res["losses"]
        assert torch.equal(res["final_resumed"], res["final"])
