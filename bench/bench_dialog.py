"""Dialog engine vs Moshi's LMGen on the same weights, measured in the same run.

1. Ticks: stream-steps/s and per-tick p50/p99 at each batch size B, the engine with every slot's
   MemChunks filled (L1 + L2 written), young (its ring holds the timed steps only) and with a full ring
   (a stream older than the ring), LMGen with the same trained context (its ring cache attends all
   `context` entries every step, masked, so its cost does not depend on how full it is).
2. Refresh: one L1 MemChunk refresh for one slot vs re-prefilling that slot the standard way (one
   full-sequence forward over [L1 ; L2 ; 2048 dialog steps], Moshi's fastest way to rebuild a cache).

    python bench/bench_dialog.py                                  # tiny preset, CPU
    python bench/bench_dialog.py --device cuda --preset 7b --batches 1,2,4,8,16,32,64

Writes bench/results/bench_dialog.json and bench_dialog.png; prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from moshi.models.lm import LMGen
from moshi.utils.compile import no_compile

from egomem.dialog import DialogEngine
from egomem.dialog.checkpoint import DTYPES, build_lm
from egomem.dialog.kv_cache import KVCacheTooLarge

TICK_BUDGET_MS = 80.0  # one Mimi frame


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def _time_ticks(fn, device: torch.device, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):  # first steps are slow (allocator, caches)
        fn()
    return [_time(fn, device) for _ in range(steps)]


def _summary(times_ms: list[float], B: int) -> dict:
    q = statistics.quantiles(times_ms, n=100, method="inclusive")
    return {"p50_ms": statistics.median(times_ms), "p99_ms": q[98],
            "stream_steps_per_s": B * len(times_ms) / (sum(times_ms) / 1e3)}


def _engine(lm, B: int, l1: int, l2: int, ring: int | None, kv_dtype: torch.dtype | None, aged: bool):
    """An engine with B open slots, MemChunks filled (memory text then text-pad, as served); `aged`: as if
    each stream had already taken a ring's worth of steps, so every ring entry is read."""
    eng = DialogEngine(lm, max_streams=B, l1_steps=l1, l2_steps=l2, ring_steps=ring, kv_dtype=kv_dtype)
    slots = [eng.open() for _ in range(B)]
    g = torch.Generator().manual_seed(0)
    for s in slots:
        eng.write_memchunk(s, 1, torch.randint(4, lm.text_card, (l1 * 3 // 4,), generator=g))
        eng.write_memchunk(s, 2, torch.randint(4, lm.text_card, (l2 * 3 // 4,), generator=g))
        if aged:
            eng.cache.steps[s] = eng.cache.ring
    return eng, slots


def bench_ticks(lm, B: int, warmup: int, steps: int, l1: int, l2: int, ring: int | None,
                kv_dtype: torch.dtype | None = None) -> tuple[dict | None, dict | None, dict | None]:
    """(engine, engine with a full ring, LMGen) tick timings at batch B. The engine's streams are young
    (their ring holds only the timed steps); the full-ring engine is the cost of a stream older than the
    ring (2232 steps, ~3 min), as LMGen's always is (its ring cache attends all `context` entries).

    On the CPU the three are built together and their ticks interleaved, so machine noise hits all alike.
    On CUDA each holds a full KV cache (at 7B shape 1.46 GiB per stream in bf16), so they run one after
    the other, each freed before the next; one that does not fit is None (out of memory), not a crash."""
    n_listen = lm.num_codebooks - lm.dep_q - 1
    codes = torch.randint(0, lm.card, (B, n_listen), device=lm.device)
    if lm.device.type != "cuda":
        gen = LMGen(lm, use_sampling=False)
        (young, young_slots), (old, old_slots) = (_engine(lm, B, l1, l2, ring, kv_dtype, aged) for aged in (False, True))
        ours, aged_t, ref = [], [], []
        with gen.streaming(B):
            for i in range(warmup + steps):
                t_ref = _time(lambda: gen.step(codes[..., None]), lm.device)
                t_ours = _time(lambda: young.tick(young_slots, codes), lm.device)  # the served tick
                t_old = _time(lambda: old.tick(old_slots, codes), lm.device)
                if i >= warmup:  # first steps are slow (allocator, caches)
                    ref.append(t_ref), ours.append(t_ours), aged_t.append(t_old)
        return _summary(ours, B), _summary(aged_t, B), _summary(ref, B)

    def engine_run(aged: bool) -> dict:
        eng, slots = _engine(lm, B, l1, l2, ring, kv_dtype, aged)
        return _summary(_time_ticks(lambda: eng.tick(slots, codes), lm.device, warmup, steps), B)

    def lmgen_run() -> dict:
        gen = LMGen(lm, use_sampling=False)
        try:
            with gen.streaming(B):
                return _summary(_time_ticks(lambda: gen.step(codes[..., None]), lm.device, warmup, steps), B)
        finally:  # moshi's streaming() that fails half-way leaves the modules it reached streaming, caches held
            gen._stop_streaming()
            lm._stop_streaming()

    results = []
    for run in (lambda: engine_run(False), lambda: engine_run(True), lmgen_run):
        try:
            results.append(run())
        except (torch.OutOfMemoryError, KVCacheTooLarge):  # the engine refuses a cache it cannot hold
            results.append(None)
        gc.collect()
        torch.cuda.empty_cache()
    return tuple(results)


def bench_refresh(lm, l1: int, l2: int, dialog_steps: int, repeats: int) -> dict:
    ring = min(dialog_steps, lm.context or dialog_steps)
    eng = DialogEngine(lm, max_streams=1, l1_steps=l1, l2_steps=l2, ring_steps=ring)
    slot = eng.open()
    tokens = torch.randint(4, lm.text_card, (l1 * 3 // 4,))
    seq = torch.randint(0, lm.card, (1, lm.num_codebooks, l1 + l2 + dialog_steps), device=lm.device)
    seq[:, 0] = torch.randint(0, lm.text_card, (1, seq.shape[2]))

    def prefill():
        with torch.no_grad():
            lm.forward_text(seq)

    refresh = _time_ticks(lambda: eng.write_memchunk(slot, 1, tokens), lm.device, 1, repeats)
    full = _time_ticks(prefill, lm.device, 1, repeats)
    return {"l1_refresh_ms": statistics.median(refresh), "reprefill_ms": statistics.median(full),
            "reprefill_steps": l1 + l2 + dialog_steps,
            "refresh_over_reprefill": statistics.median(refresh) / statistics.median(full)}


def _row(B: int, ours: dict | None, old: dict | None, ref: dict | None) -> dict:
    """One batch size's record; a peer that ran out of GPU memory is None and its ratios with it."""
    def ratio(a: dict | None) -> float | None:
        return a["stream_steps_per_s"] / ref["stream_steps_per_s"] if a and ref else None

    return {"B": B, "lmgen": ref, "engine": ours, "engine_full_ring": old,
            "ratio_stream_steps": ratio(ours), "ratio_stream_steps_full_ring": ratio(old),
            "engine_within_80ms": bool(ours and ours["p99_ms"] <= TICK_BUDGET_MS),
            "engine_full_ring_within_80ms": bool(old and old["p99_ms"] <= TICK_BUDGET_MS)}


def _fmt(t: dict | None) -> str:
    if t is None:
        return "out of memory"
    return f"{t['stream_steps_per_s']:8.1f} st/s p50 {t['p50_ms']:7.1f} ms p99 {t['p99_ms']:7.1f} ms"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "7b"])
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--steps", type=int, default=40, help="timed ticks per measurement")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--l1", type=int, default=512)
    ap.add_argument("--l2", type=int, default=256)
    ap.add_argument("--ring", type=int, default=None, help="default: model context - l1 - l2")
    ap.add_argument("--dialog-steps", type=int, default=2048, help="dialog steps re-prefilled in the refresh peer")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"], help="engine KV cache: model dtype or fp8")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (0: torch default); 1: on a shared 2-core box more threads spin-wait")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_dialog.json")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device == "cuda" else torch.float32)
    lm = build_lm(args.preset, device=args.device, dtype=dtype, seed=0)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with torch.no_grad(), no_compile():
        for B in batches:
            kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else None
            ours, old, ref = bench_ticks(lm, B, args.warmup, args.steps, args.l1, args.l2, args.ring, kv_dtype)
            rows.append(_row(B, ours, old, ref))
            args.out.parent.mkdir(parents=True, exist_ok=True)  # rows so far, should a later B fail
            args.out.write_text(json.dumps({"device": args.device, "preset": args.preset, "partial": True,
                                            "ticks": rows}, indent=2))
            print(f"B={B:3d}  engine {_fmt(ours)} | full ring {_fmt(old)} | LMGen {_fmt(ref)} | ratio "
                  f"{_ratio(rows[-1]['ratio_stream_steps'])}, full ring {_ratio(rows[-1]['ratio_stream_steps_full_ring'])}",
                  flush=True)
        refresh = bench_refresh(lm, args.l1, args.l2, args.dialog_steps, repeats=3)
    print(f"L1 refresh {refresh['l1_refresh_ms']:.1f} ms vs re-prefill of {refresh['reprefill_steps']} steps "
          f"{refresh['reprefill_ms']:.1f} ms -> {refresh['refresh_over_reprefill']:.3f}x")
    within = [r["B"] for r in rows if r["engine_within_80ms"]]
    result = {
        "device": args.device, "preset": args.preset, "dtype": str(dtype).removeprefix("torch."), "kv_dtype": args.kv_dtype,
        "threads": torch.get_num_threads(), "l1": args.l1, "l2": args.l2, "steps": args.steps,
        "params_m": sum(p.numel() for p in lm.parameters()) / 1e6,
        "ticks": rows, "refresh": refresh, "max_streams_within_80ms_p99": max(within) if within else 0,
        "max_streams_within_80ms_p99_full_ring": max([r["B"] for r in rows if r["engine_full_ring_within_80ms"]],
                                                     default=0),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    _plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Bs = [r["B"] for r in result["ticks"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("engine", "engine_full_ring", "lmgen"):  # a peer out of GPU memory at some B: a gap there
        def at(key: str, name: str = name) -> list[float]:
            return [r[name][key] if r[name] else float("nan") for r in result["ticks"]]

        a.plot(Bs, at("stream_steps_per_s"), "o-", label=name)
        b.plot(Bs, at("p50_ms"), "o-", label=f"{name} p50")
        b.plot(Bs, at("p99_ms"), "x--", label=f"{name} p99")
    b.axhline(TICK_BUDGET_MS, color="grey", lw=0.8, label="80 ms budget")
    a.set(xscale="log", xlabel="streams B", ylabel="stream-steps/s", title="throughput (MemChunks filled)")
    b.set(xscale="log", xlabel="streams B", ylabel="ms per tick", title="tick latency")
    a.legend(), b.legend(fontsize=7)
    ref = result["refresh"]
    fig.suptitle(f"{result['preset']} on {result['device']}: L1 refresh {ref['l1_refresh_ms']:.0f} ms vs "
                 f"re-prefill {ref['reprefill_ms']:.0f} ms ({ref['refresh_over_reprefill']:.2f}x)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
