"""The product's processes (egomem.stack.Stack, what `egomem serve` runs: tritonserver + the
orchestrator as its own process): Triton killed under a live stream, then restarted. The stream
fails cleanly (0x05 error + close 1011), its memory is still handed over, /readyz says 503 and new
streams are refused meanwhile, and new streams work once Triton is back, with the same orchestrator
process. Uses its own tritonserver (the shared one must live)."""

from __future__ import annotations

import time

import pytest

from egomem import protocol as P
from egomem.client import ChatRefused, EgoMemClient, stream_audio
from egomem.memory import open_store
from egomem.serving.launcher import TritonServer
from egomem.stack import Stack
from tests.conftest import test_config
from tests.orchestrator_harness import run, tone

MODELS = ["mimi_codec", "dialog_lm"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("orch_recovery")
    cfg = test_config(d, mimi={"max_streams": 4}, dialog={"max_streams": 4}, orchestrator={"max_streams": 4})
    oc = cfg.orchestrator
    oc.identify_models, oc.retrieval, oc.triton_timeout_s = False, False, 3.0
    cfg.memory.chunk_dir = d / "chunks"
    with Stack(cfg, models=MODELS, worker=False) as s:  # no worker: the test reads the queue itself
        yield s


def test_tokens_file_is_private(stack):
    path = stack.run_dir / "tokens.json"
    assert path.stat().st_mode & 0o077 == 0 and set(stack.tokens) == {"stream", "admin"}


def test_streams_fail_cleanly_and_the_service_recovers(stack):
    cfg = stack.cfg

    async def down():
        async with EgoMemClient(stack.url, stack.tokens["stream"]) as c, \
                EgoMemClient(stack.url, stack.tokens["admin"]) as admin:
            chat = await c.open_chat(handshake_timeout=60)
            sid = (await chat.wait_event("stream_open"))["stream_id"]
            await chat.wait_for(lambda s: s.text or s.audio_chunks, 60)  # it ticks
            stack.triton.stop()  # SIGTERM, then SIGKILL the whole group: every model process is gone
            await stream_audio(chat, tone(0.5))
            await chat.wait_for(lambda s: s.closed, 60)
            ready = await admin.ready()
            with pytest.raises(ChatRefused) as refused:  # a new stream while Triton is down: no handshake
                await c.open_chat(handshake_timeout=30)
            metrics = await admin.metrics()
            return chat, sid, ready, refused.value, metrics

    chat, sid, ready_while_down, refused, metrics = run(down())
    assert chat.close_code == P.CLOSE_INTERNAL and any("unavailable" in e for e in chat.errors)
    assert ready_while_down is False
    assert refused.code == P.CLOSE_INTERNAL and "unavailable" in refused.reason
    assert "egomem_stream_failures_total 0\n" not in metrics
    deadline = time.monotonic() + 30
    jobs = []
    while not jobs and time.monotonic() < deadline:
        store = open_store(cfg.memory)
        jobs = [j for j in store.list_jobs() if f":{sid}:" in j.key]
        store.close()
        time.sleep(0.2)
    assert len(jobs) == 1 and jobs[0].status == "queued"  # what was recorded before the failure is not lost

    # Same ports: the old server's sockets may sit in TIME_WAIT; the launcher's check allows that.
    stack.triton = TritonServer(cfg, models=MODELS).start()

    async def back():
        async with EgoMemClient(stack.url, stack.tokens["admin"]) as c:
            await c.wait_ready(60)
            async with c.chat(handshake_timeout=60) as chat:
                await stream_audio(chat, tone(0.4))
                await chat.wait_for(lambda s: len(s.audio_chunks) >= 2, 60)
                return chat.errors, stack.orchestrator.pid

    pid = stack.orchestrator.pid
    errors, pid_after = run(back())
    assert errors == [] and pid_after == pid  # the same orchestrator process served it
