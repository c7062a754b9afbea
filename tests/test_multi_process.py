"""Many processes, one memory (issue #16 point 3): the store's change feed carries forgets, merges and
profile changes to every process (PostgreSQL LISTEN/NOTIFY, SQLite op-log polling); two orchestrators
and two worker processes on one PostgreSQL: a forget through one orchestrator reaches a stream on
the other, and concurrent jobs each run once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from egomem.memory.changes import Change
from egomem.memory.errors import StoreError

REPO = Path(__file__).resolve().parents[1]
BOUND_S = 5.0  # a change must reach the other process within this (measured: tens of ms on PostgreSQL)


class Collector:
    """Changes from a feed, with a wait for one that matches."""

    def __init__(self) -> None:
        self.changes: list[Change] = []
        self._cond = threading.Condition()

    def __call__(self, change: Change) -> None:
        with self._cond:
            self.changes.append(change)
            self._cond.notify_all()

    def wait(self, pred, timeout: float = BOUND_S) -> Change:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for c in self.changes:
                    if pred(c):
                        return c
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching change within {timeout} s; saw {self.changes}")
                self._cond.wait(left)


def test_the_change_feed_reports_what_another_store_commits(backend):
    """A second store object on the same database (another process's view) follows the first's
    profile changes, merges and forgets; a forget's change names no one."""
    writer, reader = backend.open(), backend.open()
    seen = Collector()
    feed = reader.change_feed(seen, poll_s=0.1)
    try:
        assert feed.ready.wait(10)
        ann, max_, bob = writer.create_user("Ann"), writer.create_user("Max"), writer.create_user("Bob")
        writer.add_fact(ann.user_id, "likes tennis")
        seen.wait(lambda c: c.kind == "profile" and ann.user_id in c.user_ids)
        writer.merge_users(ann.user_id, bob.user_id)
        seen.wait(lambda c: c.kind == "merge" and c.user_ids == (ann.user_id, bob.user_id))
        writer.forget_user(max_.user_id)
        forget = seen.wait(lambda c: c.kind == "forget")
        assert forget.user_ids == ()
        assert max_.user_id not in json.dumps([c.payload() for c in seen.changes if c.kind == "forget"])
        if backend.name == "postgres":
            assert forget.origin == writer.origin and forget.origin != reader.origin
        # the newest op-log row is the one forget deletes (before SQLite schema v5 its id came back)
        eve = writer.create_user("Eve")
        writer.rename_user(eve.user_id, "Eve Lin")
        seen.wait(lambda c: c.kind == "profile" and eve.user_id in c.user_ids)
        n = len(seen.changes)
        writer.forget_user(eve.user_id)
        seen.wait(lambda c: c.kind == "forget" and seen.changes.index(c) >= n)
        writer.add_fact(ann.user_id, "after the forget")  # and the feed goes on after it
        seen.wait(lambda c: c.kind == "profile" and ann.user_id in c.user_ids and seen.changes.index(c) > n)
    finally:
        feed.close()
        writer.close()
        reader.close()


def test_a_rolled_back_write_announces_nothing(backend):
    """A change is announced only when its transaction commits (PostgreSQL: NOTIFY is transactional;
    SQLite: the op-log row goes with the rollback)."""
    writer, reader = backend.open(), backend.open()
    seen = Collector()
    feed = reader.change_feed(seen, poll_s=0.1)
    try:
        assert feed.ready.wait(10)
        ann, doomed = writer.create_user("Ann"), writer.create_user("Doomed")

        def crash(c):  # the write's NOTIFY has been sent by now; the transaction then rolls back
            raise StoreError("crash before commit")

        writer._before_commit = crash
        with pytest.raises(StoreError):
            writer.add_fact(doomed.user_id, "never committed")
        del writer._before_commit
        writer.add_fact(ann.user_id, "marker")
        seen.wait(lambda c: c.kind == "profile" and ann.user_id in c.user_ids)
        assert writer.items(doomed.user_id) == []
        assert not [c for c in seen.changes if doomed.user_id in c.user_ids], seen.changes
    finally:
        feed.close()
        writer.close()
        reader.close()


def _worker(dsn: str, run_dir: Path, name: str) -> subprocess.Popen:
    """A durability worker process (bench/durability_pg.py --role worker) on the store at `dsn`."""
    cmd = ["nice", "-n", "19", sys.executable, str(REPO / "bench" / "durability_pg.py"), "--role", "worker",
           "--dsn", dsn, "--run-dir", str(run_dir), "--name", name, "--lease-s", "3", "--work-s", "0.05"]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.DEVNULL, stderr=open(run_dir / f"{name}.err", "wb"))


