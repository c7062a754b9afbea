"""Serving the dialog engine: streams (Triton correlation ids) mapped to engine slots, one batch per tick.

`serve_dialog_batch` is what `model_repository/dialog_lm` calls for each `execute()`: per-request
validation (a bad request gets its own error, the others are served), START/END, an optional
MemChunk refresh applied before that stream's step, then ONE batched engine step over the valid
requests. Idle streams are closed by the pool's own TTL because Triton frees idle sequences silently.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import numpy as np
import torch

from egomem.config import DialogConfig
from egomem.serving.streams import SlotTable, StreamError, admit
from egomem.serving.wire import RowError

from .card import serving_settings
from .checkpoint import DTYPES, build_lm
from .engine import DialogEngine, NoFreeSlotError
from .query_grammar import GrammarTokens, profile_relations
from .tokenizer import TextTokenizer, load_tokenizer


@dataclass
class DialogRequest:
    """One tick of one stream, as carried by a Triton request."""

    stream: int
    start: bool = False  # open the stream (fresh slot) before this tick
    end: bool = False  # close it after this tick
    listen: np.ndarray | None = None  # int64 [8] user audio codes of this tick
    memchunk_level: int | None = None  # 1 (profile) or 2 (retrieved facts): refresh before the step
    memchunk_tokens: np.ndarray | None = None  # int64 [n] text token ids for the refresh ...
    memchunk_text: str | None = None  # ... or the text, tokenized with the model's tokenizer


@dataclass
class DialogResult:
    text_token: int  # -2 while Moshi's delays warm up
    speak_codes: np.ndarray  # int64 [dep_q], -2 while warming up
    text_piece: str  # the decoded text token ("" for pad / special tokens)
    step: int  # ticks this stream has taken


def build_engine(cfg: DialogConfig, device: str | None = None) -> tuple[DialogEngine, TextTokenizer]:
    """The engine (and its text tokenizer) that `cfg` describes: weights and start temperature as `card.py`
    settles them (`dialog.weights`, else the shipped tiny model, else seeded random)."""
    if device is None or device == "auto":
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[cfg.dtype] if cfg.dtype != "auto" else (torch.bfloat16 if device == "cuda" else torch.float32)
    if cfg.threads > 0 and device == "cpu":
        torch.set_num_threads(cfg.threads)
    tokenizer = load_tokenizer(cfg.tokenizer)
    settings = serving_settings(cfg)
    lm = build_lm(cfg.preset, settings.weights, device=device, dtype=dtype, seed=cfg.seed)
    if tokenizer.vocab_size > lm.text_card + 1:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the {cfg.preset!r} model's text vocabulary "
                         f"is {lm.text_card}: set dialog.tokenizer and dialog.preset to a matching pair")
    engine = DialogEngine(lm, cfg.max_streams, l1_steps=cfg.l1_steps, l2_steps=cfg.l2_steps,
                          ring_steps=cfg.ring_steps or None, temperature=cfg.temperature, kernels=cfg.kernels,
                          start_temperature=settings.start_temperature, start_floor=cfg.start_floor,
                          top_k_text=cfg.top_k_text, top_k_audio=cfg.top_k_audio, cuda_graphs=cfg.cuda_graphs,
                          kv_dtype=torch.float8_e4m3fn if cfg.kv_cache_dtype == "fp8" else None,
                          query_grammar=GrammarTokens.from_tokenizer(tokenizer) if cfg.query_grammar else None)
    return engine, tokenizer


def stream_seed(seed: int, stream: int) -> int:
    """A stream's draw seed from the server's seed and its id (Triton's correlation id): 32 bits, mixed."""
    return int(hashlib.blake2b(f"{seed}:{stream}".encode(), digest_size=4).hexdigest(), 16)


class DialogStreamPool:
    """Stream ids -> engine slots, with a TTL for streams Triton forgot. Thread-safe."""

    def __init__(self, engine: DialogEngine, tokenizer: TextTokenizer, ttl_s: float = 600.0,
                 seed: int | None = None):
        """`seed` (`dialog.seed` when served): each stream's turn-start draws follow from it and the stream id
        (`stream_seed`), so a stream replays exactly whatever else is served beside it; None: torch's generator."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.ttl_s = ttl_s
        self.seed = seed
        self._slots = SlotTable("dialog")
        self._lock = threading.Lock()

    def is_open(self, stream: int) -> bool:
        return stream in self._slots

    @property
    def open_streams(self) -> int:
        return len(self._slots)

    def open(self, stream: int) -> int:
        """Open (or restart from scratch) a stream; returns its slot."""
        self._slots.reclaim_idle(self.ttl_s, self.close)
        old = self._slots.pop(stream)
        if old is not None:
            self.engine.close(old)
        try:
            slot = self.engine.open(None if self.seed is None else stream_seed(self.seed, stream))
        except NoFreeSlotError as e:
            raise StreamError(f"{e} (dialog.max_streams = {self.engine.max_streams})", RowError.NO_FREE_SLOT) from e
        self._slots.put(stream, slot)
        return slot

    def close(self, stream: int) -> None:
        slot = self._slots.pop(stream)
        if slot is not None:
            self.engine.close(slot)

    def _memchunk_tokens(self, r: DialogRequest) -> list[int] | None:
        if r.memchunk_level is None:
            if r.memchunk_tokens is not None or r.memchunk_text is not None:
                raise StreamError("MEMCHUNK_TOKENS / MEMCHUNK_TEXT need MEMCHUNK_LEVEL (1 or 2)")
            return None
        if (r.memchunk_tokens is None) == (r.memchunk_text is None):
            raise StreamError("a MemChunk refresh carries exactly one of MEMCHUNK_TOKENS or MEMCHUNK_TEXT")
        if r.memchunk_text is not None:
            return self.tokenizer.encode(r.memchunk_text)
        return [int(t) for t in np.asarray(r.memchunk_tokens).reshape(-1)]

    def serve(self, requests: list[DialogRequest]) -> list[DialogResult | StreamError]:
        """One Triton batch = one engine tick over every valid request."""
        with self._lock:
            results: list[DialogResult | StreamError | None] = [None] * len(requests)
            n_listen = self.engine.lm.num_codebooks - self.engine.lm.dep_q - 1
            card = self.engine.lm.card
            for i, r in enumerate(requests):
                try:
                    admit(self, r.stream, r.start)
                    self._slots.touch(r.stream)
                    if r.listen is None or np.asarray(r.listen).shape != (n_listen,):
                        shape = None if r.listen is None else list(np.asarray(r.listen).shape)
                        raise StreamError(f"LISTEN_CODES must hold {n_listen} codes, got shape {shape}")
                    if not ((r.listen >= 0) & (r.listen < card)).all():
                        raise StreamError(f"LISTEN_CODES must be in [0, {card})")
                    tokens = self._memchunk_tokens(r)
                    if tokens is not None:
                        self.engine.write_memchunk(self._slots[r.stream], r.memchunk_level, tokens)
                        if r.memchunk_level == 1 and self.engine.grammar is not None:  # the profile's relations
                            text = r.memchunk_text if r.memchunk_text is not None else self.tokenizer.decode(tokens)
                            self.engine.set_query_relations(self._slots[r.stream], [
                                self.tokenizer.encode(rel) for rel in profile_relations(text)])
                except (StreamError, ValueError, KeyError) as e:
                    results[i] = e if isinstance(e, StreamError) else StreamError(str(e))
            ok = [i for i, res in enumerate(results) if res is None]
            if ok:
                slots = [self._slots[requests[i].stream] for i in ok]
                listen = torch.from_numpy(np.stack([np.asarray(requests[i].listen, dtype=np.int64) for i in ok]))
                text, speak, steps = self.engine.tick(slots, listen)
                text, speak, steps = text.cpu().numpy(), speak.cpu().numpy(), steps.cpu().numpy()
                for j, i in enumerate(ok):
                    tok = int(text[j])
                    piece = self.tokenizer.decode([tok]) if tok >= 0 else ""
                    results[i] = DialogResult(tok, speak[j], piece, int(steps[j]))
            for r in requests:
                if r.end:
                    self.close(r.stream)
            return results
