"""Lifelong memory (docs/architecture.md#memory-store): the durable store, the LLM / rule agents, the memory manager.

Entry points:
- `open_store(cfg.memory) -> MemoryStore`: users, keys, facts, preferences, summaries, persona,
  relations, sessions, job queue, dead letters, the append-only op log; `render_profile` (Level-1)
  and `neighbour_memories` (Level-2 documents).
- `submit_chunk(store, cfg.memory.chunk_dir, StreamChunk(...))`: hand a recorded chunk to the worker.
- `run_worker(cfg, stop_event)`: the memory manager over the job queue.
- Interfaces others implement: `Identifier` (egomem.identity), `TriggerLabeler` (egomem.trigger).
"""

from egomem.memory.chunk import StreamChunk, submit_chunk
from egomem.memory.errors import StoreError, VersionConflict
from egomem.memory.factory import open_store
from egomem.memory.identify import Identifier
from egomem.memory.manager import MemoryManager
from egomem.memory.segment import TriggerLabeler, decode_sessions
from egomem.memory.store import MemoryStore
from egomem.memory.types import UNKNOWN_USER, Provenance


def __getattr__(name: str):
    """`run_worker` imports lazily, so `python -m egomem.memory.worker` runs without a double import."""
    if name == "run_worker":
        from egomem.memory.worker import run_worker

        return run_worker
    raise AttributeError(f"module 'egomem.memory' has no attribute {name!r}")

__all__ = [
    "UNKNOWN_USER", "Identifier", "MemoryManager", "MemoryStore", "Provenance", "StoreError", "StreamChunk",
    "TriggerLabeler", "VersionConflict", "decode_sessions", "open_store", "run_worker", "submit_chunk",
]
