"""Who is this session's user? The `Identifier` interface the memory manager calls.

The implementation is `egomem.identity.StoreBackedIdentifier`, the same one the live streams use
(model ids, thresholds, s-norm and conflict rule from `[identity]`), so the worker and the
orchestrator never disagree about who someone is. Any object with this shape plugs in.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Identifier(Protocol):
    face_model_id: str  # the model ids the manager enrols new keys under (the ones `identify` searches)
    voice_model_id: str

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
    return result.user_id


def mean_direction(vectors: np.ndarray) -> np.ndarray | None:
    """The normalised mean of L2-normalised rows [N, D] -> [D], or None for no rows."""
    v = np.asarray(vectors, dtype=np.float32)
    if v.ndim != 2 or v.shape[0] == 0:
        return None
    v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    m = v.mean(axis=0)
    n = float(np.linalg.norm(m))
    return m / n if n > 0 else None
