"""`identify(face_vecs, voice_vec)`: who is there, from the faces in view and the voice heard.

Per modality (thresholds per model, from config):
  - face: the speaker-candidate face's nearest user is accepted when cosine distance < face threshold;
  - voice: the nearest user by AS-normed score (snorm.py) is accepted when s' > voice threshold
    (raw cosine when no cohort is configured). s-norm reorders users, so the top `snorm_candidates`
    keys by raw score are re-scored and the best s' wins.

Decision rule (docs/architecture.md#identification-every-2-s):
  1. both accept the same user -> that user, decided_by "both";
  2. the voice's user is an accepted match of *another* face in view -> that user, "both" (the person
     talking is visible but not the largest/most central face);
  3. both accept different users (conflict) -> `conflict_rule`: "face" (default: the face embedder is the
     more discriminative one at our thresholds; see bench_identity), "voice", or "reject" (None);
  4. only one accepts -> that one; neither -> None, "none".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from egomem.config import IdentityConfig
from egomem.identity.index import IndexParams, KeyRecord, UserKeyIndex
from egomem.identity.snorm import AdaptiveSNorm, default_cohort_file

ConflictRule = Literal["face", "voice", "reject"]
FACE_MODEL_IDS = {"dlib": "dlib_resnet_v1", "deepface": "facenet512"}  # = FaceEncoder.model_id per backend
VOICE_MODEL_IDS = {"resemblyzer": "resemblyzer_ge2e", "wavlm": "wavlm_sv"}  # = SpeakerEncoder.model_id


@dataclass(frozen=True)
class Identification:
    user_id: str | None
    decided_by: Literal["face", "voice", "both", "none"]
    face_user: str | None = None  # best user for the speaker-candidate face (accepted or not)
    face_distance: float | None = None  # its cosine distance
    voice_user: str | None = None  # best user for the voice (accepted or not)
    voice_score: float | None = None  # s-normed score (raw cosine when s-norm is off)
    voice_raw: float | None = None  # raw cosine of that match
    conflict: bool = False  # face and voice accepted different users


class Identifier:
    """Enrols keys into a `UserKeyIndex` and identifies users from face and voice embeddings."""

    def __init__(self, index: UserKeyIndex, face_model_id: str, voice_model_id: str, face_threshold: float,
                 voice_threshold: float, snorm: AdaptiveSNorm | None = None, snorm_candidates: int = 64,
                 conflict_rule: ConflictRule = "face") -> None:
        self._enrol_stats: dict[int, tuple[float, float]] = {}  # key id -> (μ_e, σ_e) of `index`'s keys
        self.index = index
        self.face_model_id = face_model_id
        self.voice_model_id = voice_model_id
        self.face_threshold = float(face_threshold)
        self.voice_threshold = float(voice_threshold)
        self.snorm = snorm
        self.snorm_candidates = int(snorm_candidates)
        self.conflict_rule = conflict_rule

    @property
    def index(self) -> UserKeyIndex:
        return self._index

    @index.setter
    def index(self, index: UserKeyIndex) -> None:
        """Swap in another index (e.g. rebuilt from the store); the cached s-norm statistics go with the old one."""
        self._index = index
        self._enrol_stats.clear()

    @classmethod
    def from_config(cls, cfg: IdentityConfig, index: UserKeyIndex | None = None, use_snorm: bool = True) -> Identifier:
        """Thresholds and model ids of the configured backends; the cohort from `cohort_file` or the shipped one."""
        face_id, voice_id = FACE_MODEL_IDS[cfg.face_backend], VOICE_MODEL_IDS[cfg.voice_backend]
        snorm = None
        if use_snorm:
            snorm = AdaptiveSNorm.from_file(cfg.cohort_file or default_cohort_file(voice_id), cfg.cohort_top_k, cfg.cohort_size)
        face_thr = cfg.face_threshold_dlib if cfg.face_backend == "dlib" else cfg.face_threshold_deepface
        voice_thr = cfg.voice_threshold_resemblyzer if cfg.voice_backend == "resemblyzer" else cfg.voice_threshold_wavlm
        return cls(index or UserKeyIndex(IndexParams.from_config(cfg)), face_id, voice_id, face_thr, voice_thr, snorm, cfg.snorm_candidates,
                   cfg.conflict_rule)

    # -- enrolment ------------------------------------------------------------------------------

    def enrol_face(self, user_id: str, vec: np.ndarray) -> int:
        return self.index.add(KeyRecord(user_id, "face", self.face_model_id, _finite(vec, "face")))

    def enrol_voice(self, user_id: str, vec: np.ndarray) -> int:
        kid = self.index.add(KeyRecord(user_id, "voice", self.voice_model_id, _finite(vec, "voice")))
        if self.snorm is not None:
            mu, sd = self.snorm.stats(vec)
            self._enrol_stats[kid] = (float(mu[0]), float(sd[0]))
        return kid

    def forget(self, user_id: str) -> int:
        """Remove the user's keys and the s-norm statistics derived from them; returns keys removed."""
        for kid in self.index.user_key_ids(user_id, "voice", self.voice_model_id):
            self._enrol_stats.pop(kid, None)
        return self.index.remove_user(user_id)

    # -- matching -------------------------------------------------------------------------------

    def match_faces(self, face_vecs: np.ndarray) -> list[tuple[str | None, float | None]]:
        """Best user and cosine distance for each face: [F, D] -> F pairs."""
        f = _finite(face_vecs, "face").reshape(-1, np.shape(face_vecs)[-1])
        out: list[tuple[str | None, float | None]] = []
        for row in self.index.search_users("face", self.face_model_id, f, 1):
            out.append((row[0].user_id, 1.0 - row[0].score) if row else (None, None))
        return out

    def match_voice(self, voice_vec: np.ndarray) -> tuple[str | None, float | None, float | None]:
        """(best user, score used for the decision, raw cosine)."""
        v = _finite(voice_vec, "voice").reshape(1, -1)
        if self.snorm is None:
            row = self.index.search_users("voice", self.voice_model_id, v, 1)[0]
            return (row[0].user_id, row[0].score, row[0].score) if row else (None, None, None)
        scores, ids = self.index.search_keys("voice", self.voice_model_id, v, self.snorm_candidates)
        live = ids[0] >= 0  # an approximate index may end a row early
        scores, ids = scores[0][live], ids[0][live]
        if ids.size == 0:
            return None, None, None
        test = self.snorm.stats(v)
        enrol = self._keys_stats(ids)  # [C, 2]
        s_norm = AdaptiveSNorm.normalize(scores, (enrol[:, 0], enrol[:, 1]), (test[0][0], test[1][0]))
        best = int(np.argmax(s_norm))
        user = self.index.key_user("voice", self.voice_model_id, int(ids[best]))
        return user, float(s_norm[best]), float(scores[best])

    def _keys_stats(self, key_ids: np.ndarray) -> np.ndarray:
        """(μ_e, σ_e) of each key [C, 2]. Keys added straight to the index (from the store) get theirs
        computed here once, all missing ones in one cohort product, and cached."""
        assert self.snorm is not None
        missing = [int(k) for k in key_ids if int(k) not in self._enrol_stats]
        if missing:
            vecs = np.stack([self.index.key_vector("voice", self.voice_model_id, k) for k in missing])
            mu, sd = self.snorm.stats(vecs)
            self._enrol_stats.update(zip(missing, zip(mu.tolist(), sd.tolist())))
        return np.array([self._enrol_stats[int(k)] for k in key_ids], dtype=np.float64).reshape(-1, 2)

    def identify(self, face_vecs: np.ndarray | None = None, voice_vec: np.ndarray | None = None,
                 speaker: int = 0) -> Identification:
        """Decide who is there; `speaker` indexes the speaker-candidate face among `face_vecs` [F, D]."""
        faces = [] if face_vecs is None or np.size(face_vecs) == 0 else self.match_faces(face_vecs)
        f_user, f_dist = faces[speaker] if 0 <= speaker < len(faces) else (None, None)
        accepted_faces = {u for u, d in faces if u is not None and d is not None and d < self.face_threshold}
        face_ok = f_user is not None and f_dist is not None and f_dist < self.face_threshold
        v_user, v_score, v_raw = (None, None, None) if voice_vec is None else self.match_voice(voice_vec)
        voice_ok = v_user is not None and v_score is not None and v_score > self.voice_threshold
        info = dict(face_user=f_user, face_distance=f_dist, voice_user=v_user, voice_score=v_score, voice_raw=v_raw)
        if voice_ok and v_user in accepted_faces:  # rules 1 and 2: the voice agrees with a face in view
            return Identification(v_user, "both", **info)
        if face_ok and voice_ok:  # rule 3: they disagree
            if self.conflict_rule == "face":
                return Identification(f_user, "face", conflict=True, **info)
            if self.conflict_rule == "voice":
                return Identification(v_user, "voice", conflict=True, **info)
            return Identification(None, "none", conflict=True, **info)
        if face_ok:
            return Identification(f_user, "face", **info)
        if voice_ok:
            return Identification(v_user, "voice", **info)
        return Identification(None, "none", **info)


def _finite(vec: np.ndarray, what: str) -> np.ndarray:
    v = np.asarray(vec, dtype=np.float32)
    if v.size == 0 or not np.isfinite(v).all():
        raise ValueError(f"{what} embedding is empty or has NaN/Inf")
    return v
