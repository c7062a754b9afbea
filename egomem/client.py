"""Python client for the orchestrator: REST (admin) and `/api/chat` streams (egomem/protocol.py).

Used by `egomem chat`, `egomem demo`, the tests and the load benchmark. Asynchronous (aiohttp):

    async with EgoMemClient("http://127.0.0.1:8998", token) as c:
        users = await c.users()
        async with c.chat() as chat:            # opens the WebSocket, waits for the 0x00 handshake
            await chat.send_pcm(pcm_24k)          # float32 mono 24 kHz, Opus-encoded here
            await chat.send_video(jpeg_bytes)
            ev = await chat.wait_event("user_recognised", timeout=10)

A `ChatSession` collects what the server sends: `events` (dicts), `text` (the model's text
channel), `pcm` (decoded model audio) and `errors`, with arrival times for latency measurements.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from egomem import protocol as P


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class ChatRefused(ConnectionError):
    """The server closed the chat before or right after the handshake (no slot, auth, limits)."""

    def __init__(self, code: int | None, reason: str):
        super().__init__(f"chat refused (close code {code}): {reason}")
        self.code = code
        self.reason = reason


@dataclass
class ChatSession:
    ws: aiohttp.ClientWebSocketResponse
    events: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""
    errors: list[str] = field(default_factory=list)
    audio_chunks: list[tuple[float, np.ndarray]] = field(default_factory=list)  # (arrival time, pcm)
    opened_at: float = 0.0
    close_code: int | None = None
    close_reason: str = ""
    stream_id: str | None = None  # from the server's stream_open event (set by whoever reads it)

    def __post_init__(self) -> None:
        import sphn

        self._opus_out = sphn.OpusStreamWriter(P.SAMPLE_RATE)
        self._opus_in = sphn.OpusStreamReader(P.SAMPLE_RATE)
        self._changed = asyncio.Event()
        self._reader: asyncio.Task | None = None
        self.handshake = asyncio.Event()

    # -- sending ---------------------------------------------------------------------------------
    async def send_pcm(self, pcm: np.ndarray) -> None:
        """Opus-encode float32 24 kHz mono and send what the encoder has ready (it buffers 20 ms pages)."""
        data = self._opus_out.append_pcm(np.asarray(pcm, np.float32).reshape(-1))
        if len(data):
            await self.ws.send_bytes(P.pack(P.AUDIO, data))

    async def send_video(self, image_bytes: bytes) -> None:
        await self.ws.send_bytes(P.pack(P.VIDEO, image_bytes))

    async def send_transcript(self, text: str) -> None:
        await self.ws.send_bytes(P.pack(P.TRANSCRIPT, text.encode("utf-8")))

    async def send_model_text(self, text: str) -> None:
        await self.ws.send_bytes(P.pack(P.CONTROL, json.dumps({"type": "model_text", "text": text}).encode()))

    async def send_raw(self, data: bytes | str) -> None:
        if isinstance(data, str):
            await self.ws.send_str(data)
        else:
            await self.ws.send_bytes(data)

    async def close(self) -> None:
        await self.ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    # -- receiving -------------------------------------------------------------------------------
    @property
    def pcm(self) -> np.ndarray:
        return np.concatenate([c for _, c in self.audio_chunks]) if self.audio_chunks else np.zeros(0, np.float32)

    @property
    def closed(self) -> bool:
        return self.ws.closed

    async def _read(self) -> None:
        while True:
            msg = await self.ws.receive()
            if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED,
                            aiohttp.WSMsgType.ERROR):
                if msg.type == aiohttp.WSMsgType.CLOSE:
                    self.close_reason = str(msg.extra or "")
                break
            if msg.type != aiohttp.WSMsgType.BINARY or not msg.data:
                continue
            kind, payload = msg.data[0], msg.data[1:]
            now = time.monotonic()
            if kind == P.HANDSHAKE:
                self.opened_at = now
                self.handshake.set()
            elif kind == P.AUDIO:
                pcm = self._opus_in.append_bytes(payload)
                if pcm.size:
                    self.audio_chunks.append((now, pcm))
            elif kind == P.TEXT:
                self.text += payload.decode("utf-8", "replace")
            elif kind == P.EVENT:
                ev = json.loads(payload)
                ev["_t"] = now
                self.events.append(ev)
            elif kind == P.ERROR:
                self.errors.append(payload.decode("utf-8", "replace"))
            self._changed.set()
        if not self.ws.closed:
            await self.ws.close()
        self.close_code = self.ws.close_code
        self._changed.set()

    def find(self, type_: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == type_ and all(e.get(k) == v for k, v in match.items())]

    async def wait_for(self, predicate, timeout: float) -> Any:
        """Wait until `predicate(self)` is truthy (returns it) or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            got = predicate(self)
            if got:
                return got
            if self.ws.closed and self._reader is not None and self._reader.done():
                raise ConnectionError(f"chat closed (code {self.close_code}) while waiting; errors: {self.errors}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out waiting on the chat stream")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 0.1))
            except TimeoutError:
                pass

    async def wait_event(self, type_: str, timeout: float = 10.0, after: int = 0, **match: Any) -> dict[str, Any]:
        """The first event of `type_` (matching `match`) among events[after:]."""
        def pred(s: ChatSession):
            hits = [e for e in s.events[after:] if e["type"] == type_ and all(e.get(k) == v for k, v in match.items())]
            return hits[0] if hits else None
        return await self.wait_for(pred, timeout)


