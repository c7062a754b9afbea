"""Identification at scale (issue #16 point 5): exact vs approximate (IVF, HNSW) key search at 1k..1M users.

    nice -n 19 .venv/bin/python bench/bench_identify_scale.py [--sizes 1000 100000 1000000]
        [--kinds ivf hnsw] [--hnsw-max 100000] [--queries 300] [--recall-queries 2000] [--only-timing]

Embeddings: synthetic, shaped like the real speaker embeddings this system stores. A Gaussian is fitted
to the shipped s-norm cohort (251 real Resemblyzer GE2E embeddings, 256-d: mean + the cohort's own
deviations as a low-rank covariance, plus a little isotropic noise to make it full rank). Users are
clustered: `--clusters` centres are drawn from that Gaussian (deviation scaled by √(1 − 0.7²)) and
each user is centre + 0.7 × a fresh deviation (so the total variance is the cohort's), L2-normalised:
users come in groups of similar voices (as accents / sexes / ages do) and the inter-user cosines
match the real cohort's (mean 0.58, sd 0.08; both reported). One voice key per user.
Queries: an enrolled user's key + a deviation drawn from the same covariance, scaled so the median
cosine(query, enrolled key) is `--query-cos` (0.85: an assumption, not measured here; bench_identity's
same-speaker LibriSpeech pairs lie mostly above its raw-cosine EER threshold 0.71). The deviation lies
in the between-speaker directions, so it moves a query towards other users: harder for an index
than isotropic noise of the same size.

Measured per size and index kind (one faiss/OpenMP thread for queries, as in the model processes):
  - `identify` p50/p99: `Identifier.identify(voice_vec=q)` with the configured s-norm (top
    `snorm_candidates` keys re-scored with the cohort; their statistics computed on first use, so a
    query over never-seen keys pays for them: the cold case, which dominates at 1M users);
  - search p50/p99: `search_users(k=1)` alone;
  - recall@1: the approximate top-1 user equals the exact top-1 user (`search_users`), and the same for
    identify's decision (voice user after s-norm); also how often exact search finds the true user;
  - build: the flat (exact) store, and the approximate index's training + filling (two threads).
The machine is 2 cores shared with other jobs; a nice'd run on a busy box is pessimistic (the JSON
records the load average before and after each timing block). Writes
bench/results/bench_identify_scale.json and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from egomem.config import IdentityConfig
from egomem.identity.identify import VOICE_MODEL_IDS, Identifier
from egomem.identity.index import IndexParams, UserKeyIndex
from egomem.identity.snorm import AdaptiveSNorm, default_cohort_file

RESULTS = Path(__file__).parent / "results"
MODEL = VOICE_MODEL_IDS["resemblyzer"]
ISO_NOISE = 0.05  # isotropic share of the fitted covariance (the cohort's 250 deviations span < 256 dims)
USER_SPREAD = 0.7  # a user's deviation from their cluster centre, relative to the population's
GEN_BATCH = 100_000  # users generated per step (bounds temporary memory at 1M)
NPROBE_SWEEP = (64, 128, 192, 256, 512)
EF_SWEEP = (128, 256, 512, 1024)


class VoiceLike:
    """Sampler of unit vectors with the real cohort's mean and covariance shape."""

    def __init__(self, cohort: np.ndarray, seed: int) -> None:
        c = cohort / np.linalg.norm(cohort, axis=1, keepdims=True)
        self.mean = c.mean(axis=0)
        self.dev = (c - self.mean) / np.sqrt(len(c) - 1)  # [n, D]: x = mean + z @ dev has the cohort's covariance
        self.iso = ISO_NOISE * float(np.sqrt((self.dev ** 2).sum() / c.shape[1]))
        self.dim = c.shape[1]
        self.rng = np.random.default_rng(seed)

    def deviation(self, n: int) -> np.ndarray:
        z = self.rng.standard_normal((n, self.dev.shape[0]), dtype=np.float32)
        return z @ self.dev.astype(np.float32) + self.iso * self.rng.standard_normal((n, self.dim), dtype=np.float32)

    def users(self, n: int, clusters: int) -> np.ndarray:
        centres = self.mean + np.sqrt(1 - USER_SPREAD ** 2) * self.deviation(clusters)
        out = np.empty((n, self.dim), np.float32)
        for s in range(0, n, GEN_BATCH):
            m = min(GEN_BATCH, n - s)
            x = centres[self.rng.integers(0, clusters, m)] + USER_SPREAD * self.deviation(m)  # total: the cohort's
            out[s:s + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
        return out

    def queries(self, keys: np.ndarray, n: int, target_cos: float) -> tuple[np.ndarray, np.ndarray, float]:
        """n re-recordings of random enrolled keys: (queries [n, D], their users [n], noise scale)."""
        who = self.rng.choice(len(keys), n, replace=False)
        noise = self.deviation(n)
        noise /= np.linalg.norm(noise, axis=1, keepdims=True)
        lo, hi = 0.0, 4.0
        for _ in range(40):  # bisection on the scale: median cosine falls as it grows
            mid = (lo + hi) / 2
            q = keys[who] + mid * noise
            cos = np.median(np.sum(q * keys[who], axis=1) / np.linalg.norm(q, axis=1))
            lo, hi = (mid, hi) if cos > target_cos else (lo, mid)
        q = keys[who] + lo * noise
        return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32), who, lo


