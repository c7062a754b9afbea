"""User-key index (faiss) against brute force, and adaptive s-norm against a plain NumPy computation."""

from __future__ import annotations

import numpy as np
import pytest

from egomem.identity.errors import ModelFilesMissing
from egomem.identity.index import KeyRecord, UserKeyIndex
from egomem.identity.snorm import AdaptiveSNorm, default_cohort_file


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def random_records(rng: np.random.Generator, users: int, dim: int) -> list[KeyRecord]:
    recs = []
    for u in range(users):
        for _ in range(int(rng.integers(1, 4))):  # 1..3 keys per user
            recs.append(KeyRecord(f"u{u}", "voice", "m", rng.normal(size=dim)))
    return recs


def brute_force(recs: list[KeyRecord], q: np.ndarray, k: int) -> list[list[tuple[str, float]]]:
    best: list[list[tuple[str, float]]] = []
    keys = unit(np.stack([r.vector for r in recs]))
    for row in unit(q):
        per_user: dict[str, float] = {}
        for r, s in zip(recs, keys @ row):
            per_user[r.user_id] = max(per_user.get(r.user_id, -2.0), float(s))
        best.append(sorted(per_user.items(), key=lambda t: -t[1])[:k])
    return best


def test_search_users_equals_brute_force() -> None:
    rng = np.random.default_rng(0)
    recs = random_records(rng, 300, 32)
    idx = UserKeyIndex.rebuild(recs, batch=97)  # several batches
    q = rng.normal(size=(20, 32))
    got = idx.search_users("voice", "m", q, k=5)
    want = brute_force(recs, q, 5)
    for g, w in zip(got, want):
        assert [m.user_id for m in g] == [u for u, _ in w]
        np.testing.assert_allclose([m.score for m in g], [s for _, s in w], atol=1e-5)


def test_remove_user_and_spaces_are_separate() -> None:
    rng = np.random.default_rng(1)
    idx = UserKeyIndex()
    a = unit(rng.normal(size=(2, 16)))
    idx.add_many(["alice", "alice"], "voice", "m", a)
    idx.add(KeyRecord("bob", "voice", "m", rng.normal(size=16)))
    idx.add(KeyRecord("alice", "face", "f", rng.normal(size=8)))
    assert idx.search_users("voice", "m", a[1], 1)[0][0].user_id == "alice"
    assert idx.count("voice", "m") == 3 and idx.count("face", "f") == 1
    assert idx.remove_user("alice") == 3
    assert idx.search_users("voice", "m", a[1], 5)[0][0].user_id == "bob"
    assert idx.count("face", "f") == 0 and idx.search_users("face", "f", rng.normal(size=8), 1) == [[]]
    assert idx.search_users("voice", "other_model", a[0], 1) == [[]]


@pytest.mark.parametrize("vec, message", [(np.zeros(16), "all zeros"), (np.full(16, np.nan), "NaN"), (np.ones(12), "16-d")])
def test_bad_keys_are_refused(vec: np.ndarray, message: str) -> None:
    idx = UserKeyIndex()
    idx.add(KeyRecord("a", "voice", "m", np.ones(16)))
    with pytest.raises(ValueError, match=message):
        idx.add(KeyRecord("b", "voice", "m", vec))


def test_snorm_matches_numpy_formula() -> None:
    rng = np.random.default_rng(2)
    cohort = unit(rng.normal(size=(300, 24)))
    sn = AdaptiveSNorm(cohort, top_k=200, cohort_size=2000)
    assert sn.k == 30  # 300 rows keep the paper's 200/2000 fraction
    e, t = unit(rng.normal(size=24)), unit(rng.normal(size=24))
    s = float(e @ t)
    top_e = np.sort(cohort @ e)[::-1][:30]
    top_t = np.sort(cohort @ t)[::-1][:30]
    want = 0.5 * ((s - top_e.mean()) / top_e.std() + (s - top_t.mean()) / top_t.std())
    got = sn.normalize(s, sn.stats(e), sn.stats(t))
    assert got.item() == pytest.approx(want, rel=1e-5)
    assert got.item() != pytest.approx(s, abs=0.1)  # it really changes the score


def test_snorm_paper_sizes_and_self_exclusion() -> None:
    rng = np.random.default_rng(3)
    cohort = unit(rng.normal(size=(2500, 8)))
    sn = AdaptiveSNorm(cohort, top_k=200, cohort_size=2000)
    assert sn.cohort.shape[0] == 2000 and sn.k == 200
    mu_self, _ = sn.stats(sn.cohort[5])  # a cohort row: its own score 1.0 must not count
    top = np.sort(np.delete(sn.cohort @ sn.cohort[5], 5))[::-1][:200]
    assert float(mu_self[0]) == pytest.approx(float(top.mean()), rel=1e-5)


def test_shipped_cohort_file_loads(tmp_path) -> None:
    sn = AdaptiveSNorm.from_file(default_cohort_file("resemblyzer_ge2e"))
    assert sn.cohort.shape == (251, 256) and sn.k == 25
    with pytest.raises(ModelFilesMissing, match="cohort_build"):
        AdaptiveSNorm.from_file(tmp_path / "nope.npy")