class EgoMemClient:
    def __init__(self, base_url: str, token: str | None, timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self._session: aiohttp.ClientSession | None = None
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def __aenter__(self) -> EgoMemClient:
        self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use `async with EgoMemClient(...)`")
        return self._session

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def request(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        params = {k: str(v) for k, v in params.items() if v is not None}
        async with self.session.request(method, self.base_url + path, json=body, params=params,
                                        headers=self._headers()) as r:
            text = await r.text()
            if r.status >= 400:
                try:
                    msg = json.loads(text).get("error", text)
                except (json.JSONDecodeError, AttributeError):
                    msg = text
                raise ApiError(r.status, msg)
            return json.loads(text) if r.content_type == "application/json" else text

    # -- REST ------------------------------------------------------------------------------------
    async def health(self) -> dict:
        return await self.request("GET", "/healthz")

    async def ready(self) -> bool:
        try:
            return bool((await self.request("GET", "/readyz"))["ready"])
        except (ApiError, aiohttp.ClientError):
            return False

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not await self.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"orchestrator at {self.base_url} not ready after {timeout:.0f} s")
            await asyncio.sleep(0.5)

    async def metrics(self) -> str:
        return await self.request("GET", "/metrics")

    async def users(self) -> list[dict]:
        return (await self.request("GET", "/api/users"))["users"]

    async def user(self, user_id: str) -> dict:
        return await self.request("GET", f"/api/users/{user_id}")

    async def rename(self, user_id: str, name: str) -> dict:
        return (await self.request("PATCH", f"/api/users/{user_id}", {"name": name}))["user"]

    async def merge(self, keep_id: str, drop_id: str) -> dict:
        return (await self.request("POST", f"/api/users/{keep_id}/merge", {"drop_user_id": drop_id}))["user"]

    async def forget(self, user_id: str) -> dict:
        return await self.request("DELETE", f"/api/users/{user_id}")

    async def facts(self, user_id: str, history: bool = False) -> list[dict]:
        return (await self.request("GET", f"/api/users/{user_id}/facts", history=int(history)))["items"]

    async def add_fact(self, user_id: str, text: str) -> str:
        return (await self.request("POST", f"/api/users/{user_id}/facts", {"text": text}))["item_id"]

    async def relations(self, user_id: str) -> list[dict]:
        return (await self.request("GET", f"/api/users/{user_id}/relations"))["relations"]

    async def add_relation(self, user_id: str, other_user_id: str, relation: str) -> str:
        body = {"other_user_id": other_user_id, "relation": relation}
        return (await self.request("POST", f"/api/users/{user_id}/relations", body))["relation_id"]

    async def sessions(self, user_id: str | None = None, stream_id: str | None = None) -> list[dict]:
        return (await self.request("GET", "/api/sessions", user_id=user_id, stream_id=stream_id))["sessions"]

    async def oplog(self, user_id: str | None = None, after: int = 0) -> list[dict]:
        return (await self.request("GET", "/api/oplog", user_id=user_id, after=after))["entries"]

    async def jobs(self, status: str | None = None) -> list[dict]:
        return (await self.request("GET", "/api/jobs", status=status))["jobs"]

    async def wait_jobs_done(self, timeout: float, stream_id: str | None = None) -> list[dict]:
        """Wait until no memory job is queued or running (and, with `stream_id`, until that stream's
        final job exists: a stream's last chunk is handed over just after it closes); returns all jobs."""
        deadline = time.monotonic() + timeout
        while True:
            jobs = await self.jobs()
            mine = [j for j in jobs if stream_id is None or f":{stream_id}:" in j["key"]]
            if mine and all(j["status"] in ("done", "dead") for j in jobs):
                return jobs
            if time.monotonic() > deadline:
                raise TimeoutError(f"memory jobs not done after {timeout:.0f} s: {[j['status'] for j in jobs]}")
            await asyncio.sleep(0.5)

    # -- chat --------------------------------------------------------------------------------------
    def chat(self, handshake_timeout: float = 10.0) -> _ChatContext:
        return _ChatContext(self, handshake_timeout)

    async def open_chat(self, handshake_timeout: float = 10.0) -> ChatSession:
        url = self.base_url.replace("http://", "ws://").replace("https://", "wss://") + "/api/chat"
        ws = await self.session.ws_connect(url, headers=self._headers(), max_msg_size=0, autoping=True)
        chat = ChatSession(ws)
        chat._reader = asyncio.create_task(chat._read())
        done, _ = await asyncio.wait([chat._reader, asyncio.create_task(chat.handshake.wait())],
                                     timeout=handshake_timeout, return_when=asyncio.FIRST_COMPLETED)
        if not chat.handshake.is_set():
            await chat.close()
            raise ChatRefused(chat.close_code or ws.close_code, chat.close_reason or "; ".join(chat.errors) or "no handshake")
        return chat


class _ChatContext:
    def __init__(self, client: EgoMemClient, timeout: float):
        self.client, self.timeout = client, timeout
        self.chat: ChatSession | None = None

    async def __aenter__(self) -> ChatSession:
        self.chat = await self.client.open_chat(self.timeout)
        return self.chat

    async def __aexit__(self, *exc) -> None:
        if self.chat is not None:
            await self.chat.close()


async def stream_audio(chat: ChatSession, pcm: np.ndarray, realtime: bool = True, frame: int = P.FRAME_SAMPLES) -> None:
    """Send `pcm` frame by frame, paced at real time (or as fast as possible)."""
    t0 = time.monotonic()
    for i in range(0, len(pcm), frame):
        if chat.closed:
            return
        await chat.send_pcm(pcm[i:i + frame])
        if realtime:
            delay = t0 + (i // frame + 1) * P.TICK_S - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
