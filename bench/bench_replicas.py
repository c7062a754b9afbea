"""Triton replica failover (issue #16 point 4): one orchestrator, two real tritonservers, live streams
on both; replica 1 is killed -9 and restarted, `--cycles` times. Measured per cycle:

- close: from the kill to each of replica 1's streams closed with 1011 (the client's view);
- marked down: from the kill to `/readyz` showing replica 1 not ready;
- survivors: replica 0's streams' longest gap between two model outputs in the 3 s after the kill,
  beside the same stream's longest gap in the 3 s before (the stream should not notice);
- failover open: a new stream opened right after the kill, to its handshake (it must land on replica 0);
- rejoin: from the restarted tritonserver answering ready to `/readyz` showing it (bounded by
  `server.replica_probe_s`), and a new stream then placed on it.

    .venv/bin/python bench/bench_replicas.py [--cycles 3] [--streams-per-replica 2]

A process kill closes its sockets, so calls fail at once; a machine that vanishes without a reset is
found by the call timeout (`orchestrator.triton_timeout_s`) instead. Writes bench/results/bench_replicas.json
and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.orchestrator_harness import STREAM_TOKEN, OrchestratorThread, orchestrator_config, tone  # noqa: E402

RESULTS = REPO / "bench" / "results"
MODELS = ["mimi_codec", "dialog_lm"]
WINDOW_S = 3.0  # the survivors' output gaps are compared over this long before and after the kill


def ms(x: float) -> float:
    return round(x * 1000, 1)


async def readyz(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/readyz") as r:
        return json.loads(await r.text())


async def until_replica(session: aiohttp.ClientSession, url: str, index: int, ready: bool, timeout: float) -> float:
    """Poll /readyz every 10 ms until replica `index` is `ready`; the monotonic time it was seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (await readyz(session, url))["replicas"][index]["ready"] is ready:
            return time.monotonic()
        await asyncio.sleep(0.01)
    raise TimeoutError(f"replica {index} not ready={ready} within {timeout:.0f} s")


async def talk(chat, stop: asyncio.Event) -> None:
    """Stream a tone in real time until `stop` (or the chat closes)."""
    from egomem.client import stream_audio

    sig = tone(0.8)
    while not stop.is_set() and not chat.closed:
        await stream_audio(chat, sig)


def longest_gap(chat, t0: float, t1: float) -> float:
    """The longest time between two model outputs (audio chunks) the client got in [t0, t1]."""
    times = [t for t, _ in chat.audio_chunks if t0 <= t <= t1]
    if len(times) < 2:
        return t1 - t0
    return float(np.max(np.diff([t0, *times, t1])))


