"""`/api/chat`: the WebSocket handler (Moshi's binary protocol plus EgoMem's kinds, egomem/protocol.py).

Admission: a free stream slot or a close with 1013 "no free stream slot". Reading: each message is
checked (kind, size, rate, payload) — a malformed one gets a 0x05 error and is dropped; a client
that keeps sending garbage, or over the rate limit, is closed with 1008. Writing: a bounded outbox
drained by its own task, so a slow or vanished client never blocks the stream's ticks.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid

import sphn
from aiohttp import WSMsgType, web

from egomem.protocol import (
    AUDIO, CLOSE_POLICY, CLOSE_TRY_LATER, CONTROL, ERROR, SAMPLE_RATE, TRANSCRIPT, VIDEO, ProtocolError,
    pack, parse_json, parse_text, unpack,
)

from .services import Services
from .stream import Stream

log = logging.getLogger(__name__)
MAX_MALFORMED = 20  # malformed messages tolerated per stream before it is closed
SEND_TIMEOUT_S = 5.0  # one send blocked this long: the client is gone


class Outbox:
    """Bounded outbound queue. When full, audio goes first (text, events and errors are kept)."""

    def __init__(self, capacity: int, on_drop):
        self.capacity = capacity
        self.q: collections.deque[bytes] = collections.deque()
        self.ready = asyncio.Event()
        self.closed = False
        self.on_drop = on_drop

    def put(self, msg: bytes) -> None:
        if self.closed:
            return
        if len(self.q) >= self.capacity:
            victim = next((m for m in self.q if m[0] == AUDIO), None)
            if victim is None and msg[0] == AUDIO:
                self.on_drop()
                return
            if victim is not None:
                self.q.remove(victim)
            else:
                self.q.popleft()
            self.on_drop()
        self.q.append(msg)
        self.ready.set()

    async def drain(self, ws: web.WebSocketResponse) -> None:
        while True:
            await self.ready.wait()
            self.ready.clear()
            while self.q:
                msg = self.q.popleft()
                if ws.closed:
                    return
                try:
                    await asyncio.wait_for(ws.send_bytes(msg), SEND_TIMEOUT_S)
                except (ConnectionError, RuntimeError, asyncio.TimeoutError):
                    return  # the client is gone; the reader loop ends too


class RateLimit:
    """Token bucket: `rate` messages per second, bursts up to one second's worth."""

    def __init__(self, rate: float):
        self.rate = rate
        self.tokens = rate
        self.last = time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


async def chat(request: web.Request) -> web.WebSocketResponse:
    from .app import SERVICES

    s: Services = request.app[SERVICES]
    oc = s.cfg.orchestrator
    ws = web.WebSocketResponse(max_msg_size=oc.max_message_bytes, heartbeat=20.0)
    await ws.prepare(request)
    if s.free_slots <= 0:
        s.metrics.inc("egomem_streams_rejected_total")
        await ws.close(code=CLOSE_TRY_LATER, message=f"no free stream slot (max {oc.max_streams})".encode())
        return ws
    stream_id = uuid.uuid4().hex[:16]
    outbox = Outbox(oc.send_queue_messages, lambda: s.metrics.inc("egomem_dropped_output_messages_total"))
    stream = Stream(s, stream_id, outbox.put)
    s.streams[stream_id] = stream
    s.metrics.inc("egomem_streams_total")
    s.metrics.set("egomem_open_streams", len(s.streams))
    writer = asyncio.create_task(outbox.drain(ws))
    runner = asyncio.create_task(stream.run())
    closer = asyncio.create_task(_close_when_done(stream, ws, outbox))
    try:
        await _read(ws, stream, s, outbox)
    finally:
        stream.stop()
        await asyncio.gather(runner, return_exceptions=True)
        await closer
        outbox.closed = True
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        if not ws.closed:
            await ws.close()
        s.streams.pop(stream_id, None)
        s.metrics.set("egomem_open_streams", len(s.streams))
        log.info("stream %s closed after %d ticks%s", stream_id, stream.ticks,
                 f" ({stream.failure})" if stream.failure else "")
    return ws


