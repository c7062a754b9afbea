"""The whole product in one object: tritonserver + the orchestrator + the memory worker.

`egomem serve` and `egomem demo` use it. The orchestrator runs as its own process
(`python -m egomem.orchestrator`, log in <run_dir>/orchestrator.log) so `egomem` never imports it;
the memory worker runs in a thread of this process over the same durable job queue (several
workers on one store are safe, so more can be started with `python -m egomem.memory.worker`).
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

from egomem.config import Config, to_toml
from egomem.serving.launcher import LaunchError, TritonServer

log = logging.getLogger(__name__)
SERVICE_MODELS = ["mimi_codec", "dialog_lm", "face_encoder", "speaker_encoder", "text_encoder"]
SCOPES = ("stream", "admin")


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


class Stack:
    def __init__(self, cfg: Config, models: list[str] | None = None, labeler=None, worker: bool = True):
        self.cfg = cfg
        self.run_dir = Path(cfg.server.run_dir)
        self.triton = TritonServer(cfg, models=models or models_for(cfg))
        self.labeler = labeler
        self.with_worker = worker
        self.orchestrator: subprocess.Popen | None = None
        self._stop_worker = threading.Event()
        self._worker: threading.Thread | None = None
        self.tokens: dict[str, str] = {}

    @property
    def url(self) -> str:
        return f"http://{self.cfg.orchestrator.host}:{self.cfg.orchestrator.port}"

    def start(self) -> "Stack":
        self.tokens = ensure_tokens(self.cfg)
        self.triton.start()
        try:
            self.start_orchestrator()
            if self.with_worker:
                from egomem.memory.worker import run_worker

                self._worker = threading.Thread(target=run_worker, args=(self.cfg, self._stop_worker),
                                                kwargs={"labeler": self.labeler}, name="memory-worker", daemon=True)
                self._worker.start()
        except BaseException:
            self.stop()
            raise
        return self

    def start_orchestrator(self, timeout_s: float = 120.0) -> None:
        config_path = self.run_dir / "egomem.resolved.toml"
        config_path.write_text(to_toml(self.cfg))
        logf = open(self.run_dir / "orchestrator.log", "ab", buffering=0)
        env = dict(os.environ, EGOMEM_CONFIG=str(config_path))
        self.orchestrator = subprocess.Popen([sys.executable, "-m", "egomem.orchestrator", "--config", str(config_path)],
                                             stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                             start_new_session=True)
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
                raise LaunchError(f"the orchestrator did not answer on {self.url} in {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def stop_orchestrator(self) -> None:
        proc, self.orchestrator = self.orchestrator, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)  # aiohttp's graceful shutdown: streams flush their memory jobs
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def is_alive(self) -> bool:
        return self.triton.is_alive() and self.orchestrator is not None and self.orchestrator.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = (self.run_dir / "orchestrator.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no orchestrator log)"
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        self.stop_orchestrator()
        self._stop_worker.set()
        if self._worker is not None:
            self._worker.join(timeout=60)
        self.triton.stop()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
