"""The prepared device check (issue #17): one command that turns a lent GPU into numbers.

Runs each part in its own subprocess with its own time limit (a part that fails or runs out of time
is recorded as such; the others still run), and writes one JSON per part plus `summary.json`
under `bench/results/gpu/` (`--cpu-smoke`: `bench/results/gpu/smoke/`, tiny shapes on the CPU, so
CI keeps the script from rotting):

  parity   the dialog engine on CUDA (Triton kernels, the CUDA-graphed fixed-shape tick) against the
           training forward, the same engine on the CPU, and its own narrow tick: the tiny preset in
           float32, MemChunks written, the ring wrapped;
  kernels  the Triton kernels compiled on CUDA (bf16) against the naive references, and timed at
           7B shape (B = 64, 3,000-step ring); with --cpu-smoke, the same code under the Triton
           interpreter at tiny shapes;
  dialog   bench/bench_dialog.py at Moshi-7B shape with random weights for B = 1..128: tick p50/p99,
           the largest B within 80 ms p99, beside moshi's LMGen at the same B; the L1 refresh;
  dialog_fp8  the same at B = 64 with the fp8 KV cache;
  mimi     full-size Mimi encode + decode per 80 ms tick for B streams (MimiStreamPool, random weights,
           CUDA graphs);
  finetune `egomem finetune`'s training loop on CUDA: the tiny preset fully fine-tuned in bf16 on a
           synthetic memorisation set (the loss must fall; the checkpoint serves from the engine on CUDA),
           and three LoRA steps at Moshi-7B shape with gradient checkpointing (s/step, peak memory);
  served   bench/bench_orchestrator.py (the whole served stack, GPU instances) at the largest B the
           dialog part found real-time (capped by --served-max).

    python bench/gpu_check.py                # on the GPU machine: a few minutes on an H100/H200
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
PARTS = ("parity", "kernels", "dialog", "dialog_fp8", "mimi", "finetune", "served")
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
            read = 2 * kr.numel() * kr.element_size()  # bytes of K and V one call reads
            key = f"decode_attention_7b_b{rows}_{str(cache_dtype).removeprefix('torch.')}_splits{splits or 'auto'}"
            result[key + "_ms"] = per_call * 1e3
            result[key + "_gb_s"] = read / per_call / 1e9
            try:  # as the engine runs it: replayed from a CUDA graph, no host launch cost per call
                per_replay = _graph_ms(lambda args=call_args, s=splits: decode_attention(
                    *args, n1=n1, n2=n2, impl="triton", num_splits=s))
                result[key + "_graph_ms"] = per_replay
                result[key + "_graph_gb_s"] = read / (per_replay / 1e3) / 1e9
            except Exception as e:  # noqa: BLE001 -- recorded, not fatal: the eager figures above stand
                result[key + "_graph_error"] = f"{type(e).__name__}: {e}"[:300]
    out.write_text(json.dumps(result, indent=1))
    return result


def _graph_ms(call, replays: int = 20) -> float:
    """Milliseconds per replay of `call` captured once in a CUDA graph (warmed on a side stream first)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / replays * 1e3


# ---------------------------------------------------------------------------------------------- parity


