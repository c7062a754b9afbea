"""`/api/chat`: the WebSocket handler (Moshi's binary protocol plus EgoMem's kinds, egomem/protocol.py).

Admission: a free stream slot or a close with 1013 "no free stream slot". Reading: each message is
checked (kind, size, rate, payload) — a malformed one gets a 0x05 error and is dropped; a client
that keeps sending garbage, or over the rate limit, is closed with 1008 after its errors were sent.
Audio is bounded per message and per second and decoded off the event loop (orchestrator/audio_input.py),
so one client's audio can never stall the others' ticks. Writing: a bounded outbox drained by its own
task, so a slow or vanished client never blocks the stream's ticks; errors are never dropped from it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid

from aiohttp import WSMsgType, web

from egomem.protocol import (
    AUDIO,
    CLOSE_POLICY,
    CLOSE_TRY_LATER,
    CONTROL,
    ERROR,
    TRANSCRIPT,
    VIDEO,
    ProtocolError,
    check_video_frame,
    pack,
    parse_json,
    parse_text,
    unpack,
)

from .audio_input import AudioInput
from .services import SERVICES, Services
from .stream import Stream

log = logging.getLogger(__name__)
MAX_MALFORMED = 20  # malformed messages tolerated per stream before it is closed
SEND_TIMEOUT_S = 5.0  # one send blocked this long: the client is gone
FLUSH_TIMEOUT_S = 2.0  # before a close, queued messages (the errors that explain it) get this long to go out


class Outbox:
    """Bounded outbound queue. When full, audio goes first, then the oldest text or event. 0x05 errors
    are never dropped: each answers a client message that counts toward the malformed close, so at
    most MAX_MALFORMED + 2 of them are ever queued (a new non-error is dropped when only errors are)."""

    def __init__(self, capacity: int, on_drop):
        self.capacity = capacity
        self.q: collections.deque[bytes] = collections.deque()
        self.ready = asyncio.Event()
        self.closed = False  # nothing more is taken
        self.final = False  # the stream is being closed: only errors are still taken
        self.sending = False  # a message is on its way out (popped, not yet sent)
        self.gone = False  # the drain task ended: nothing queued will be sent
        self.idle = asyncio.Event()  # nothing queued, nothing on its way out (or the drain task ended)
        self.idle.set()
        self.on_drop = on_drop

    def put(self, msg: bytes) -> None:
        if self.closed or (self.final and msg[0] != ERROR):
            return
        if len(self.q) >= self.capacity:
            victim = next((m for m in self.q if m[0] == AUDIO), None)
            if victim is None and msg[0] == AUDIO:
                self.on_drop()
                return
            if victim is None:
                victim = next((m for m in self.q if m[0] != ERROR), None)
            if victim is not None:
                self.q.remove(victim)
                self.on_drop()
            elif msg[0] != ERROR:  # only errors queued: they stay, the newcomer goes
                self.on_drop()
                return
        self.q.append(msg)
        self.idle.clear()
        self.ready.set()

    def finish(self) -> None:
        """The stream is closing: drop queued audio (its moment has passed), take only errors from now."""
        self.final = True
        for m in [m for m in self.q if m[0] == AUDIO]:
            self.q.remove(m)
        if not self.q and not self.sending:
            self.idle.set()

    async def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Wait until everything queued was sent, the client is gone, or `timeout_s` passed."""
        try:
            await asyncio.wait_for(self.idle.wait(), timeout_s)
        except TimeoutError:
            pass

    async def drain(self, ws: web.WebSocketResponse) -> None:
        try:
            while True:
                await self.ready.wait()
                self.ready.clear()
                while self.q:
                    msg = self.q.popleft()
                    if ws.closed:
                        return
                    self.sending = True
                    try:
                        await asyncio.wait_for(ws.send_bytes(msg), SEND_TIMEOUT_S)
                    except (TimeoutError, ConnectionError, RuntimeError):
                        return  # the client is gone; the reader loop ends too
                    finally:
                        self.sending = False
                self.idle.set()  # the queue is empty and its last message went out
        finally:
            self.gone = True
            self.idle.set()


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
    s = request.app[SERVICES]
    oc = s.cfg.orchestrator
    # aiohttp refuses a message of max_msg_size bytes or more; ours is "over max_message_bytes" (README)
    ws = web.WebSocketResponse(max_msg_size=oc.max_message_bytes + 1, heartbeat=20.0)
    await ws.prepare(request)
    if s.free_slots <= 0:
        s.metrics.inc("egomem_streams_rejected_total")
        await ws.close(code=CLOSE_TRY_LATER, message=f"no free stream slot (max {oc.max_streams})".encode())
        return ws
    stream_id = uuid.uuid4().hex[:16]
    outbox = Outbox(oc.send_queue_messages, lambda: s.metrics.inc("egomem_dropped_output_messages_total"))
    stream = Stream(s, stream_id, outbox.put)
    s.add_stream(stream_id, stream)
    s.metrics.inc("egomem_streams_total")
    writer = asyncio.create_task(outbox.drain(ws))
    runner = asyncio.create_task(stream.run())
    closer = asyncio.create_task(_close_when_done(stream, runner, ws, outbox))
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
        s.drop_stream(stream_id)
        log.info("stream %s closed after %d ticks%s", stream_id, stream.ticks,
                 f" ({stream.failure})" if stream.failure else "")
    return ws


