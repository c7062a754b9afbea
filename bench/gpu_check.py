"""The prepared device check (issue #17): one command that turns a lent GPU into numbers.

Runs each part in its own subprocess with its own time limit (a part that fails or runs out of time
is recorded as such; the others still run), and writes one JSON per part plus `summary.json`
under `bench/results/gpu/` (`--cpu-smoke`: `bench/results/gpu/smoke/`, tiny shapes on the CPU, so
CI keeps the script from rotting):

  kernels  the Triton kernels compiled on CUDA (bf16) against the naive references, and timed at
           7B shape (B = 64, 3,000-step ring); with --cpu-smoke, the same code under the Triton
           interpreter at tiny shapes;
  dialog   bench/bench_dialog.py at Moshi-7B shape with random weights for B = 1..128: tick p50/p99,
           the largest B within 80 ms p99, beside moshi's LMGen at the same B; the L1 refresh;
  dialog_fp8  the same at B = 64 with the fp8 KV cache;
  mimi     full-size Mimi encode + decode per 80 ms tick for B streams (MimiStreamPool, random weights,
           CUDA graphs);
  served   bench/bench_orchestrator.py (the whole served stack, GPU instances) at the largest B the
           dialog part found real-time (capped by --served-max).

    python bench/gpu_check.py                # on the GPU machine: ~6-8 min on an H100/H200
    python bench/gpu_check.py --cpu-smoke    # anywhere, ~2 min: tiny shapes, CPU, same code paths
    python bench/gpu_check.py --parts kernels,dialog

The engine's tick is the served one (`DialogEngine.tick`: on CUDA one fixed-shape step over all slots,
replayed from a CUDA graph). `dialog_fp8` repeats the dialog part at B = 64 with the fp8 KV cache; the
kernels part states fp8's and split-KV's accuracy. The codec part runs `MimiStreamPool` as served: on
CUDA every row of the full batch each call (fixed shape), through moshi's streaming Mimi, which captures
its encoder, decoder and transformers in CUDA graphs on CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gpu"
PARTS = ("kernels", "dialog", "dialog_fp8", "mimi", "served")
PENDING: list[str] = []  # parts of issue #17 this script cannot measure yet


# ---------------------------------------------------------------------------------------------- kernels


def kernels_part(out: Path, smoke: bool) -> dict:
    """Compiled (or interpreted, smoke) kernels vs the naive references; decode attention timed at 7B shape."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import (this runs in its own process)
    import torch

    from egomem.kernels.decode_attention import decode_attention
    from egomem.kernels.memchunk_write import memchunk_write
    from egomem.kernels.reference import decode_attention_reference, memchunk_write_reference

    dev = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    # correctness at a size the (slow, per-key) reference can check
    B, S, H, Hkv, D, n1, n2, W = (3, 4, 4, 2, 32, 8, 4, 100) if smoke else (4, 8, 32, 8, 128, 64, 32, 256)
    q = torch.randn(B, H, D, generator=g)
    k = torch.randn(S, Hkv, n1 + n2 + W, D, generator=g)
    v = torch.randn(S, Hkv, n1 + n2 + W, D, generator=g)
    slots = torch.randperm(S, generator=g)[:B]
    l1 = torch.full((B,), n1, dtype=torch.int32)
    l2 = torch.full((B,), n2, dtype=torch.int32)
    ring = torch.randint(1, W + 1, (B,), generator=g, dtype=torch.int32)
    pos0 = torch.randint(0, 5000, (B,), generator=g, dtype=torch.int64)
    ref = decode_attention_reference(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), slots, l1, l2,
                                     ring, pos0, n1=n1, n2=n2)
    got = decode_attention(*(t.to(dev) for t in (q.to(dtype), k.to(dtype), v.to(dtype), slots, l1, l2, ring, pos0)),
                           n1=n1, n2=n2, impl="triton").float().cpu()
    result = {"device": dev, "dtype": str(dtype).removeprefix("torch."),
              "decode_attention_max_abs_err": float((got - ref).abs().max()),
              "decode_attention_tolerance": 2e-5 if smoke else 3e-2}
    L = 2
    src_k = torch.randn(L, Hkv, n1, D, generator=g)
    dst = torch.zeros(L, S, Hkv, n1 + n2 + W, D, dtype=dtype)
    want_k, _ = memchunk_write_reference(src_k, src_k, dst, dst, 1, 0)
    dk, dv = dst.clone().to(dev), dst.clone().to(dev)
    memchunk_write(src_k.to(dev), src_k.to(dev), dk, dv, 1, 0, impl="triton")
    result["memchunk_write_exact"] = bool(torch.equal(dk.cpu(), want_k))
    # the fp8 KV cache against the model dtype's, both against the fp32 reference of the unquantised values
    ref32 = decode_attention_reference(q, k, v, slots, l1, l2, ring, pos0, n1=n1, n2=n2)
    for name, cache_dtype in (("model_dtype", dtype), ("fp8", torch.float8_e4m3fn)):
        att = decode_attention(*(t.to(dev) for t in (q.to(dtype), k.to(cache_dtype), v.to(cache_dtype), slots, l1,
                                                    l2, ring, pos0)), n1=n1, n2=n2, impl="triton").float().cpu()
        result[f"kv_{name}_rel_err"] = float((att - ref32).abs().max() / ref32.abs().max())
    # split-KV (flash-decoding) against one program per (row, kv head)
    args_dev = [t.to(dev) for t in (q.to(dtype), k.to(dtype), v.to(dtype), slots, l1, l2, ring, pos0)]
    one = decode_attention(*args_dev, n1=n1, n2=n2, impl="triton", num_splits=1).float()
    split = decode_attention(*args_dev, n1=n1, n2=n2, impl="triton", num_splits=4).float()
    result["split_kv_max_abs_diff"] = float((split - one).abs().max())
    result["ok"] = result["memchunk_write_exact"] and \
        result["decode_attention_max_abs_err"] <= result["decode_attention_tolerance"] and \
        result["split_kv_max_abs_diff"] <= result["decode_attention_tolerance"]
    if not smoke:  # speed at 7B shape: B = 64 streams, full L1 + L2 + 3,000-step ring
        B, S, H, Hkv, D, n1, n2, W = 64, 64, 32, 32, 128, 512, 256, 2232
        q = torch.randn(B, H, D, device=dev, dtype=dtype)
        kc = torch.randn(S, Hkv, n1 + n2 + W, D, device=dev, dtype=dtype)
        vc = torch.randn_like(kc)
        ix = torch.arange(B, device=dev)
        lens = [torch.full((B,), n, device=dev, dtype=torch.int32) for n in (n1, n2, W)]
        p0 = torch.zeros(B, device=dev, dtype=torch.int64)
        for rows, cache_dtype, splits in ((64, dtype, 1), (64, torch.float8_e4m3fn, 1), (2, dtype, 1), (2, dtype, None)):
            kr, vr = kc[:rows].to(cache_dtype), vc[:rows].to(cache_dtype)
            call_args = (q[:rows], kr, vr, ix[:rows], *(x[:rows] for x in lens), p0[:rows])
            for _ in range(3):
                decode_attention(*call_args, n1=n1, n2=n2, impl="triton", num_splits=splits)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                decode_attention(*call_args, n1=n1, n2=n2, impl="triton", num_splits=splits)
            torch.cuda.synchronize()
            per_call = (time.perf_counter() - t) / 20
            key = f"decode_attention_7b_b{rows}_{str(cache_dtype).removeprefix('torch.')}_splits{splits or 'auto'}"
            result[key + "_ms"] = per_call * 1e3
            result[key + "_gb_s"] = 2 * kr.numel() * kr.element_size() / per_call / 1e9
    out.write_text(json.dumps(result, indent=1))
    return result


