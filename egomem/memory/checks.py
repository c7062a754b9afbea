"""What a valid write is, checked the same way by every backend before it stores anything: a
user's name, a biometric key, a memory item, a persona update, a relation. Each raises `StoreError`
with the reason, or returns the value in its stored form."""

from __future__ import annotations

import numpy as np

from egomem.memory.errors import StoreError
from egomem.memory.types import PersonaUpdate


def user_name(name: str) -> str:
    """A new name for an existing user (PATCH / rename): stripped, never empty."""
    name = name.strip()
    if not name:
        raise StoreError("a user's name cannot be empty; use 'unknown_user' for an unnamed user")
    return name


def key_vector(modality: str, vector: np.ndarray) -> np.ndarray:
    """A biometric key as stored: float32 little-endian, flat, L2-normalised."""
    if modality not in ("face", "voice"):
        raise StoreError(f"modality {modality!r}; allowed: 'face', 'voice'")
    v = np.asarray(vector, dtype="<f4").reshape(-1)
    n = float(np.linalg.norm(v))
    if not np.isfinite(n) or n == 0.0:
        raise StoreError("a biometric key vector must be finite and non-zero")
    return (v / n).astype("<f4")


def memory_item(kind: str, text: str, polarity: str | None) -> None:
    """A fact, or a preference with a polarity; either with some text."""
    if kind not in ("fact", "preference"):
        raise StoreError(f"item kind {kind!r}; allowed: 'fact', 'preference'")
    if kind == "preference" and polarity not in ("like", "dislike"):
        raise StoreError(f"a preference needs polarity 'like' or 'dislike', got {polarity!r}")
    if not text.strip():
        raise StoreError("a memory item needs text")


def persona_update(u: PersonaUpdate) -> None:
    """One of the 90 dimensions, value and confidence in [0, 1]."""
    if not (0 <= u.dim < 90 and 0.0 <= u.value <= 1.0 and 0.0 <= u.confidence <= 1.0):
        raise StoreError(f"persona update out of range: {u}")


def relation_words(relation: str) -> str:
    """The relation as stored: lower case, single spaces, not empty."""
    relation = " ".join(relation.lower().split())
    if not relation:
        raise StoreError("a relation needs words (e.g. 'sister')")
    return relation
