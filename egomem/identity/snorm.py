"""Adaptive symmetric score normalisation (AS-norm) for speaker verification (docs/architecture.md#identification-every-2-s).

    s' = ½ [ (s − μ_e) / σ_e + (s − μ_t) / σ_t ]

μ_e, σ_e: mean and standard deviation of the top-K cosine scores of the *enrolment* embedding against
an imposter cohort; μ_t, σ_t: the same for the *test* embedding. The paper uses a 2,000-speaker
cohort and K = 200; with a smaller cohort of N rows we keep the same fraction, K = round(N · 200 / 2000)
(at least 1), so "top-K" still means "the closest 10% of imposters". Cohort rows identical to the
embedding (score ≥ 1 − 1e-5: the same recording) are left out, so a cohort speaker enrolled as a user
is not normalised against itself. Enrolment statistics depend only on the enrolled key: callers cache them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from egomem.identity.errors import ModelFilesMissing

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
SAME_RECORDING = 1.0 - 1e-5  # a cohort score this high means the cohort row *is* this embedding


def default_cohort_file(model_id: str) -> Path:
    """Where the shipped cohort for a voice model lives (egomem/data/cohort_<model_id>.npy)."""
    return DATA_DIR / f"cohort_{model_id}.npy"


class AdaptiveSNorm:
    """Cohort statistics and the AS-norm formula, vectorised over many scores at once."""

    def __init__(self, cohort: np.ndarray, top_k: int = 200, cohort_size: int = 2000) -> None:
        c = np.asarray(cohort, dtype=np.float32)
        if c.ndim != 2 or c.shape[0] < 2:
            raise ValueError(f"cohort must be [N >= 2, D], got {list(c.shape)}")
        if not np.isfinite(c).all():
            raise ValueError("cohort contains NaN/Inf rows")
        c = c[:cohort_size]
        self.cohort = c / np.linalg.norm(c, axis=1, keepdims=True)  # [N, D] unit rows
        n = self.cohort.shape[0]
        self.k = int(min(top_k, n - 1, max(1, round(n * top_k / cohort_size))))  # n-1: one row may be excluded

    @classmethod
    def from_file(cls, path: Path, top_k: int = 200, cohort_size: int = 2000) -> AdaptiveSNorm:
        p = Path(path)
        if not p.is_file():
            raise ModelFilesMissing(
                f"s-norm cohort file {p} is missing; build it with "
                f"`python -m egomem.identity.cohort_build --audio-dir <cohort speech> --out {p}`"
            )
        return cls(np.load(p), top_k, cohort_size)

    @property
    def dim(self) -> int:
        return int(self.cohort.shape[1])

    def stats(self, vecs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and std of each row's top-K cohort scores: vecs [M, D] -> (μ [M], σ [M])."""
        v = np.asarray(vecs, dtype=np.float32).reshape(-1, self.dim)
        v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        s = v @ self.cohort.T  # [M, N]
        s = np.where(s >= SAME_RECORDING, -np.inf, s)  # leave out the row that is this very embedding
        top = -np.partition(-s, self.k - 1, axis=1)[:, : self.k]  # [M, K] the K largest
        return top.mean(axis=1), np.maximum(top.std(axis=1), 1e-6)

    @staticmethod
    def normalize(scores: np.ndarray, enrol: tuple[np.ndarray, np.ndarray],
                  test: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """s' = ½[(s − μ_e)/σ_e + (s − μ_t)/σ_t]; all arguments broadcast together."""
        s = np.asarray(scores, dtype=np.float64)
        (mu_e, sd_e), (mu_t, sd_t) = enrol, test
        return 0.5 * ((s - mu_e) / sd_e + (s - mu_t) / sd_t)
