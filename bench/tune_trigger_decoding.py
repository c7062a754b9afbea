"""Pick the trigger's decoding price for a short gap (`trigger.short_gap_cost`) and how it refines
boundaries (`trigger.boundary_window_steps`, `trigger.boundary_min_gain`) on TRAINING-split streams.

The hard gap rule (sessions adjacent or >= `trigger.min_gap_steps`, 2 s, apart) cannot decode a new
user who starts 0.4-2 s after the last one left: the decoder must merge the two or move a boundary.
A finite cost lets a sure tagger place such a gap. This scores each cost on synthetic streams of the
trigger's training users (`egomem train-trigger`'s code cache), so the held-out figures of
`bench/bench_trigger.py` carry no choice made on them. The tagger's log-probabilities are computed
once per stream and decoded under every cost (boundaries as the Viterbi path puts them), then at the
configured cost under every boundary window and minimum gain (`decode.refine_boundaries`; window 0 = off).

    python bench/tune_trigger_decoding.py --cache runs/trigger_cache/trigger_codes_train_<key>.npz \
        --data ../shared/data/speech   # listen rows encoded whole from audio, as the shipped trigger trains

(without --data the listen rows are spliced from the cache's codes, as the trigger shipped before trained).

Writes bench/results/tune_trigger_decoding.json and .png (F1@5 and Jaccard against the cost and the window).
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
from egomem.trigger.decode import configured_decode
from egomem.trigger.listen_audio import draw_stream
from egomem.trigger.metrics import error_breakdown, evaluate
from egomem.trigger.synth import CodeCache, StreamSpec, poll_voices

COSTS = (math.inf, 16.0, 12.0, 8.0, 6.0, 4.0, 2.0, 0.0)
WINDOWS = (0, 2, 3, 4, 5, 6, 8)
GAINS = (0.0, 0.25, 0.5, 1.0)


def _score(lps: list, golds: list, cfg: TriggerConfig, cost: float, window: int, gain: float = 0.0) -> dict:
    preds = [decode_sessions(configured_decode(lp, cfg, cost, window, gain)) for lp in lps]
    m = evaluate(preds, golds)
    return {"jaccard": m["jaccard"], "f1@5": m["span_match@5"]["f1"], "f1@0": m["span_match@0"]["f1"],
            "errors@5": error_breakdown(preds, golds, 5)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, required=True, help="the trigger's TRAINING-split code cache (.npz)")
    p.add_argument("--checkpoint", type=Path, default=None, help="trigger checkpoint (default: the shipped one)")
    p.add_argument("--streams", type=int, default=100, help="streams per condition")
    p.add_argument("--seed", type=int, default=2024, help="stream seed (not one the trainer's batches use)")
    p.add_argument("--data", type=Path, default=None,
                   help="LibriSpeech root: encode each stream's listen row whole from audio (egomem.trigger.listen_audio)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "tune_trigger_decoding.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = TriggerConfig(checkpoint=a.checkpoint)
    labeler = TriggerLabeler(cfg)
    cache = CodeCache.load(a.cache)
    if cache.split != "train":
        raise SystemExit(f"{a.cache} is the {cache.split!r} split: tune on the training split, report on held-out")
    listen = None
    if a.data is not None:
        from egomem.config import load_config
        from egomem.trigger.codec import build_codec
        from egomem.trigger.listen_audio import SourceAudio

        listen = (SourceAudio.load(a.data, "train"), build_codec(load_config(None).mimi))
    rows: dict = {}
    logps: dict = {}
    for noised in (False, True):
        cond = "noised" if noised else "clean"
        rng = np.random.default_rng([a.seed, int(noised)])
        lps, golds = [], []
        for _ in tqdm(range(a.streams), desc=f"{cond} streams", unit="stream"):
            s = draw_stream(cache, rng, StreamSpec(steps=1024), noised, listen)
            lps.append(labeler.log_probs(s.tokens, poll_voices(cache, s)))  # the track, as the manager hands it
            golds.append(s.sessions)
        logps[cond] = (lps, golds)
        for c in COSTS:
            rows.setdefault(str(c), {})[cond] = _score(lps, golds, cfg, c, 0)
    for c, r in rows.items():
        r["mean_f1@5"] = float(np.mean([r["clean"]["f1@5"], r["noised"]["f1@5"]]))
        print(f"short_gap_cost {c:>4}: F1@5 clean {r['clean']['f1@5']:.3f} noised {r['noised']['f1@5']:.3f} "
              f"(mean {r['mean_f1@5']:.3f}); Jaccard {r['clean']['jaccard']:.3f} / {r['noised']['jaccard']:.3f}")
    best = max(rows, key=lambda c: rows[c]["mean_f1@5"])
    print(f"best on training streams: short_gap_cost = {best} (configured: {cfg.short_gap_cost})")
    windows: dict = {}
    for w in WINDOWS:  # at the configured cost: what ships
        for g in GAINS if w else (0.0,):
            r = windows[f"{w}/{g}"] = {cond: _score(lps, golds, cfg, cfg.short_gap_cost, w, g)
                                       for cond, (lps, golds) in logps.items()}
            r["mean_f1@5"] = float(np.mean([r["clean"]["f1@5"], r["noised"]["f1@5"]]))
            r["mean_jaccard"] = float(np.mean([r["clean"]["jaccard"], r["noised"]["jaccard"]]))
            print(f"boundary_window_steps {w}, min_gain {g}: F1@5 clean {r['clean']['f1@5']:.3f} noised "
                  f"{r['noised']['f1@5']:.3f} (mean {r['mean_f1@5']:.3f}); F1@0 {r['clean']['f1@0']:.3f} / "
                  f"{r['noised']['f1@0']:.3f}; Jaccard {r['clean']['jaccard']:.4f} / {r['noised']['jaccard']:.4f}")
    best_window = max(windows, key=lambda k: (windows[k]["mean_f1@5"], windows[k]["mean_jaccard"]))  # equals: Jaccard
    print(f"best on training streams: boundary_window_steps / min_gain = {best_window} at short_gap_cost "
          f"{cfg.short_gap_cost} (configured: {cfg.boundary_window_steps} / {cfg.boundary_min_gain}, searched "
          f"+-{cfg.boundary_search_steps} steps)")
    out = {"cache": str(a.cache), "listen": "audio" if listen else "codes", "checkpoint": str(labeler.checkpoint), "streams_per_condition": a.streams,
           "seed": a.seed, "min_gap_steps": cfg.min_gap_steps, "min_session_steps": cfg.min_session_steps,
           "costs": rows, "best": best, "boundary_search_steps": cfg.boundary_search_steps,
           "boundary_windows": windows, "best_boundary_window_and_gain": best_window}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    _plot(out, cfg, a.out.with_suffix(".png"))
    return out


def _plot(out: dict, cfg: TriggerConfig, path: Path) -> None:
    """F1@5 and Jaccard against the cost (the hard rule drawn at the right, as 'inf'); noised F1@5 and
    F1@0 against the boundary window, one line per minimum gain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    costs = sorted(out["costs"], key=float)
    xs = np.arange(len(costs))
    for cond, style in (("clean", "-o"), ("noised", "-s")):
        ax.plot(xs, [out["costs"][c][cond]["f1@5"] for c in costs], style, label=f"F1@5 {cond}")
        ax.plot(xs, [out["costs"][c][cond]["jaccard"] for c in costs], style, alpha=0.4, label=f"Jaccard {cond}")
    if str(cfg.short_gap_cost) in costs:
        ax.axvline(costs.index(str(cfg.short_gap_cost)), color="grey", ls=":", label=f"configured ({cfg.short_gap_cost})")
    ax.set_xticks(xs, costs)
    ax.set_xlabel("trigger.short_gap_cost (log-probability a gap under min_gap_steps costs; boundaries not refined)",
                  fontsize=8)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax = axes[1]
    rows = out["boundary_windows"]
    off = rows["0/0.0"]["noised"]
    for g in GAINS:
        ks = [k for k in rows if k.endswith(f"/{g}")]
        ws = [int(k.split("/")[0]) for k in ks]
        ax.plot(ws, [rows[k]["noised"]["f1@5"] for k in ks], "-o", label=f"noised F1@5, min_gain {g}")
        ax.plot(ws, [rows[k]["noised"]["f1@0"] for k in ks], ":", alpha=0.6, label=f"noised F1@0, min_gain {g}")
    ax.axhline(off["f1@5"], color="grey", ls="--", label="noised F1@5, not refined")
    ax.axvline(cfg.boundary_window_steps, color="grey", ls=":", label=f"configured ({cfg.boundary_window_steps} / "
                                                                      f"{cfg.boundary_min_gain})")
    ax.set_xlabel(f"trigger.boundary_window_steps (at short_gap_cost {cfg.short_gap_cost})", fontsize=8)
    ax.legend(fontsize=6)
    fig.suptitle(f"trigger decoding on {out['streams_per_condition']} training-split streams per condition", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
