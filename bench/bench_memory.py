"""Memory-store benchmark: sustained memory operations/s with N concurrent writer processes, and
the latency of a profile read (render_profile, the Level-1 MemChunk text) idle and under that load.

    .venv/bin/python bench/bench_memory.py [--writers 8] [--seconds 10] [--synchronous FULL]

A "memory operation" is one op-log row: add a fact / preference, supersede a fact, a persona
update, add a summary; each in its own durable transaction, as the REST API and the memory
manager write them. Each writer works on its own user and, one write in four, on a user shared by
all writers (the "writes for one user are serialised" path). The peer measured in the same run is
one writer alone: the ratio says how much the 8 concurrent writers gain (or lose) over it.
Writes bench/results/bench_memory.json and bench_memory.png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from egomem.memory.sqlite import SQLiteMemoryStore
from egomem.memory.store import MemoryStore
from egomem.memory.types import PersonaUpdate

RESULTS = Path(__file__).parent / "results"
SHARED_FRACTION = 0.25  # one write in four goes to the user all writers share (writes for one user serialise)


def seed_profile(s: MemoryStore, name: str) -> str:
    """A realistic long-time user: 40 facts, 20 preferences, 90 persona dims, 10 summaries, 5 relations."""
    u = s.create_user(name).user_id
    for i in range(40):
        s.add_item(u, "fact", f"fact number {i} about {name}: works on project {i}", key=f"k{i}")
    for i in range(20):
        s.add_item(u, "preference", f"thing {i}", polarity="like" if i % 3 else "dislike")
    s.update_persona(u, [PersonaUpdate(d, float(d % 2), 0.6, "seed") for d in range(90)])
    for i in range(10):
        s.add_summary(u, f"session {i}: talked about a long list of things, mostly project {i}")
    for i in range(5):
        s.add_relation(u, s.create_user(f"{name}-friend{i}").user_id, "friend")
    return u


def memory_op(s: MemoryStore, u: str, rng: np.random.Generator, n: int, tag: str, last_fact: dict[str, str]) -> None:
    """One memory operation of the mix, in its own durable transaction: add a fact (40 %), supersede
    one (20 %), add a preference (20 %), a persona update (15 %), a summary (5 %)."""
    r = rng.random()
    if r < 0.4:
        s.add_item(u, "fact", f"{tag} fact {n}")
    elif r < 0.6 and last_fact.get(u):
        try:
            last_fact[u] = s.supersede_item(last_fact[u], f"{tag} fact {n} (updated)", reason="bench")
        except Exception:  # noqa: BLE001 — another writer superseded it first: a real conflict
            last_fact[u] = s.add_item(u, "fact", f"{tag} fact {n}", key="moving")
    elif r < 0.6:
        last_fact[u] = s.add_item(u, "fact", f"{tag} fact {n}", key="moving")
    elif r < 0.8:
        s.add_item(u, "preference", f"item {n}", polarity="like")
    elif r < 0.95:
        s.update_persona(u, [PersonaUpdate(int(rng.integers(90)), float(rng.random()), 0.5, "bench")])
    else:
        s.add_summary(u, f"{tag} summary {n}")


def writer(db: str, shared: str, seconds: float, start: mp.Event, out: mp.Queue, sync: str, seed: int) -> None:
    s = SQLiteMemoryStore(db, busy_timeout_s=120, synchronous=sync)
    rng = np.random.default_rng(seed)
    own = s.create_user(f"writer{seed}").user_id
    last_fact: dict[str, str] = {}
    start.wait()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        u = shared if rng.random() < SHARED_FRACTION else own
        memory_op(s, u, rng, n, f"w{seed}", last_fact)
        n += 1
    out.put((n, time.perf_counter() - t0))
    s.close()


def read_latencies(db: str, user: str, stop: threading.Event, max_reads: int = 100000) -> list[float]:
    return profile_reads(SQLiteMemoryStore(db), user, stop, max_reads)


def profile_reads(s: MemoryStore, user: str, stop: threading.Event, max_reads: int = 100000) -> list[float]:
    """render_profile latencies (s) until `stop` or `max_reads`; closes the store."""
    lat = []
    while not stop.is_set() and len(lat) < max_reads:
        t = time.perf_counter()
        s.render_profile(user)
        lat.append(time.perf_counter() - t)
    s.close()
    return lat


def run_writers(db: str, shared: str, writers: int, seconds: float, sync: str, reader_user: str | None):
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=writer, args=(db, shared, seconds, start, out, sync, w)) for w in range(writers)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # let every process import and open the store
    stop, lat = threading.Event(), []
    th = None
    if reader_user:
        th = threading.Thread(target=lambda: lat.extend(read_latencies(db, reader_user, stop)))
    start.set()
    if th:
        th.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    stop.set()
    if th:
        th.join()
    for p in procs:
        p.join()
    ops = sum(n for n, _ in results)
    wall = max(t for _, t in results)
    return ops / wall, ops, lat


def pct(lat: list[float]) -> dict[str, float]:
    a = np.array(lat) * 1e3
    return {"n": int(a.size), **{f"p{q}_ms": float(np.percentile(a, q)) for q in (50, 90, 95, 99)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--synchronous", choices=["FULL", "NORMAL"], default="FULL")
    ap.add_argument("--idle-reads", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_memory.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "bench.sqlite3")
        s = SQLiteMemoryStore(db, synchronous=args.synchronous)
        reader_user = seed_profile(s, "Ada")
        shared = s.create_user("Shared").user_id
        idle = read_latencies(db, reader_user, threading.Event(), args.idle_reads)
        one_rate, one_ops, _ = run_writers(db, shared, 1, args.seconds, args.synchronous, None)
        rate, ops, loaded = run_writers(db, shared, args.writers, args.seconds, args.synchronous, reader_user)
        log_rows = len(s.op_log(limit=10**9))
        profile_chars = len(s.render_profile(reader_user))
        s.close()

    res = {
        "writers": args.writers, "seconds": args.seconds, "synchronous": args.synchronous,
        "ops_per_s": rate, "ops": ops,
        "peer_one_writer_ops_per_s": one_rate, "ratio_vs_one_writer": rate / one_rate,
        "profile_read_idle": pct(idle), "profile_read_under_load": pct(loaded),
        "profile_chars": profile_chars, "op_log_rows_total": log_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.bar(["1 writer", f"{args.writers} writers"], [one_rate, rate], color=["grey", "tab:blue"])
    a1.set_ylabel("memory operations / s")
    a1.set_title(f"sustained writes (synchronous={args.synchronous})")
    for name, lat in (("idle", idle), (f"{args.writers} writers", loaded)):
        a = np.sort(np.array(lat) * 1e3)
        a2.plot(a, np.arange(1, a.size + 1) / a.size, label=name)
    a2.set_xscale("log")
    a2.set_xlabel("render_profile latency (ms)")
    a2.set_ylabel("CDF")
    a2.legend()
    a2.set_title("profile read")
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=100)

    print(f"{'metric':34s} {'value':>12s}")
    print(f"{'ops/s, 1 writer (peer)':34s} {one_rate:12.1f}")
    print(f"{f'ops/s, {args.writers} writers':34s} {rate:12.1f}")
    print(f"{'ratio vs 1 writer':34s} {rate / one_rate:12.2f}")
    for name, d in (("profile read idle", res["profile_read_idle"]), ("profile read loaded", res["profile_read_under_load"])):
        print(f"{name + ' p50 / p99 (ms)':34s} {d['p50_ms']:6.2f} / {d['p99_ms']:.2f}")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