def test_two_orchestrators_and_two_workers_on_one_postgres(tmp_path, pg_server):
    """Orchestrators A and B (each its own store, change feed and port) and workers W1, W2 (processes)
    share one PostgreSQL. A forget through A's REST API reaches B's stream of the forgotten user (dropped)
    and B's other stream (profile reloaded, redacted); a merge and a fact added through A reach B's
    streams too (the dropped user's stream goes on as the kept one). Meanwhile the two workers take 40
    jobs concurrently: every job is done and its session committed exactly once."""
    from egomem.client import EgoMemClient
    from egomem.memory import open_store
    from tests.conftest import test_config
    from tests.memory_helpers import StoreBackend
    from tests.orchestrator_harness import (
        ADMIN_TOKEN,
        FakeStream,
        OrchestratorThread,
        orchestrator_config,
        run,
        wait_until,
    )

    db = StoreBackend("postgres", tmp_path, pg_server, prefix=f"mp{os.getpid()}")
    try:
        cfgs = []
        for name in ("a", "b"):
            d = tmp_path / name
            d.mkdir()
            cfg = db.configure(orchestrator_config(test_config(d), d, identify_models=False, retrieval=False))
            cfgs.append(cfg)
        store = open_store(cfgs[0].memory)
        max_, ann, bob, zed, jobber = (store.create_user(n) for n in ("Max Moe", "Ann Lee", "Bob", "Zed", "Jobs"))
        store.add_fact(ann.user_id, "works with Max Moe on radar")
        workers = [_worker(cfgs[0].memory.dsn, tmp_path, f"w{i}") for i in (1, 2)]
        with OrchestratorThread(cfgs[0]) as a, OrchestratorThread(cfgs[1]) as b:
            streams = {n: FakeStream(u.user_id) for n, u in (("max", max_), ("ann", ann), ("bob", bob), ("zed", zed))}
            for sid, st in streams.items():
                b._loop.call_soon_threadsafe(b.services.add_stream, sid, st)
            wait_until(lambda: len(b.services.streams) == 4, 5)
            wait_until(lambda: all((tmp_path / f"w{i}.ready").exists() for i in (1, 2)), 120)
            jobs = [store.enqueue_job("durability", f"job-{i}", {"user_id": jobber.user_id}) for i in range(40)]

            async def admin(*calls):
                async with EgoMemClient(a.url, ADMIN_TOKEN) as c:
                    return [await getattr(c, name)(*args) for name, *args in calls]

            (res,) = run(admin(("forget", max_.user_id)))
            assert res["verified_leftovers"] == [], res
            wait_until(lambda: ("forget_user", max_.user_id) in [c[:2] for c in streams["max"].calls], BOUND_S)
            wait_until(lambda: ("refresh_profile", ann.user_id) in [c[:2] for c in streams["ann"].calls], BOUND_S)
            assert streams["max"].user_id is None and streams["ann"].user_id == ann.user_id
            assert "Max" not in store.render_profile(ann.user_id)  # what B's stream reloads is redacted

            n_ann = len(streams["ann"].calls)
            run(admin(("merge", zed.user_id, bob.user_id), ("add_fact", ann.user_id, "plays chess")))
            wait_until(lambda: streams["bob"].user_id == zed.user_id, BOUND_S)  # Bob's stream goes on as Zed
            wait_until(lambda: ("refresh_profile", zed.user_id) in [c[:2] for c in streams["zed"].calls], BOUND_S)
            wait_until(lambda: len(streams["ann"].calls) > n_ann, BOUND_S)  # Ann's new fact reloads her profile
            metrics = b.services.metrics
            assert metrics.get("egomem_changes_applied_total") >= 3
            assert metrics.get("egomem_change_propagation_seconds") >= 3

            wait_until(lambda: all(store.get_job(j.job_id).status == "done" for j in jobs), 120)
        for w in workers:
            w.terminate()
            w.wait(30)
        done = [store.get_job(j.job_id) for j in jobs]
        by_worker: dict[str, int] = {}
        for j in done:
            name = j.worker.split(":")[0]
            by_worker[name] = by_worker.get(name, 0) + 1
        assert set(by_worker) == {"w1", "w2"}, by_worker  # both took jobs, concurrently
        commits: list[str] = []
        for i in (1, 2):
            commits += [json.loads(line)["job_key"] for line in (tmp_path / f"w{i}.acks").read_text().splitlines()
                        if '"commit"' in line]
        assert sorted(commits) == sorted(j.key for j in jobs)  # each job's effect committed exactly once
        texts = [it.text for it in store.items(jobber.user_id, history=True)]
        assert all(texts.count(f"job job-{i} ran") == 1 for i in range(40))
        store.close()
    finally:
        db.drop()
