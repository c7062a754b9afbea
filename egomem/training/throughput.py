"""Throughput of a dialog model for `egomem eval-dialog` (paper Table 3's fps column).

`engine_fps` steps the in-process `DialogEngine`; `served_fps` the `dialog_lm` model of a real
tritonserver (the nvidia-pytriton binary, `egomem.serving.launcher`) loaded with the evaluated
weights, one cohort request per tick for all streams as the orchestrator's grid sends them. Both
measure with every stream's L1 MemChunk written ("l1"), then with its L2 written too ("l2"), after a
warm-up (the first steps are slow), and report stream-frames/s and per-tick p50/p99.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from egomem.dialog.engine import DialogEngine


class ServedTickError(RuntimeError):
    """dialog_lm refused a tick of the throughput run."""


def timing(ms: list[float], streams: int) -> dict[str, float]:
    """Summary of per-tick wall times (ms) of `streams` streams stepped together."""
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
    return {"frames_per_s": streams * len(ms) / (sum(ms) / 1e3), "per_stream_frames_per_s": len(ms) / (sum(ms) / 1e3),
            "p50_ms": statistics.median(ms), "p99_ms": q[98], "streams": streams, "ticks": len(ms)}


@torch.no_grad()
def engine_fps(engine: DialogEngine, l1_tokens: Sequence[list[int]], l2_tokens: Sequence[list[int]],
               ticks: int = 40, warmup: int = 8, seed: int = 0) -> dict[str, Any]:
    """In-process stream-frames/s of every free slot of `engine` stepped together; slot i's MemChunks get
    `l1_tokens[i % len]` (then `l2_tokens[i % len]`). The slots are closed again afterwards."""
    lm, device = engine.lm, engine.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    slots = [engine.open() for _ in range(len(engine.free))]
    if not slots:
        raise ValueError("the engine has no free slot to measure with")
    codes = torch.randint(0, lm.card, (len(slots), lm.num_codebooks - lm.dep_q - 1),
                          generator=torch.Generator().manual_seed(seed))
    out: dict[str, Any] = {"device": str(device)}
    try:
        for level, tokens in ((1, l1_tokens), (2, l2_tokens)):
            for i, s in enumerate(slots):
                engine.write_memchunk(s, level, tokens[i % len(tokens)])
            ms = []
            for k in range(warmup + ticks):
                sync()
                t0 = time.perf_counter()
                engine.step(slots, codes)
                sync()
                if k >= warmup:
                    ms.append((time.perf_counter() - t0) * 1e3)
            out[f"l{level}"] = timing(ms, len(slots))
    finally:
        for s in slots:
            engine.close(s)
    return out


def served_fps(cfg: Any, l1_texts: Sequence[str], l2_texts: Sequence[str], streams: int = 8, ticks: int = 40,
               warmup: int = 8, seed: int = 0) -> dict[str, Any]:
    """Stream-frames/s of `dialog_lm` on a tritonserver started from `cfg` (`cfg.dialog.weights`: the model
    under test; `cfg.server`: ports and run folder): START with an L1 refresh ("l1"), then an L2 refresh
    ("l2"); texts as `engine_fps` (the model tokenizes them, as it does the orchestrator's)."""
    import asyncio

    from egomem.dialog.presets import lm_kwargs
    from egomem.serving.client import AsyncTritonClient
    from egomem.serving.launcher import TritonServer
    from egomem.serving.wire import DIALOG_LM, SEQUENCE_END, SEQUENCE_START

    kw = lm_kwargs(cfg.dialog.preset)
    codes = np.random.default_rng(seed).integers(0, kw["card"], (streams, kw["n_q"] - kw["dep_q"])).astype(np.int64)
    ids = [7_000_000 + i for i in range(streams)]
    cohort_ids = iter(range(8_000_000, 9_000_000))

    async def tick(client: AsyncTritonClient, flag: int, level: int = 0, texts: Sequence[str] = ()) -> float:
        inputs: dict[str, np.ndarray] = {"COHORT_LISTEN_CODES": codes}
        if level:
            inputs["COHORT_MEMCHUNK_LEVEL"] = np.full(streams, level, np.int32)
            inputs["COHORT_MEMCHUNK_TEXT"] = np.array([texts[i % len(texts)].encode() for i in range(streams)],
                                                      dtype=np.object_)
        t0 = time.perf_counter()
        _, errors = await client.infer_cohort(DIALOG_LM, next(cohort_ids), ids, [flag] * streams, inputs,
                                              ["COHORT_TEXT_TOKEN"], timeout_s=120)
        bad = [e for e in errors if e is not None]
        if bad:
            raise ServedTickError(f"dialog_lm refused a tick: {bad[0][0].value}: {bad[0][1]}")
        return (time.perf_counter() - t0) * 1e3

    async def run(url: str) -> dict[str, Any]:
        async with AsyncTritonClient(url, timeout_s=120) as client:
            out: dict[str, Any] = {}
            for level, texts in ((1, l1_texts), (2, l2_texts)):
                await tick(client, SEQUENCE_START if level == 1 else 0, level, texts)
                ms = [await tick(client, 0) for _ in range(warmup + ticks)][warmup:]
                out[f"l{level}"] = timing(ms, streams)
            await tick(client, SEQUENCE_END)
            return out

    with TritonServer(cfg, models=[DIALOG_LM]) as server:
        result = asyncio.run(run(server.grpc_url))
    result["device"] = server.device
    return result
