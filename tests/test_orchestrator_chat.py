"""/api/chat end to end: real tritonserver (mimi_codec + dialog_lm), the real app on loopback, a real
WebSocket client. Moshi protocol (handshake, Opus both ways), silence for late frames, admission
control, garbage, a vanishing client; the memory job of every stream is enqueued."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest

from egomem import protocol as P
from egomem.client import ChatRefused, EgoMemClient, stream_audio
from egomem.memory import open_store
from tests.orchestrator_harness import STREAM_TOKEN, run, served_orchestrator, tone, wait_until


@pytest.fixture(scope="module")
def orch(triton, tmp_path_factory):
    d = tmp_path_factory.mktemp("orch_chat")
    with served_orchestrator(triton, d, identify_models=False, retrieval=False, max_streams=2,
                             accept_model_text=False) as o:
        yield o


def test_moshi_protocol_handshake_and_opus_round_trip(orch):
    """Speak like moshi/client.py: raw aiohttp, 0x00 first, Opus pages (sphn) in, Opus pages out."""
    import sphn

    async def go():
        writer, reader = sphn.OpusStreamWriter(24000), sphn.OpusStreamReader(24000)
        kinds, pcm_out, text = [], [], b""
        url = orch.url.replace("http", "ws") + f"/api/chat?token={STREAM_TOKEN}"  # Moshi clients can't set headers
        async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
            first = await ws.receive_bytes(timeout=10)
            sig = tone(2.0)

            async def send():
                for i in range(0, len(sig), 1920):
                    data = writer.append_pcm(sig[i:i + 1920])
                    if len(data):
                        await ws.send_bytes(b"\x01" + data)
                    await asyncio.sleep(0.08)

            sender = asyncio.create_task(send())
            deadline = time.monotonic() + 60  # a loaded 2-core box can tick far slower than real time
            while time.monotonic() < deadline and kinds.count(P.AUDIO) < 6:
                try:
                    msg = await ws.receive(timeout=0.5)
                except TimeoutError:
                    continue
                if msg.type != aiohttp.WSMsgType.BINARY:
                    break
                kinds.append(msg.data[0])
                if msg.data[0] == 1:
                    pcm_out.append(reader.append_bytes(msg.data[1:]))
                elif msg.data[0] == 2:
                    text += msg.data[1:]
            await sender
        return first, kinds, pcm_out, text

    first, kinds, pcm_out, text = run(go())
    assert first == b"\x00"
    assert kinds.count(P.AUDIO) >= 6 and set(kinds) <= {P.AUDIO, P.TEXT, P.EVENT}
    audio = np.concatenate(pcm_out)
    assert audio.size >= 4 * 1920 and np.isfinite(audio).all()  # decoded model voice came back over Opus
    text.decode("utf-8", "replace")  # text pieces are bytes of UTF-8


def test_silence_is_fed_when_the_client_sends_nothing(orch):
    m = orch.services.metrics

    async def go():
        late0, ticks = m.get("egomem_late_frames_total"), None
        async with EgoMemClient(orch.url, STREAM_TOKEN) as c, c.chat() as chat:
            sid = (await chat.wait_event("stream_open"))["stream_id"]
            stream = orch.services.streams[sid]
            await chat.wait_for(lambda _: stream.ticks >= 6, 60)
            ticks = stream.ticks
            text_before = len(chat.text)
        return m.get("egomem_late_frames_total") - late0, ticks, text_before

    late, ticks, _ = run(go())
    assert ticks >= 6 and late >= ticks - 1  # no client audio at all: silence was fed, the model kept ticking


def test_admission_control_and_garbage_do_not_touch_other_streams(orch):
    wait_until(lambda: not orch.services.streams, 60)  # earlier tests' streams have closed their sequences

    async def go():
        async with EgoMemClient(orch.url, STREAM_TOKEN) as c:
            good = await c.open_chat()
            bad = await c.open_chat()
            with pytest.raises(ChatRefused) as refused:
                await c.open_chat()
            sid = (await good.wait_event("stream_open"))["stream_id"]
            t0 = orch.services.streams[sid].ticks
            for junk in [b"", b"\x01not-an-ogg-stream", b"\x7fwhat", b"\x13{bad json", b"\x11\xff\xfe",
                         b"\x13" + b'{"type": "model_text", "text": "x"}']:
                await bad.send_raw(junk)
            await bad.send_raw("a text frame")
            await bad.wait_for(lambda s: len(s.errors) >= 7, 5)
            for _ in range(30):  # keep going: closed with 1008 after MAX_MALFORMED
                if bad.closed:
                    break
                await bad.send_raw(b"\x7f")
            await bad.wait_for(lambda s: s.closed, 5)
            stream = orch.services.streams[sid]
            await stream_audio(good, tone(0.4))
            await good.wait_for(lambda _: stream.ticks >= t0 + 5, 60)
            t1 = stream.ticks
            await good.close()
            return refused.value, bad, t1 - t0

    refused, bad, good_ticks = run(go())
    assert refused.code == P.CLOSE_TRY_LATER and "no free stream slot" in refused.reason
    assert any("Ogg/Opus" in e for e in bad.errors) and any("unknown message kind" in e for e in bad.errors)
    assert any("disabled" in e for e in bad.errors) and any("binary" in e for e in bad.errors)
    assert bad.close_code == P.CLOSE_POLICY
    assert good_ticks >= 5  # the well-behaved stream kept ticking meanwhile


def test_a_full_model_pool_refuses_one_stream_and_the_others_tick_on(orch, triton):
    """The codec's pool is full (sequences opened straight on Triton): the next chat's START row fails
    alone, with 1013 naming the model, in the same cohort request as a stream that keeps ticking."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    wait_until(lambda: not orch.services.streams, 60)
    client, held = triton.client(), []

    def fill_codec_pool() -> None:
        pcm = grpcclient.InferInput("PCM", [1, P.FRAME_SAMPLES], "FP32")
        pcm.set_data_from_numpy(np.zeros((1, P.FRAME_SAMPLES), np.float32))
        for seq in range(7_000_001, 7_000_065):
            try:
                client.infer("mimi_codec", [pcm], sequence_id=seq, sequence_start=True)
            except InferenceServerException as e:
                assert "no free stream slot" in str(e)
                return
            held.append(seq)
        raise AssertionError("the codec pool never filled")

    async def go():
        async with EgoMemClient(orch.url, STREAM_TOKEN) as c:
            good = await c.open_chat()
            sid = (await good.wait_event("stream_open"))["stream_id"]
            stream = orch.services.streams[sid]
            await asyncio.to_thread(fill_codec_pool)
            with pytest.raises(ChatRefused) as refused:
                await c.open_chat()
            t0 = stream.ticks
            await stream_audio(good, tone(0.4))
            await good.wait_for(lambda _: stream.ticks >= t0 + 5, 60)
            return refused.value, good.closed

    try:
        refused, good_closed = run(go())
    finally:
        pcm = grpcclient.InferInput("PCM", [1, P.FRAME_SAMPLES], "FP32")
        pcm.set_data_from_numpy(np.zeros((1, P.FRAME_SAMPLES), np.float32))
        for seq in held:
            client.infer("mimi_codec", [pcm], sequence_id=seq, sequence_end=True)
    assert held  # the pool was filled by this test
    assert refused.code == P.CLOSE_TRY_LATER and "no free stream slot in mimi_codec" in refused.reason
    assert not good_closed  # the stream that shared its cohort requests kept ticking