def pairwise_cos(x: np.ndarray, rng: np.random.Generator, n: int = 2000) -> dict[str, float]:
    s = x[rng.choice(len(x), min(n, len(x)), replace=False)]
    c = s @ s.T
    v = c[np.triu_indices(len(s), 1)]
    return {"mean": float(v.mean()), "sd": float(v.std()), "p99": float(np.percentile(v, 99))}


def load() -> float:
    return round(os.getloadavg()[0], 2)


def set_threads(n: int) -> None:
    import faiss

    faiss.omp_set_num_threads(n)


def time_calls(fn, queries: np.ndarray) -> dict[str, float]:
    """p50/p99 in ms of fn(q) over the queries, after two warm-up calls."""
    for q in queries[:2]:
        fn(q)
    ts = []
    for q in queries:
        t0 = time.perf_counter()
        fn(q)
        ts.append(time.perf_counter() - t0)
    return {"p50_ms": 1e3 * float(np.percentile(ts, 50)), "p99_ms": 1e3 * float(np.percentile(ts, 99)),
            "mean_ms": 1e3 * float(np.mean(ts)), "n": len(ts)}


def top1(idx: UserKeyIndex, q: np.ndarray, exact: bool) -> list[str | None]:
    return [r[0].user_id if r else None for r in idx.search_users("voice", MODEL, q, 1, exact=exact)]


