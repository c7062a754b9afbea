"""Approximate key search (IVF / HNSW + exact re-scoring) against exact search, removal, store sync, config.

issue #16 point 5. Timing is not tested here (bench/bench_identify_scale.py measures it)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from egomem.config import Config, ConfigError, IdentityConfig, with_overrides
from egomem.identity import StoreBackedIdentifier
from egomem.identity.identify import FACE_MODEL_IDS, Identifier
from egomem.identity.index import IndexParams, KeyRecord, UserKeyIndex
from egomem.memory.sqlite import SQLiteMemoryStore
from egomem.memory.types import Provenance

DIM = 64
FACE = FACE_MODEL_IDS["dlib"]  # the model id StoreBackedIdentifier searches under [identity] defaults
FACE_DIM = 128


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def clustered(rng: np.random.Generator, n: int, dim: int, clusters: int = 40, spread: float = 0.6) -> np.ndarray:
    """Unit vectors around `clusters` centres: neighbours are close, as with real embeddings."""
    centres = unit(rng.normal(size=(clusters, dim)))
    return unit(centres[rng.integers(0, clusters, n)] + spread * unit(rng.normal(size=(n, dim))))


def seeded_index(kind: str, users: int = 6000, seed: int = 0) -> tuple[UserKeyIndex, list[KeyRecord], np.ndarray]:
    """`users` users with 1-2 clustered keys each, under an approximate index of `kind`."""
    rng = np.random.default_rng(seed)
    vecs = clustered(rng, int(users * 1.5), DIM)
    owners = np.concatenate([np.arange(users), rng.integers(0, users, len(vecs) - users)])
    recs = [KeyRecord(f"u{o}", "voice", "m", v) for o, v in zip(owners, vecs)]
    idx = UserKeyIndex.rebuild(recs, batch=1000, params=IndexParams(kind=kind, candidates=64))  # type: ignore[arg-type]
    queries = unit(vecs[:300] + 0.25 * unit(rng.normal(size=(300, DIM))))  # a re-recording of enrolled keys
    return idx, recs, queries


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_top1_equals_exact_on_a_seeded_set(kind: str) -> None:
    idx, _, queries = seeded_index(kind)
    assert idx.index_kind("voice", "m") == kind
    approx = idx.search_users("voice", "m", queries, 3)
    exact = idx.search_users("voice", "m", queries, 3, exact=True)
    for a, e in zip(approx, exact):
        assert a[0].user_id == e[0].user_id
        assert abs(a[0].score - e[0].score) < 1e-5  # candidates are re-scored exactly: same cosine
    # the s-norm path asks for keys, not users: the best key and its score agree too
    sa, ia = idx.search_keys("voice", "m", queries, 64)
    se, ie = idx.search_keys("voice", "m", queries, 64, exact=True)
    assert (ia[:, 0] == ie[:, 0]).all()
    np.testing.assert_allclose(sa[:, 0], se[:, 0], atol=1e-5)


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_removed_user_is_never_returned_by_the_approximate_index(kind: str) -> None:
    idx, recs, _ = seeded_index(kind, users=3000, seed=1)
    gone = {f"u{i}" for i in range(0, 3000, 7)}  # 429 users, each asked for with their own keys
    own = np.stack([r.vector for r in recs if r.user_id in gone])
    for u in gone:
        idx.remove_user(u)
    assert idx.index_kind("voice", "m") == kind  # still approximate (HNSW: filtered, below its rebuild share)
    for row in idx.search_users("voice", "m", own, 10):
        assert row and not gone & {m.user_id for m in row}
    _, ids = idx.search_keys("voice", "m", own, 128)
    assert not gone & {idx.key_user("voice", "m", int(k)) for k in ids.ravel() if k >= 0}


def test_identifier_forget_with_ivf_and_snorm_candidates() -> None:
    idx, recs, _ = seeded_index("ivf", users=2000, seed=2)
    ident = Identifier(idx, "f", "m", face_threshold=0.1, voice_threshold=0.5)  # raw cosine, no s-norm
    target = recs[5]
    assert ident.match_voice(target.vector)[0] == target.user_id
    ident.forget(target.user_id)
    assert ident.match_voice(target.vector)[0] not in (None, target.user_id)


def test_auto_switches_to_ivf_at_the_threshold_and_back() -> None:
    rng = np.random.default_rng(3)
    idx = UserKeyIndex(IndexParams(kind="auto", approx_min_keys=2000))
    vecs = clustered(rng, 2000, DIM)
    idx.add_many([f"u{i}" for i in range(1999)], "voice", "m", vecs[:1999])
    assert idx.index_kind("voice", "m") == "exact"
    idx.add(KeyRecord("last", "voice", "m", vecs[1999]))  # the 2000th key
    assert idx.index_kind("voice", "m") == "ivf"
    assert idx.search_users("voice", "m", vecs[1999], 1)[0][0].user_id == "last"  # added after training: found
    idx.remove_user("last")
    assert idx.index_kind("voice", "m") == "exact"


def test_ivf_is_retrained_with_more_lists_when_the_space_grows() -> None:
    rng = np.random.default_rng(4)
    idx = UserKeyIndex(IndexParams(kind="ivf", ivf_retrain_growth=2.0))
    vecs = clustered(rng, 8000, DIM)
    idx.add_many([f"a{i}" for i in range(2000)], "voice", "m", vecs[:2000])
    lists_before = idx._tables[("voice", "m")].ann.nlist  # type: ignore[attr-defined]
    idx.add_many([f"b{i}" for i in range(1999)], "voice", "m", vecs[2000:3999])  # 3999 < 2 x 2000: extended
    assert idx._tables[("voice", "m")].ann_keys_at_build == 2000
    idx.add_many([f"c{i}" for i in range(4001)], "voice", "m", vecs[3999:])  # 8000 >= 2 x 2000: retrained
    table = idx._tables[("voice", "m")]
    assert table.ann_keys_at_build == 8000 and table.ann.nlist > lists_before  # type: ignore[attr-defined]
    assert table.ann.ntotal == 8000  # type: ignore[attr-defined]


def ivf_config() -> IdentityConfig:
    return IdentityConfig(index="ivf", index_candidates=64)


def test_refresh_adds_a_key_written_by_another_connection_and_rebuilds_after_forget(tmp_path) -> None:
    db = tmp_path / "m.db"
    mine, theirs = SQLiteMemoryStore(db), SQLiteMemoryStore(db)  # two connections, as two processes have
    rng = np.random.default_rng(5)
    faces = clustered(rng, 3000, FACE_DIM)
    users = []
    for i in range(0, 3000, 3):
        u = theirs.create_user(f"user {i}")
        users.append(u.user_id)
        for v in faces[i:i + 3]:
            theirs.add_key(u.user_id, "face", FACE, v)
    ident = StoreBackedIdentifier(mine, ivf_config(), use_snorm=False)
    assert ident.identify(faces[7][None], None).face_user == users[2]
    assert ident.rebuilds == 1 and ident.identifier.index.index_kind("face", FACE) == "ivf"

    newcomer = theirs.create_user("Newcomer")
    new_face = unit(rng.normal(size=FACE_DIM))
    theirs.add_key(newcomer.user_id, "face", FACE, new_face)  # written by the other connection
    got = ident.identify(new_face[None], None)
    assert got.face_user == newcomer.user_id and got.user_id == newcomer.user_id
    assert ident.rebuilds == 1 and ident.incremental_adds == 1  # added to the live IVF, not rebuilt

    ivf = ident.identifier.index._tables[("face", FACE)].ann
    centroids = ivf.quantizer.reconstruct_n(0, ivf.nlist)  # type: ignore[attr-defined]
    theirs.forget_user(users[2], Provenance("admin", "manual"), reason="asked")
    for v in faces[6:9]:  # her own keys as queries: she must not come back, not even as a near miss
        assert ident.identify(v[None], None).face_user != users[2]
    assert ident.rebuilds == 2 and users[2] not in ident.indexed_users()
    rebuilt = ident.identifier.index._tables[("face", FACE)].ann
    assert rebuilt is not ivf and rebuilt.ntotal == 2998  # type: ignore[attr-defined]
    np.testing.assert_array_equal(rebuilt.quantizer.reconstruct_n(0, rebuilt.nlist), centroids)  # training kept

    theirs.merge_users(users[0], users[1], Provenance("admin", "manual"), reason="same person")
    assert ident.identify(faces[4][None], None).face_user == users[0]  # user 1's key now answers as user 0
    assert ident.rebuilds == 3


_WRITER = """
import sys
import numpy as np
from egomem.memory.sqlite import SQLiteMemoryStore
s = SQLiteMemoryStore(sys.argv[1])
u = s.create_user("From another process")
s.add_key(u.user_id, "face", sys.argv[2], np.load(sys.argv[3]))
print(u.user_id)
"""


def test_a_key_written_by_another_process_is_found_without_a_rebuild(tmp_path) -> None:
    db = tmp_path / "m.db"
    s = SQLiteMemoryStore(db)
    rng = np.random.default_rng(7)
    for i, v in enumerate(clustered(rng, 2500, FACE_DIM)):
        s.add_key(s.create_user(f"user {i}").user_id, "face", FACE, v)
    ident = StoreBackedIdentifier(s, ivf_config(), use_snorm=False)
    assert ident.indexed_users() and ident.identifier.index.index_kind("face", FACE) == "ivf"
    face = unit(rng.normal(size=FACE_DIM))
    np.save(tmp_path / "face.npy", face)
    out = subprocess.run([sys.executable, "-c", _WRITER, str(db), FACE, str(tmp_path / "face.npy")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ident.identify(face[None], None).user_id == out.stdout.strip()
    assert (ident.rebuilds, ident.incremental_adds) == (1, 1)


def test_store_key_changes_are_additions_until_a_removal(backend) -> None:
    s = backend.open()
    rng = np.random.default_rng(6)
    a, b = s.create_user("A"), s.create_user("B")
    s.add_key(a.user_id, "face", FACE, rng.normal(size=FACE_DIM))
    first = s.key_changes(None)
    assert first.rebuild and len(first.keys) == 1
    assert s.key_changes(first.generation).keys == [] and not s.key_changes(first.generation).rebuild
    kid = s.add_key(b.user_id, "face", FACE, rng.normal(size=FACE_DIM))
    added = s.key_changes(first.generation)
    assert not added.rebuild and [k.key_id for k in added.keys] == [kid] and added.generation > first.generation
    s.forget_user(b.user_id, Provenance("admin", "manual"))
    after = s.key_changes(added.generation)
    assert after.rebuild and {k.user_id for k in after.keys} == {a.user_id}


@pytest.mark.parametrize("overrides, message", [
    ({"index": "fast"}, r"identity\.index = 'fast' is not allowed; allowed values: .*exact.*ivf.*hnsw.*auto"),
    ({"index_candidates": 32}, r"identity\.index_candidates = 32 is below identity\.snorm_candidates = 64"),
    ({"index_candidates": 0}, r"identity\.index_candidates = 0 must be positive"),
    ({"ivf_retrain_growth": 1.0}, r"identity\.ivf_retrain_growth = 1\.0 must be > 1"),
    ({"ivf_nlist": 16, "ivf_nprobe": 32}, r"identity\.ivf_nprobe = 32 exceeds identity\.ivf_nlist = 16"),
    ({"ivf_nlist": -1}, r"identity\.ivf_nlist = -1 must be >= 0"),
    ({"hnsw_ef_search": 0}, r"identity\.hnsw_ef_search = 0 must be positive"),
])
def test_index_config_errors_name_the_keys(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        with_overrides(Config(), {"identity": overrides})


def test_index_params_follow_the_config_and_refuse_bad_values() -> None:
    p = IndexParams.from_config(with_overrides(Config(), {"identity": {"index": "hnsw", "hnsw_m": 16}}).identity)
    assert p.kind == "hnsw" and p.hnsw_m == 16 and IndexParams.from_config(IdentityConfig()).kind == "auto"
    with pytest.raises(ValueError, match="not one of exact, ivf, hnsw, auto"):
        IndexParams(kind="flat")  # type: ignore[arg-type]
    assert IndexParams().nlist_for(1_000_000) == 2048 and IndexParams().nlist_for(100) == 2