async def _close_when_done(stream: Stream, runner: asyncio.Task, ws: web.WebSocketResponse, outbox: Outbox) -> None:
    """When the stream's ticks end on their own (a model failure), tell the client and close."""
    ended = asyncio.ensure_future(stream.ticking_ended.wait())  # set once run() knows its failure, if any
    try:
        await asyncio.wait([ended, runner], return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()
    if stream.failure is not None and not ws.closed:
        stream.s.metrics.inc("egomem_stream_failures_total")
        await _refuse(ws, outbox, stream.failure.close_code, str(stream.failure))


async def _read(ws: web.WebSocketResponse, stream: Stream, s: Services, outbox: Outbox) -> None:
    """Every client message until the client leaves, the stream ends, or a limit closes it. Every
    malformed message gets its 0x05 error; the (MAX_MALFORMED + 1)th also closes with 1008."""
    oc = s.cfg.orchestrator
    audio = AudioInput(oc, stream.stream_id)
    rate = RateLimit(oc.max_messages_per_s)
    malformed = 0
    try:
        async for msg in ws:
            if msg.type == WSMsgType.ERROR:  # e.g. over max_message_bytes: aiohttp closes with 1009
                s.metrics.inc("egomem_malformed_messages_total")
                break
            if not rate.allow():
                s.metrics.inc("egomem_malformed_messages_total")
                await _refuse(ws, outbox, CLOSE_POLICY, f"over {oc.max_messages_per_s:g} messages per second")
                break
            try:
                if msg.type != WSMsgType.BINARY:
                    raise ProtocolError("messages are binary frames: one kind byte, then the payload")
                kind, payload = unpack(msg.data)
                if kind == AUDIO:
                    stream.push_pcm(await audio.decode(payload))  # bounded, then decoded on the stream's thread
                elif kind == VIDEO:
                    check_video_frame(payload)
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
                    await _refuse(ws, outbox, CLOSE_POLICY, f"more than {MAX_MALFORMED} malformed messages")
                    break
            if stream.closed.is_set():
                break
    finally:
        audio.close()


async def _refuse(ws: web.WebSocketResponse, outbox: Outbox, code: int, reason: str) -> None:
    """Close the stream with `code`: the errors already queued go out first, then `reason` as a last
    0x05 error, then the close frame (whose reason is cut to the 123 bytes a close frame holds)."""
    outbox.finish()
    outbox.put(pack(ERROR, reason.encode()))
    await outbox.flush()
    outbox.closed = True
    if not ws.closed:
        await ws.close(code=code, message=reason.encode()[:120].decode("utf-8", "ignore").encode())
