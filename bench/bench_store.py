"""Memory store backends side by side: memory operations/s with 1 and N writer threads on SQLite and on
PostgreSQL, in one run, plus the profile-read latency (render_profile, the Level-1 MemChunk text) on each.

    .venv/bin/python bench/bench_store.py [--writers 8] [--seconds 10]

A "memory operation" is bench_memory.py's mix (`memory_op`: add / supersede a fact, a preference, a
persona update, a summary), each its own durable transaction, as the REST API and the memory manager
write them; each writer thread works on its own user and, one write in four, on a user all writers
share (per-user serialised writes). The threads share one store object, as the orchestrator's and
the worker's threads do. SQLite: a WAL file with synchronous=FULL; PostgreSQL: the pgserver wheel's
PostgreSQL 16 on a Unix socket, default durability (fsync, synchronous_commit on), in a temporary
folder. Writes bench/results/bench_store.json and bench_store.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_memory import SHARED_FRACTION, memory_op, pct, profile_reads, seed_profile

from egomem.memory.store import MemoryStore

RESULTS = Path(__file__).parent / "results"
BUSY_TIMEOUT_S = 120.0  # 8 writers on 2 shared cores: a lock wait may be long, never an error
SETTLE_S = 0.5  # between runs: let the previous run's checkpoints / background writers settle


def run_writers(s: MemoryStore, shared: str, writers: int, seconds: float) -> tuple[float, int]:
    """(operations/s, operations) of `writers` threads running the mix for `seconds` on store `s`."""
    own = [s.create_user(f"writer{w}").user_id for w in range(writers)]
    start, counts, errors = threading.Barrier(writers + 1), [0] * writers, []

    def work(w: int) -> None:
        rng, last_fact = np.random.default_rng(w), {}
        start.wait()
        t0 = time.perf_counter()
        try:
            while time.perf_counter() - t0 < seconds:
                u = shared if rng.random() < SHARED_FRACTION else own[w]
                memory_op(s, u, rng, counts[w], f"w{w}", last_fact)
                counts[w] += 1
        except BaseException as e:  # noqa: BLE001 — reported after the run: a failed write is a failed bench
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} writer(s) failed: {errors[0]!r}")
    return sum(counts) / wall, sum(counts)


def bench_backend(open_store: Callable[[], MemoryStore], writers: int, seconds: float, reads: int) -> dict:
    s = open_store()
    reader = seed_profile(s, "Ada")
    shared = s.create_user("Shared").user_id
    idle = profile_reads(open_store(), reader, threading.Event(), reads)
    out: dict = {"profile_read_idle": pct(idle)}
    for n in (1, writers):
        time.sleep(SETTLE_S)
        rate, ops = run_writers(s, shared, n, seconds)
        out[f"writers_{n}"] = {"ops_per_s": rate, "ops": ops}
        print(f"  {n} writer(s): {rate:8.1f} ops/s ({ops} ops)", flush=True)
    out["op_log_rows_total"] = len(s.op_log(limit=10**9))
    s.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--idle-reads", type=int, default=500)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_store.json")
    args = ap.parse_args()

    import pgserver
    import psycopg

    from egomem.memory.postgres import PostgresMemoryStore
    from egomem.memory.sqlite import SQLiteMemoryStore

    res: dict = {"writers": args.writers, "seconds": args.seconds, "threads": True, "backends": {}}
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.sqlite3"
        print("sqlite (WAL, synchronous=FULL)", flush=True)
        res["backends"]["sqlite"] = bench_backend(
            lambda: SQLiteMemoryStore(db, busy_timeout_s=BUSY_TIMEOUT_S), args.writers, args.seconds, args.idle_reads)
    pg_dir = tempfile.mkdtemp(prefix="egomem-bench-pg-")  # not under a folder other tools narrow (see conftest)
    server = pgserver.get_server(pg_dir, cleanup_mode="stop")
    try:
        uri = server.get_uri()
        with psycopg.connect(uri, autocommit=True) as c:
            c.execute("CREATE DATABASE bench")
            res["postgres_version"] = c.execute("SHOW server_version").fetchone()[0]
        dsn = uri.replace("/postgres?", "/bench?", 1)
        print(f"postgres {res['postgres_version']} (pgserver, Unix socket)", flush=True)
        res["backends"]["postgres"] = bench_backend(
            lambda: PostgresMemoryStore(dsn, busy_timeout_s=BUSY_TIMEOUT_S), args.writers, args.seconds,
            args.idle_reads)
    finally:
        server.cleanup()
        shutil.rmtree(pg_dir, ignore_errors=True)
    for r in res["backends"].values():
        r["ratio_n_vs_1"] = r[f"writers_{args.writers}"]["ops_per_s"] / r["writers_1"]["ops_per_s"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    plot(res, args.out.with_suffix(".png"))

    print(f"{'backend':10s} {'1 writer':>10s} {f'{args.writers} writers':>11s} {'ratio':>6s} {'read p50/p99 ms':>16s}")
    for name, r in res["backends"].items():
        d = r["profile_read_idle"]
        print(f"{name:10s} {r['writers_1']['ops_per_s']:10.1f} {r[f'writers_{args.writers}']['ops_per_s']:11.1f} "
              f"{r['ratio_n_vs_1']:6.2f} {d['p50_ms']:7.2f} / {d['p99_ms']:.2f}")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = res["writers"]
    names = list(res["backends"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(names))
    for k, (w, color) in enumerate(((1, "grey"), (n, "tab:blue"))):
        a1.bar(x + (k - 0.5) * 0.38, [res["backends"][b][f"writers_{w}"]["ops_per_s"] for b in names], 0.38,
               label=f"{w} writer{'s' if w > 1 else ''}", color=color)
    a1.set_xticks(x, names)
    a1.set_ylabel("memory operations / s")
    a1.set_title(f"durable writes, {res['seconds']:.0f} s per run")
    a1.legend()
    a2.bar(names, [res["backends"][b]["profile_read_idle"]["p50_ms"] for b in names], color="tab:green", label="p50")
    a2.scatter(names, [res["backends"][b]["profile_read_idle"]["p99_ms"] for b in names], color="k", label="p99", zorder=3)
    a2.set_ylabel("render_profile latency (ms)")
    a2.set_title("profile read, idle")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
