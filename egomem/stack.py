"""The whole product in one object: tritonserver + the orchestrator + the memory worker.

`egomem serve` and `egomem demo` use it. The orchestrator runs as its own process
(`python -m egomem.orchestrator`, log in <run_dir>/orchestrator.log) so `egomem` never imports it;
the memory worker too (`python -m egomem.memory.worker`, log in <run_dir>/worker.log), except when
the caller hands in a labeler object (the demo): then it runs in a thread of this process. Several
workers on one store are safe, so more can be started with `python -m egomem.memory.worker`.

Supervision (`supervise()`, called every second by `egomem serve`): a child that dies is restarted
(tritonserver on the same ports with the same models), at most `server.max_restarts` times per
child within `server.restart_window_s`, after a backoff that doubles. Children started from the
main thread die with this process however it dies (PR_SET_PDEATHSIG), and <run_dir>/serve.pid
names them, so a new Stack on the same run folder stops the strays of a killed one before it
binds its ports (or says which process holds a port). Logs and run folders are owner-only.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from egomem.config import Config, to_toml
from egomem.serving.launcher import (
    LaunchError,
    TritonServer,
    group_alive,
    open_private_log,
    port_owner,
    private_dir,
    process_start_time,
    start_child,
    write_private,
)

log = logging.getLogger(__name__)
SERVICE_MODELS = ["mimi_codec", "dialog_lm", "face_encoder", "speaker_encoder", "text_encoder"]
SCOPES = ("stream", "admin")
PID_FILE = "serve.pid"


def tokens_path(cfg: Config) -> Path:
    return Path(cfg.orchestrator.tokens_file or Path(cfg.server.run_dir) / "tokens.json")


def ensure_tokens(cfg: Config) -> dict[str, str]:
    """{scope: token}: read the tokens file, or create it with one fresh token per scope (mode 0600)."""
    path = tokens_path(cfg)
    if path.is_file():
        data = json.loads(path.read_text())
        return {scope: tok for tok, scope in data.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    made = {s: secrets.token_urlsafe(24) for s in SCOPES}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({tok: scope for scope, tok in made.items()}, f)
    return made


def models_for(cfg: Config) -> list[str]:
    """The models the orchestrator calls, plus any listed in server.models."""
    need = ["mimi_codec", "dialog_lm"]
    if cfg.orchestrator.identify_models:
        need += ["face_encoder", "speaker_encoder"]
    if cfg.orchestrator.retrieval:
        need += ["text_encoder"]
    return list(dict.fromkeys(list(cfg.server.models) + need))


def _pid_entry(pid: int) -> dict[str, Any]:
    return {"pid": pid, "start": process_start_time(pid)}


def _same_process(entry: dict[str, Any]) -> bool:
    """The process an entry of the pid file names is still running (not a reuse of its pid)."""
    pid, start = entry.get("pid"), entry.get("start")
    return isinstance(pid, int) and start is not None and process_start_time(pid) == start


def _stop_group(pid: int, grace_s: float) -> None:
    """SIGTERM process group `pid`, wait up to `grace_s` for it to empty, then SIGKILL it."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait_s
        while group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not group_alive(pid):
            return


