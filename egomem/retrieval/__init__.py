"""Level-2 text retrieval (docs/architecture.md#level-2-retrieval-query): parse the model's `<retr>` query, build neighbour documents,
BM25 on relation words, re-rank by sentence-embedding similarity, fit the 256-step MemChunk."""

from egomem.retrieval.documents import Document, Neighbour, build_documents, render
from egomem.retrieval.query import RetrievalQuery, parse_query
from egomem.retrieval.search import Hit, Level2Retriever, byte_count

__all__ = ["Document", "Hit", "Level2Retriever", "Neighbour", "RetrievalQuery", "build_documents", "byte_count",
           "parse_query", "render"]
