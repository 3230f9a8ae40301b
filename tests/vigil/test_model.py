"""The byte-level GPT: output shape, causality, loss at init. Needs only torch (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from vigil.contract.schemas import ModelSpec
from vigil.model import GPT, VOCAB_SIZE, GPTConfig, build_model


def _model(**kw: int) -> GPT:
    torch.manual_seed(0)
    return build_model(ModelSpec(**{"n_layer": 2, "n_head": 2, "d_model": 32, "context": 16, **kw}))


def test_logits_shape_and_loss_shape() -> None:
    m = _model()
    idx = torch.randint(0, VOCAB_SIZE, (3, 16))
    logits, loss = m(idx)
    assert logits.shape == (3, 16, VOCAB_SIZE)
    assert loss is None
    _, loss = m(idx, idx)
    assert loss is not None and loss.ndim == 0


def test_shorter_sequence_ok_longer_refused() -> None:
    m = _model()
    logits, _ = m(torch.zeros(1, 5, dtype=torch.long))
    assert logits.shape == (1, 5, VOCAB_SIZE)
    with pytest.raises(ValueError, match="context"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_causal_future_token_does_not_change_past_logits() -> None:
    m = _model().eval()
    idx = torch.randint(0, VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % VOCAB_SIZE
    with torch.no_grad():
        a, _ = m(idx)
        b, _ = m(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    # ...and the change is visible from position 10 on (the test would pass vacuously otherwise).
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_loss_at_init_is_near_uniform() -> None:
    m = _model()
    idx = torch.randint(0, VOCAB_SIZE, (8, 16), generator=torch.Generator().manual_seed(2))
    _, loss = m(idx[:, :-1], idx[:, 1:])
    assert loss is not None
    assert abs(loss.item() - math.log(VOCAB_SIZE)) < 0.1


def test_head_is_tied_to_embedding() -> None:
    m = _model()
    assert m.head.weight is m.tok_emb.weight
    # The state dict lists the shared matrix under both names; the parameters count it once.
    assert sum(v.numel() for v in m.state_dict().values()) - m.num_parameters() == VOCAB_SIZE * 32


def test_config_rejects_heads_not_dividing_width() -> None:
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(n_head=3, d_model=32)
    assert GPTConfig.from_spec(ModelSpec(n_layer=3, d_model=48, n_head=4, context=8)) == GPTConfig(
        n_layer=3, n_head=4, d_model=48, context=8
    )
