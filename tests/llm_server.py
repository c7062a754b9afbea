"""A local aiohttp server speaking the OpenAI chat-completions and audio-transcriptions protocols.

Tests script its behaviour per request: `push(("ok", obj))`, `("malformed", text)`,
`("status", 429)`, `("timeout", seconds)`; with nothing scripted it answers with
`responder(request_json) -> obj`. Every request is recorded in `requests` / `transcriptions`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import web


class FakeOpenAIServer:
    def __init__(self, model: str = "fake-model"):
        self.model = model
        self.script: deque[tuple[str, Any]] = deque()
        self.responder: Callable[[dict[str, Any]], Any] = lambda req: {}
        self.requests: list[dict[str, Any]] = []
        self.transcriptions: list[dict[str, Any]] = []
        self.transcription_files: list[bytes] = []  # the uploaded audio files, in order
        self.transcription_languages: list[str | None] = []
        self.transcript_text = "my name is Zelda and I live in Oslo."
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def push(self, *actions: tuple[str, Any]) -> None:
        self.script.extend(actions)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        kind, arg = self.script.popleft() if self.script else ("ok", None)
        if kind == "status":
            return web.json_response({"error": {"message": f"scripted {arg}", "type": "server_error"}}, status=arg,
                                     headers={"retry-after": "0"} if arg == 429 else None)
        if kind == "timeout":
            await asyncio.sleep(arg)
            kind, arg = "ok", None
        if kind == "malformed":
            content = arg
        else:
            content = json.dumps(arg if arg is not None else self.responder(body))
        return web.json_response({
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })

    async def _transcribe(self, request: web.Request) -> web.Response:
        form = await request.post()
        data = form["file"].file.read()
        self.transcriptions.append({"model": form.get("model"), "bytes": len(data)})
        self.transcription_files.append(data)
        self.transcription_languages.append(form.get("language"))
        return web.json_response({"text": self.transcript_text})

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/audio/transcriptions", self._transcribe)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def start(self) -> FakeOpenAIServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
