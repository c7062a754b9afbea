"""Pick the trigger's decoding price for a short gap (`trigger.short_gap_cost`) on TRAINING-split streams.

The hard gap rule (sessions adjacent or >= `trigger.min_gap_steps`, 2 s, apart) cannot decode a new
user who starts 0.4-2 s after the last one left: the decoder must merge the two or move a boundary.
A finite cost lets a sure tagger place such a gap. This scores each cost on synthetic streams of the
trigger's training users (`egomem train-trigger`'s code cache), so the held-out figures of
`bench/bench_trigger.py` carry no choice made on them. The tagger's log-probabilities are computed
once per stream and decoded under every cost.

    python bench/tune_trigger_decoding.py --cache runs/trigger_cache/trigger_codes_train_<key>.npz

Writes bench/results/tune_trigger_decoding.json and .png (F1@5 and Jaccard against the cost).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from egomem.config import REPO_ROOT, TriggerConfig
from egomem.trigger import TriggerLabeler, decode_sessions
from egomem.trigger.decode import configured_viterbi
from egomem.trigger.metrics import error_breakdown, evaluate
from egomem.trigger.synth import CodeCache, StreamSpec, poll_voices, synth_recorded

COSTS = (math.inf, 16.0, 12.0, 8.0, 6.0, 4.0, 2.0, 0.0)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, required=True, help="the trigger's TRAINING-split code cache (.npz)")
    p.add_argument("--checkpoint", type=Path, default=None, help="trigger checkpoint (default: the shipped one)")
    p.add_argument("--streams", type=int, default=100, help="streams per condition")
    p.add_argument("--seed", type=int, default=2024, help="stream seed (not one the trainer's batches use)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "tune_trigger_decoding.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = TriggerConfig(checkpoint=a.checkpoint)
    labeler = TriggerLabeler(cfg)
    cache = CodeCache.load(a.cache)
    if cache.split != "train":
        raise SystemExit(f"{a.cache} is the {cache.split!r} split: tune on the training split, report on held-out")
    rows: dict = {}
    for noised in (False, True):
        cond = "noised" if noised else "clean"
        rng = np.random.default_rng([a.seed, int(noised)])
        lps, golds = [], []
        for _ in tqdm(range(a.streams), desc=f"{cond} streams", unit="stream"):
            s = synth_recorded(cache, rng, StreamSpec(steps=1024), noised=noised)
            lps.append(labeler.log_probs(s.tokens, poll_voices(cache, s)))  # the track, as the manager hands it
            golds.append(s.sessions)
        for c in COSTS:
            preds = [decode_sessions(configured_viterbi(lp, cfg, c)) for lp in lps]
            m = evaluate(preds, golds)
            rows.setdefault(str(c), {})[cond] = {"jaccard": m["jaccard"], "f1@5": m["span_match@5"]["f1"],
                                                 "errors@5": error_breakdown(preds, golds, 5)}
    for c, r in rows.items():
        r["mean_f1@5"] = float(np.mean([r["clean"]["f1@5"], r["noised"]["f1@5"]]))
        print(f"short_gap_cost {c:>4}: F1@5 clean {r['clean']['f1@5']:.3f} noised {r['noised']['f1@5']:.3f} "
              f"(mean {r['mean_f1@5']:.3f}); Jaccard {r['clean']['jaccard']:.3f} / {r['noised']['jaccard']:.3f}")
    best = max(rows, key=lambda c: rows[c]["mean_f1@5"])
    print(f"best on training streams: short_gap_cost = {best} (configured: {cfg.short_gap_cost})")
    out = {"cache": str(a.cache), "checkpoint": str(labeler.checkpoint), "streams_per_condition": a.streams,
           "seed": a.seed, "min_gap_steps": cfg.min_gap_steps, "min_session_steps": cfg.min_session_steps,
           "costs": rows, "best": best}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    _plot(out, cfg.short_gap_cost, a.out.with_suffix(".png"))
    return out


def _plot(out: dict, configured: float, path: Path) -> None:
    """F1@5 and Jaccard against the cost (the hard rule drawn at the right, as 'inf')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    costs = sorted(out["costs"], key=float)
    xs = np.arange(len(costs))
    fig, ax = plt.subplots(figsize=(7, 4))
    for cond, style in (("clean", "-o"), ("noised", "-s")):
        ax.plot(xs, [out["costs"][c][cond]["f1@5"] for c in costs], style, label=f"F1@5 {cond}")
        ax.plot(xs, [out["costs"][c][cond]["jaccard"] for c in costs], style, alpha=0.4, label=f"Jaccard {cond}")
    if str(configured) in costs:
        ax.axvline(costs.index(str(configured)), color="grey", ls=":", label=f"configured ({configured})")
    ax.set_xticks(xs, costs)
    ax.set_xlabel("trigger.short_gap_cost (log-probability a gap under min_gap_steps costs)")
    ax.set_ylim(0, 1)
    ax.set_title(f"trigger decoding on {out['streams_per_condition']} training-split streams per condition", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
