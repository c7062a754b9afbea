"""Query detection on one stream's text channel -> Level-2 retrieval -> an L2 refresh
(docs/architecture.md, "Query detection").

The model's text (and `model_text` control messages) is watched for a complete `<retr>...<answer>`;
each query found runs as a task: the store and the `text_encoder` model are asked in a worker
thread, the hits go to the client (`retrieval` event) and into the MemChunk (an L2 refresh), unless
the person changed meanwhile. A failed retrieval is a warning; it never ends the dialog.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from egomem.config import Config
from egomem.protocol import pack_event
from egomem.retrieval import RetrievalQuery, parse_query

from .memchunk import MemChunk
from .metrics import Metrics
from .perception import Perception

MAX_TEXT_CHANNEL = 4000  # characters of the model's text kept for query detection


class QueryDetector:
    def __init__(self, perception: Perception | None, cfg: Config, metrics: Metrics, memchunk: MemChunk,
                 send: Callable[[bytes], None]):
        self.p, self.cfg, self.metrics, self.memchunk, self.send = perception, cfg, metrics, memchunk, send
        self.enabled = perception is not None and cfg.orchestrator.retrieval
        self._text_channel = ""
        self._tasks: list[asyncio.Task] = []  # retrievals under way

    def on_text(self, piece: str) -> None:
        self._text_channel = (self._text_channel + piece)[-MAX_TEXT_CHANNEL:]
        if ">" not in piece or not self.enabled:
            return
        query = parse_query(self._text_channel, self.cfg.retrieval.max_query_chars)
        if query is None:
            return
        self._text_channel = ""  # this query is handled; the next one starts fresh
        self._tasks.append(asyncio.create_task(self._retrieve(query)))

    async def close(self) -> None:
        """Cancel the retrievals still under way and wait for them to end."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _retrieve(self, query: RetrievalQuery) -> None:
        t0 = time.monotonic()
        user = self.memchunk.user_id
        try:
            hits = await asyncio.to_thread(self.p.retrieve, user, query)
        except Exception as e:  # noqa: BLE001 - a failed retrieval must not end the dialog
            self.metrics.inc("egomem_triton_errors_total")
            self.send(pack_event("warning", message=f"retrieval failed: {e}"))
            return
        dt = time.monotonic() - t0
        self.metrics.observe("egomem_retrieval_seconds", dt)
        if self.memchunk.user_id != user:  # the person changed or was forgotten meanwhile: not theirs
            return
        texts = [h.document.text() for h in hits]
        self.send(pack_event("retrieval", user_id=user, query={"relations": list(query.relations),
                                                              "keywords": list(query.keywords)},
                             results=texts, latency_ms=round(dt * 1000, 1)))
        self.memchunk.request(2, "\n".join(texts), user)
