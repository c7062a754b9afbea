"""Per-step latency of the served Mimi codec (encode + decode of one 80 ms frame) through Triton.

N concurrent streams each send one frame per tick, all at once (as the orchestrator's tick does);
we time each stream's encode->decode round trip over `--steps` ticks after a warm-up, and compare
with the same pool stepped in-process (no Triton, no gRPC) measured in the same run.

    .venv/bin/python bench/bench_mimi_codec.py --streams 1 8 --steps 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from egomem.codec.mimi import FRAME_SAMPLES, MimiStreamPool, build_mimi
from egomem.config import load_config, with_overrides
from egomem.serving.client import AsyncTritonClient
from egomem.serving.launcher import TritonServer, free_ports

RESULTS = Path(__file__).parent / "results"


def pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e3
    return {f"p{q}": round(float(np.percentile(a, q)), 2) for q in (50, 90, 95, 99)} | {"mean": round(float(a.mean()), 2)}


async def served(url: str, n: int, steps: int, warmup: int) -> list[float]:
    frames = np.random.default_rng(0).standard_normal((n, FRAME_SAMPLES)).astype(np.float32) * 0.1
    lat: list[float] = []
    async with AsyncTritonClient(url) as client:
        async def one(s: int, step: int) -> None:
            t = time.perf_counter()
            sid = 1000 + s
            codes = (await client.infer("mimi_codec", {"PCM": frames[s:s + 1]}, ["CODES"], sequence_id=sid,
                                        start=step == 0))["CODES"]
            await client.infer("mimi_codec", {"CODES_IN": codes}, ["AUDIO"], sequence_id=sid,
                               end=step == warmup + steps - 1)
            if step >= warmup:
                lat.append(time.perf_counter() - t)

        for step in range(warmup + steps):
            await asyncio.gather(*(one(s, step) for s in range(n)))
    return lat


def in_process(pool: MimiStreamPool, n: int, steps: int, warmup: int) -> list[float]:
    frames = np.random.default_rng(0).standard_normal((n, FRAME_SAMPLES)).astype(np.float32) * 0.1
    ids = [2000 + s for s in range(n)]
    for i in ids:
        pool.open(i)
    lat = []
    for step in range(warmup + steps):
        t = time.perf_counter()
        pool.decode(ids, pool.encode(ids, frames))
        if step >= warmup:
            lat.append(time.perf_counter() - t)
    for i in ids:
        pool.close(i)
    return lat


def _fmt(row: dict) -> str:
    return "  ".join(f"{k}={row[k]:7.2f}ms" for k in ("p50", "p90", "p99"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--config", help="TOML config (default: built-in defaults, tiny Mimi on CPU)")
    ap.add_argument("--out", type=Path, default=RESULTS / "mimi_codec.json")
    args = ap.parse_args(argv)

    http, grpc, metrics = free_ports(3)
    cfg = with_overrides(load_config(args.config), {
        "server": {"http_port": http, "grpc_port": grpc, "metrics_port": metrics,
                   "run_dir": Path(tempfile.mkdtemp(prefix="egomem-bench-"))},
        "mimi": {"max_streams": max(args.streams)},
        "orchestrator": {"max_streams": min(max(args.streams), load_config(args.config).orchestrator.max_streams)}},
        source="bench_mimi_codec")
    rows = []
    with TritonServer(cfg, models=["mimi_codec"]) as server:
        for n in args.streams:
            lat = asyncio.run(served(server.grpc_url, n, args.steps, args.warmup))
            rows.append({"streams": n, "path": "triton", **pct(lat)})
            print(f"triton     streams={n:3d}  " + _fmt(rows[-1]), flush=True)
    torch.set_num_threads(1)  # as the launcher gives each CPU model process
    pool = MimiStreamPool(build_mimi(cfg.mimi), cfg.mimi.max_streams)
    for n in args.streams:
        lat = in_process(pool, n, args.steps, args.warmup)
        rows.append({"streams": n, "path": "in-process", **pct(lat)})
        print(f"in-process streams={n:3d}  " + _fmt(rows[-1]), flush=True)
    for n in args.streams:
        t = next(r for r in rows if r["streams"] == n and r["path"] == "triton")
        p = next(r for r in rows if r["streams"] == n and r["path"] == "in-process")
        print(f"streams={n}: Triton p50 / in-process p50 = {t['p50'] / p['p50']:.2f}x")
    result = {"benchmark": "mimi_codec per-step encode+decode latency", "preset": cfg.mimi.preset,
              "steps": args.steps, "warmup": args.warmup, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    _plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for path_name, marker in (("triton", "o"), ("in-process", "s")):
        rs = [r for r in rows if r["path"] == path_name]
        ns = [r["streams"] for r in rs]
        ax.plot(ns, [r["p50"] for r in rs], marker=marker, label=f"{path_name} p50")
        ax.plot(ns, [r["p99"] for r in rs], marker=marker, linestyle="--", label=f"{path_name} p99")
    ax.axhline(80, color="red", linewidth=0.8, label="80 ms frame")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("encode+decode per step (ms)")
    ax.set_title("mimi_codec per-step latency")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
