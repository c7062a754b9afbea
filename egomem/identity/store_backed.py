"""The one identifier of the system: `Identifier` over the memory store's biometric keys.

Live streams (the orchestrator's 2 s polls) and the memory worker (who is this session's user?)
must agree about who someone is, and must search the keys under the same model ids. Both build a
`StoreBackedIdentifier` from `[identity]`: the configured backends' model ids and thresholds,
adaptive s-norm with the same cohort, the same face/voice conflict rule, the same index choice
(exact / IVF / HNSW, egomem/identity/index.py).

Staying in sync across processes: each call first reads `store.keys_generation()` (one small
query). When it moved, `store.key_changes(last generation)` says, from one snapshot, what happened:
  - only additions (enrolment) -> those keys are added to the live index (an IVF assigns them to its
    lists; no retraining until the space grew `ivf_retrain_growth`-fold);
  - any removal or move (forget, merge) -> the index is rebuilt from every live key, so a forgotten
    or merged-away user is never answered by a call that starts after the forget committed.
The bound: a rebuild lists every key and refills the approximate index (an IVF keeps its training
when the size still fits it; an HNSW is rebuilt whole, see bench_identify_scale for both build
times); identify calls of that process wait for it. A key written by another process is searched from that
process's next call on.

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
from egomem.identity.index import IndexParams, KeyRecord, UserKeyIndex


class KeyChangesLike(Protocol):
    generation: int
    rebuild: bool
    keys: list[Any]  # objects with user_id, modality, model_id, vector


class KeySource(Protocol):
    """What the identifier needs of the memory store."""

    def keys_generation(self) -> int: ...

    def list_keys(self) -> Iterable[Any]:  # objects with user_id, modality, model_id, vector
        ...

    def key_changes(self, since: int | None) -> KeyChangesLike: ...


class StoreBackedIdentifier:
    """Thread-safe `identify` over the store's keys with the thresholds and model ids of `[identity]`."""

    def __init__(self, store: KeySource, cfg: IdentityConfig, use_snorm: bool = True) -> None:
        self.store = store
        self.params = IndexParams.from_config(cfg)
        self.identifier = Identifier.from_config(cfg, use_snorm=use_snorm)
        self._lock = threading.Lock()
        self._generation: int | None = None
        self.rebuilds = 0  # full rebuilds so far (observability; tests)
        self.incremental_adds = 0  # keys added without a rebuild

    @property
    def face_model_id(self) -> str:
        return self.identifier.face_model_id

    @property
    def voice_model_id(self) -> str:
        return self.identifier.voice_model_id

    def _sync(self) -> None:
        """Bring the index to the store's keys: add new keys, or rebuild after removals (caller holds the lock)."""
        since = self._generation
        if since is not None and self.store.keys_generation() == since:
            return
        changes = self.store.key_changes(since)
        records = (KeyRecord(k.user_id, k.modality, k.model_id, np.asarray(k.vector, np.float32)) for k in changes.keys)
        if changes.rebuild:
            self.identifier.index = UserKeyIndex.rebuild(records, params=self.params, previous=self.identifier.index)
            self.rebuilds += 1
        else:
            self.incremental_adds += self.identifier.index.add_records(records)
        self._generation = changes.generation

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