def run_size(n: int, args: argparse.Namespace, gen: VoiceLike, snorm: AdaptiveSNorm, cfg: IdentityConfig) -> dict:
    rng = np.random.default_rng(args.seed + n)
    keys = gen.users(n, max(1, min(args.clusters, n // 10)))
    n_q = min(args.queries, n)
    n_r = min(args.recall_queries, n)
    queries, who, scale = gen.queries(keys, max(n_q, n_r), args.query_cos)
    out: dict = {"users": n, "inter_user_cos": pairwise_cos(keys, rng), "query_noise_scale": scale,
                 "query_cos_median": float(np.median(np.sum(queries * keys[who], axis=1))), "kinds": {}}
    users = [f"u{i}" for i in range(n)]
    set_threads(args.build_threads)
    t0 = time.perf_counter()
    idx = UserKeyIndex(IndexParams(kind="exact"))
    for s in range(0, n, GEN_BATCH):
        idx.add_many(users[s:s + GEN_BATCH], "voice", MODEL, keys[s:s + GEN_BATCH])
    out["flat_build_s"] = time.perf_counter() - t0
    del keys
    set_threads(1)
    t0 = time.perf_counter()
    exact_top = top1(idx, queries[:n_r], exact=True)
    out["exact_batch_search_s"] = time.perf_counter() - t0
    out["exact_accuracy_true_user"] = float(np.mean([u == f"u{w}" for u, w in zip(exact_top, who[:n_r])]))
    ident = Identifier(idx, "unused", MODEL, face_threshold=cfg.face_threshold_dlib,
                       voice_threshold=cfg.voice_threshold_resemblyzer, snorm=snorm,
                       snorm_candidates=cfg.snorm_candidates)
    kinds = ["exact"] + [k for k in args.kinds if not (k == "hnsw" and n > args.hnsw_max)]
    exact_voice: list[str | None] = []
    for kind in kinds:
        res: dict = {}
        set_threads(args.build_threads)
        t0 = time.perf_counter()
        params = dataclasses.replace(IndexParams.from_config(cfg), kind=kind)
        idx.set_params(params)
        res["ann_build_s"] = time.perf_counter() - t0
        res["index_kind"] = idx.index_kind("voice", MODEL)
        if kind == "ivf":
            res["nlist"] = int(idx._tables[("voice", MODEL)].ann.nlist)  # type: ignore[attr-defined]
            res["nprobe"] = params.ivf_nprobe
        set_threads(1)
        ident.index = idx  # fresh s-norm statistics cache: every kind starts cold
        res["load_before"] = load()
        res["identify"] = time_calls(lambda q: ident.identify(None, q), queries[:n_q])
        res["search"] = time_calls(lambda q: idx.search_users("voice", MODEL, q, 1), queries[:n_q])
        res["load_after"] = load()
        if not args.only_timing:
            voice = [ident.match_voice(q)[0] for q in queries[:n_r]]
            if kind == "exact":
                exact_voice = voice
            else:
                res["recall_at_1"] = float(np.mean([a == e for a, e in zip(top1(idx, queries[:n_r], False), exact_top)]))
                res["identify_agreement"] = float(np.mean([a == e for a, e in zip(voice, exact_voice)]))
            if kind != "exact" and n >= args.sweep_min:
                res["sweep"] = sweep(idx, kind, queries, n_q, n_r, exact_top)
        out["kinds"][kind] = res
        print(f"  {n:>8} {kind:<5} identify p50 {res['identify']['p50_ms']:.2f} ms p99 {res['identify']['p99_ms']:.2f} "
              f"| search p50 {res['search']['p50_ms']:.2f} | recall@1 {res.get('recall_at_1', 1.0):.4f} "
              f"| build {res['ann_build_s']:.1f} s | load {res['load_before']}->{res['load_after']}", flush=True)
    return out


def sweep(idx: UserKeyIndex, kind: str, queries: np.ndarray, n_q: int, n_r: int, exact_top: list) -> list[dict]:
    """Recall@1 and search latency per IVF nprobe / HNSW efSearch on the built index (both are read at
    every search, so no rebuild)."""
    import faiss

    ann = idx._tables[("voice", MODEL)].ann
    target = ann if kind == "ivf" else faiss.downcast_index(ann.index).hnsw  # type: ignore[attr-defined]
    name, values = ("nprobe", NPROBE_SWEEP) if kind == "ivf" else ("efSearch", EF_SWEEP)
    keep = getattr(target, name)
    rows = []
    for value in values:
        setattr(target, name, value)
        rec = float(np.mean([a == e for a, e in zip(top1(idx, queries[:n_r], False), exact_top)]))
        t = time_calls(lambda q: idx.search_users("voice", MODEL, q, 1), queries[:n_q])
        rows.append({name: value, "recall_at_1": rec, "search_p50_ms": t["p50_ms"], "search_p99_ms": t["p99_ms"]})
        print(f"      {kind} {name}={value}: recall@1 {rec:.4f}, search p50 {t['p50_ms']:.2f} ms", flush=True)
    setattr(target, name, keep)
    return rows


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colours = {"exact": "tab:gray", "ivf": "tab:blue", "hnsw": "tab:orange"}
    for kind, c in colours.items():
        pts = [(r["users"], r["kinds"][kind]) for r in res["sizes"] if kind in r["kinds"]]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        axes[0].plot(xs, [p[1]["identify"]["p50_ms"] for p in pts], "o-", color=c, label=f"{kind} p50")
        axes[0].plot(xs, [p[1]["identify"]["p99_ms"] for p in pts], "x--", color=c, label=f"{kind} p99")
        if kind != "exact":
            axes[1].plot(xs, [p[1].get("recall_at_1", np.nan) for p in pts], "o-", color=c, label=kind)
            axes[2].plot(xs, [p[1]["ann_build_s"] for p in pts], "o-", color=c, label=f"{kind} train+fill")
    axes[2].plot([r["users"] for r in res["sizes"]], [r["flat_build_s"] for r in res["sizes"]], "o-",
                 color="tab:gray", label="flat store")
    axes[0].axhline(10, color="red", lw=0.8, ls=":", label="10 ms target")
    axes[1].axhline(0.99, color="red", lw=0.8, ls=":", label="0.99 target")
    for ax, title, ylab in ((axes[0], "identify latency (s-norm, 1 thread)", "ms"),
                            (axes[1], "recall@1 vs exact search", "recall@1"),
                            (axes[2], "build time (2 threads)", "s")):
        ax.set_xscale("log")
        ax.set_xlabel("enrolled users")
        ax.set_ylabel(ylab)
        ax.set_title(title)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    fig.suptitle(f"bench_identify_scale ({res['machine']['cpus']} CPUs, nice'd, load {res['machine']['load_start']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    ap.add_argument("--kinds", nargs="+", default=["ivf", "hnsw"], choices=["ivf", "hnsw"])
    ap.add_argument("--hnsw-max", type=int, default=100_000, help="largest size HNSW is built for (its build is slow)")
    ap.add_argument("--queries", type=int, default=300, help="timed identify calls per size and kind")
    ap.add_argument("--recall-queries", type=int, default=2000)
    ap.add_argument("--query-cos", type=float, default=0.85)
    ap.add_argument("--clusters", type=int, default=1000)
    ap.add_argument("--build-threads", type=int, default=2)
    ap.add_argument("--sweep-min", type=int, default=100_000, help="nprobe / efSearch sweep at sizes from this on")
    ap.add_argument("--only-timing", action="store_true", help="skip recall (e.g. to rerun timing when the box is idle)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_identify_scale.json")
    args = ap.parse_args()

    cfg = IdentityConfig()
    cohort = np.load(default_cohort_file(MODEL)).astype(np.float32)
    snorm = AdaptiveSNorm(cohort, cfg.cohort_top_k, cfg.cohort_size)
    gen = VoiceLike(cohort, args.seed)
    res: dict = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_start": load(),
                    "nice": os.nice(0)},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k.startswith(("index", "ivf", "hnsw", "snorm"))},
        "cohort_inter_cos": pairwise_cos(cohort / np.linalg.norm(cohort, axis=1, keepdims=True), np.random.default_rng(0)),
        "sizes": [],
    }
    for n in args.sizes:
        res["sizes"].append(run_size(n, args, gen, snorm, cfg))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))  # partial results survive a later failure
    res["machine"]["load_end"] = load()
    args.out.write_text(json.dumps(res, indent=1))
    plot(res, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
