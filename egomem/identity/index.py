"""The user-key index: enrolled users' face and voice keys, searched by inner product (faiss).

One table per embedding space `(modality, model_id)`, so keys of different models never mix. A user
may hold several keys per space (several photos, several utterances). Keys are stored L2-normalised,
so inner product = cosine similarity. The memory store is the source of truth: `UserKeyIndex.rebuild`
makes a fresh index from any iterable of `KeyRecord`s, and `remove_user` drops every key of a user.

Each table keeps every key in a flat (brute-force) faiss index: the exact store. Exact search asks it
for `k × (most keys any user holds)` keys, which always contains each of the k best users' best key,
so the answer equals a brute force over all users (tested). Flat search costs ~40 ms at 1M 256-d keys
on one core (bench_identify_scale), so above `IndexParams.approx_min_keys` ("auto") or always ("ivf",
"hnsw") a table also gets an approximate index over the same key ids: IVF or HNSW on 8-bit scalar-
quantised codes (a quarter of the float32 memory). It only proposes `candidates` keys per query;
those are re-scored exactly against the flat store, so every returned score is the exact cosine and
the answer equals exact search whenever the exact top keys are among the candidates (recall@1 is
measured by bench/bench_identify_scale.py). An IVF is retrained with more lists once its space grew
`ivf_retrain_growth`-fold; HNSW cannot delete, so keys removed from it are filtered out of its results
(and it is rebuilt once they are a quarter of its nodes). A removed key is never returned either way:
its id leaves the flat store and the key -> user map first, and only mapped keys are answered.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from egomem.config import IdentityConfig

Modality = Literal["face", "voice"]
IndexKind = Literal["exact", "ivf", "hnsw", "auto"]
Approximate = Literal["ivf", "hnsw"]

ADD_BATCH = 65536  # keys handed to faiss per call when (re)building
IVF_LISTS_PER_SQRT_KEYS = 2  # automatic nlist ≈ 2·sqrt(keys) (faiss guideline: 1..16·sqrt(N))
IVF_MAX_LISTS = 4096  # past this the coarse quantizer (nlist dot products per query) dominates search
IVF_TRAIN_PER_LIST = 40  # k-means sample: faiss warns below 39 points per centroid
IVF_KMEANS_ITERS = 10  # faiss's default is 25; centroids only route queries (candidates are re-scored)
HNSW_MAX_REMOVED = 0.25  # rebuild an HNSW once this fraction of its nodes are removed keys
SQ_TRAIN_KEYS = 65536  # keys sampled to learn the 8-bit quantiser's ranges (HNSW)
SAMPLE_SEED = 0  # training samples are drawn reproducibly


_id_lock = threading.Lock()
_next_key_id = 0


def _take_key_ids(n: int) -> np.ndarray:
    """Key ids unique in this process, across every index (so caches keyed by key id never mix keys)."""
    global _next_key_id
    with _id_lock:
        start, _next_key_id = _next_key_id, _next_key_id + n
    return np.arange(start, start + n, dtype=np.int64)


@dataclass(frozen=True)
class IndexParams:
    """How each space's keys are searched: [identity] index, index_*, ivf_*, hnsw_* (egomem/config.py).

    The default is exact search everywhere (what a bare `UserKeyIndex()` does); `from_config` gives the
    configured choice, "auto" by default."""

    kind: IndexKind = "exact"
    approx_min_keys: int = 100_000
    candidates: int = 128
    ivf_nlist: int = 0
    ivf_nprobe: int = 192
    ivf_retrain_growth: float = 4.0
    hnsw_m: int = 32
    hnsw_ef_construction: int = 64
    hnsw_ef_search: int = 256

    def __post_init__(self) -> None:
        if self.kind not in ("exact", "ivf", "hnsw", "auto"):
            raise ValueError(f"index kind {self.kind!r} is not one of exact, ivf, hnsw, auto")
        for name in ("approx_min_keys", "candidates", "ivf_nprobe", "hnsw_m", "hnsw_ef_construction",
                     "hnsw_ef_search"):
            if getattr(self, name) <= 0:
                raise ValueError(f"IndexParams.{name} = {getattr(self, name)} must be positive")
        if self.ivf_nlist < 0 or self.ivf_retrain_growth <= 1.0:
            raise ValueError(f"IndexParams: ivf_nlist = {self.ivf_nlist} must be >= 0 (0 = automatic) and "
                             f"ivf_retrain_growth = {self.ivf_retrain_growth} must be > 1")

    @classmethod
    def from_config(cls, cfg: IdentityConfig) -> IndexParams:
        return cls(cfg.index, cfg.index_approx_min_keys, cfg.index_candidates, cfg.ivf_nlist, cfg.ivf_nprobe,
                   cfg.ivf_retrain_growth, cfg.hnsw_m, cfg.hnsw_ef_construction, cfg.hnsw_ef_search)

    def approximate_for(self, n_keys: int) -> Approximate | None:
        """Which approximate index a space of `n_keys` keys gets (None: exact search only)."""
        if self.kind == "exact" or n_keys == 0:
            return None
        if self.kind == "auto":
            return "ivf" if n_keys >= self.approx_min_keys else None
        return self.kind

    def nlist_for(self, n_keys: int) -> int:
        """IVF lists for `n_keys` keys: the configured count, else ~2·sqrt(N) as a power of two; never more
        lists than the keys can train (IVF_TRAIN_PER_LIST each)."""
        if self.ivf_nlist:
            want = self.ivf_nlist
        else:
            want = min(IVF_MAX_LISTS, 2 ** round(np.log2(max(1.0, IVF_LISTS_PER_SQRT_KEYS * np.sqrt(n_keys)))))
        return int(max(1, min(want, n_keys // IVF_TRAIN_PER_LIST)))


@dataclass(frozen=True)
class KeyRecord:
    """One biometric key as the memory store holds it."""

    user_id: str
    modality: Modality
    model_id: str
    vector: np.ndarray  # [D] float


@dataclass(frozen=True)
class UserMatch:
    user_id: str
    score: float  # cosine similarity of the user's best key
    key_id: int  # which key gave it


class _Table:
    """Keys of one embedding space: the exact store (faiss IndexIDMap2(IndexFlatIP)), id -> user
    bookkeeping, and optionally an approximate index over the same ids."""

    def __init__(self, dim: int) -> None:
        import faiss

        self.dim = dim
        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self.key_user: dict[int, str] = {}
        self.user_keys: dict[str, list[int]] = {}
        self.max_keys = 0  # upper bound on keys per user (never lowered: keeps search exact and cheap)
        self.ann: object | None = None  # faiss index proposing candidates; None = exact search
        self.ann_kind: Approximate | None = None
        self.ann_keys_at_build = 0  # keys when the approximate index was (re)built (IVF retraining)
        self.ann_removed: set[int] = set()  # HNSW only: removed keys still in its graph, filtered out

    def vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """(key ids [N], unit vectors [N, D]) as zero-copy views of the flat store: valid until it changes."""
        import faiss

        n = int(self.index.ntotal)
        flat = faiss.downcast_index(self.index.index)
        xb = faiss.rev_swig_ptr(flat.get_xb(), n * self.dim).reshape(n, self.dim)
        return faiss.vector_to_array(self.index.id_map), xb


class UserKeyIndex:
    """Face/voice keys of enrolled users; thread-safe for one writer and many readers."""

    def __init__(self, params: IndexParams | None = None) -> None:
        self.params = params or IndexParams()
        self._tables: dict[tuple[str, str], _Table] = {}
        self._lock = threading.RLock()
        self._defer_ann = False  # rebuild: build approximate indexes once, after every key is in

    @classmethod
    def rebuild(cls, records: Iterable[KeyRecord], batch: int = ADD_BATCH, params: IndexParams | None = None,
                previous: UserKeyIndex | None = None) -> UserKeyIndex:
        """A fresh index holding exactly `records` (e.g. everything the memory store lists).

        `previous`: the index this one replaces; a space whose IVF it trained for a size within a factor
        `ivf_retrain_growth` of this one reuses that training (centroids and quantiser ranges; only the filling is redone), so a rebuild
        after a forget costs the fill, not a k-means."""
        idx = cls(params)
        idx._defer_ann = True
        idx.add_records(records, batch)
        idx._defer_ann = False
        with idx._lock:
            for space, table in idx._tables.items():
                old = None if previous is None else previous._tables.get(space)
                if not (old is not None and idx._reuse_ivf(table, old)):
                    idx._update_ann(table)
        return idx

    def _reuse_ivf(self, table: _Table, old: _Table) -> bool:
        """Fill `table` with a copy of `old`'s trained IVF when it fits the new size; False if it does not."""
        import faiss

        n, growth = int(table.index.ntotal), self.params.ivf_retrain_growth
        if (old.ann_kind != "ivf" or self.params.approximate_for(n) != "ivf" or old.dim != table.dim
                or not old.ann_keys_at_build / growth < n < growth * old.ann_keys_at_build):
            return False  # the same hysteresis as retraining on growth: the lists still fit this size
        ann = faiss.clone_index(old.ann)
        ann.reset()  # keeps the training, drops the keys
        ann.nprobe = min(self.params.ivf_nprobe, ann.nlist)
        ids, xb = table.vectors()
        for start in range(0, len(ids), ADD_BATCH):
            ann.add_with_ids(np.ascontiguousarray(xb[start:start + ADD_BATCH]), ids[start:start + ADD_BATCH])
        table.ann, table.ann_kind, table.ann_keys_at_build, table.ann_removed = ann, "ivf", old.ann_keys_at_build, set()
        return True

    def add_records(self, records: Iterable[KeyRecord], batch: int = ADD_BATCH) -> int:
        """Add keys of any spaces (e.g. those the store added since the last sync); returns how many."""
        pending: dict[tuple[str, str], tuple[list[str], list[np.ndarray]]] = {}
        n = 0
        for r in records:
            users, vecs = pending.setdefault((r.modality, r.model_id), ([], []))
            users.append(r.user_id)
            vecs.append(np.asarray(r.vector, dtype=np.float32).reshape(-1))
            n += 1
            if len(users) >= batch:
                self.add_many(users, r.modality, r.model_id, np.stack(vecs))
                users.clear()
                vecs.clear()
        for (modality, model_id), (users, vecs) in pending.items():
            if users:
                self.add_many(users, modality, model_id, np.stack(vecs))  # type: ignore[arg-type]
        return n

    def add(self, record: KeyRecord) -> int:
        """Add one key; returns its key id."""
        v = np.asarray(record.vector, dtype=np.float32).reshape(1, -1)
        return int(self.add_many([record.user_id], record.modality, record.model_id, v)[0])

    def add_many(self, user_ids: Sequence[str], modality: Modality, model_id: str, vectors: np.ndarray) -> np.ndarray:
        """Add N keys of one space at once: user_ids [N], vectors [N, D]. Returns the key ids [N]."""
        v = np.ascontiguousarray(np.asarray(vectors, dtype=np.float32))
        if v.ndim != 2 or v.shape[0] != len(user_ids):
            raise ValueError(f"vectors must be [N={len(user_ids)}, D], got {list(v.shape)}")
        if not np.isfinite(v).all():
            raise ValueError("key vectors contain NaN/Inf")
        norms = np.linalg.norm(v, axis=1, keepdims=True)
        if (norms < 1e-8).any():
            raise ValueError("a key vector is all zeros")
        v = v / norms
        with self._lock:
            table = self._tables.get((modality, model_id))
            if table is None:
                table = self._tables[(modality, model_id)] = _Table(v.shape[1])
            if v.shape[1] != table.dim:
                raise ValueError(f"{modality}/{model_id} keys are {table.dim}-d; got {v.shape[1]}-d")
            ids = _take_key_ids(len(user_ids))
            table.index.add_with_ids(v, ids)
            for kid, uid in zip(ids.tolist(), user_ids):
                table.key_user[kid] = uid
                keys = table.user_keys.setdefault(uid, [])
                keys.append(kid)
                table.max_keys = max(table.max_keys, len(keys))
            if not self._defer_ann:
                self._update_ann(table, v, ids)
        return ids

    def remove_user(self, user_id: str) -> int:
        """Drop every key of `user_id` in every space ("forget this user"); returns how many were removed."""
        removed = 0
        with self._lock:
            for table in self._tables.values():
                keys = table.user_keys.pop(user_id, [])
                if keys:
                    ids = np.asarray(keys, dtype=np.int64)
                    removed += int(table.index.remove_ids(ids))
                    for k in keys:
                        del table.key_user[k]
                    if table.ann_kind == "ivf":
                        table.ann.remove_ids(ids)  # type: ignore[attr-defined]
                    elif table.ann_kind == "hnsw":
                        table.ann_removed.update(keys)
                    self._update_ann(table)
        return removed

    # -- the approximate index --------------------------------------------------------------------

    def _update_ann(self, table: _Table, v: np.ndarray | None = None, ids: np.ndarray | None = None) -> None:
        """After keys were added (`v`, `ids`) or removed: drop, build, retrain or extend the table's
        approximate index as `params` asks for its new size (caller holds the lock)."""
        n = int(table.index.ntotal)
        want = self.params.approximate_for(n)
        if want is None:
            table.ann, table.ann_kind, table.ann_removed = None, None, set()
            return
        stale = (table.ann is None or table.ann_kind != want
                 or (want == "ivf" and v is not None and n >= self.params.ivf_retrain_growth * table.ann_keys_at_build)
                 or (want == "hnsw" and len(table.ann_removed) > HNSW_MAX_REMOVED * n))
        if stale:
            self._build_ann(table, want)
        elif v is not None and ids is not None:
            table.ann.add_with_ids(v, ids)  # type: ignore[attr-defined]

    def _build_ann(self, table: _Table, kind: Approximate) -> None:
        """Train and fill a fresh approximate index from the table's exact store."""
        import faiss

        p = self.params
        ids, xb = table.vectors()
        n, d = xb.shape
        rng = np.random.default_rng(SAMPLE_SEED)
        if kind == "ivf":
            nlist = p.nlist_for(n)
            quantizer = faiss.IndexFlatIP(d)
            ann = faiss.IndexIVFScalarQuantizer(quantizer, d, nlist, faiss.ScalarQuantizer.QT_8bit,
                                                faiss.METRIC_INNER_PRODUCT)
            ann.cp.niter = IVF_KMEANS_ITERS
            sample = min(n, nlist * IVF_TRAIN_PER_LIST)
            ann.train(xb[np.sort(rng.choice(n, sample, replace=False))])
            ann.nprobe = min(p.ivf_nprobe, nlist)
        else:
            inner = faiss.IndexHNSWSQ(d, faiss.ScalarQuantizer.QT_8bit, p.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            inner.hnsw.efConstruction = p.hnsw_ef_construction
            inner.hnsw.efSearch = max(p.hnsw_ef_search, p.candidates)
            inner.train(xb[np.sort(rng.choice(n, min(n, SQ_TRAIN_KEYS), replace=False))])
            ann = faiss.IndexIDMap(inner)
        for start in range(0, n, ADD_BATCH):
            ann.add_with_ids(np.ascontiguousarray(xb[start:start + ADD_BATCH]), ids[start:start + ADD_BATCH])
        table.ann, table.ann_kind, table.ann_keys_at_build, table.ann_removed = ann, kind, n, set()

    def set_params(self, params: IndexParams) -> None:
        """Search with other parameters from now on: approximate indexes are dropped or (re)built to match."""
        with self._lock:
            self.params = params
            for table in self._tables.values():
                table.ann, table.ann_kind = None, None
                self._update_ann(table)

    def index_kind(self, modality: Modality, model_id: str) -> Literal["exact", "ivf", "hnsw"]:
        """How the space is searched right now."""
        t = self._tables.get((modality, model_id))
        return "exact" if t is None or t.ann_kind is None else t.ann_kind

    # -- reading ----------------------------------------------------------------------------------

    def count(self, modality: Modality, model_id: str) -> int:
        t = self._tables.get((modality, model_id))
        return 0 if t is None else int(t.index.ntotal)

    def users(self, modality: Modality, model_id: str) -> list[str]:
        t = self._tables.get((modality, model_id))
        return [] if t is None else list(t.user_keys)

    def user_key_ids(self, user_id: str, modality: Modality, model_id: str) -> list[int]:
        t = self._tables.get((modality, model_id))
        return [] if t is None else list(t.user_keys.get(user_id, []))

    def key_user(self, modality: Modality, model_id: str, key_id: int) -> str:
        return self._tables[(modality, model_id)].key_user[int(key_id)]

    def key_vector(self, modality: Modality, model_id: str, key_id: int) -> np.ndarray:
        """The stored (unit) vector of one key."""
        return self._tables[(modality, model_id)].index.reconstruct(int(key_id))

    def search_keys(self, modality: Modality, model_id: str, queries: np.ndarray, k: int,
                    exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Top-k keys per query: queries [Q, D] -> (scores [Q, k'], key ids [Q, k']), k' = min(k, #keys).

        Scores are exact cosines either way; with an approximate index a row can end early (key id -1,
        score -inf) when fewer than k' of its candidates are live keys. `exact` forces brute force."""
        q = np.ascontiguousarray(np.asarray(queries, dtype=np.float32).reshape(-1, np.shape(queries)[-1]))
        q = q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)
        with self._lock:
            t = self._tables.get((modality, model_id))
            if t is None or t.index.ntotal == 0:
                return np.zeros((q.shape[0], 0), np.float32), np.zeros((q.shape[0], 0), np.int64)
            if q.shape[1] != t.dim:
                raise ValueError(f"{modality}/{model_id} keys are {t.dim}-d; query is {q.shape[1]}-d")
            k = min(k, int(t.index.ntotal))
            if t.ann is None or exact:
                return t.index.search(q, k)
            return self._search_approximate(t, q, k)

    def _search_approximate(self, t: _Table, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Candidates from the approximate index, re-scored exactly against the flat store; top k of them."""
        want = max(k, self.params.candidates)
        n_cand = min(want + min(len(t.ann_removed), want), int(t.ann.ntotal))  # type: ignore[attr-defined]
        _, cand = t.ann.search(q, n_cand)  # type: ignore[attr-defined]
        scores = np.full((q.shape[0], k), -np.inf, np.float32)
        ids = np.full((q.shape[0], k), -1, np.int64)
        for row in range(q.shape[0]):
            live = np.asarray([c for c in cand[row].tolist() if c in t.key_user], np.int64)  # drops -1 and removed
            if live.size == 0:
                continue
            exact = t.index.reconstruct_batch(live) @ q[row]  # [C] exact cosines
            top = np.argsort(-exact, kind="stable")[:k]
            scores[row, : top.size], ids[row, : top.size] = exact[top], live[top]
        return scores, ids

    def search_users(self, modality: Modality, model_id: str, queries: np.ndarray, k: int,
                     exact: bool = False) -> list[list[UserMatch]]:
        """Top-k *users* per query, each scored by their best key (exact; approximate: see module doc)."""
        t = self._tables.get((modality, model_id))
        if t is None:
            return [[] for _ in range(np.asarray(queries).reshape(-1, np.shape(queries)[-1]).shape[0])]
        scores, ids = self.search_keys(modality, model_id, queries, k * max(t.max_keys, 1), exact=exact)
        out: list[list[UserMatch]] = []
        for srow, irow in zip(scores, ids):
            seen: dict[str, UserMatch] = {}
            for s, kid in zip(srow.tolist(), irow.tolist()):
                if kid < 0:
                    continue
                uid = t.key_user[kid]
                if uid not in seen:  # rows come best-first, so the first key seen is the user's best
                    seen[uid] = UserMatch(uid, float(s), int(kid))
                    if len(seen) == k:
                        break
            out.append(list(seen.values()))
        return out