def parity_part(out: Path, smoke: bool) -> dict:
    """The served engine on the device against three references, on one seeded tiny model in float32:

    - the training forward (`lm.forward_text` over [L1 ; L2 ; the inputs the engine fed itself]), as
      tests/test_dialog_engine.py does on the CPU: the per-step text logits of a slot with both chunks
      written and of a slot with none;
    - the same engine on the CPU (torch attention, no graph), fed the same inputs: its logits;
    - the engine's own narrow tick (`step`, only the named slots) against the served fixed-shape tick
      (`tick` -> `step_all`, replayed from a CUDA graph on CUDA) over a ring that wraps: the tokens.
    """
    import copy

    import torch
    from moshi.utils.compile import no_compile

    from egomem.dialog import DialogEngine
    from egomem.dialog.checkpoint import build_lm
    from egomem.dialog.query_grammar import GrammarTokens
    from egomem.dialog.tokenizer import ByteTokenizer

    dev = "cpu" if smoke else "cuda"
    lm_cpu = build_lm("tiny", seed=0)  # float32; the device copy has the same weights
    lm_dev = copy.deepcopy(lm_cpu).to(dev)
    g = torch.Generator().manual_seed(0)
    n_listen = lm_cpu.num_codebooks - lm_cpu.dep_q - 1
    n1, n2, ring, steps = 64, 32, 48, 24
    l1 = torch.randint(4, lm_cpu.text_card, (40,), generator=g)
    l2 = torch.randint(4, lm_cpu.text_card, (20,), generator=g)
    codes = torch.randint(0, lm_cpu.card, (steps * 3, 2, n_listen), generator=g)

    def teacher_forced(lm, fed: list[torch.Tensor] | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Engine logits [T, 2, text_card] for slots (with chunks, without); `fed`: inputs to force."""
        eng = DialogEngine(lm, max_streams=3, l1_steps=n1, l2_steps=n2, ring_steps=ring, fixed_shape_tick=False)
        a, b = eng.open(), eng.open()
        eng.write_memchunk(a, 1, l1)
        eng.write_memchunk(a, 2, l2)
        logits, inputs = [], []
        for t in range(steps):
            if fed is not None:  # the CPU run: feed the device run's own tokens so both see one sequence
                eng.tokens[[a, b]] = fed[t].to(eng.tokens.device)
            before = eng.tokens[[a, b]].clone()
            logits.append(eng.step([a, b], codes[t], return_logits=True)[2].float().cpu())
            inputs.append((before, eng.last_inputs.cpu()))
        return torch.stack(logits), inputs

    with torch.no_grad(), no_compile():
        got, inputs = teacher_forced(lm_dev, None)
        cpu, _ = teacher_forced(lm_cpu, [before for before, _ in inputs])
        ref = []
        for row, chunks in ((0, (l1, l2)), (1, (l1[:0], l2[:0]))):
            seq = torch.full((1, lm_cpu.num_codebooks, n1 + n2), lm_cpu.initial_token_id)
            seq[0, 0] = lm_cpu.text_padding_token_id
            seq[0, 0, :len(chunks[0])] = chunks[0]
            seq[0, 0, n1:n1 + len(chunks[1])] = chunks[1]
            fed = torch.stack([fed_in[row] for _, fed_in in inputs], dim=1)[..., 0]  # [K, T]
            seq = torch.cat([seq, fed[None]], dim=2).to(dev)
            ref.append(lm_dev.forward_text(seq)[1][0, 0, n1 + n2:].float().cpu())  # [T, text_card]
        ref = torch.stack(ref, dim=1)  # [T, 2, text_card]
        scale = float(ref.std())
        # the served tick (fixed shape, graphed on CUDA) against the narrow one, tokens over a wrapped ring
        narrow = DialogEngine(lm_dev, max_streams=4, l1_steps=n1, l2_steps=n2, ring_steps=ring,
                              fixed_shape_tick=False)
        fixed = DialogEngine(lm_dev, max_streams=4, l1_steps=n1, l2_steps=n2, ring_steps=ring,
                             fixed_shape_tick=True)
        for eng in (narrow, fixed):
            for _ in range(3):
                eng.open()
            eng.write_memchunk(1, 1, l1)
        same = total = 0
        for t in range(steps * 3):  # 72 ticks > the 48-step ring
            slots = [0, 1] if t % 3 else [2, 1]
            a, b = narrow.tick(slots, codes[t]), fixed.tick(slots, codes[t])
            for x, y in zip(a[:2], b[:2]):
                same += int((x.cpu() == y.cpu()).sum())
                total += x.numel()
        # the same with the query grammar: slot 1 put on the relation line every 24 ticks (the graph must
        # read the grammar's tables and state, not a copy captured at the first replay)
        grammar = GrammarTokens.from_tokenizer(ByteTokenizer())
        relations = [ByteTokenizer().encode(r) for r in ("son", "son's teacher", "aunt")]
        engines = []
        for fixed_shape in (False, True):
            eng = DialogEngine(lm_dev, max_streams=4, l1_steps=n1, l2_steps=n2, ring_steps=ring,
                               fixed_shape_tick=fixed_shape, query_grammar=grammar)
            for _ in range(3):
                eng.open()
            eng.set_query_relations(1, relations)
            engines.append(eng)
        g_same = g_total = g_states = 0
        for t in range(steps * 3):
            if t % 24 == 0:
                for eng in engines:
                    eng.grammar.state[1] = eng.grammar.H
            slots = [0, 1] if t % 3 else [2, 1]
            a, b = (eng.tick(slots, codes[t]) for eng in engines)
            g_same += int((a[0].cpu() == b[0].cpu()).sum())
            g_total += a[0].numel()
            g_states += int(torch.equal(engines[0].grammar.state.cpu(), engines[1].grammar.state.cpu()))
    result = {
        "device": dev, "preset": "tiny", "dtype": "float32", "steps": steps,
        "vs_forward_max_abs": float((got - ref).abs().max()), "vs_cpu_max_abs": float((got - cpu).abs().max()),
        "logit_std": scale, "fixed_vs_narrow_token_agreement": same / total, "fixed_vs_narrow_tokens": total,
        "tolerance_rel": 1e-3, "grammar_fixed_vs_narrow_text_agreement": g_same / g_total,
        "grammar_states_equal_ticks": g_states, "grammar_ticks": steps * 3,
    }
    result["ok"] = (result["vs_forward_max_abs"] <= result["tolerance_rel"] * scale
                    and result["vs_cpu_max_abs"] <= result["tolerance_rel"] * scale
                    and result["fixed_vs_narrow_token_agreement"] == 1.0
                    and result["grammar_fixed_vs_narrow_text_agreement"] == 1.0 and g_states == steps * 3)
    print(json.dumps(result, indent=1), flush=True)
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


# ---------------------------------------------------------------------------------------------- finetune


class _MemoryData:
    """`finetune.DataSource` in memory: rows whose reply names the person their L1 MemChunk holds."""

    def __init__(self, rows: int, steps: int, card: int, seed: int = 0):
        from egomem.dialog.tokenizer import ByteTokenizer
        from egomem.training.types import Sample, Span

        tok, g = ByteTokenizer(), np.random.default_rng(seed)
        self.manifest = {"format": "egomem-memchunk-v1", "n1": 512, "n2": 256, "tokenizer": "byte",
                         "codec": "gpu_check", "seed": seed}
        self.samples, self.streams = [], {}
        for i in range(rows):
            name = "".join(chr(c) for c in g.integers(97, 123, 6)).title()
            ids = tok.encode(f"Hi {name}!")
            at = int(g.integers(8, steps - len(ids) - 4))
            tokens = np.empty((17, steps), dtype=np.int64)
            tokens[0] = tok.pad_id
            tokens[0, at:at + len(ids)] = ids
            tokens[1:] = g.integers(0, card, (16, steps))
            self.streams[f"s{i}"] = tokens
            self.samples.append(Sample(stream=f"s{i}", kind="l1_response", l1_text=f"name: {name}", l2_text="",
                                       text=(Span(at - 2, at + len(ids) + 1),), speak=(Span(at, at + len(ids)),),
                                       dialog=0, turn=0, generator="gpu_check"))

    def tokens(self, stream_id: str) -> np.ndarray:
        return self.streams[stream_id]


def finetune_part(out: Path, smoke: bool) -> dict:
    """The tiny preset fully fine-tuned (bf16 on CUDA) and LoRA steps at 7B shape; see the module docstring."""
    import tempfile

    import torch

    from egomem.dialog import DialogEngine
    from egomem.dialog.checkpoint import build_lm
    from egomem.training.finetune import TrainConfig, train

    dev = "cpu" if smoke else "cuda"
    dtype = "float32" if smoke else "bfloat16"
    result: dict = {"device": dev, "dtype": dtype}
    with tempfile.TemporaryDirectory() as tmp:
        steps = 12 if smoke else 80
        data = _MemoryData(rows=8, steps=96, card=2048)
        cfg = TrainConfig(data=None, out=Path(tmp) / "tiny", preset="tiny", steps=steps, batch_size=4, lr=3e-3,
                          min_lr=3e-4, device=dev, dtype=dtype, eval_samples=8, ckpt_every=steps, seed=0)
        t = time.perf_counter()
        res = train(cfg, data, progress=False)
        seconds = time.perf_counter() - t
        lm = build_lm("tiny", weights=res.path, device=dev, dtype=getattr(torch, dtype))
        eng = DialogEngine(lm, max_streams=2)
        slot = eng.open()
        eng.write_memchunk(slot, 1, list(b"name: Ada"))
        for _ in range(4):  # the checkpoint serves: the engine ticks on it
            eng.tick([slot], torch.zeros(1, 8, dtype=torch.long))
        result["tiny"] = {"steps": steps, "seconds": round(seconds, 2), "s_per_step": seconds / steps,
                          "first_loss": res.losses[0], "final_loss": float(np.mean(res.losses[-5:])),
                          "served_ticks": int(eng.steps(slot))}
        result["tiny"]["ok"] = result["tiny"]["final_loss"] < 0.7 * result["tiny"]["first_loss"] \
            and result["tiny"]["served_ticks"] == 4
        # LoRA at Moshi-7B shape (smoke: a narrow 2-layer stand-in), gradient checkpointing, 3 steps
        shape = {"text_card": 260} | ({"dim": 256, "num_heads": 4, "num_layers": 2, "depformer_dim": 128,
                                       "depformer_dim_feedforward": 528, "depformer_num_heads": 2,
                                       "depformer_num_layers": 2} if smoke else {})
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        cfg = TrainConfig(data=None, out=Path(tmp) / "lora", preset="7b", model_overrides=shape, steps=100,
                          stop_after=3, batch_size=1, lr=2e-6, min_lr=2e-7, lora=True, gradient_checkpointing=True,
                          dialog_steps=256, device=dev, dtype=dtype, eval_samples=2, seed=0)
        t = time.perf_counter()
        res = train(cfg, _MemoryData(rows=2, steps=256, card=2048), progress=False)
        seconds = time.perf_counter() - t
        result["lora_7b"] = {"shape": "7b" + (" (narrow stand-in)" if smoke else ""), "steps": res.step,
                             "seconds_incl_build": round(seconds, 2), "losses": res.losses,
                             "rows": "1 x (768 chunk + 256 dialog) steps",
                             "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None}
        result["lora_7b"]["ok"] = res.step == 3 and all(np.isfinite(res.losses))
    result["ok"] = result["tiny"]["ok"] and result["lora_7b"]["ok"]
    print(json.dumps(result, indent=1), flush=True)
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
            ["--device", "cuda", "--preset", "7b", "--batches", "64,128", "--steps", "30", "--warmup", "5"])
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
    if args._part == "parity":
        return 0 if parity_part(args._out, args.cpu_smoke)["ok"] else 1
    if args._part == "finetune":
        return 0 if finetune_part(args._out, args.cpu_smoke)["ok"] else 1
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
    limits = {"parity": 60, "kernels": 90, "dialog": 240, "dialog_fp8": 90, "mimi": 90, "finetune": 150, "served": 150}
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
