"""Level-2 text retrieval: BM25 on relation words, re-rank by embedding similarity, fit the MemChunk.

docs/architecture.md#level-2-retrieval-query. For a query (relation group R, keyword group K) over the documents of the current
user's neighbours:
  1. R given: BM25 (bm25s) over each document's relation words (with the words users say for it,
     `egomem.relations.also_called`: "mom" finds "mother") + name words; the top `bm25_candidates`
     with a positive score go on. No document matches R (a word the table does not know): all
     documents go on and R joins K in the re-rank text. R empty: all documents go on.
  2. K given (or R unmatched): re-rank the candidates by cosine similarity between the embedded
     joined keywords and each embedded document; BM25 breaks ties. K empty: BM25 order.
  3. Take documents in rank order, at most `top_k`, while the rendered text (one per line) fits
     `memchunk_steps` text tokens as counted by `count_tokens` (default: UTF-8 bytes, which is what
     the dialog engine's offline byte-level tokenizer produces; pass the real tokenizer otherwise).
Document embeddings are cached by text, so a stored memory item is embedded once.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from egomem.config import RetrievalConfig
from egomem.relations import also_called
from egomem.retrieval.documents import Document, Neighbour, build_documents, render
from egomem.retrieval.encoder import TextEncoder
from egomem.retrieval.query import RetrievalQuery, parse_query

_WORD = re.compile(r"\w+", re.UNICODE)


def byte_count(text: str) -> int:
    """Tokens of the byte-level tokenizer: one per UTF-8 byte."""
    return len(text.encode("utf-8"))


def tokenize(text: str) -> list[str]:
    """Lower-case words with possessives and plain plurals folded ("sisters'" / "sister's" -> "sister")."""
    out = []
    for w in _WORD.findall(text.lower()):
        if len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
            w = w[:-1]
        out.append(w)
    return out


@dataclass(frozen=True)
class Hit:
    document: Document
    score: float  # what the rank used: embedding similarity when re-ranked, else BM25
    bm25: float


class Level2Retriever:
    """Ranks neighbour documents for a parsed query and cuts the list to the Level-2 token budget."""

    def __init__(self, encoder: TextEncoder | None, bm25_candidates: int = 50, top_k: int = 8,
                 memchunk_steps: int = 256, count_tokens: Callable[[str], int] = byte_count,
                 cache_size: int = 100_000, max_query_chars: int = 2000) -> None:
        self.encoder = encoder  # None: BM25 only (keywords then only count as BM25 words)
        self.bm25_candidates = int(bm25_candidates)
        self.top_k = int(top_k)
        self.memchunk_steps = int(memchunk_steps)
        self.count_tokens = count_tokens
        self.cache_size = int(cache_size)
        self.max_query_chars = int(max_query_chars)
        self._cache: dict[str, np.ndarray] = {}
        self._bm25_last: tuple[tuple[str, ...], object, set[str]] | None = None

    @classmethod
    def from_config(cls, cfg: RetrievalConfig, encoder: TextEncoder | None, memchunk_steps: int,
                    count_tokens: Callable[[str], int] = byte_count) -> Level2Retriever:
        """`memchunk_steps`: the Level-2 MemChunk's length, dialog.l2_steps (the setting's one place)."""
        return cls(encoder, cfg.bm25_candidates, cfg.top_k, memchunk_steps, count_tokens,
                   max_query_chars=cfg.max_query_chars)

    # -- ranking --------------------------------------------------------------------------------

    def rank(self, query: RetrievalQuery, docs: Sequence[Document]) -> list[Hit]:
        """Every candidate document, best first (no budget applied)."""
        if not docs or not query:
            return []
        bm25 = np.zeros(len(docs), np.float64)
        cand = np.arange(len(docs))
        rerank_words = list(query.keywords)
        if query.relations:
            bm25 = self._bm25([f"{also_called(d.relation)} {d.name}" for d in docs], tokenize(" ".join(query.relations)))
            matched = np.flatnonzero(bm25 > 0)
            if matched.size:
                cand = matched[np.argsort(-bm25[matched], kind="stable")][: self.bm25_candidates]
            else:
                rerank_words = list(query.relations) + rerank_words  # relation unknown to BM25: let meaning decide
        if rerank_words and self.encoder is not None:
            q = self.encoder.encode([", ".join(rerank_words)])[0]
            sim = self._doc_vectors([docs[i] for i in cand]) @ q  # [C]
            order = np.lexsort((-bm25[cand], -sim))  # by similarity, then BM25
            return [Hit(docs[cand[i]], float(sim[i]), float(bm25[cand[i]])) for i in order]
        if rerank_words:  # no encoder: keywords act as extra BM25 words over the whole document
            bm25 = bm25 + self._bm25([d.text() for d in docs], tokenize(" ".join(rerank_words)))
            cand = np.flatnonzero(bm25 > 0)
        cand = cand[np.argsort(-bm25[cand], kind="stable")]
        return [Hit(docs[i], float(bm25[i]), float(bm25[i])) for i in cand]

    def retrieve(self, query: RetrievalQuery | None, neighbours: Iterable[Neighbour] | Sequence[Document]) -> list[Hit]:
        """The ranked documents that fit the Level-2 MemChunk (at most `top_k`)."""
        if query is None:
            return []
        items = list(neighbours)
        docs = build_documents(items) if items and isinstance(items[0], Neighbour) else items
        chosen: list[Hit] = []
        used = 0
        for hit in self.rank(query, docs):
            line = hit.document.text()
            cost = self.count_tokens(line) + (self.count_tokens("\n") if chosen else 0)
            if used + cost <= self.memchunk_steps:
                chosen.append(hit)
                used += cost
                if len(chosen) == self.top_k:
                    break
        return chosen

    def answer(self, text: str, neighbours: Iterable[Neighbour]) -> str:
        """Parse the model's query out of `text` and return the Level-2 MemChunk text ("" when nothing)."""
        hits = self.retrieve(parse_query(text, self.max_query_chars), neighbours)
        return render(h.document for h in hits)

    def clear(self) -> None:
        """Drop the embedding cache and the last BM25 index. Documents are rebuilt from the store on
        every query, so nothing stale is ever *returned*; but both caches hold document texts, so a
        forget clears them to leave no copy of a forgotten person's memories in this process."""
        self._cache.clear()
        self._bm25_last = None

    def warm(self, docs: Sequence[Document]) -> None:
        """Embed documents ahead of queries (e.g. when the memory manager stores new facts)."""
        if self.encoder is not None and docs:
            self._doc_vectors(docs)

    # -- helpers --------------------------------------------------------------------------------

    def _bm25(self, texts: list[str], query_tokens: list[str]) -> np.ndarray:
        """BM25 score of every text for the query words; the last index built is reused (same neighbours)."""
        import bm25s

        key = tuple(texts)
        cached = self._bm25_last
        if cached is None or cached[0] != key:
            corpus = [tokenize(t) or [""] for t in texts]
            index = bm25s.BM25()
            index.index(corpus, show_progress=False)
            cached = self._bm25_last = (key, index, {w for doc in corpus for w in doc})
        _, index, vocab = cached
        q = [w for w in query_tokens if w in vocab]
        if not q:
            return np.zeros(len(texts), np.float64)
        return np.asarray(index.get_scores(q), dtype=np.float64)

    def _doc_vectors(self, docs: Sequence[Document]) -> np.ndarray:
        assert self.encoder is not None
        texts = [d.text() for d in docs]
        todo = list(dict.fromkeys(t for t in texts if t not in self._cache))
        if todo:
            if len(self._cache) + len(todo) > self.cache_size:
                self._cache.clear()  # simple bound; stored memories re-embed on the next query
                todo = list(dict.fromkeys(texts))
            for t, v in zip(todo, self.encoder.encode(todo)):
                self._cache[t] = v
        return np.stack([self._cache[t] for t in texts])  # [N, D]
