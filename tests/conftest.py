"""Shared fixtures. `triton` is a real tritonserver (from the nvidia-pytriton wheel) on the project's
model repository, started once per test session in explicit model-control mode; tests load the
models they need with `triton.load(name)`. `backend` runs a memory-store test once per store backend
(SQLite, and PostgreSQL on `pg_server`: a real PostgreSQL 16 from the pgserver wheel, started once
per test session); each test gets its own empty database."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from egomem.config import Config, load_config, with_overrides
from egomem.serving.launcher import TritonServer, free_ports
from tests.memory_helpers import StoreBackend

DATA = Path(__file__).parent / "data"


def test_config(run_dir: Path, **sections) -> Config:
    """A default config on four distinct free ports (Triton's three, the orchestrator's) with its run
    folder under `run_dir`; `sections` override keys, e.g. test_config(p, mimi={"max_streams": 4})
    (through `with_overrides`: checked and validated)."""
    http, grpc, metrics, orchestrator = free_ports(4)
    base = {"server": {"http_port": http, "grpc_port": grpc, "metrics_port": metrics, "run_dir": run_dir},
            "orchestrator": {"port": orchestrator},
            "memory": {"database": run_dir / "memory.sqlite3"}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return with_overrides(load_config(env={}), base, source="test_config")


test_config.__test__ = False  # a helper, not a test


class TritonFixture:
    """A running server plus helpers to load models and make clients."""

    def __init__(self, server: TritonServer):
        self.server = server
        self._loaded: set[str] = set()

    @property
    def grpc_url(self) -> str:
        return self.server.grpc_url

    @property
    def http_url(self) -> str:
        return self.server.http_url

    def load(self, name: str) -> None:
        if name not in self._loaded:
            self.server.load(name)
            self._loaded.add(name)

    def client(self):
        import tritonclient.grpc as grpcclient

        return grpcclient.InferenceServerClient(self.grpc_url)

    def log_tail(self, lines: int = 40) -> str:
        return self.server.log_tail(lines)


@contextmanager
def triton_server(cfg: Config) -> Iterator[TritonFixture]:
    """A tritonserver on `cfg`'s ports and model repository, no model loaded, stopped on exit."""
    server = TritonServer(cfg, models=[])
    server.start()
    try:
        yield TritonFixture(server)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def triton(tmp_path_factory) -> Iterator[TritonFixture]:
    # small batched codec steps on 2 CPU cores; the served dialog model decodes without draws (its shipped
    # setting draws turn starts at T = 1, seeded per stream id, and a replay is a new stream), so tests can
    # replay a stream tick for tick
    cfg = test_config(tmp_path_factory.mktemp("triton"), mimi={"max_streams": 8}, dialog={"start_temperature": None})
    with triton_server(cfg) as server:
        yield server


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one torch intra-op thread avoids spin-wait contention on a shared 2-core box.
    A test module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


STORE_BACKENDS = ("sqlite", "postgres")


@pytest.fixture(scope="session")
def pg_server() -> str:
    """A PostgreSQL server for the whole test session: the pgserver wheel's PostgreSQL 16, started as a
    child process on a Unix socket in a temporary folder (no root, no system package), stopped and
    removed at the end. Yields the superuser URI of its `postgres` database. The folder is not under
    pytest's basetemp: run as root, pgserver runs the server as an unprivileged user and opens the
    folders above it to that user, and any pytest session starting meanwhile narrows basetemp's root
    back to 0700, cutting the server off from its own data."""
    import pgserver

    folder = tempfile.mkdtemp(prefix="egomem-test-pg-")
    server = pgserver.get_server(folder, cleanup_mode="stop")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=STORE_BACKENDS)
def backend(request, tmp_path) -> StoreBackend:
    """The store backend this run of a test uses, with a fresh database (a file in tmp_path, or a
    CREATE DATABASE on `pg_server`, dropped afterwards)."""
    uri = request.getfixturevalue("pg_server") if request.param == "postgres" else None
    b = StoreBackend(request.param, tmp_path, uri, prefix=f"t{uuid.uuid4().hex[:12]}")
    try:
        yield b
    finally:
        b.drop()
