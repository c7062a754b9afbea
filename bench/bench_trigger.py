"""Benchmark the episodic trigger: session metrics on held-out synthetic streams, and labelling speed.

Metrics (EgoMem paper: Jaccard 0.99, span_match F1@5 0.98 on its own data): Jaccard of session
spans and span_match@{0,5,10} precision/recall/F1 over `--streams` held-out streams per condition
(clean, noised), built from held-out users' and assistant utterances (egomem.trigger.synth).
A third condition, clean streams without user switches, shows how much of the error is telling
two users apart across a short pause (voice only). Peer in the same run: a rule-based activity segmenter (a step is active when the text channel
carries a word or a listen code differs from the stream's most common code row; runs of activity
closer than 3 s are merged into one session) — what the trigger must beat.
Speed: seconds to label one 8,192-step chunk (paper: 0.08 s on an H100), median of `--repeats`.

    python bench/bench_trigger.py                # shipped checkpoint, held-out code cache in tests/data
    python bench/bench_trigger.py --device cuda  # the same on a GPU
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from egomem.config import REPO_ROOT, TriggerConfig
from egomem.trigger import TriggerLabeler, decode_sessions
from egomem.trigger.metrics import SHIPPED_BAR, evaluate, meets_bar
from egomem.trigger.synth import TEXT_PAD, CodeCache, StreamSpec, synth_stream

DEFAULT_CACHE = REPO_ROOT / "tests" / "data" / "trigger" / "heldout_codes.npz"


def activity_segmenter(tokens: np.ndarray, merge_gap: int = 38) -> list[tuple[int, int]]:
    """Peer: sessions = runs of channel activity, merged across gaps shorter than `merge_gap` steps."""
    listen = tokens[:, 9:]
    rows, counts = np.unique(listen, axis=0, return_counts=True)
    background = rows[counts.argmax()]
    active = (tokens[:, 0] != TEXT_PAD) | np.any(listen != background, axis=1)
    idx = np.flatnonzero(active)
    if idx.size == 0:
        return []
    spans, a, prev = [], idx[0], idx[0]
    for t in idx[1:]:
        if t - prev > merge_gap:
            spans.append((int(a), int(prev)))
            a = t
        prev = t
    spans.append((int(a), int(prev)))
    return [(s, e) for s, e in spans if e - s + 1 >= 3]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=None, help="trigger checkpoint (default: the shipped one)")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="held-out code cache (.npz)")
    p.add_argument("--streams", type=int, default=200, help="held-out streams per condition")
    p.add_argument("--stream-steps", type=int, default=1024)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "bench_trigger.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    labeler = TriggerLabeler(TriggerConfig(checkpoint=args.checkpoint, device=args.device))
    cache = CodeCache.load(args.cache)
    if cache.fingerprint != labeler.meta.get("codec_fingerprint"):
        print(f"WARNING: cache codec {cache.fingerprint} != checkpoint codec {labeler.meta.get('codec_fingerprint')}")
    spec = StreamSpec(steps=args.stream_steps)
    results: dict = {"checkpoint": str(labeler.checkpoint), "cache": str(args.cache), "device": args.device,
                     "threads": torch.get_num_threads(), "streams_per_condition": args.streams,
                     "stream_steps": args.stream_steps, "metrics": {}}
    no_switch = StreamSpec(steps=args.stream_steps, switch_p=0.0)
    conditions = {"clean": (spec, False), "noised": (spec, True), "clean_no_user_switch": (no_switch, False)}
    for i, (cond, (cspec, noised)) in enumerate(conditions.items()):
        rng = np.random.default_rng([args.seed, i])
        preds, peer, golds = [], [], []
        for _ in range(args.streams):
            tokens, _, gold = synth_stream(cache, rng, cspec, noised=noised)
            preds.append(decode_sessions(labeler.label(tokens)))
            peer.append(activity_segmenter(tokens))
            golds.append(gold)
        results["metrics"][cond] = {"trigger": evaluate(preds, golds), "activity_peer": evaluate(peer, golds)}
    results["bar"] = SHIPPED_BAR
    results["meets_bar"] = {c: meets_bar(results["metrics"][c]["trigger"], b) for c, b in SHIPPED_BAR.items()}

    # speed: one 8,192-step chunk (several streams back to back)
    rng = np.random.default_rng([args.seed, 9])
    chunk = np.concatenate([synth_stream(cache, rng, StreamSpec(steps=1024), noised=False)[0] for _ in range(8)])
    labeler.label(chunk)  # warm-up
    times = []
    for _ in range(args.repeats):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        labeler.label(chunk)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    results["label_8192_steps_s"] = {"median": float(np.median(times)), "min": float(np.min(times)),
                                     "all": [round(x, 4) for x in times],
                                     "real_time_factor": float(np.median(times) / (8192 * 0.08))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    _print_table(results)
    _plot(results, args.out.with_suffix(".png"))
    return results


def _print_table(r: dict) -> None:
    print(f"{'condition':20} {'segmenter':14} {'Jaccard':>8} " + " ".join(f"{'P/R/F1@' + str(n):>20}" for n in (0, 5, 10)))
    for cond, by in r["metrics"].items():
        for name, m in by.items():
            cells = " ".join(f"{m[f'span_match@{n}']['precision']:.3f}/{m[f'span_match@{n}']['recall']:.3f}/"
                             f"{m[f'span_match@{n}']['f1']:.3f}".rjust(20) for n in (0, 5, 10))
            print(f"{cond:20} {name:14} {m['jaccard']:8.3f} {cells}")
    print("shipped bar (Jaccard, F1@5):", ", ".join(
        f"{c} {b['jaccard']}/{b['f1@5']} {'met' if r['meets_bar'][c] else 'MISSED'}" for c, b in r["bar"].items()))
    s = r["label_8192_steps_s"]
    print(f"label 8,192 steps on {r['device']} ({r['threads']} threads): median {s['median']:.3f} s "
          f"(paper: 0.08 s on H100); {1 / s['real_time_factor']:.0f}x faster than real time")


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["jaccard", "F1@0", "F1@5", "F1@10"]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = [(c, n) for c in r["metrics"] for n in r["metrics"][c]]
    w = 0.8 / len(bars)
    for i, (cond, name) in enumerate(bars):
        m = r["metrics"][cond][name]
        vals = [m["jaccard"]] + [m[f"span_match@{n}"]["f1"] for n in (0, 5, 10)]
        ax.bar(np.arange(len(keys)) + i * w, vals, w, label=f"{name} ({cond})")
    ax.set_xticks(np.arange(len(keys)) + 0.4 - w / 2, keys)
    ax.set_ylim(0, 1)
    ax.set_title(f"episodic trigger, {r['streams_per_condition']} held-out streams/condition; "
                 f"8,192 steps in {r['label_8192_steps_s']['median']:.2f} s ({r['device']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
