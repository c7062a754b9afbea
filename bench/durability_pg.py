"""Durability under kill -9 on PostgreSQL (issue #16 point 3): workers, writers and orchestrators
write memory into one PostgreSQL while this script SIGKILLs one of them at a random moment and
restarts it, `--kills` times; then it counts acknowledged writes lost and jobs run twice.

    .venv/bin/python bench/durability_pg.py [--kills 60] [--workers 2] [--writers 2] [--orchestrators 1]

Roles (each a process of its own; killed and restarted by name):
- worker: the memory worker's job loop on the durable queue (`claim_job`: FOR UPDATE SKIP LOCKED, a
  lease renewed by the worker's `LeaseKeeper`, `lease.check()` before the commit as the manager
  does); a job's effect is one `commit_session` (a session and one fact "job <key> ran"), then
  `complete_job`. Only the ML steps of the real manager are left out (a short random sleep stands for
  them, so kills land mid-job).
- writer: `add_fact` in a loop through the store API, and every fourth write `enqueue_job`.
- orchestrator: the real orchestrator process (`python -m egomem.orchestrator`, no Triton models),
  written to by this script over REST (POST /api/users/{id}/facts).
An acknowledged write is one the store (or the REST API) returned; its id goes to an ack file,
appended and fsynced by the process that saw it return, before it counts. At the end: every acked
fact, job and session must be in the store (lost = 0), no job's session committed twice (dup = 0),
and every job done. Writes bench/results/durability_pg.json. The PostgreSQL server (the pgserver
wheel's, default durability: fsync, synchronous_commit on) is never killed: the processes are.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
JOB_KIND = "durability"
ADMIN_TOKEN = "durability-admin-token-0123456789"
HTTP_TIMEOUT_S = 30.0  # one REST write; a lock wait behind a forget may be long on 2 shared cores


class Acks:
    """An append-only file of acknowledged writes: each line is on disk (fsync) before it counts."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._lock = threading.Lock()

    def add(self, **record: Any) -> None:
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        with self._lock:
            os.write(self.fd, line)
            os.fsync(self.fd)


