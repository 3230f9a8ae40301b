"""``python -m vigil.bench.convergence``: the small reproduction, end to end on a tiny configuration.

Needs torch with gloo and the offline pydoc corpus (the session's ``corpus_cache``); starts 4 gloo
ranks on 127.0.0.1 (free port, under a timeout) twice: once for two methods (DDP AdamW and
SDP4Bit, whose baseline is added) through the real train loop, once for the quantization errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vigil.bench.convergence import (
    BY_NAME,
    COMPARISONS,
    METHODS,
    SENSITIVITY,
    add_gaps,
    main,
    plan,
    plot,
    run,
    table,
)
from vigil.contract.schemas import ModelSpec

TIMEOUT = 300
TINY = ModelSpec(n_layer=1, n_head=2, d_model=32, context=32)


@pytest.mark.timeout(TIMEOUT)
def test_two_methods_end_to_end(tmp_path: Path, corpus_cache: Path) -> None:
    result = run(steps=4, seeds=[0], methods=["adamw", "sdp4bit"], eval_interval=2, model=TINY, batch_size=4,
                 max_bytes=100_000, cache_dir=str(corpus_cache), timeout_per_run=120)
    assert set(result) == {"meta", "methods", "comparisons", "quant_errors"}
    entries = {e["optimizer"]: e for e in result["methods"]}
    assert list(entries) == ["adamw", "sdp4bit_baseline", "sdp4bit"]  # the baseline comes with its method
    for e in entries.values():
        assert "error" not in e, e
        assert set(e) >= {"payload_bits_per_param_step", "components", "val_loss_mean", "val_loss_std", "gap_pct",
                          "gap_to_baseline", "wire_bytes_per_step", "step_time_s", "curve", "seeds"}
        assert set(e["curve"]) == {"2", "4"}
    adamw = entries["adamw"]
    assert adamw["payload_bits_per_param_step"] == 32.0  # measured by the communication layer
    assert adamw["components"] == {"grads": 32.0}
    assert adamw["gap_to_baseline"] == 0.0
    sdp = entries["sdp4bit"]
    assert sdp["components"]["grads_intra"] == pytest.approx(8.25)
    assert sdp["components"]["grads_inter"] == pytest.approx(4.25)
    assert sdp["payload_bits_per_param_step"] < entries["sdp4bit_baseline"]["payload_bits_per_param_step"] / 2
    assert result["comparisons"] == []  # no comparison is complete with these methods
    q = result["quant_errors"]
    assert q is not None and "error" not in q
    assert 0 < q["weight_diff_q4_error_in_weights"] < q["weights_q4"]
    assert 0 < q["grad_q8"] < q["grad_q4"] and 0 < q["grad_q8_hadamard"] < q["grad_q4_hadamard"]
    text = table(result)
    assert "sdp4bit_baseline" in text and "Hadamard" in text
    figure = plot(result, tmp_path / "conv.png")
    assert figure.exists() and figure.stat().st_size > 0


def test_plan_gives_key_methods_every_seed() -> None:
    runs = plan([BY_NAME["cser_r16"], BY_NAME["dsm_gamma4"], BY_NAME["sgd"]], [0, 1, 2])
    assert [(m.name, s) for m, s in runs] == [
        ("sgd", 0), ("sgd", 1), ("sgd", 2), ("cser_r16", 0), ("cser_r16", 1), ("cser_r16", 2), ("dsm_gamma4", 0)
    ]
    # every ratio of CSER vs EF-SGD vs QSparse-local-SGD is a key comparison: three seeds
    assert all(BY_NAME[f"{m}_r{r}"].key for m in ("cser", "ef_sgd", "qsparse") for r in (16, 64, 256))
    every = {m for c in COMPARISONS for m in c.methods}
    assert every == {m.name for m in METHODS}  # every method is in some comparison
    assert all(BY_NAME[m.baseline].baseline == m.baseline for m in METHODS)  # baselines are their own
    assert all(not BY_NAME[n].key for n in SENSITIVITY)  # seed 0 only, and left out of --quick


def test_gaps_are_paired_by_seed() -> None:
    entries = [
        {"optimizer": "b", "baseline": "b", "val_loss": {"0": 2.0, "1": 3.0}},
        {"optimizer": "m", "baseline": "b", "val_loss": {"0": 2.2, "1": 3.3}},
        {"optimizer": "one", "baseline": "b", "val_loss": {"0": 2.1}},
    ]
    add_gaps(entries)
    assert entries[1]["gap_to_baseline"] == pytest.approx(0.25) and entries[1]["gap_pct"] == pytest.approx(10.0)
    assert entries[1]["gap_pct_std"] == pytest.approx(0.0)
    assert entries[2]["gap_seeds"] == [0] and entries[2]["gap_to_baseline_std"] is None


def test_cli_rejects_unknown_methods(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--only", "nope"])
    assert "unknown methods" in capsys.readouterr().err
