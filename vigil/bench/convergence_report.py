"""The convergence bench's results: per-method summaries over seeds, gaps to the baselines, the
checks each published comparison makes, the table and the plots (:mod:`vigil.bench.convergence`
runs the methods)."""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vigil.bench.convergence_methods import (
    BY_NAME,
    CLOSE_PCT,
    CLOSE_TO_ADAMW_PCT,
    COMPARISONS,
    CSER_RATIOS,
    Comparison,
    Method,
)

log = logging.getLogger(__name__)




def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _rnd(x: float | None, nd: int = 5) -> float | None:
    return None if x is None else round(x, nd)


def summarize_method(method: Method, per_seed: dict[int, list[dict[str, Any]]], steps: int) -> dict[str, Any]:
    """One method's entry from every seed's per-rank raw results (gaps are added later)."""
    entry: dict[str, Any] = {
        "optimizer": method.name, "kind": method.kind, "params": method.params, "family": method.family,
        "baseline": method.baseline, "seeds": sorted(per_seed),
    }
    errors = sorted({r["error"] for ranks in per_seed.values() for r in ranks if "error" in r})
    if errors:
        entry["error"] = "; ".join(errors)
    ok = {s: ranks for s, ranks in per_seed.items() if all("error" not in r for r in ranks)}
    if not ok:
        return entry
    entry["seeds"] = sorted(ok)
    finals = {s: ranks[0]["val"][max(ranks[0]["val"])] for s, ranks in ok.items()}
    mean, std = _mean_std(list(finals.values()))
    curve_steps = sorted(set.intersection(*(set(ranks[0]["val"]) for ranks in ok.values())))
    first = next(iter(ok.values()))
    n = first[0]["n_params"]
    bits_per_seed = [statistics.fmean(sum(r["bits"].values()) for r in ranks) / (n * steps) for ranks in ok.values()]
    tags = sorted({t for ranks in ok.values() for r in ranks for t in r["bits"]})
    components = {}
    for tag in tags:
        elements = sum(r["elements"].get(tag, 0) for ranks in ok.values() for r in ranks)
        if elements:
            components[tag] = round(sum(r["bits"].get(tag, 0) for ranks in ok.values() for r in ranks) / elements, 4)
    slowest = [max(ts) for ranks in ok.values() for ts in list(zip(*(r["step_times"] for r in ranks)))[1:]]
    local_vals = [ranks[0]["local_val"] for ranks in ok.values() if ranks[0].get("local_val") is not None]
    train_tail = [
        statistics.fmean(v for r in ranks for s, v in r["losses"].items() if s > steps - 10 and v is not None)
        for ranks in ok.values()
    ]
    entry.update(
        val_loss={str(s): _rnd(v) for s, v in sorted(finals.items())},
        val_loss_mean=_rnd(mean),
        val_loss_std=_rnd(std),
        train_loss_last10=_rnd(statistics.fmean(train_tail)),
        val_loss_rank0_model=_rnd(statistics.fmean(local_vals)) if local_vals else None,
        payload_bits_per_param_step=round(statistics.fmean(bits_per_seed), 4),
        components=components,
        wire_bytes_per_step=round(statistics.fmean(r["wire_bytes"] for ranks in ok.values() for r in ranks) / steps, 1),
        step_time_s=_rnd(statistics.fmean(slowest) if slowest else None, 4),
        curve={str(s): _rnd(statistics.fmean(ranks[0]["val"][s] for ranks in ok.values())) for s in curve_steps},
        model_params=n,
    )
    return entry


