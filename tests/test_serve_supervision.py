"""`egomem serve` keeps its processes up and leaves none behind; job leases of dead workers come back fast.

One real `egomem serve` (tritonserver + orchestrator + memory worker process) is shared by the
tests in order: its files are private, a SIGKILLed tritonserver / worker / orchestrator is
restarted (a live stream closes with 1011, a new one works once Triton is back), and a SIGKILLed
serve takes its children with it so a new serve starts on the same ports. Separately, two real
worker processes on one SQLite store: the lease of a worker stuck in a long step stays held while
it lives, and its job is taken over within ~2 leases once it is SIGKILLed; a worker whose lease
was taken over commits nothing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from egomem import protocol as P
from egomem.client import EgoMemClient, stream_audio
from egomem.config import load_config, to_toml
from egomem.memory.chunk import StreamChunk, submit_chunk
from egomem.memory.segment import spans_to_labels
from egomem.memory.sqlite import SQLiteMemoryStore
from egomem.memory.worker import build_manager, process_next_job
from egomem.serving.launcher import LaunchError, free_ports, process_start_time
from egomem.stack import PID_FILE, Stack
from tests.conftest import test_config
from tests.orchestrator_harness import run, tone

EGOMEM = str(Path(sys.executable).parent / "egomem")
MODELS = "mimi_codec,dialog_lm"


# -- helpers ---------------------------------------------------------------------------------------
def alive(pid: int) -> bool:
    """A live (non-zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def group_members(pgid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            f = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if f[0] != "Z" and int(f[2]) == pgid:
            out.append(int(stat.parent.name))
    return out


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def wait_until(pred, timeout: float, what: str, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


class Serve:
    """One `egomem serve` subprocess and what its pid file says."""

    def __init__(self, cfg, config_path: Path, args: tuple[str, ...] = ("--models", MODELS)):
        self.cfg, self.config_path, self.args = cfg, config_path, args
        self.run_dir = Path(cfg.server.run_dir)
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []

    def start(self, timeout: float = 300) -> Serve:
        argv = [EGOMEM, "serve", "--config", str(self.config_path), *self.args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("ready:"):
                break
            assert time.monotonic() < deadline, "".join(self.lines)
        else:
            pytest.fail("egomem serve exited before it was ready:\n" + "".join(self.lines))
        threading.Thread(target=self._drain, daemon=True).start()  # keep its pipe from filling
        return self

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def children(self) -> dict[str, int]:
        data = json.loads((self.run_dir / PID_FILE).read_text())
        assert data["serve"]["pid"] == self.proc.pid
        return {name: e["pid"] for name, e in data["children"].items()}

    def child(self, name: str) -> int:
        return self.children()[name]

    def new_child(self, name: str, old: int, timeout: float) -> int:
        """The pid of `name` once serve has replaced `old` with a live one."""
        def fresh():
            try:
                pid = self.child(name)
            except (OSError, ValueError, KeyError):
                return None
            return pid if pid != old and alive(pid) else None

        return wait_until(fresh, timeout, f"a new {name} (serve output:\n{''.join(self.lines[-20:])})")

    @property
    def tokens(self) -> dict[str, str]:
        return {scope: tok for tok, scope in json.loads((self.run_dir / "tokens.json").read_text()).items()}

    @property
    def url(self) -> str:
        return f"http://{self.cfg.orchestrator.host}:{self.cfg.orchestrator.port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_sup")
    cfg = test_config(d / "run", mimi={"max_streams": 2}, dialog={"max_streams": 2}, orchestrator={"max_streams": 2})
    oc = cfg.orchestrator
    oc.identify_models, oc.retrieval, oc.triton_timeout_s = False, False, 3.0
    cfg.memory.chunk_dir = d / "run" / "chunks"
    cfg.memory.extractor = "rules"
    cfg.server.restart_backoff_s = 0.5
    path = d / "serve.toml"
    path.write_text(to_toml(cfg))
    s = Serve(cfg, path).start()
    try:
        yield s
    finally:
        s.stop()
        for pid in s.children().values() if (s.run_dir / PID_FILE).exists() else []:
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)


# -- one served stack ------------------------------------------------------------------------------
def test_logs_run_folders_and_pid_file_are_owner_only(serve):
    run_dir = serve.run_dir
    assert mode(run_dir) == 0o700 and mode(Path(serve.cfg.memory.chunk_dir)) == 0o700
    wait_until(lambda: (run_dir / "worker.log").exists(), 30, "worker.log")
    for name in ("tritonserver.log", "orchestrator.log", "worker.log", "tokens.json", PID_FILE, "egomem.resolved.toml"):
        assert mode(run_dir / name) == 0o600, f"{name} is {oct(mode(run_dir / name))}"
    assert mode(Path(serve.cfg.memory.database)) == 0o600  # made by the children, under their umask 077
    kids = serve.children()
    assert set(kids) == {"tritonserver", "orchestrator", "worker"} and all(alive(p) for p in kids.values())


def test_a_killed_tritonserver_is_restarted_and_new_chats_work(serve):
    triton_pid, orch_pid = serve.child("tritonserver"), serve.child("orchestrator")
    tokens = serve.tokens

    async def killed_under_a_stream():
        async with EgoMemClient(serve.url, tokens["stream"]) as c:
            chat = await c.open_chat(handshake_timeout=60)
            await chat.wait_for(lambda s: s.audio_chunks, 60)  # it ticks
            os.kill(triton_pid, signal.SIGKILL)
            await chat.wait_for(lambda s: s.closed, 60)
            return chat

    chat = run(killed_under_a_stream())
    assert chat.close_code == P.CLOSE_INTERNAL and any("unavailable" in e for e in chat.errors), chat.errors
    new_pid = serve.new_child("tritonserver", triton_pid, 240)  # in the pid file once it is ready
    back_at = time.monotonic()
    assert serve.proc.poll() is None and not group_members(triton_pid)  # the old server's stubs are gone too

    async def back():
        async with EgoMemClient(serve.url, tokens["admin"]) as c:
            await c.wait_ready(120)
            ready_after = time.monotonic() - back_at
            async with c.chat(handshake_timeout=60) as chat:
                await stream_audio(chat, tone(0.4))
                await chat.wait_for(lambda s: len(s.audio_chunks) >= 2, 60)
                return chat.errors, ready_after

    errors, ready_after = run(back())
    print(f"orchestrator ready {ready_after:.1f} s after tritonserver was back")
    assert errors == []
    # the orchestrator's gRPC channel reconnects within its capped backoff (2 s), not gRPC's default (up to 120 s)
    assert ready_after < 8.0, f"the orchestrator saw Triton ready {ready_after:.1f} s after it was back"
    assert serve.child("tritonserver") == new_pid and serve.child("orchestrator") == orch_pid
    assert "tritonserver exited" in "".join(serve.lines)  # logged, with the reason


def test_a_killed_worker_and_orchestrator_are_restarted(serve):
    worker = serve.child("worker")
    os.kill(worker, signal.SIGKILL)
    serve.new_child("worker", worker, 60)
    orch = serve.child("orchestrator")
    os.kill(orch, signal.SIGKILL)
    serve.new_child("orchestrator", orch, 120)

    async def health():
        async with EgoMemClient(serve.url, serve.tokens["admin"]) as c:
            await c.wait_ready(60)
            return await c.health()

    assert run(health())["status"] == "ok"
    assert serve.proc.poll() is None


def test_a_killed_serve_leaves_no_process_and_a_new_one_starts_on_the_same_ports(serve):
    kids = serve.children()
    os.kill(serve.proc.pid, signal.SIGKILL)
    serve.proc.wait(30)

    def all_gone():
        return not any(alive(p) or group_members(p) for p in kids.values())

    wait_until(all_gone, 60, f"the children {kids} of the killed serve to exit")
    again = Serve(serve.cfg, serve.config_path).start()  # same config: same ports, same run folder
    try:
        assert set(again.children()) == {"tritonserver", "orchestrator", "worker"}
    finally:
        again.stop()
        assert again.proc.returncode == 0, "".join(again.lines[-30:])
        serve.proc = None  # nothing left for the fixture to stop


# -- one part per machine ---------------------------------------------------------------------------
def test_serve_parts_runs_an_orchestrator_alone_on_a_remote_triton(triton, tmp_path):
    """`egomem serve --parts orchestrator`: no tritonserver of its own; its streams run on the Triton
    named in server.triton_urls (here the session's, as another machine's would be)."""
    for m in MODELS.split(","):
        triton.load(m)
    cfg = test_config(tmp_path / "run", mimi={"max_streams": 2}, dialog={"max_streams": 2},
                      orchestrator={"max_streams": 2})
    oc = cfg.orchestrator
    oc.identify_models, oc.retrieval = False, False
    cfg.server.triton_urls = [triton.grpc_url]
    cfg.memory.chunk_dir = tmp_path / "run" / "chunks"
    path = tmp_path / "serve.toml"
    path.write_text(to_toml(cfg))
    bad = subprocess.run([EGOMEM, "serve", "--config", str(path), "--parts", "triton,gpu"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "choose among triton, orchestrator, worker" in bad.stderr
    s = Serve(cfg, path, ("--parts", "orchestrator")).start()
    try:
        assert set(s.children()) == {"orchestrator"}  # no tritonserver, no worker here

        async def chat():
            async with EgoMemClient(s.url, s.tokens["stream"]) as c, c.chat(handshake_timeout=60) as ch:
                await stream_audio(ch, tone(0.4))
                await ch.wait_for(lambda x: len(x.audio_chunks) >= 2, 60)
                return (await ch.wait_event("stream_open"))["replica"], ch.errors

        replica, errors = run(chat())
        assert replica == 0 and errors == []
    finally:
        s.stop()
    assert s.proc.returncode == 0, "".join(s.lines[-30:])


# -- strays and ports, without servers ----------------------------------------------------------------
def test_a_new_stack_stops_the_strays_of_a_dead_serve_and_names_a_port_holder(tmp_path):
    cfg = test_config(tmp_path / "run")
    run_dir = Path(cfg.server.run_dir)
    run_dir.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        (run_dir / PID_FILE).write_text(json.dumps({
            "serve": {"pid": dead.pid, "start": 1},
            "children": {"orchestrator": {"pid": stray.pid, "start": process_start_time(stray.pid)}}}))
        Stack(cfg).stop_stale()
        assert stray.wait(30) is not None and not (run_dir / PID_FILE).exists()
    finally:
        if stray.poll() is None:
            stray.kill()

    # a live serve on the same run folder: refused, by pid
    live = {"pid": os.getppid(), "start": process_start_time(os.getppid())}
    (run_dir / PID_FILE).write_text(json.dumps({"serve": live, "children": {}}))
    with pytest.raises(LaunchError, match=rf"another egomem serve \(pid {os.getppid()}\)"):
        Stack(cfg).stop_stale()
    (run_dir / PID_FILE).unlink()

    with socket.socket() as holder:  # the orchestrator's port held by someone else: say who
        holder.bind((cfg.orchestrator.host, 0))
        holder.listen()
        cfg.orchestrator.port = holder.getsockname()[1]
        with pytest.raises(LaunchError, match=rf"orchestrator.port\) is in use by pid {os.getpid()} "):
            Stack(cfg).start()


# -- job leases ------------------------------------------------------------------------------------
T = 160  # steps (12.8 s)

_WORKER = """
import os, sys, threading, time
from pathlib import Path
from egomem.config import load_config
from egomem.memory.worker import run_worker

db, chunks, lease, stuck_marker = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]

class ColumnLabeler:  # the trigger's test double: labels are written in the text column
    def label(self, tokens):
        return tokens[:, 0] % 4

class StuckLabeler(ColumnLabeler):  # a step far longer than the lease (a slow LLM, a long chunk)
    def label(self, tokens):
        Path(stuck_marker).write_text(str(os.getpid()))
        time.sleep(3600)

cfg = load_config(env={})
cfg.memory.database, cfg.memory.chunk_dir, cfg.memory.extractor = Path(db), Path(chunks), "rules"
cfg.memory.job_lease_s, cfg.memory.worker_poll_s, cfg.trigger.identity_split = lease, 0.1, False
run_worker(cfg, threading.Event(), labeler=StuckLabeler() if stuck_marker != "-" else ColumnLabeler(),
           worker_id=f"w:{os.getpid()}")
"""


def _chunk(index: int = 0) -> StreamChunk:
    tokens = np.random.default_rng(index).integers(0, 2048, size=(T, 17))
    tokens[:, 0] = spans_to_labels([(10, 60)], T)
    return StreamChunk("cam", index, 1000.0, tokens, client_transcript=[(12, "Hi, my name is Zelda. I live in Oslo.")])


def test_a_stuck_worker_keeps_its_lease_and_a_killed_one_loses_it_within_two_leases(tmp_path):
    lease = 2.0
    db, chunks = tmp_path / "memory.sqlite3", tmp_path / "chunks"
    store = SQLiteMemoryStore(db)
    job = submit_chunk(store, chunks, _chunk())
    marker = tmp_path / "stuck"
    args = [str(db), str(chunks), str(lease)]
    stuck = subprocess.Popen([sys.executable, "-c", _WORKER, *args, str(marker)])
    other = None
    try:
        wait_until(marker.exists, 120, "the first worker to take the job")
        assert store.get_job(job.job_id).worker == f"w:{stuck.pid}"
        other = subprocess.Popen([sys.executable, "-c", _WORKER, *args, "-"])
        time.sleep(4 * lease)  # the stuck worker lives: its thread renews the lease, nobody else runs the job
        j = store.get_job(job.job_id)
        assert (j.status, j.worker, j.attempts) == ("running", f"w:{stuck.pid}", 1)
        assert other.poll() is None

        os.kill(stuck.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: store.get_job(job.job_id).worker == f"w:{other.pid}", 3 * lease + 30,
                   "the other worker to take the job over")
        taken_after = time.monotonic() - killed
        done = wait_until(lambda: (j := store.get_job(job.job_id)).status == "done" and j, 60, "the job to finish")
    finally:
        for p in (stuck, other):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
    assert taken_after < 2 * lease + 1.0, f"the job was taken over {taken_after:.1f} s after its worker died"
    assert done.attempts == 2 and [s["status"] for s in done.result["sessions"]] == ["committed"]
    assert len(store.list_sessions()) == 1
    store.close()


def test_a_worker_whose_lease_was_taken_over_commits_nothing(tmp_path):
    cfg = load_config(env={})
    cfg.memory.database, cfg.memory.chunk_dir = tmp_path / "m.sqlite3", tmp_path / "chunks"
    cfg.memory.extractor = "rules"
    cfg.memory.job_lease_s, cfg.trigger.identity_split = 60.0, False
    store = SQLiteMemoryStore(cfg.memory.database)
    job = submit_chunk(store, cfg.memory.chunk_dir, _chunk())
    labelling, go = threading.Event(), threading.Event()

    class PausedLabeler:  # the worker stalls here (a paused VM, a stopped process) until the test says go
        def label(self, tokens):
            labelling.set()
            go.wait(60)
            return tokens[:, 0] % 4

    manager = build_manager(cfg, store, labeler=PausedLabeler())
    out: list = []
    t = threading.Thread(target=lambda: out.append(process_next_job(manager, cfg, "slow")))
    t.start()
    assert labelling.wait(60)
    # meanwhile its lease ran out and another worker claimed the job
    with sqlite3.connect(cfg.memory.database) as c:
        c.execute("UPDATE jobs SET worker = 'thief', attempts = 2 WHERE job_id = ?", (job.job_id,))
    go.set()
    t.join(60)
    j = out[0]
    assert (j.status, j.worker, j.attempts, j.error) == ("running", "thief", 2, None)  # untouched: the thief's
    assert store.list_sessions() == [] and store.list_users() == []  # the stale worker committed nothing
    store.close()


def test_free_ports_are_distinct_and_free():
    """A config's ports are taken in one call: distinct by construction, each one bindable afterwards."""
    ports = free_ports(32)
    assert len(set(ports)) == 32
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
