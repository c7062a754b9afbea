"""The one identifier of the system: `Identifier` over the memory store's biometric keys.

Live streams (the orchestrator's 2 s polls) and the memory worker (who is this session's user?)
must agree about who someone is, and must search the keys under the same model ids. Both build a
`StoreBackedIdentifier` from `[identity]`: the configured backends' model ids and thresholds,
adaptive s-norm with the same cohort, the same face/voice conflict rule. Its faiss index is rebuilt
from the store whenever `store.keys_generation()` changes (enrolment, merge, forget), so a key
written by one process is searched by the others at their next call.

The store is taken as a small protocol (`KeySource`), so this package does not import
`egomem.memory` (which imports it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

from egomem.config import IdentityConfig
from egomem.identity.identify import Identification, Identifier
from egomem.identity.index import KeyRecord, UserKeyIndex


class KeySource(Protocol):
    """What the identifier needs of the memory store."""

    def keys_generation(self) -> int: ...

    def list_keys(self) -> Iterable[Any]:  # objects with user_id, modality, model_id, vector
        ...


class StoreBackedIdentifier:
    """Thread-safe `identify` over the store's keys with the thresholds and model ids of `[identity]`."""

    def __init__(self, store: KeySource, cfg: IdentityConfig, use_snorm: bool = True) -> None:
        self.store = store
        self.identifier = Identifier.from_config(cfg, use_snorm=use_snorm)
        self._lock = threading.Lock()
        self._generation: int | None = None

    @property
    def face_model_id(self) -> str:
        return self.identifier.face_model_id

    @property
    def voice_model_id(self) -> str:
        return self.identifier.voice_model_id

    def _sync(self) -> None:
        """Rebuild the index when the store's keys changed since the last call (caller holds the lock)."""
        gen = self.store.keys_generation()
        if gen == self._generation:
            return
        self.identifier.index = UserKeyIndex.rebuild(
            KeyRecord(k.user_id, k.modality, k.model_id, np.asarray(k.vector, np.float32)) for k in self.store.list_keys())
        self._generation = gen

    def identify(self, face_vecs: np.ndarray | None, voice_vec: np.ndarray | None, speaker: int = 0) -> Identification:
        """face_vecs [F, D] (row `speaker` is the speaker candidate), voice_vec [D]; either may be None."""
        with self._lock:
            self._sync()
            return self.identifier.identify(face_vecs, voice_vec, speaker=max(speaker, 0))

    def invalidate(self) -> None:
        """Rebuild at the next call even if the store's generation looks unchanged (after a forget).
        Lock-free on purpose: a forget must never wait behind an identification's index rebuild; a
        rebuild racing with it still sees the store's bumped generation at the next call."""
        self._generation = None

    def indexed_users(self) -> set[str]:
        """Users with at least one key the configured models search."""
        with self._lock:
            self._sync()
            idx = self.identifier.index
            return set(idx.users("face", self.face_model_id)) | set(idx.users("voice", self.voice_model_id))