def test_vanishing_client_frees_its_slot_and_its_memory_job_is_queued(orch):
    async def go():
        http = aiohttp.ClientSession()
        c = EgoMemClient(orch.url, STREAM_TOKEN)
        c._session = http
        chat = await c.open_chat()
        sid = (await chat.wait_event("stream_open"))["stream_id"]
        await stream_audio(chat, tone(0.6))
        chat.ws._response.connection.transport.abort()  # gone: no close frame, TCP reset
        return sid, http

    sid, http = run(go())
    wait_until(lambda: sid not in orch.services.streams, 30)
    store = open_store(orch.cfg.memory)
    jobs = [j for j in store.list_jobs() if sid in j.key]
    store.close()
    assert len(jobs) == 1 and jobs[0].status == "queued"
    run(http.close())


def test_rate_and_size_limits_close_only_the_offender(orch):
    wait_until(lambda: not orch.services.streams, 60)

    async def go():
        async with EgoMemClient(orch.url, STREAM_TOKEN) as c:
            flood = await c.open_chat()
            for _ in range(400):  # well-formed but far over max_messages_per_s (200)
                if flood.closed:
                    break
                try:
                    await flood.send_transcript("hi")
                except ConnectionError:
                    break
            await flood.wait_for(lambda s: s.closed, 30)
            wait_until(lambda: len(orch.services.streams) == 0, 60)
            big = await c.open_chat()
            await big.send_video(b"\xff" * (orch.cfg.orchestrator.max_message_bytes + 1))
            await big.wait_for(lambda s: s.closed, 30)
            return flood, big

    flood, big = run(go())
    assert flood.close_code == P.CLOSE_POLICY and any("messages per second" in e for e in flood.errors)
    assert big.close_code == P.CLOSE_TOO_BIG


def test_input_clock_ticks_each_stream_on_its_own_frames(triton, tmp_path):
    """tick_clock = "input": a stream ticks when its client's frame is complete, on its own loop; a
    stream whose client sends nothing is fed silence at its own pace, and neither waits for the other."""
    with served_orchestrator(triton, tmp_path, identify_models=False, retrieval=False, max_streams=2,
                             tick_clock="input") as o:
        m = o.services.metrics

        async def go():
            late0 = m.get("egomem_late_frames_total")
            async with EgoMemClient(o.url, STREAM_TOKEN) as c, c.chat() as talker, c.chat() as silent:
                sid = (await talker.wait_event("stream_open"))["stream_id"]
                quiet = (await silent.wait_event("stream_open"))["stream_id"]
                sig = tone(1.6)
                for i in range(0, len(sig), 1920):
                    await talker.send_pcm(sig[i:i + 1920])
                    await asyncio.sleep(0.08)
                await talker.wait_for(lambda s: s.pcm.size >= 6 * 1920, 60)
                return (o.services.streams[sid].ticks, o.services.streams[quiet].ticks,
                        m.get("egomem_late_frames_total") - late0, talker.pcm.size, o.services.replicas.replicas[0].clock.size)

        talker_ticks, quiet_ticks, late, pcm_samples, grid_streams = run(go())
    assert talker_ticks >= 10 and quiet_ticks >= 10  # both ticked, each on its own loop
    assert late >= quiet_ticks - 2  # the silent client's ticks were (nearly) all fed silence
    assert pcm_samples >= 6 * 1920  # the talker got the model's voice back
    assert grid_streams == 0  # no stream went through the global grid clock
