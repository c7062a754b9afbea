"""The dialog engine: batched full-duplex RQ-Transformer streams with MemChunk KV slots (docs/kv-cache.md#memchunk-kv-layout)."""

from .checkpoint import CheckpointError, build_lm
from .engine import DialogEngine, NoFreeSlotError
from .kv_cache import MemChunkKVCache
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["CheckpointError", "build_lm", "DialogEngine", "NoFreeSlotError", "MemChunkKVCache", "ByteTokenizer",
           "load_tokenizer"]
