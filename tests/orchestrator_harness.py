"""Helpers for the orchestrator tests: run the real aiohttp app on a loopback port in a thread,
and a memory worker in another, so tests drive them through `egomem.client` like any user."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
from pathlib import Path

import numpy as np
from aiohttp import web

from egomem.config import Config

STREAM_TOKEN = "stream-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"
FORGED_TOKEN = "forged-token-0123456789abcdef"


def orchestrator_config(cfg: Config, run_dir: Path, grpc_url: str | None = None, **orch) -> Config:
    """`cfg` (from conftest.test_config, which put the orchestrator on a free port) with tokens, and Triton at
    `grpc_url`."""
    if grpc_url:
        host, port = grpc_url.rsplit(":", 1)
        cfg.server.host, cfg.server.grpc_port = host, int(port)
    tokens = run_dir / "tokens.json"
    tokens.write_text(json.dumps({STREAM_TOKEN: "stream", ADMIN_TOKEN: "admin"}))
    cfg.orchestrator.tokens_file = tokens
    cfg.orchestrator.tokens_env = "EGOMEM_TEST_TOKENS_UNSET"
    cfg.memory.chunk_dir = run_dir / "chunks"
    for k, v in orch.items():
        setattr(cfg.orchestrator, k, v)
    return cfg


class OrchestratorThread:
    """The app from `egomem.orchestrator.app.init(cfg)` served on 127.0.0.1 in its own event loop."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.url = f"http://127.0.0.1:{cfg.orchestrator.port}"
        self.app: web.Application | None = None
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from egomem.orchestrator.app import init

        asyncio.set_event_loop(self._loop)
        try:
            self.app = init(self.cfg)
            self._runner = web.AppRunner(self.app)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", self.cfg.orchestrator.port)
            self._loop.run_until_complete(site.start())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def start(self) -> OrchestratorThread:
        self._thread.start()
        self._started.wait(60)
        if self._error:
            raise self._error
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(60)

    @property
    def services(self):
        from egomem.orchestrator.services import SERVICES

        return self.app[SERVICES]

    def __enter__(self) -> OrchestratorThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


DIALOG_MODELS = ("mimi_codec", "dialog_lm")
IDENTIFY_MODELS = DIALOG_MODELS + ("face_encoder", "speaker_encoder")


@contextlib.contextmanager
def served_orchestrator(triton, run_dir: Path, models: tuple[str, ...] = DIALOG_MODELS, dialog: dict | None = None,
                        **orch):
    """The orchestrator app in a thread, on the session's tritonserver with `models` loaded;
    `orch` overrides [orchestrator] keys, `dialog` the orchestrator's [dialog] keys (not the served model's)."""
    from tests.conftest import test_config

    for m in models:
        triton.load(m)
    cfg = orchestrator_config(test_config(run_dir), run_dir, triton.grpc_url, **orch)
    if dialog:
        cfg = dataclasses.replace(cfg, dialog=dataclasses.replace(cfg.dialog, **dialog))
    with OrchestratorThread(cfg) as o:
        yield o


def run(coro):
    return asyncio.run(coro)


def wait_until(pred, timeout: float) -> None:
    """Poll `pred` every 50 ms; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.05)


def tone(seconds: float, freq: float = 220.0, sr: int = 24000) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


class FakeStream:
    """An open chat as the REST routes and the change applier see it (services.OpenStream), with no
    Triton behind it: records what it was asked to do."""

    def __init__(self, user_id: str | None):
        from orchestrator.recording import Recorder

        self.user_id = user_id
        self.ticks, self.opened_at = 0, time.time()
        self.recorder = Recorder("fake", record_audio=False)
        self.calls: list[tuple[str, str | None, float]] = []  # (what, user id, time.time())

    def stop(self) -> None:
        pass

    def forget_user(self, user_id: str) -> None:
        if self.user_id == user_id:
            self.user_id = None
        self.calls.append(("forget_user", user_id, time.time()))

    def refresh_profile(self) -> None:
        self.calls.append(("refresh_profile", self.user_id, time.time()))