def compare(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every comparison whose methods all ran, with its checks."""
    by_name = {e["optimizer"]: e for e in entries}
    return [
        {**asdict(comp), "methods": list(comp.methods), "checks": comparison_checks(comp, by_name)}
        for comp in COMPARISONS
        if all(m in by_name for m in comp.methods)
    ]


def add_gaps(entries: list[dict[str, Any]]) -> None:
    """Paired gaps to each entry's baseline: mean and std over the seeds both have."""
    by_name = {e["optimizer"]: e for e in entries}
    for e in entries:
        base = by_name.get(e["baseline"])
        if "val_loss" not in e or base is None or "val_loss" not in base:
            continue
        common = sorted(set(e["val_loss"]) & set(base["val_loss"]), key=int)
        gaps = [e["val_loss"][s] - base["val_loss"][s] for s in common]
        pcts = [100.0 * (e["val_loss"][s] / base["val_loss"][s] - 1.0) for s in common]
        gap, gap_std = _mean_std(gaps)
        pct, pct_std = _mean_std(pcts)
        e.update(gap_to_baseline=_rnd(gap), gap_to_baseline_std=_rnd(gap_std), gap_pct=_rnd(pct, 3),
                 gap_pct_std=_rnd(pct_std, 3), gap_seeds=[int(s) for s in common])


def _se(e: dict[str, Any]) -> float:
    """Standard error of a paired gap in % (0 with one seed: no estimate)."""
    std = e.get("gap_pct_std")
    return 0.0 if std is None else std / math.sqrt(len(e.get("gap_seeds", [1])))


def _check(claim: str, holds: bool, detail: str) -> dict[str, Any]:
    return {"claim": claim, "holds": bool(holds), "detail": detail}


def comparison_checks(comp: Comparison, by_name: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The published claim of ``comp`` as explicit, mechanical checks on the measured means."""
    if any("val_loss_mean" not in by_name.get(m, {}) for m in comp.methods):
        return []
    loss = {m: by_name[m]["val_loss_mean"] for m in comp.methods}
    gap = {m: by_name[m].get("gap_pct", 0.0) for m in comp.methods}
    checks = []
    if comp.name == "sdp4bit_ablation":
        for m in ("sdp4bit_qwd", "sdp4bit_tlq_hs", "sdp4bit"):
            checks.append(_check(f"{m} within {CLOSE_PCT}% of the baseline", abs(gap[m]) <= CLOSE_PCT,
                                 f"gap {gap[m]:+.3f}% (+-{_se(by_name[m]):.3f}% s.e.)"))
        checks.append(_check("TLq worse than TLq-HS", loss["sdp4bit_tlq"] > loss["sdp4bit_tlq_hs"],
                             f"TLq {gap['sdp4bit_tlq']:+.3f}% vs TLq-HS {gap['sdp4bit_tlq_hs']:+.3f}%"))
        worst = max(loss, key=loss.__getitem__)
        checks.append(_check("qW the worst of the ablation", worst == "sdp4bit_qw",
                             f"qW {gap['sdp4bit_qw']:+.3f}%; worst: {worst}"))
    elif comp.name == "local_steps":
        others = min(loss["slowmo"], loss["local_adamw"])
        checks.append(_check("DSM-LS below SlowMo and Local AdamW", loss["dsm"] < others,
                             f"dsm {loss['dsm']:.4f}, slowmo {loss['slowmo']:.4f}, local_adamw {loss['local_adamw']:.4f}"))
    elif comp.name.startswith("cser_r"):
        r = comp.name.removeprefix("cser_r")
        cser, ef, qs = f"cser_r{r}", f"ef_sgd_r{r}", f"qsparse_r{r}"
        checks.append(_check(f"CSER below EF-SGD and QSparse at R={r}", loss[cser] < min(loss[ef], loss[qs]),
                             f"gaps: cser {gap[cser]:+.2f}%, ef_sgd {gap[ef]:+.2f}%, qsparse {gap[qs]:+.2f}%"))
        own: dict[str, float] = {m: v for m in (cser, ef, qs) if (v := by_name[m].get("val_loss_rank0_model")) is not None}
        if len(own) == 3:
            checks.append(_check(
                f"a CSER worker's own model below EF-SGD's and QSparse's at R={r}", own[cser] < min(own[ef], own[qs]),
                ", ".join(f"{m} {v:.4f}" for m, v in own.items()) + f" (synchronous SGD {loss['sgd']:.4f})"))
    elif comp.name == "dsm_gamma":
        best = min(("dsm", "dsm_gamma4", "dsm_gamma12"), key=loss.__getitem__)
        checks.append(_check("a larger gamma lowers DSM-LS's loss", best != "dsm",
                             ", ".join(f"{m} {loss[m]:.4f}" for m in comp.methods)))
    elif comp.name == "onebit_chunk":
        ef, noef = "compressed_adam_ef_c256", "compressed_adam_noef_c256"
        checks.append(_check("error feedback helps with chunk 256", loss[ef] < loss[noef],
                             f"EF {gap[ef]:+.2f}%, no EF {gap[noef]:+.2f}%"))
    elif comp.name == "compressed_adam":
        ef, noef = "compressed_adam_ef", "compressed_adam_noef"
        margin = 2.0 * math.hypot(_se(by_name[ef]), _se(by_name[noef]))
        checks.append(_check("without error feedback a clear gap (beyond 2 s.e. of the difference)",
                             gap[noef] - gap[ef] > margin, f"no EF {gap[noef]:+.2f}%, EF {gap[ef]:+.2f}%"))
        checks.append(_check(f"with error feedback within {CLOSE_TO_ADAMW_PCT}% of AdamW",
                             abs(gap[ef]) <= CLOSE_TO_ADAMW_PCT, f"EF {gap[ef]:+.2f}%"))
    return checks


# -- driver ---------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict[str, Any], markdown: bool = False) -> str:
    """The per-method table, the checks and the quantization errors, as text or Markdown."""
    head = ["method", "kind", "b/p/step", "val loss", "± std", "seeds", "gap", "gap %", "rank-0 model val",
            "train loss", "step s"]
    rows = []
    for e in result["methods"]:
        if "val_loss_mean" not in e:
            rows.append([e["optimizer"], e["kind"], "error", e.get("error", "")[:60], *[""] * 7])
            continue
        gap_pct = _fmt(e.get("gap_pct"), "+.2f")
        if e.get("gap_pct_std") is not None:
            gap_pct += f" ± {e['gap_pct_std']:.2f}"
        rows.append([
            e["optimizer"], e["kind"], _fmt(e["payload_bits_per_param_step"], ".3f"), _fmt(e["val_loss_mean"], ".4f"),
            _fmt(e["val_loss_std"], ".4f"), str(len(e["seeds"])), _fmt(e.get("gap_to_baseline"), "+.4f"), gap_pct,
            _fmt(e.get("val_loss_rank0_model"), ".4f"), _fmt(e.get("train_loss_last10"), ".4f"),
            _fmt(e["step_time_s"], ".3f"),
        ])
    lines = []
    if markdown:
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append("")
    for comp in result["comparisons"]:
        lines.append(f"{'**' if markdown else ''}{comp['title']}{'**' if markdown else ''} "
                     f"(published: {comp['published']})")
        for c in comp["checks"]:
            mark = "yes" if c["holds"] else "NO"
            lines.append(f"{'- ' if markdown else '  '}{c['claim']}: {mark} ({c['detail']})")
        lines.append("")
    q = result.get("quant_errors")
    if q and "error" not in q:
        lines.append(f"Relative quantization error ||Q(x)-x||/||x|| at step {q['at_step']} (mean over ranks):")
        lines.append("")
        rows_q = [
            ("weights W, Q4 group 2048 (qW)", q.get("weights_q4")),
            ("weight difference D, Q4 group 2048 (qWD)", q.get("weight_diff_q4")),
            ("  error qW puts in the weights, / ||W||", q.get("weights_q4_error_in_weights")),
            ("  error qWD puts in the weights, / ||W||", q.get("weight_diff_q4_error_in_weights")),
            ("gradient, Q8 group 128", q.get("grad_q8")),
            ("gradient, Hadamard + Q8 group 128", q.get("grad_q8_hadamard")),
            ("gradient, Q4 group 128", q.get("grad_q4")),
            ("gradient, Hadamard + Q4 group 128", q.get("grad_q4_hadamard")),
            ("gradient groups' peak/RMS (absmax quantizer's enemy)", q.get("grad_group_peak_to_rms")),
            ("  after the Hadamard transform", q.get("grad_hadamard_group_peak_to_rms")),
            ("share of gradient elements in tensors where Hadamard lowers Q4 error",
             q.get("grad_q4_hadamard_better_share")),
        ]
        rows_q = [(k, v) for k, v in rows_q if v is not None]  # older results lack the newer rows
        if markdown:
            lines += ["| quantity | value |", "|---|---:|"]
            lines += [f"| {k.strip().replace('|', chr(92) + '|')} | {v:.4f} |" for k, v in rows_q]  # escape ||x||
        else:
            lines += [f"  {k:<70} {v:.4f}" for k, v in rows_q]
    elif q:
        lines.append(f"quantization errors: {q['error']}")
    return "\n".join(lines)


_LABELS = {"sdp4bit_baseline": "baseline", "sdp4bit_qw": "qW", "sdp4bit_qwd": "qWD", "sdp4bit_tlq": "TLq",
           "sdp4bit_tlq_hs": "TLq-HS", "sdp4bit": "SDP4Bit"}


def plot(result: dict[str, Any], path: Path) -> Path:
    """Draw the figure: PNG (any suffix matplotlib knows) if matplotlib imports, else an SVG of the gaps."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed: writing an SVG bar chart instead")
        return _svg_gaps(result, path.with_suffix(".svg"))
    by = {e["optimizer"]: e for e in result["methods"] if "val_loss_mean" in e}
    fig, axes = plt.subplots(2, 2, figsize=(15, 8.5))
    meta = result["meta"]
    fig.suptitle(f"vigil bench convergence: {meta['world_size']} gloo ranks, {meta['model_params']} params, "
                 f"{meta['steps']} steps, validation loss (mean ± std over seeds)", fontsize=11)

    ax = axes[0][0]
    names = [n for n in _LABELS if n in by]
    gaps = [by[n].get("gap_pct", 0.0) for n in names]
    errs = [by[n].get("gap_pct_std") or 0.0 for n in names]
    ax.bar([_LABELS[n] for n in names], gaps, yerr=errs, capsize=3,
           color=["grey" if n == "sdp4bit_baseline" else "tab:blue" for n in names])
    ax.axhline(0, color="black", lw=0.8)
    ax.set_title("SDP4Bit ablation: gap to fp32 ZeRO-1 baseline")
    ax.set_ylabel("val loss gap (%)")

    for ax, group, title in (
        (axes[0][1], ["adamw", "local_adamw", "slowmo", "dsm", "dsm_gamma4", "dsm_gamma12"], "Local steps, tau = 12"),
        (axes[1][1], ["adamw", "compressed_adam_ef", "compressed_adam_noef", "compressed_adam_ef_c256",
                      "compressed_adam_noef_c256"], "Two-way onebit AdamW: error feedback"),
    ):
        for n in group:
            if n in by:
                xs = [int(s) for s in by[n]["curve"]]
                sensitivity = not BY_NAME[n].key  # the seed-0-only rows are dashed
                ax.plot(xs, list(by[n]["curve"].values()), marker="o", ms=3, ls="--" if sensitivity else "-",
                        label=f"{n} ({by[n]['payload_bits_per_param_step']:.2f} b/p, {len(by[n]['seeds'])} seeds)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("val loss")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curves, not on them
        lows = [min(by[n]["curve"].values()) for n in group if n in by]
        finals = [by[n]["val_loss_mean"] for n in group if n in by]
        if lows:  # the first evaluations are far above the rest: zoom on the part that separates methods
            ax.set_ylim(min(lows) - 0.05, max(min(lows) + 1.0, max(finals) + 0.3))

    ax = axes[1][0]
    cap = by["sgd"]["val_loss_mean"] + 3.0 if "sgd" in by else math.inf
    for series, (prefix, label) in enumerate((("cser_r", "CSER"), ("ef_sgd_r", "EF-SGD"),
                                              ("qsparse_r", "QSparse-local-SGD"))):
        pts = [(r, by[f"{prefix}{r}"]) for r in CSER_RATIOS if f"{prefix}{r}" in by]
        if pts:
            ys = [min(e["val_loss_mean"], cap) for _, e in pts]
            errs = [0.0 if e["val_loss_mean"] > cap else e["val_loss_std"] or 0.0 for _, e in pts]
            line = ax.errorbar([r for r, _ in pts], ys, yerr=errs, marker="o", capsize=3, label=label)
            for (r, e), y in zip(pts, ys, strict=True):
                if e["val_loss_mean"] > cap:  # diverged: drawn at the cap, its value written beside it
                    ax.annotate(f"{e['val_loss_mean']:.1f}", (r, y), textcoords="offset points", xytext=(4, -10 - 9 * series),
                                fontsize=7, color=line[0].get_color())
            if prefix == "cser_r" and all(e.get("val_loss_rank0_model") is not None for _, e in pts):
                ax.plot([r for r, _ in pts], [e["val_loss_rank0_model"] for _, e in pts], marker="s", ls=":",
                        color=line[0].get_color(), label="CSER, a worker's own model x_i")
    if "sgd" in by:
        ax.axhline(by["sgd"]["val_loss_mean"], color="grey", ls="--", label="synchronous SGD (32 b/p)")
    if "sgd" in by:
        ax.set_ylim(by["sgd"]["val_loss_mean"] - 0.3, cap + 0.3)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(CSER_RATIOS), [str(r) for r in CSER_RATIOS])
    ax.set_title("Momentum SGD at overall ratio R (capped values written)")
    ax.set_xlabel("overall ratio R (32/R b/p/step)")
    ax.set_ylabel("val loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _svg_gaps(result: dict[str, Any], path: Path) -> Path:
    """A dependency-free SVG: one horizontal bar per method, its val-loss gap (%) to its baseline."""
    items = [(e["optimizer"], e.get("gap_pct") or 0.0) for e in result["methods"] if "val_loss_mean" in e]
    span = max([abs(g) for _, g in items] + [0.1])
    w, row, left, mid = 720, 18, 170, 445
    scale = (w - mid - 20) / span
    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{row * len(items) + 40}" '
              'font-family="sans-serif" font-size="11">'),
             '<text x="10" y="16">val loss gap to the uncompressed baseline (%)</text>',
             f'<line x1="{mid}" y1="24" x2="{mid}" y2="{row * len(items) + 30}" stroke="black"/>']
    for i, (name, gap) in enumerate(items):
        y = 28 + i * row
        x0, x1 = sorted((mid, mid + gap * scale))
        parts.append(f'<text x="{left - 160}" y="{y + 12}">{name}</text>')
        parts.append(f'<rect x="{x0:.1f}" y="{y + 2}" width="{max(x1 - x0, 0.5):.1f}" height="{row - 5}" '
                     f'fill="{"#c44" if gap > 0 else "#48c"}"/>')
        parts.append(f'<text x="{left + 10}" y="{y + 12}">{gap:+.2f}%</text>')
    parts.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n")
    return path