# ---------------------------------------------------------------------------------------------- mimi


def mimi_part(out: Path, smoke: bool, batches: list[int], steps: int) -> dict:
    """Encode + decode of one 80 ms frame for B streams at once (the orchestrator's tick), per B."""

    from egomem.codec.mimi import FRAME_SAMPLES, MimiStreamPool, build_mimi
    from egomem.config import MimiConfig

    dev = "cpu" if smoke else "cuda"
    if smoke:
        import torch

        torch.set_num_threads(1)  # as the launcher gives each CPU model process (more threads spin on 2 cores)
    cfg = MimiConfig(preset="tiny" if smoke else "full", random_init=True, max_streams=max(batches))
    pool = MimiStreamPool(build_mimi(cfg, device=dev), cfg.max_streams)
    rows = []
    for B in batches:
        ids = list(range(B))
        for i in ids:
            pool.open(i)
        frames = (np.random.default_rng(B).standard_normal((B, FRAME_SAMPLES)) * 0.05).astype(np.float32)
        lat = []
        for step in range(steps + 3):
            t = time.perf_counter()
            pool.decode(ids, pool.encode(ids, frames))  # both return host arrays: the step is synchronised
            if step >= 3:
                lat.append((time.perf_counter() - t) * 1e3)
        for i in ids:
            pool.close(i)
        rows.append({"B": B, "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
                     "within_80ms": float(np.percentile(lat, 99)) <= 80.0})
        print(f"mimi {cfg.preset} B={B}: p50 {rows[-1]['p50_ms']:.1f} ms p99 {rows[-1]['p99_ms']:.1f} ms", flush=True)
    result = {"device": dev, "preset": cfg.preset, "rows": rows, "ok": True}
    out.write_text(json.dumps(result, indent=1))
    return result