class Stack:
    def __init__(self, cfg: Config, models: list[str] | None = None, labeler=None, worker: bool = True,
                 triton: bool = True, orchestrator: bool = True):
        """The parts this machine runs (all three by default; README "Several machines"): `triton=False`
        for an orchestrator that dials the replicas in server.triton_urls, `orchestrator=False` (and
        `worker=False`) for a machine that only serves the models."""
        self.cfg = cfg
        self.run_dir = Path(cfg.server.run_dir)
        self.triton = TritonServer(cfg, models=models or models_for(cfg))
        self.labeler = labeler
        self.with_worker = worker
        self.with_triton = triton
        self.with_orchestrator = orchestrator
        self.orchestrator: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None  # the worker process (None: none, or a thread)
        self._stop_worker = threading.Event()
        self._worker: threading.Thread | None = None  # the worker thread (a labeler object was given)
        self._restarts: dict[str, list[float]] = {}
        self._stopping = False
        self.tokens: dict[str, str] = {}

    @property
    def url(self) -> str:
        return f"http://{self.cfg.orchestrator.host}:{self.cfg.orchestrator.port}"

    @property
    def pid_file(self) -> Path:
        return self.run_dir / PID_FILE

    # -- start / stop ---------------------------------------------------------------------------
    def start(self) -> Stack:
        private_dir(self.run_dir)
        private_dir(Path(self.cfg.memory.chunk_dir))  # raw audio of users waits here for the worker
        db = Path(self.cfg.memory.database)
        for f in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
            if f.is_file():
                os.chmod(f, 0o600)  # a store made before files were private (new ones: the children's umask)
        self.stop_stale()
        if self.with_orchestrator:
            self._require_port(self.cfg.orchestrator.host, self.cfg.orchestrator.port, "orchestrator.port")
            self.tokens = ensure_tokens(self.cfg)
        self._stopping = False
        if self.with_triton:
            self.triton.start()
        try:
            self._write_pid_file()
            if self.with_orchestrator:
                self.start_orchestrator()
            if self.with_worker:
                self.start_worker()
            self._write_pid_file()
        except BaseException:
            self.stop()
            raise
        return self

    def start_orchestrator(self, timeout_s: float = 120.0) -> None:
        config_path = self.run_dir / "egomem.resolved.toml"
        write_private(config_path, to_toml(self.cfg))
        self._require_port(self.cfg.orchestrator.host, self.cfg.orchestrator.port, "orchestrator.port", wait_s=15.0)
        logf = open_private_log(self.run_dir / "orchestrator.log")
        env = dict(os.environ, EGOMEM_CONFIG=str(config_path))
        argv = [sys.executable, "-m", "egomem.orchestrator", "--config", str(config_path)]
        self.orchestrator = start_child(argv, logf, env)
        logf.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.orchestrator.poll() is not None:
                raise LaunchError(f"the orchestrator exited (code {self.orchestrator.returncode}); "
                                  f"see {self.run_dir / 'orchestrator.log'}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise LaunchError(f"the orchestrator did not answer on {self.url} in {timeout_s:.0f} s:\n"
                                  f"{self.log_tail()}")
            time.sleep(0.25)

    def start_worker(self) -> None:
        """The memory worker: a process of its own (log <run_dir>/worker.log), or a thread of this
        process when a labeler object was given (it cannot cross a process boundary)."""
        if self.labeler is not None:
            from egomem.memory.worker import run_worker

            self._stop_worker.clear()
            self._worker = threading.Thread(target=run_worker, args=(self.cfg, self._stop_worker),
                                            kwargs={"labeler": self.labeler}, name="memory-worker", daemon=True)
            self._worker.start()
            return
        config_path = self.run_dir / "egomem.resolved.toml"
        write_private(config_path, to_toml(self.cfg))
        logf = open_private_log(self.run_dir / "worker.log")
        env = dict(os.environ, EGOMEM_CONFIG=str(config_path))
        argv = [sys.executable, "-m", "egomem.memory.worker", "--config", str(config_path)]
        self.worker = start_child(argv, logf, env)
        logf.close()

    def stop_orchestrator(self) -> None:
        proc, self.orchestrator = self.orchestrator, None
        _stop_process(proc, signal.SIGINT, 30)  # aiohttp's graceful shutdown: streams flush their memory jobs

    def stop_worker(self) -> None:
        proc, self.worker = self.worker, None
        _stop_process(proc, signal.SIGTERM, 60)  # the current job finishes first (else its lease runs out)
        self._stop_worker.set()
        if self._worker is not None:
            self._worker.join(timeout=60)
            self._worker = None

    def stop(self) -> None:
        self._stopping = True
        self.stop_orchestrator()
        self.stop_worker()
        self.triton.stop()
        if self._pid_file_is_ours():
            self.pid_file.unlink(missing_ok=True)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- supervision ----------------------------------------------------------------------------
    def is_alive(self) -> bool:
        return ((not self.with_triton or self.triton.is_alive())
                and (not self.with_orchestrator or (self.orchestrator is not None and self.orchestrator.poll() is None)))

    def supervise(self, stop: threading.Event | None = None) -> None:
        """Restart whichever child died (from the thread that started the stack, so the new one
        dies with this process too). Raises LaunchError when one keeps dying (server.max_restarts
        within server.restart_window_s): a crash loop is reported, not hidden."""
        stop = stop or threading.Event()
        if self._stopping:
            return
        if self.with_triton and not self.triton.is_alive():
            code = None if self.triton.proc is None else self.triton.proc.returncode
            self._restart("tritonserver", code, self.triton.log_tail(), stop, self.triton.restart)
        if self._stopping or stop.is_set():
            return
        if self.with_orchestrator and (self.orchestrator is None or self.orchestrator.poll() is not None):
            code = None if self.orchestrator is None else self.orchestrator.returncode
            self._restart("orchestrator", code, self.log_tail(), stop, self.start_orchestrator)
        if not self.with_worker or self._stopping or stop.is_set():
            return
        if self.labeler is None and (self.worker is None or self.worker.poll() is not None):
            code = None if self.worker is None else self.worker.returncode
            self._restart("memory worker", code, self.log_tail(name="worker.log"), stop, self.start_worker)
        elif self.labeler is not None and (self._worker is None or not self._worker.is_alive()):
            self._restart("memory worker", None, "(a thread of this process)", stop, self.start_worker)

    def _restart(self, name: str, code: int | None, tail: str, stop: threading.Event, start) -> None:
        sc, now = self.cfg.server, time.monotonic()
        recent = [t for t in self._restarts.get(name, []) if now - t < sc.restart_window_s]
        if len(recent) >= sc.max_restarts:
            raise LaunchError(f"{name} died again (exit code {code}) after {len(recent)} restarts within "
                              f"{sc.restart_window_s:.0f} s (server.max_restarts); not restarting it.\n{tail}")
        recent.append(now)
        self._restarts[name] = recent
        delay = sc.restart_backoff_s * 2 ** (len(recent) - 1)
        log.error("%s exited (code %s); restart %d/%d in %.1f s.\n%s", name, code, len(recent), sc.max_restarts,
                  delay, tail)
        if stop.wait(delay):
            return
        try:
            start()
        except LaunchError as e:  # counted; the next supervise() tries again
            log.error("restarting %s failed: %s", name, e)
            return
        log.warning("%s is back (restart %d)", name, len(recent))
        self._write_pid_file()

    def log_tail(self, lines: int = 30, name: str = "orchestrator.log") -> str:
        try:
            text = (self.run_dir / name).read_text(errors="replace").splitlines()
        except OSError:
            return f"(no {name})"
        return f"--- {name} (last lines) ---\n" + "\n".join(text[-lines:])

    # -- pid file, strays -----------------------------------------------------------------------
    def _children(self) -> dict[str, int]:
        procs = {"tritonserver": self.triton.proc, "orchestrator": self.orchestrator, "worker": self.worker}
        return {name: p.pid for name, p in procs.items() if p is not None and p.poll() is None}

    def _write_pid_file(self) -> None:
        """<run_dir>/serve.pid: this process and its children (pid + start time: a reused pid is no match)."""
        data = {"serve": _pid_entry(os.getpid()),
                "children": {name: _pid_entry(pid) for name, pid in self._children().items()}}
        tmp = self.pid_file.with_suffix(".tmp")
        write_private(tmp, json.dumps(data))
        os.replace(tmp, self.pid_file)

    def _pid_file_is_ours(self) -> bool:
        try:
            return json.loads(self.pid_file.read_text())["serve"]["pid"] == os.getpid()
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def stop_stale(self) -> None:
        """Stop the children a dead `egomem serve` left (from its pid file) before binding ports;
        refuse to start next to a live one on the same run folder."""
        try:
            data = json.loads(self.pid_file.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable %s: %s", self.pid_file, e)
            self.pid_file.unlink(missing_ok=True)
            return
        owner = data.get("serve") or {}
        if owner.get("pid") != os.getpid() and _same_process(owner):
            raise LaunchError(f"another egomem serve (pid {owner['pid']}) is running on {self.run_dir} "
                              f"(see {self.pid_file}); stop it first (kill {owner['pid']}) or use another "
                              "server.run_dir")
        for name, entry in (data.get("children") or {}).items():
            pid = entry.get("pid")
            if not isinstance(pid, int) or pid == os.getpid():
                continue
            if _same_process(entry) or (process_start_time(pid) is None and group_alive(pid)):
                log.warning("stopping %s (pid %d) left running by egomem serve pid %s, which is gone",
                            name, pid, owner.get("pid"))
                _stop_group(pid, self.cfg.server.shutdown_timeout_s)
        self.pid_file.unlink(missing_ok=True)

    @staticmethod
    def _require_port(host: str, port: int, key: str, wait_s: float = 0.0) -> None:
        import socket

        deadline = time.monotonic() + wait_s
        while True:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, port))
                    return
                except OSError:
                    pass
            if time.monotonic() > deadline:
                owner = port_owner(port)
                raise LaunchError(f"port {host}:{port} ({key}) is in use{f' by {owner}' if owner else ''}; "
                                  f"stop that process or set {key} to a free port")
            time.sleep(0.25)


def _stop_process(proc: subprocess.Popen | None, sig: int, grace_s: float) -> None:
    """`sig`, wait up to `grace_s`, then SIGKILL (the process leads its own group: all of it)."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop in %.0f s; killing it", proc.pid, grace_s)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything it started and left behind
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
