"""What the two-phase forget costs (orchestrator/forgets.py): `DELETE /api/users/{id}` through orchestrator A
while orchestrator B shares the store, on PostgreSQL and on SQLite. Per forget: the whole REST call, and
`ack_wait_s` (A's wait for B to read the person's names and keys, redact its recordings and acknowledge);
beside it the same forgets with A alone (nobody else to wait for).

    .venv/bin/python bench/bench_forget.py [--forgets 20] [--users 200]

Each orchestrator is the real app (served in a thread, no Triton models); B holds one open stand-in
stream with a recorder, as a live chat's. Every user has a face and a voice key, so each forget reads
and redacts with real key sets. Writes bench/results/bench_forget.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.orchestrator_harness import (  # noqa: E402
    ADMIN_TOKEN,
    FakeStream,
    OrchestratorThread,
    orchestrator_config,
    wait_until,
)

RESULTS = REPO / "bench" / "results"


def pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)) * 1000, 1)


def configs(root: Path, n: int, memory: dict[str, Any]) -> list[Any]:
    from tests.conftest import test_config

    out = []
    for i in range(n):
        d = root / f"orch{i}"
        d.mkdir(parents=True)
        cfg = orchestrator_config(test_config(d), d, identify_models=False, retrieval=False)
        for k, v in memory.items():
            setattr(cfg.memory, k, v)
        out.append(cfg)
    return out


def run_series(cfgs: list[Any], forgets: int, users: int) -> dict[str, Any]:
    """`forgets` REST forgets through the first orchestrator while the others run; latencies in ms."""
    from egomem.client import EgoMemClient
    from egomem.memory import open_store
    from egomem.orchestrator.recording import Recorder

    rng = np.random.default_rng(16)
    store = open_store(cfgs[0].memory)
    ids = []
    for i in range(users):
        u = store.create_user(f"Person {i:04d}")
        for modality, dim in (("face", 128), ("voice", 256)):
            v = rng.standard_normal(dim).astype(np.float32)
            store.add_key(u.user_id, modality, f"bench-{modality}", v / np.linalg.norm(v))
        ids.append(u.user_id)
    total, waits = [], []
    with OrchestratorThread(cfgs[0]) as a:
        others = [OrchestratorThread(c).start() for c in cfgs[1:]]
        try:
            for o in others:  # a live chat's recorder on each other orchestrator
                st = FakeStream(ids[-1])
                st.recorder = Recorder("bench", record_audio=False, redactor=o.services.forgets)
                o._loop.call_soon_threadsafe(o.services.add_stream, "bench", st)
            origins = {o.services.store.origin for o in [a, *others]}
            wait_until(lambda: origins <= {r.origin for r in store.live_orchestrators(60)}, 30)

            async def go() -> None:
                async with EgoMemClient(a.url, ADMIN_TOKEN) as c:
                    for user_id in ids[:forgets]:
                        t0 = time.perf_counter()
                        res = await c.forget(user_id)
                        total.append(time.perf_counter() - t0)
                        waits.append(res["ack_wait_s"])
                        assert res["unacknowledged"] == [] and res["verified_leftovers"] == [], res

            asyncio.run(go())
        finally:
            for o in others:
                o._loop.call_soon_threadsafe(o.services.drop_stream, "bench")
                o.stop()
    store.close()
    return {"orchestrators": len(cfgs), "forgets": len(total), "users": users,
            "forget_ms": {"p50": pct(total, 50), "p90": pct(total, 90), "max": pct(total, 100)},
            "ack_wait_ms": {"p50": pct(waits, 50), "p90": pct(waits, 90), "max": pct(waits, 100)},
            "other_orchestrators_acknowledging_each_forget": len(cfgs) - 1}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{r['backend']}, {r['orchestrators']} orch.", r) for r in result["series"]]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    y = np.arange(len(rows))
    ax.barh(y - 0.2, [r["forget_ms"]["p50"] for _, r in rows], 0.4, label="forget (REST call) p50")
    ax.barh(y + 0.2, [r["ack_wait_ms"]["p50"] for _, r in rows], 0.4, label="of which: waiting for acks p50")
    ax.set_yticks(y, [name for name, _ in rows])
    ax.set_xlabel("ms")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("DELETE /api/users/{id}: one orchestrator alone vs two sharing the store")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forgets", type=int, default=20)
    ap.add_argument("--users", type=int, default=200)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_forget.json")
    a = ap.parse_args(argv)

    import pgserver
    import psycopg

    tmp = Path(tempfile.mkdtemp(prefix="egomem-bench-forget-"))
    server = pgserver.get_server(str(tmp / "pg"), cleanup_mode="stop")
    series = []
    try:
        uri = server.get_uri()
        for backend in ("postgres", "sqlite"):
            for n in (1, 2):
                root = tmp / f"{backend}{n}"
                if backend == "postgres":
                    with psycopg.connect(uri, autocommit=True) as c:
                        c.execute(f'CREATE DATABASE "forget{n}"')
                    memory = {"backend": "postgres", "dsn": uri.replace("/postgres?", f"/forget{n}?", 1)}
                else:
                    memory = {"database": root / "memory.sqlite3"}
                r = run_series(configs(root, n, memory), a.forgets, a.users)
                series.append({"backend": backend, **r})
                print(json.dumps(series[-1]), file=sys.stderr, flush=True)
    finally:
        server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"series": series, "machine": f"{os.cpu_count()} CPU cores",
              "command": ".venv/bin/python bench/bench_forget.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    plot(result, a.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
