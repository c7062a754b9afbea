"""Who is this session's user? The `Identifier` interface and a simple in-process implementation.

`StoreIdentifier` is the stub until the identification work (issue 4, `egomem.identity`) lands its
faiss index with adaptive s-norm; that one implements the same `identify` and plugs into the
memory manager unchanged. The stub: cosine nearest neighbour over the store's biometric keys,
accepted below a per-modality distance threshold, rebuilt whenever `keys_generation` changes
(so a forgotten user's vectors leave the index at once).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np

from egomem.memory.store import MemoryStore


class Identifier(Protocol):
    def identify(self, face_vecs: np.ndarray | None, voice_vec: np.ndarray | None) -> Any:
        """face_vecs [F, D] faces in view (row 0 = the speaker candidate; the memory manager passes
        the session's mean face, [1, D]) and voice_vec [D] (the session's mean voice embedding);
        either may be None. Returns the user_id (str), None for someone new, or an object with a
        `user_id` attribute (as `egomem.identity.Identifier` returns)."""
        ...


def user_of(result: Any) -> str | None:
    """The user id from whatever an Identifier returned."""
    if result is None or isinstance(result, str):
        return result
    return getattr(result, "user_id")


def mean_direction(vectors: np.ndarray) -> np.ndarray | None:
    """The normalised mean of L2-normalised rows [N, D] -> [D], or None for no rows."""
    v = np.asarray(vectors, dtype=np.float32)
    if v.ndim != 2 or v.shape[0] == 0:
        return None
    v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    m = v.mean(axis=0)
    n = float(np.linalg.norm(m))
    return m / n if n > 0 else None


class StoreIdentifier:
    def __init__(self, store: MemoryStore, face_model_id: str, voice_model_id: str,
                 face_threshold: float = 0.30, voice_threshold: float = 0.35):
        self.store = store
        self.models = {"face": face_model_id, "voice": voice_model_id}
        self.thresholds = {"face": face_threshold, "voice": voice_threshold}
        self._lock = threading.Lock()
        self._generation = -1
        self._index: dict[str, tuple[np.ndarray, list[str]]] = {}  # modality -> ([N, D] keys, user ids)

    def _refresh(self) -> None:
        gen = self.store.keys_generation()
        if gen == self._generation:
            return
        index = {}
        for modality, model_id in self.models.items():
            keys = self.store.list_keys(modality, model_id)  # type: ignore[arg-type]
            mat = np.stack([k.vector for k in keys]) if keys else np.zeros((0, 0), np.float32)  # [N, D]
            index[modality] = (mat, [k.user_id for k in keys])
        self._index, self._generation = index, gen

    def indexed_users(self) -> set[str]:
        with self._lock:
            self._refresh()
            return {u for _, users in self._index.values() for u in users}

    def identify(self, face_vecs: np.ndarray | None, voice_vec: np.ndarray | None) -> str | None:
        """Nearest user over the speaker-candidate face (row 0) and the voice; the modality whose
        distance is the smaller fraction of its threshold decides."""
        with self._lock:
            self._refresh()
            best: tuple[float, str] | None = None
            face = None if face_vecs is None or np.size(face_vecs) == 0 else np.asarray(face_vecs).reshape(
                -1, np.shape(face_vecs)[-1])[0]
            voice = None if voice_vec is None or np.size(voice_vec) == 0 else np.asarray(voice_vec).reshape(-1)
            for modality, q in (("face", face), ("voice", voice)):
                mat, users = self._index.get(modality, (np.zeros((0, 0)), []))
                if q is None or not users or mat.shape[1] != q.shape[0]:
                    continue
                q = q / max(float(np.linalg.norm(q)), 1e-12)
                dist = 1.0 - mat @ q  # [N] cosine distances
                i = int(np.argmin(dist))
                score = float(dist[i]) / self.thresholds[modality]  # < 1: accepted
                if score < 1.0 and (best is None or score < best[0]):
                    best = (score, users[i])
            return best[1] if best else None
