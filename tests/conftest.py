"""Shared fixtures. `triton` is a real tritonserver (from the nvidia-pytriton wheel) on the project's
model repository, started once per test session in explicit model-control mode; tests load the
models they need with `triton.load(name)`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from egomem.config import Config, load_config, with_overrides
from egomem.serving.launcher import TritonServer, free_port

DATA = Path(__file__).parent / "data"


def test_config(run_dir: Path, **sections) -> Config:
    """A default config on free ports with its run folder under `run_dir`; `sections` override keys,
    e.g. test_config(p, mimi={"max_streams": 4}) (through `with_overrides`: checked and validated)."""
    base = {"server": {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port(),
                       "run_dir": run_dir},
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


@pytest.fixture(scope="session")
def triton(tmp_path_factory) -> TritonFixture:
    cfg = test_config(tmp_path_factory.mktemp("triton"), mimi={"max_streams": 8})  # small batched codec steps on 2 CPU cores
    server = TritonServer(cfg, models=[])
    server.start()
    try:
        yield TritonFixture(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one torch intra-op thread avoids spin-wait contention on a shared 2-core box.
    A test module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
