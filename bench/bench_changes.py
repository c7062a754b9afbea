"""Change propagation between processes (issue #16 point 3): how long after a profile change, merge or
forget commits through one store does another orchestrator apply it to its streams, identifier and
caches? PostgreSQL (LISTEN/NOTIFY) and SQLite (op-log polling every `memory.change_poll_s`).

    nice -n 19 .venv/bin/python bench/bench_changes.py [--changes 150] [--forgets 20] [--load-writers 2]

Orchestrator B is the real app (`egomem.orchestrator.app.init`, served in a thread as the tests do,
no Triton models) with one stand-in stream per user; a writer process (another store, another
connection: bench/durability_pg.py's writer role, the "load") keeps writing meanwhile, and this
script commits the measured changes through a store of its own, one at a time, each after a random
pause (uniform in [0, change_poll_s]: changes come at any moment, not in step with SQLite's polls). The latency is
B's: time.time() when applied minus the time the writing transaction stamped on the change just
before its commit (`Change.ts`; one machine, one clock). Series: profile changes (add_fact), merges,
forgets, on PostgreSQL idle and under load, and on SQLite. Writes bench/results/bench_changes.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.orchestrator_harness import FakeStream, OrchestratorThread, orchestrator_config, wait_until  # noqa: E402

RESULTS = REPO / "bench" / "results"
APPLY_TIMEOUT_S = 30.0  # a change not applied within this is counted as missed
START_TIMEOUT_S = 600.0  # the orchestrator's imports and start at nice 19 on a busy 2-core box


def pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)) * 1000, 2) if xs else float("nan")


def summary(xs: list[float], missed: int) -> dict[str, Any]:
    return {"n": len(xs), "missed": missed, "p50_ms": pct(xs, 50), "p90_ms": pct(xs, 90), "p99_ms": pct(xs, 99),
            "max_ms": round(max(xs) * 1000, 2) if xs else float("nan")}


def measure(cfg: Any, n_changes: int, n_merges: int, n_forgets: int) -> dict[str, list[float]]:
    """Latencies (s) by kind, as orchestrator B applied them, of changes committed by a store of our own."""
    from egomem.memory import open_store
    from egomem.orchestrator.changes import CHANGES

    rng = random.Random(16)
    store = open_store(cfg.memory)
    users = [store.create_user(f"User {i}") for i in range(8)]
    out: dict[str, list[float]] = {"profile": [], "merge": [], "forget": []}
    missed = {"profile": 0, "merge": 0, "forget": 0}
    with OrchestratorThread(cfg) as b:
        wait_until(lambda: b._started.is_set(), START_TIMEOUT_S)  # start() gives up waiting after 60 s
        if b._error:
            raise b._error
        applier = b.app[CHANGES]
        streams = {u.user_id: FakeStream(u.user_id) for u in users}
        for sid, st in streams.items():
            b._loop.call_soon_threadsafe(b.services.add_stream, sid, st)
        wait_until(lambda: len(b.services.streams) == len(streams), 10)

        def one(kind: str, user_id: str, do) -> None:
            """Commit one change (`do`) and wait for B to apply it: told apart from the load's changes by
            kind, user (forget: our store's origin) and a stamp after `do` began."""
            time.sleep(rng.uniform(0, cfg.memory.change_poll_s))  # changes come at random moments, not in phase
            t0 = time.time()

            def applied() -> float | None:
                for change, dt in applier.latencies.copy():
                    if change.ts < t0:
                        continue
                    if kind == "forget" and change.kind in ("forget", "resync") and change.origin in (store.origin, ""):
                        return dt  # SQLite: a forget whose op-log row reused an id arrives as a resync
                    if change.kind == kind and user_id in change.user_ids:
                        return dt
                return None

            do()
            try:
                wait_until(lambda: applied() is not None, APPLY_TIMEOUT_S)
            except TimeoutError:
                missed[kind] += 1
                return
            out[kind].append(applied())

        for i in range(n_changes):
            u = users[i % len(users)]
            one("profile", u.user_id, lambda u=u, i=i: store.add_fact(u.user_id, f"measured fact {i}"))
        for i in range(n_merges):
            keep, drop = store.create_user(f"Keep {i}"), store.create_user(f"Drop {i}")
            one("merge", keep.user_id, lambda k=keep, d=drop: store.merge_users(k.user_id, d.user_id))
        for i in range(n_forgets):
            gone = store.create_user(f"Gone {i}")
            st = FakeStream(gone.user_id)
            b._loop.call_soon_threadsafe(b.services.add_stream, f"gone{i}", st)
            wait_until(lambda i=i: f"gone{i}" in b.services.streams, 10)
            one("forget", gone.user_id, lambda g=gone: store.forget_user(g.user_id))
            wait_until(lambda st=st: st.user_id is None, APPLY_TIMEOUT_S)  # the stream did drop them
            b._loop.call_soon_threadsafe(b.services.drop_stream, f"gone{i}")
    store.close()
    return {"latencies": out, "missed": missed}


def config(run_dir: Path, backend: str, target: str) -> Any:
    from egomem.config import load_config

    cfg = load_config(env={})
    cfg.server.run_dir = run_dir
    cfg = orchestrator_config(cfg, run_dir, identify_models=False, retrieval=False)
    cfg.memory.backend = backend
    if backend == "postgres":
        cfg.memory.dsn = target
    else:
        cfg.memory.database = Path(target)
    return cfg


def load_writers(n: int, dsn: str, run_dir: Path) -> list[subprocess.Popen]:
    """`n` writer processes (durability_pg.py's role) adding facts as fast as they can on their own users."""
    from egomem.memory.postgres import PostgresMemoryStore

    s = PostgresMemoryStore(dsn)
    users = [s.create_user(f"Load {i}").user_id for i in range(n)]
    jobs_user = s.create_user("Load jobs").user_id
    s.close()
    procs = []
    for i, u in enumerate(users):
        cmd = ["nice", "-n", "19", sys.executable, str(REPO / "bench" / "durability_pg.py"), "--role", "writer",
               "--dsn", dsn, "--run-dir", str(run_dir), "--name", f"load{i}", "--user", u, "--jobs-user", jobs_user]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    wait_until(lambda: all((run_dir / f"load{i}.ready").exists() for i in range(n)), 120)
    return procs


def main() -> None:
    import pgserver
    import psycopg

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--changes", type=int, default=150, help="profile changes per series")
    ap.add_argument("--merges", type=int, default=20)
    ap.add_argument("--forgets", type=int, default=20)
    ap.add_argument("--load-writers", type=int, default=2, help="writer processes in the 'under load' series")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_changes.json")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="egomem-bench-changes-"))
    server = pgserver.get_server(str(tmp / "pg"), cleanup_mode="stop")
    series: dict[str, Any] = {}
    try:
        uri = server.get_uri()

        def new_db(name: str) -> str:
            with psycopg.connect(uri, autocommit=True) as c:
                c.execute(f'CREATE DATABASE "{name}"')
            return uri.replace("/postgres?", f"/{name}?", 1)

        runs = [("postgres idle", "postgres", new_db("idle"), 0),
                (f"postgres, {a.load_writers} writer process(es) writing meanwhile", "postgres", new_db("load"), a.load_writers),
                ("sqlite (op-log polling)", "sqlite", str(tmp / "m.db"), 0)]
        for label, backend, target, writers in runs:
            run_dir = tmp / f"run{len(series)}"
            run_dir.mkdir(parents=True)
            cfg = config(run_dir, backend, target)
            procs = load_writers(writers, target, run_dir) if writers else []
            t0 = time.monotonic()
            try:
                r = measure(cfg, a.changes, a.merges, a.forgets)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            series[label] = {kind: summary(xs, r["missed"][kind]) for kind, xs in r["latencies"].items()}
            series[label]["seconds"] = round(time.monotonic() - t0, 1)
            series[label]["poll_s"] = cfg.memory.change_poll_s
            series[label]["_raw_ms"] = {k: [round(x * 1000, 3) for x in xs] for k, xs in r["latencies"].items()}
            print(label, json.dumps({k: v for k, v in series[label].items() if k != "_raw_ms"}), flush=True)
    finally:
        server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)

    result = {
        "what": "time from a change's commit through one store to applied by orchestrator B (streams, identifier, "
                "caches): Change.ts stamped in the writing transaction just before COMMIT, to time.time() after "
                "B applied it",
        "machine": f"{os.cpu_count()} CPU cores shared with other work; every process at nice 19",
        "postgres": "pgserver wheel, PostgreSQL 16 on a Unix socket",
        "command": "nice -n 19 .venv/bin/python bench/bench_changes.py " + " ".join(sys.argv[1:]),
        "series": {k: {kk: vv for kk, vv in v.items() if kk != "_raw_ms"} for k, v in series.items()},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(series, a.out.with_suffix(".png"))


def plot(series: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ["profile", "merge", "forget"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(13, 4), sharey=False)
    for ax, kind in zip(axes, kinds, strict=True):
        for label, s in series.items():
            xs = np.sort(np.asarray(s["_raw_ms"][kind]))
            if len(xs):
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"{label} (p99 {s[kind]['p99_ms']} ms)")
        ax.set_xscale("log")
        ax.set_xlabel("commit -> applied on the other orchestrator (ms)")
        ax.set_title(f"{kind} changes")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("fraction of changes")
    fig.suptitle("EgoMem change feed: propagation between processes (CDF)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