async def _close_when_done(stream: Stream, ws: web.WebSocketResponse, outbox: Outbox) -> None:
    """When the stream's loops end on their own (a model failure), tell the client and close."""
    await stream.closed.wait()
    await asyncio.sleep(0)  # let run() record the failure
    for _ in range(100):
        if stream.failure is not None or ws.closed:
            break
        await asyncio.sleep(0.01)
    if stream.failure is not None and not ws.closed:
        stream.s.metrics.inc("egomem_stream_failures_total")
        try:
            await asyncio.wait_for(ws.send_bytes(pack(ERROR, str(stream.failure).encode())), 1.0)
        except (ConnectionError, RuntimeError, asyncio.TimeoutError):
            pass
        outbox.closed = True
        await ws.close(code=stream.failure.close_code, message=str(stream.failure)[:120].encode())


async def _read(ws: web.WebSocketResponse, stream: Stream, s: Services, outbox: Outbox) -> None:
    oc = s.cfg.orchestrator
    opus_in = sphn.OpusStreamReader(SAMPLE_RATE)
    rate = RateLimit(oc.max_messages_per_s)
    malformed = 0
    async for msg in ws:
        if msg.type == WSMsgType.ERROR:  # e.g. over max_message_bytes: aiohttp closes with 1009
            s.metrics.inc("egomem_malformed_messages_total")
            break
        if not rate.allow():
            s.metrics.inc("egomem_malformed_messages_total")
            await _refuse(ws, CLOSE_POLICY, f"over {oc.max_messages_per_s:g} messages per second")
            break
        try:
            if msg.type != WSMsgType.BINARY:
                raise ProtocolError("messages are binary frames: one kind byte, then the payload")
            kind, payload = unpack(msg.data)
            if kind == AUDIO:
                if not payload.startswith(b"OggS"):
                    raise ProtocolError("audio payload is not an Ogg/Opus stream (each message holds whole Ogg pages)")
                try:
                    pcm = opus_in.append_bytes(payload)
                except Exception as e:  # noqa: BLE001 - sphn raises plain exceptions on bad Ogg data
                    opus_in = sphn.OpusStreamReader(SAMPLE_RATE)  # start a clean decoder for what follows
                    raise ProtocolError(f"audio payload is not an Ogg/Opus stream: {e}") from None
                stream.push_pcm(pcm)
            elif kind == VIDEO:
                if not payload:
                    raise ProtocolError("empty video frame")
                stream.push_video(payload)
            elif kind == TRANSCRIPT:
                stream.push_transcript(parse_text(payload))
            elif kind == CONTROL:
                obj = parse_json(payload)
                if obj["type"] == "model_text" and oc.accept_model_text and isinstance(obj.get("text"), str):
                    stream.push_model_text(obj["text"][: s.cfg.retrieval.max_query_chars])
                elif obj["type"] == "model_text":
                    raise ProtocolError("model_text control is disabled (orchestrator.accept_model_text = false)")
                else:
                    raise ProtocolError(f"unknown control type {obj['type']!r}")
            else:
                raise ProtocolError(f"unknown message kind 0x{kind:02x}")
        except ProtocolError as e:
            malformed += 1
            s.metrics.inc("egomem_malformed_messages_total")
            outbox.put(pack(ERROR, str(e).encode()))
            if malformed > MAX_MALFORMED:
                await _refuse(ws, CLOSE_POLICY, f"more than {MAX_MALFORMED} malformed messages")
                break
        if stream.closed.is_set():
            break


async def _refuse(ws: web.WebSocketResponse, code: int, reason: str) -> None:
    try:
        await asyncio.wait_for(ws.send_bytes(pack(ERROR, reason.encode())), 1.0)
    except (ConnectionError, RuntimeError, asyncio.TimeoutError):
        pass
    await ws.close(code=code, message=reason.encode())