def read_acks(path: Path) -> list[dict[str, Any]]:
    """The ack file's records (a line cut by a kill mid-write is not a record)."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def job_session(job_key: str, user_id: str) -> Any:
    """The session a job commits: one fact, ids derived from the session (a re-run writes nothing new)."""
    from egomem.memory.types import ItemDecision, Provenance, SessionCommit

    sid = f"{JOB_KIND}:{job_key}"
    return SessionCommit(session_id=sid, stream_id=JOB_KIND, chunk_index=0, start_step=0, end_step=1,
                         valid_from=time.time(), provenance=Provenance("durability_worker", "manual", session_id=sid),
                         user_id=user_id, decisions=[ItemDecision("add", "fact", text=f"job {job_key} ran")])


# ------------------------------------------------------------------ roles (child processes)

def role_worker(a: argparse.Namespace) -> None:
    from egomem.memory.postgres import PostgresMemoryStore
    from egomem.memory.worker import LeaseKeeper, LeaseLost

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    store = PostgresMemoryStore(a.dsn, busy_timeout_s=a.busy_timeout_s)
    worker_id = f"{a.name}:{os.getpid()}"
    lease = LeaseKeeper(store, worker_id, a.lease_s)
    acks = Acks(Path(a.run_dir) / f"{a.name}.acks")
    (Path(a.run_dir) / f"{a.name}.ready").touch()
    rng = random.Random()
    while not stop.is_set():
        job = store.claim_job(worker_id, a.lease_s, kinds=[JOB_KIND])
        if job is None:
            stop.wait(0.05)
            continue
        lease.hold(job.job_id)
        try:
            time.sleep(rng.uniform(0, a.work_s))  # the manager's work (trigger, ASR, LLM): a kill lands here too
            lease.check()
            committed = store.commit_session(job_session(job.key, job.payload["user_id"]))
            if committed:
                acks.add(commit=True, job_key=job.key, job_id=job.job_id, worker=worker_id)
            lease.release()
            store.complete_job(job.job_id, worker_id, {"committed": committed})
        except LeaseLost:
            pass
        finally:
            lease.release()
    lease.close()
    store.close()


def role_writer(a: argparse.Namespace) -> None:
    from egomem.memory.postgres import PostgresMemoryStore

    store = PostgresMemoryStore(a.dsn, busy_timeout_s=a.busy_timeout_s)
    acks = Acks(Path(a.run_dir) / f"{a.name}.acks")
    (Path(a.run_dir) / f"{a.name}.ready").touch()
    pid, seq = os.getpid(), 0
    while True:
        seq += 1
        text = f"{a.name} {pid} fact {seq}"
        item_id = store.add_fact(a.user, text)  # returned: acknowledged
        acks.add(fact=item_id, user=a.user, text=text)
        time.sleep(a.write_gap_s)  # a steady load the workers can keep up with (flat out, the queue only grows)
        if seq % a.job_every == 0:
            job = store.enqueue_job(JOB_KIND, f"{a.name}-{pid}-{seq}", {"user_id": a.jobs_user})
            acks.add(job=job.job_id, job_key=job.key)


# ------------------------------------------------------------------ the conductor

@dataclass
class Child:
    name: str
    role: str
    cmd: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    acked_since_start: int = 0  # orchestrators: REST writes acknowledged since this start
    kills: int = 0
    port: int = 0

    def start(self, env: dict[str, str], log: Path) -> None:
        self.proc = subprocess.Popen(["nice", "-n", "19", *self.cmd], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(log, "ab"), start_new_session=True)
        self.started, self.acked_since_start = time.monotonic(), 0

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the nice wrapper has exec'd python: one process
        if self.proc:
            self.proc.wait()


@dataclass
class RestDriver:
    """Writes facts through each orchestrator's REST API from threads; acks what came back 201."""

    children: list[Child]
    user: str
    acks: Acks
    stop: threading.Event = field(default_factory=threading.Event)
    errors: int = 0

    def run(self, child: Child) -> None:
        seq = 0
        while not self.stop.is_set():
            seq += 1
            text = f"rest {child.name} fact {seq}"
            req = urllib.request.Request(
                f"http://127.0.0.1:{child.port}/api/users/{self.user}/facts", method="POST",
                data=json.dumps({"text": text}).encode(),
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
                    if r.status == 201:
                        self.acks.add(fact=json.loads(r.read())["item_id"], user=self.user, text=text)
                        child.acked_since_start += 1
            except (urllib.error.URLError, http.client.HTTPException, TimeoutError, OSError):
                self.errors += 1  # down (killed, restarting; killed mid-answer): not acknowledged
                self.stop.wait(0.2)


def orchestrator_config(run_dir: Path, name: str, dsn: str, port: int) -> Path:
    d = run_dir / name
    d.mkdir(exist_ok=True)
    tokens = d / "tokens.json"
    tokens.write_text(json.dumps({ADMIN_TOKEN: "admin"}))
    path = d / "config.toml"
    path.write_text(f'''[server]
run_dir = "{d}"
[orchestrator]
host = "127.0.0.1"
port = {port}
tokens_file = "{tokens}"
tokens_env = "EGOMEM_DURABILITY_TOKENS_UNSET"
identify_models = false
retrieval = false
[memory]
backend = "postgres"
dsn = "{dsn}"
chunk_dir = "{d / 'chunks'}"
''')
    return path


def verify(dsn: str, run_dir: Path, names: list[str], jobs_user: str) -> dict[str, Any]:
    """Lost acknowledged writes and jobs run twice, read from a fresh store."""
    from egomem.memory.postgres import PostgresMemoryStore

    store = PostgresMemoryStore(dsn)
    records = [r for n in names for r in read_acks(run_dir / f"{n}.acks")]
    facts = [r for r in records if "fact" in r]
    job_acks = [r for r in records if "job" in r]
    commit_acks = [r for r in records if r.get("commit")]
    by_user: dict[str, dict[str, str]] = {}
    lost_facts = 0
    for r in facts:
        if r["user"] not in by_user:  # each user's items read once (not per acknowledged fact)
            by_user[r["user"]] = {i.item_id: i.text for i in store.items(r["user"], history=True)}
        lost_facts += by_user[r["user"]].get(r["fact"]) != r["text"]
    lost_jobs = sum(store.get_job(r["job"]) is None for r in job_acks)
    lost_commits = sum(store.get_session(f"{JOB_KIND}:{r['job_key']}") is None for r in commit_acks)
    keys = [r["job_key"] for r in commit_acks]
    dup_commit_acks = len(keys) - len(set(keys))
    jobs = [j for j in store.list_jobs() if j.kind == JOB_KIND]
    ran = collections.Counter(i.text for i in store.items(jobs_user, history=True))
    dup_effects = sum(ran[f"job {j.key} ran"] > 1 for j in jobs)
    done_without_effect = sum(j.status == "done" and f"job {j.key} ran" not in ran for j in jobs)
    states: dict[str, int] = {}
    for j in jobs:
        states[j.status] = states.get(j.status, 0) + 1
    store.close()
    return {
        "acknowledged": {"facts": len(facts), "jobs_enqueued": len(job_acks), "job_commits": len(commit_acks)},
        "lost": {"facts": lost_facts, "jobs": lost_jobs, "job_commits": lost_commits,
                 "done_jobs_without_their_session": done_without_effect},
        "lost_total": lost_facts + lost_jobs + lost_commits + done_without_effect,
        "run_twice": {"jobs_committed_twice (acks)": dup_commit_acks, "jobs_with_two_effects (store)": dup_effects},
        "dup_total": dup_commit_acks + dup_effects,
        "jobs": {"total": len(jobs), "states": states,
                 "reclaimed_after_a_death (attempts > 1)": sum(j.attempts > 1 for j in jobs)},
    }


def say(line: str) -> None:
    """Progress on stderr (the result JSON goes to --out)."""
    print(time.strftime("%H:%M:%S"), line, file=sys.stderr, flush=True)


def driver_acks(driver: RestDriver) -> int:
    """REST facts acknowledged since each orchestrator's last (re)start (the progress line's figure)."""
    return sum(c.acked_since_start for c in driver.children)


def conduct(a: argparse.Namespace) -> dict[str, Any]:
    import pgserver
    import psycopg

    from egomem.memory.postgres import PostgresMemoryStore
    from egomem.serving.launcher import free_port

    rng = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="egomem-durability-"))
    server = pgserver.get_server(str(tmp / "pg"), cleanup_mode="stop")
    t_start = time.monotonic()
    try:
        uri = server.get_uri()
        with psycopg.connect(uri, autocommit=True) as c:
            c.execute('CREATE DATABASE "durability"')
        dsn = uri.replace("/postgres?", "/durability?", 1)
        run_dir = tmp / "run"
        run_dir.mkdir()
        store = PostgresMemoryStore(dsn)
        jobs_user = store.create_user("Jobs").user_id
        for i in range(a.initial_jobs):
            store.enqueue_job(JOB_KIND, f"initial-{i}", {"user_id": jobs_user})
        me = [sys.executable, str(Path(__file__).resolve()), "--dsn", dsn, "--run-dir", str(run_dir),
              "--lease-s", str(a.lease_s), "--work-s", str(a.work_s), "--jobs-user", jobs_user,
              "--write-gap-s", str(a.write_gap_s), "--job-every", str(a.job_every)]
        children: list[Child] = []
        for i in range(a.workers):
            children.append(Child(f"worker{i}", "worker", [*me, "--role", "worker", "--name", f"worker{i}"]))
        for i in range(a.writers):
            u = store.create_user(f"Writer {i}").user_id
            children.append(Child(f"writer{i}", "writer", [*me, "--role", "writer", "--name", f"writer{i}",
                                                           "--user", u]))
        rest_user = store.create_user("Rest").user_id
        store.close()
        for i in range(a.orchestrators):
            port = free_port()
            cfg = orchestrator_config(run_dir, f"orch{i}", dsn, port)
            children.append(Child(f"orch{i}", "orchestrator", [sys.executable, "-m", "egomem.orchestrator",
                                                               "--config", str(cfg)], port=port))
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        for ch in children:
            ch.start(env, run_dir / f"{ch.name}.log")
        driver = RestDriver([c for c in children if c.role == "orchestrator"], rest_user, Acks(run_dir / "rest.acks"))
        threads = [threading.Thread(target=driver.run, args=(c,), daemon=True) for c in driver.children]
        for t in threads:
            t.start()
        kills: list[dict[str, Any]] = []
        roles = sorted({c.role for c in children})
        while len(kills) < a.kills:
            time.sleep(rng.uniform(a.min_gap_s, a.max_gap_s))
            # each role in turn (a random process of it, at a random moment), else any: a role still
            # restarting (an orchestrator's imports take a minute on a busy 2-core box) does not stall the run
            ready = [c for c in children if c.proc.poll() is None and time.monotonic() - c.started >= a.min_age_s
                     and (c.role != "orchestrator" or c.acked_since_start > 0)  # serving: writes under way
                     and (c.role == "orchestrator" or (run_dir / f"{c.name}.ready").exists())]
            role = roles[len(kills) % len(roles)]
            ready = [c for c in ready if c.role == role] or ready
            if not ready:
                continue
            victim = rng.choice(ready)
            victim.kill()
            victim.kills += 1
            kills.append({"role": victim.role, "name": victim.name, "t": round(time.monotonic() - t_start, 2)})
            say(f"kill {len(kills)}/{a.kills}: {victim.name} ({driver_acks(driver)} REST facts acked since the "
                "orchestrators last started)")
            (run_dir / f"{victim.name}.ready").unlink(missing_ok=True)
            victim.start(env, run_dir / f"{victim.name}.log")
        driver.stop.set()
        say("kills done: writers and orchestrators stop; the workers drain the queue")
        for c in children:  # writers and orchestrators stop writing; workers drain the queue
            if c.role != "worker":
                c.kill()
        for t in threads:
            t.join(HTTP_TIMEOUT_S + 5)
        from egomem.memory.postgres import PostgresMemoryStore as Store

        s = Store(dsn)
        deadline = time.monotonic() + a.drain_s
        while time.monotonic() < deadline and any(j.status in ("queued", "running") for j in s.list_jobs()):
            time.sleep(0.5)
        s.close()
        for c in children:
            if c.role == "worker":
                c.proc.send_signal(signal.SIGTERM)
                try:
                    c.proc.wait(30)
                except subprocess.TimeoutExpired:
                    c.kill()
        say("verifying against the store")
        result = verify(dsn, run_dir, [c.name for c in children] + ["rest"], jobs_user)
        by_role: dict[str, int] = {}
        for k in kills:
            by_role[k["role"]] = by_role.get(k["role"], 0) + 1
        result.update({
            "kills": len(kills), "kills_by_role": by_role, "seconds": round(time.monotonic() - t_start, 1),
            "rest_errors_while_down": driver.errors,
            "setup": {"workers": a.workers, "writers": a.writers, "orchestrators": a.orchestrators,
                      "lease_s": a.lease_s, "work_s": a.work_s, "gap_s": [a.min_gap_s, a.max_gap_s],
                      "write_gap_s": a.write_gap_s, "job_every": a.job_every,
                      "initial_jobs": a.initial_jobs, "seed": a.seed,
                      "postgres": "pgserver wheel, PostgreSQL 16, default durability (fsync on, synchronous_commit on)",
                      "machine": f"{os.cpu_count()} CPU cores, the killed processes at nice 19"},
            "command": ".venv/bin/python bench/durability_pg.py " + " ".join(sys.argv[1:]),
        })
        return result
    finally:
        for c in locals().get("children", []):
            c.kill()
        server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["conduct", "worker", "writer"], default="conduct")
    ap.add_argument("--kills", type=int, default=60, help="SIGKILLs in all (each role in turn)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--orchestrators", type=int, default=1)
    ap.add_argument("--initial-jobs", type=int, default=40)
    ap.add_argument("--lease-s", type=float, default=3.0, help="job lease: a killed worker's job is retaken after it")
    ap.add_argument("--work-s", type=float, default=0.3, help="a job's simulated work, uniform in [0, this]")
    ap.add_argument("--write-gap-s", type=float, default=0.02, help="a writer's pause between two facts")
    ap.add_argument("--job-every", type=int, default=8, help="a writer enqueues a job every this many facts")
    ap.add_argument("--min-gap-s", type=float, default=0.5)
    ap.add_argument("--max-gap-s", type=float, default=2.0)
    ap.add_argument("--min-age-s", type=float, default=1.0, help="a process is killed only after it ran this long")
    ap.add_argument("--drain-s", type=float, default=180.0, help="at the end, how long the workers get to finish")
    ap.add_argument("--busy-timeout-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--out", type=Path, default=RESULTS / "durability_pg.json")
    # the children's arguments
    ap.add_argument("--dsn", default="")
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--name", default="")
    ap.add_argument("--user", default="")
    ap.add_argument("--jobs-user", default="")
    a = ap.parse_args(argv)
    if a.role == "worker":
        return role_worker(a)
    if a.role == "writer":
        return role_writer(a)
    result = conduct(a)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if result["lost_total"] or result["dup_total"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