# ---------------------------------------------------------------------------------------------- driver


def run_part(name: str, args: argparse.Namespace, out_dir: Path, limit_s: float, served_streams: int) -> dict:
    """Run one part in a subprocess under a time limit; returns its record for the summary."""
    py = sys.executable
    out = out_dir / f"{name}.json"
    smoke = ["--cpu-smoke"] if args.cpu_smoke else []
    if name == "dialog":
        cmd = [py, "bench/bench_dialog.py", "--out", str(out)] + (
            ["--preset", "tiny", "--batches", "1,2", "--steps", "3", "--warmup", "1", "--dialog-steps", "32"]
            if args.cpu_smoke else
            ["--device", "cuda", "--preset", "7b", "--batches", args.batches, "--steps", "30", "--warmup", "5"])
    elif name == "dialog_fp8":
        cmd = [py, "bench/bench_dialog.py", "--out", str(out), "--kv-dtype", "fp8"] + (
            ["--preset", "tiny", "--batches", "2", "--steps", "3", "--warmup", "1", "--dialog-steps", "32"]
            if args.cpu_smoke else
            ["--device", "cuda", "--preset", "7b", "--batches", "64", "--steps", "30", "--warmup", "5"])
    elif name == "served":
        cmd = [py, "bench/bench_orchestrator.py", "--out", str(out), "--streams", str(served_streams)] + (
            ["--seconds", "2", "--warmup-s", "0.5", "--inproc-steps", "5"] if args.cpu_smoke else
            ["--device", "cuda", "--preset", "7b", "--seconds", "8"])
    else:
        cmd = [py, __file__, "--_part", name, "--_out", str(out), "--batches", args.batches] + smoke
    t = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        tail = (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as e:
        status, tail = f"timed out after {limit_s:.0f} s", ((e.stdout or b"")[-2000:]).decode(errors="replace") \
            if isinstance(e.stdout, bytes) else str(e.stdout or "")[-2000:]
    record = {"part": name, "status": status, "seconds": round(time.time() - t, 1), "command": " ".join(cmd[1:])}
    if out.is_file():
        record["result_file"] = str(out.relative_to(ROOT) if out.is_relative_to(ROOT) else out)
    if status != "ok":
        record["log_tail"] = tail
    print(f"[{status}] {name} ({record['seconds']} s)", flush=True)
    return record


def device_info() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info |= {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1), "cuda": torch.version.cuda}
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (CI); results under gpu/smoke/")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--batches", default="1,8,16,32,64,96,128", help="stream counts B (smoke: 1,2)")
    ap.add_argument("--served-max", type=int, default=64, help="cap on the served run's streams")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--_part", help=argparse.SUPPRESS)
    ap.add_argument("--_out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cpu_smoke and args.batches == ap.get_default("batches"):
        args.batches = "1,2"
    batches = [int(b) for b in args.batches.split(",")]
    if args._part == "kernels":
        return 0 if kernels_part(args._out, args.cpu_smoke)["ok"] else 1
    if args._part == "mimi":
        mimi_part(args._out, args.cpu_smoke, batches, steps=3 if args.cpu_smoke else 30)
        return 0
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; allowed: {', '.join(PARTS)}")
    if not args.cpu_smoke:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible: run this on the GPU machine, or pass --cpu-smoke")
    out_dir = args.out_dir or (RESULTS / "smoke" if args.cpu_smoke else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    limits = {"kernels": 90, "dialog": 240, "dialog_fp8": 90, "mimi": 90, "served": 150}
    t0 = time.time()
    records, served_streams = [], 1
    for name in parts:
        if name == "served" and not args.cpu_smoke:
            dialog = out_dir / "dialog.json"
            best = json.loads(dialog.read_text()).get("max_streams_within_80ms_p99", 0) if dialog.is_file() else 8
            served_streams = max(1, min(args.served_max, best or 1))
        records.append(run_part(name, args, out_dir, limits[name] * (3 if args.cpu_smoke else 1), served_streams))
    summary = {"device": device_info(), "cpu_smoke": args.cpu_smoke, "seconds": round(time.time() - t0, 1),
               "parts": records, "pending": PENDING}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out_dir / 'summary.json'} ({summary['seconds']} s)")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