async def cycle(url: str, replica_b, per_replica: int) -> dict[str, Any]:
    from egomem.client import EgoMemClient

    async with EgoMemClient(url, STREAM_TOKEN) as c, aiohttp.ClientSession() as http:
        await until_replica(http, url, 1, True, 120)
        chats = [await c.open_chat(handshake_timeout=60) for _ in range(2 * per_replica)]
        where = [(await ch.wait_event("stream_open", timeout=30))["replica"] for ch in chats]
        stop = asyncio.Event()
        talkers = [asyncio.create_task(talk(ch, stop)) for ch in chats]
        await asyncio.sleep(WINDOW_S + 1.0)  # every stream ticking, outputs flowing

        victims = [ch for ch, r in zip(chats, where) if r == 1]
        survivors = [ch for ch, r in zip(chats, where) if r == 0]
        t_kill = time.monotonic()
        os.killpg(replica_b.proc.pid, signal.SIGKILL)
        opened = asyncio.create_task(c.open_chat(handshake_timeout=60))  # at once: must avoid the dead replica

        async def closed_at(ch) -> float:
            await ch.wait_for(lambda s: s.closed, 30)  # wakes on the close message itself
            return time.monotonic()

        watchers = [asyncio.create_task(closed_at(ch)) for ch in victims]
        down_at = await until_replica(http, url, 1, False, 30)
        closes = [t - t_kill for t in await asyncio.gather(*watchers)]
        new = await opened
        t_new = new.opened_at - t_kill
        new_where = (await new.wait_event("stream_open", timeout=30))["replica"]
        await asyncio.sleep(WINDOW_S)
        gaps_before = [longest_gap(ch, t_kill - WINDOW_S, t_kill) for ch in survivors]
        gaps_after = [longest_gap(ch, t_kill, t_kill + WINDOW_S) for ch in survivors]
        survivors_ok = all(not ch.closed and not ch.errors for ch in survivors)

        await asyncio.to_thread(replica_b.restart)  # returns once tritonserver and its models answer ready
        t_ready = time.monotonic()
        rejoin_at = await until_replica(http, url, 1, True, 60)
        back = await c.open_chat(handshake_timeout=60)
        back_where = (await back.wait_event("stream_open", timeout=30))["replica"]
        stop.set()
        for ch in [*chats, new, back]:
            await ch.close()
        await asyncio.gather(*talkers, return_exceptions=True)
        return {
            "placement": where,
            "victim_codes": [ch.close_code for ch in victims],
            "close_ms": [ms(x) for x in closes],
            "marked_down_ms": ms(down_at - t_kill),
            "failover_open": {"replica": new_where, "handshake_ms": ms(t_new)},
            "survivor_longest_gap_ms": {"before": [ms(x) for x in gaps_before], "after": [ms(x) for x in gaps_after]},
            "survivors_untouched": survivors_ok,
            "rejoin_ms": ms(rejoin_at - t_ready),
            "rejoined_stream_replica": back_where,
        }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cycles = result["cycles"]
    series = {
        "victim stream closed (1011)": [x for c in cycles for x in c["close_ms"]],
        "replica marked down": [c["marked_down_ms"] for c in cycles],
        "new stream handshake (on replica 0)": [c["failover_open"]["handshake_ms"] for c in cycles],
        "survivor longest output gap, before": [x for c in cycles for x in c["survivor_longest_gap_ms"]["before"]],
        "survivor longest output gap, after": [x for c in cycles for x in c["survivor_longest_gap_ms"]["after"]],
        "rejoin after tritonserver ready": [c["rejoin_ms"] for c in cycles],
    }
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, xs in enumerate(series.values()):
        ax.scatter(xs, [i] * len(xs), s=30)
    ax.set_yticks(range(len(series)), list(series))
    ax.set_xlabel("ms (from the kill; rejoin: from the restarted server's readiness)")
    ax.set_title(f"Triton replica killed -9 and restarted, {len(cycles)} cycles")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--streams-per-replica", type=int, default=2)
    ap.add_argument("--probe-s", type=float, default=1.0, help="server.replica_probe_s")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_replicas.json")
    a = ap.parse_args(argv)

    from egomem.serving.launcher import TritonServer
    from tests.conftest import test_config

    tmp = Path(tempfile.mkdtemp(prefix="egomem-replicas-"))
    pools = {"mimi": {"max_streams": 8}, "dialog": {"max_streams": 8}, "orchestrator": {"max_streams": 8}}
    servers = [TritonServer(test_config(tmp / f"replica{i}", **pools), models=MODELS) for i in range(2)]
    for s in servers:
        print(f"starting tritonserver {s.grpc_url} ...", file=sys.stderr, flush=True)
        s.start()
    try:
        (tmp / "orch").mkdir()
        cfg = orchestrator_config(test_config(tmp / "orch", **pools), tmp / "orch", identify_models=False,
                                  retrieval=False)
        cfg.server.triton_urls = [s.grpc_url for s in servers]
        cfg.server.replica_probe_s = a.probe_s
        cycles = []
        with OrchestratorThread(cfg) as o:
            for i in range(a.cycles):
                cycles.append(asyncio.run(cycle(o.url, servers[1], a.streams_per_replica)))
                print(f"cycle {i + 1}/{a.cycles}: {json.dumps(cycles[-1])}", file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
    close = [x for c in cycles for x in c["close_ms"]]
    result = {
        "cycles": cycles,
        "summary": {
            "victim_close_ms": {"p50": float(np.median(close)), "max": max(close)},
            "marked_down_ms_max": max(c["marked_down_ms"] for c in cycles),
            "failover_open_on_live_replica": all(c["failover_open"]["replica"] == 0 for c in cycles),
            "survivors_untouched": all(c["survivors_untouched"] for c in cycles),
            "survivor_gap_ms_max": {"before": max(x for c in cycles for x in c["survivor_longest_gap_ms"]["before"]),
                                    "after": max(x for c in cycles for x in c["survivor_longest_gap_ms"]["after"])},
            "rejoin_ms_max": max(c["rejoin_ms"] for c in cycles),
            "rejoined_takes_new_stream": all(c["rejoined_stream_replica"] == 1 for c in cycles),
        },
        "setup": {"streams_per_replica": a.streams_per_replica, "replica_probe_s": a.probe_s,
                  "triton_timeout_s": cfg.orchestrator.triton_timeout_s, "machine": f"{os.cpu_count()} CPU cores",
                  "note": "both tritonservers and the orchestrator share this machine's cores"},
        "command": ".venv/bin/python bench/bench_replicas.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    plot(result, a.out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
