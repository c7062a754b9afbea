"""Triton replicas (`server.triton_urls`): one orchestrator on two real tritonservers (the session's and one
of its own). Streams are spread over the replicas and pinned; when one replica is killed -9 its stream
closes with 1011 (its recording still reaches the job queue) while the stream on the other replica keeps
ticking, /readyz shows the dead one, and new streams go to the live one; once the dead one is started
again it rejoins and takes new streams."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from egomem import protocol as P
from egomem.client import EgoMemClient, stream_audio
from egomem.memory import open_store
from egomem.serving.launcher import TritonServer
from tests.conftest import test_config
from tests.orchestrator_harness import STREAM_TOKEN, OrchestratorThread, orchestrator_config, run, tone

MODELS = ["mimi_codec", "dialog_lm"]


@pytest.fixture(scope="module")
def second_triton(tmp_path_factory):
    cfg = test_config(tmp_path_factory.mktemp("replica_b"), mimi={"max_streams": 4}, dialog={"max_streams": 4},
                      orchestrator={"max_streams": 4})
    server = TritonServer(cfg, models=MODELS).start()
    try:
        yield server
    finally:
        server.stop()


async def _readyz(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + "/readyz") as r:
        return json.loads(await r.text())


async def _wait_replica(url: str, index: int, ready: bool, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = await _readyz(url)
        if body["replicas"][index]["ready"] is ready:
            return body
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {index} not ready={ready} after {timeout:.0f} s: {body}")
        await asyncio.sleep(0.1)


async def _ticks(chat, n: int, timeout: float = 60) -> None:
    """Wait until the stream has sent `n` more pieces of model output (audio chunks or text)."""
    start = len(chat.audio_chunks) + len(chat.text)
    await chat.wait_for(lambda c: len(c.audio_chunks) + len(c.text) >= start + n, timeout)


def test_streams_are_pinned_and_survive_the_death_of_the_other_replica(triton, second_triton, tmp_path):
    for m in MODELS:
        triton.load(m)
    cfg = orchestrator_config(test_config(tmp_path, mimi={"max_streams": 4}, dialog={"max_streams": 4},
                                          orchestrator={"max_streams": 4}), tmp_path,
                              identify_models=False, retrieval=False, triton_timeout_s=3.0, max_streams=4)
    cfg.server.triton_urls = [triton.grpc_url, second_triton.grpc_url]
    cfg.server.replica_probe_s = 0.3

    def jobs_of(stream_id: str) -> list:
        store = open_store(cfg.memory)
        try:
            return [j for j in store.list_jobs() if f":{stream_id}:" in j.key]
        finally:
            store.close()

    with OrchestratorThread(cfg) as o:
        async def scenario():
            async with EgoMemClient(o.url, STREAM_TOKEN) as c:
                body = await _readyz(o.url)
                assert body["ready"] and [r["ready"] for r in body["replicas"]] == [True, True]
                a = await c.open_chat(handshake_timeout=60)
                b = await c.open_chat(handshake_timeout=60)
                opened = [(await ch.wait_event("stream_open", timeout=30)) for ch in (a, b)]
                assert [e["replica"] for e in opened] == [0, 1]  # the second stream went to the idle replica
                await asyncio.gather(stream_audio(a, tone(0.4)), stream_audio(b, tone(0.4)))
                await asyncio.gather(_ticks(a, 3), _ticks(b, 3))

                os.killpg(second_triton.proc.pid, signal.SIGKILL)  # replica 1 dies with every model process
                await b.wait_for(lambda ch: ch.closed, 30)
                assert b.close_code == P.CLOSE_INTERNAL and any("unavailable" in e for e in b.errors)
                down = await _wait_replica(o.url, 1, False, 10)
                assert down["ready"] and down["replicas"][0]["ready"]  # the orchestrator still serves
                await stream_audio(a, tone(0.4))
                await _ticks(a, 5)  # the stream on replica 0 goes on

                c2 = await c.open_chat(handshake_timeout=60)  # replica 0 has more streams, but 1 is down
                assert (await c2.wait_event("stream_open", timeout=30))["replica"] == 0
                await _ticks(c2, 3)
                await c2.close()
                deadline, jobs = time.monotonic() + 30, []
                while not jobs and time.monotonic() < deadline:  # what B recorded before its replica died
                    jobs = await asyncio.to_thread(jobs_of, opened[1]["stream_id"])
                    await asyncio.sleep(0.2)
                assert len(jobs) == 1

                await asyncio.to_thread(second_triton.restart)  # back on the same ports, fresh model state
                await _wait_replica(o.url, 1, True, 60)
                d = await c.open_chat(handshake_timeout=60)
                where = (await d.wait_event("stream_open", timeout=30))["replica"]
                await stream_audio(d, tone(0.4))
                await _ticks(d, 3)
                assert where == 1 and d.errors == []  # it rejoined and, the least loaded, took the new stream
                await _ticks(a, 3)
                assert not a.closed and a.errors == []  # replica 0's stream never noticed any of it
                await d.close()
                await a.close()

        run(scenario())
