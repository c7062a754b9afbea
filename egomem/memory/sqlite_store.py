"""SQLite backend of `MemoryStore`: WAL mode, one connection per thread, explicit write transactions.

Durability: `synchronous=FULL` by default, so a committed transaction survives a killed process
and a power cut. Every write runs in `BEGIN IMMEDIATE` (one writer at a time across threads and
processes; others wait up to `busy_timeout_s`), which also serialises writes for one user.
Files: the database and its -wal / -shm are 0600 (SQLite gives the WAL and shm the database
file's mode, so the database is created 0600 before SQLite opens it; an older, wider file is
narrowed), a folder it creates is 0700.

Forget (`forget_user`), in one write transaction: delete the person's rows; redact every name they
ever had (the current one, earlier names from PATCH / the op log's create_user and rename rows, and
the names of users merged into them) wherever others' rows mention it (egomem/memory/redact.py);
rewrite the chunk files of memory jobs not yet done so the person is not in them either
(memory/chunk.py `redact_chunk`; the job's `redactions` counter goes up, and `commit_session`
refuses, with `ChunkRedacted`, a session read from the chunk before that rewrite: the job retries
on the redacted files, and the refused attempt is given back). Then VACUUM and a TRUNCATE
checkpoint: `secure_delete` zeroes deleted cells, but a page rebalanced while the person's cells
still existed keeps stale copies of them in its unallocated gap, and old WAL frames keep old pages;
VACUUM rewrites every page from the live rows. `verify_forgotten` checks every cell and also the
raw bytes of the database file and WAL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import mmap
import os
import re
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from egomem.memory.chunk import JOB_KIND, job_key, redact_chunk, redact_pieces
from egomem.memory.redact import MARKER, mentions, name_pattern, redact
from egomem.memory.schema import MIGRATIONS, SCHEMA_VERSION
from egomem.memory.store import MANUAL, ChunkRedacted, MemoryStore, StoreError, VersionConflict
from egomem.memory.types import (
    BiometricKey,
    DeadLetter,
    ForgetReceipt,
    Job,
    MemoryItem,
    Modality,
    OpLogEntry,
    PersonaUpdate,
    PersonaValue,
    Polarity,
    Profile,
    Provenance,
    Relation,
    SessionCommit,
    SessionRecord,
    Summary,
    UNKNOWN_USER,
    User,
)

_USER_COLS = "user_id, name, created_at, updated_at, version, merged_into"
_ITEM_COLS = ("item_id, user_id, kind, item_key, text, polarity, valid_from, invalid_at, superseded_by, "
              "session_id, origin")
_REL_COLS = "relation_id, user_id, other_user_id, relation, valid_from, invalid_at, session_id, origin"
_SESSION_COLS = ("session_id, stream_id, chunk_index, start_step, end_step, user_id, transcript, "
                 "transcript_source, status, created_at")
_JOB_COLS = "job_id, job_key, kind, payload, status, attempts, max_attempts, lease_until, worker, result, error"
_DL_COLS = ("dl_id, source, stage, job_id, session_id, user_id, payload, error, attempts, created_at, "
            "resolved_at, resolution")


log = logging.getLogger(__name__)


def derived_id(*parts: Any) -> str:
    """A deterministic id from its parts: a re-run of the same session writes the same ids."""
    return hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).hexdigest()[:32]


def _vec_bytes(v: np.ndarray) -> bytes:
    v = np.asarray(v, dtype="<f4").reshape(-1)
    n = float(np.linalg.norm(v))
    if not np.isfinite(n) or n == 0.0:
        raise StoreError("a biometric key vector must be finite and non-zero")
    return (v / n).astype("<f4").tobytes()


class SQLiteMemoryStore(MemoryStore):
    def __init__(self, path: str | Path, busy_timeout_s: float = 30.0, synchronous: str = "FULL",
                 job_max_attempts: int = 5, clock: Callable[[], float] = time.time,
                 forget_face_distance: float = 0.30, forget_voice_distance: float = 0.35):
        self.path = Path(path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # 0700 when we make it
        _private_files(self.path)
        self._busy_ms = int(busy_timeout_s * 1000)
        if synchronous not in ("FULL", "NORMAL"):
            raise StoreError(f"synchronous = {synchronous!r}; allowed: 'FULL', 'NORMAL'")
        self._sync = synchronous
        self._job_max_attempts = job_max_attempts
        self._clock = clock
        # a queued chunk's face / voice poll within this cosine distance of a forgotten person's key
        # (and nearer to it than to anyone else's) is theirs and removed (memory/chunk.py redact_chunk)
        self._forget_distance = {"face": forget_face_distance, "voice": forget_voice_distance}
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()
        self._migrate()

    # ------------------------------------------------------------------ connections, transactions

    def _conn(self) -> sqlite3.Connection:
        c = getattr(self._local, "conn", None)
        if c is None:
            c = sqlite3.connect(self.path, timeout=self._busy_ms / 1000, isolation_level=None,
                                check_same_thread=False)
            c.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
            c.execute("PRAGMA journal_mode = WAL")
            c.execute(f"PRAGMA synchronous = {self._sync}")
            c.execute("PRAGMA foreign_keys = ON")
            c.execute("PRAGMA secure_delete = ON")  # deleted rows are zeroed, not left in free pages
            self._local.conn = c
            with self._all_lock:
                self._all.append(c)
        return c

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: BEGIN IMMEDIATE takes the database's write lock up front."""
        c = self._conn()
        c.execute("BEGIN IMMEDIATE")
        try:
            yield c
            self._before_commit(c)
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A consistent snapshot across several SELECTs."""
        c = self._conn()
        c.execute("BEGIN")
        try:
            yield c
        finally:
            c.execute("COMMIT")

    def _before_commit(self, c: sqlite3.Connection) -> None:
        """Called inside every write transaction just before COMMIT (a seam for crash tests)."""

    def _migrate(self) -> None:
        with self._write() as c:
            c.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = c.execute("SELECT MAX(version) FROM schema_version").fetchone()
            have = row[0] or 0
            if have > SCHEMA_VERSION:
                raise StoreError(f"{self.path} has schema version {have}, newer than this code "
                                 f"({SCHEMA_VERSION}); upgrade egomem")
            for v in range(have + 1, SCHEMA_VERSION + 1):
                for stmt in _split_sql(MIGRATIONS[v]):
                    c.execute(stmt)
                c.execute("INSERT INTO schema_version (version) VALUES (?)", (v,))

    def schema_version(self) -> int:
        return self._conn().execute("SELECT MAX(version) FROM schema_version").fetchone()[0]

    def close(self) -> None:
        with self._all_lock:
            for c in self._all:
                with contextlib.suppress(sqlite3.Error):
                    c.close()
            self._all.clear()
        self._local = threading.local()

    # ------------------------------------------------------------------ helpers

    def _log(self, c: sqlite3.Connection, op: str, prov: Provenance, user_id: str | None, target: str | None,
             reason: str = "", related_user_id: str | None = None, detail: dict[str, Any] | None = None) -> None:
        c.execute(
            "INSERT INTO op_log (ts, op, actor, user_id, related_user_id, target, session_id, llm_model, "
            "prompt_hash, reason, detail) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (self._clock(), op, prov.actor, user_id, related_user_id, target, prov.session_id, prov.llm_model,
             prov.prompt_hash, reason, json.dumps(detail or {}, sort_keys=True)),
        )

    def _live_user(self, c: sqlite3.Connection, user_id: str) -> User:
        row = c.execute(f"SELECT {_USER_COLS} FROM users WHERE user_id = ?", (user_id,)).fetchone()
        if row is None:
            raise StoreError(f"unknown user {user_id!r}")
        u = User(*row)
        if u.merged_into is not None:
            raise StoreError(f"user {user_id!r} was merged into {u.merged_into!r}; write to that one")
        return u

    def _touch(self, c: sqlite3.Connection, user_id: str) -> None:
        c.execute("UPDATE users SET version = version + 1, updated_at = ? WHERE user_id = ?", (self._clock(), user_id))

    def _bump_keys_generation(self, c: sqlite3.Connection) -> None:
        c.execute("UPDATE meta SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT) WHERE name = 'keys_generation'")

    # ------------------------------------------------------------------ users

    def _insert_user(self, c: sqlite3.Connection, user_id: str, name: str, prov: Provenance, reason: str) -> User:
        now = self._clock()
        c.execute("INSERT INTO users (user_id, name, created_at, updated_at, version) VALUES (?,?,?,?,0)",
                  (user_id, name, now, now))
        self._log(c, "create_user", prov, user_id, f"users:{user_id}", reason, detail={"name": name})
        return User(user_id, name, now, now, 0)

    def create_user(self, name: str = UNKNOWN_USER, prov: Provenance = MANUAL) -> User:
        with self._write() as c:
            return self._insert_user(c, uuid.uuid4().hex, name.strip() or UNKNOWN_USER, prov, "")

    def get_user(self, user_id: str) -> User | None:
        row = self._conn().execute(f"SELECT {_USER_COLS} FROM users WHERE user_id = ?", (user_id,)).fetchone()
        return User(*row) if row else None

    def resolve_user(self, user_id: str) -> User | None:
        seen = set()
        u = self.get_user(user_id)
        while u is not None and u.merged_into is not None and u.user_id not in seen:
            seen.add(u.user_id)
            u = self.get_user(u.merged_into)
        return u

    def list_users(self, include_merged: bool = False) -> list[User]:
        where = "" if include_merged else "WHERE merged_into IS NULL"
        rows = self._conn().execute(f"SELECT {_USER_COLS} FROM users {where} ORDER BY created_at, user_id")
        return [User(*r) for r in rows]

    def rename_user(self, user_id: str, name: str, prov: Provenance = MANUAL, reason: str = "") -> User:
        name = name.strip()
        if not name:
            raise StoreError("a user's name cannot be empty; use 'unknown_user' for an unnamed user")
        with self._write() as c:
            old = self._live_user(c, user_id)
            c.execute("UPDATE users SET name = ? WHERE user_id = ?", (name, user_id))
            self._touch(c, user_id)
            self._log(c, "rename", prov, user_id, f"users:{user_id}", reason, detail={"old": old.name, "new": name})
        return self.get_user(user_id)  # type: ignore[return-value]

    def merge_users(self, keep_id: str, drop_id: str, prov: Provenance = MANUAL, reason: str = "") -> User:
        if keep_id == drop_id:
            raise StoreError("cannot merge a user into itself")
        with self._write() as c:
            self._merge(c, keep_id, drop_id, prov, reason)
        return self.get_user(keep_id)  # type: ignore[return-value]

    def _merge(self, c: sqlite3.Connection, keep_id: str, drop_id: str, prov: Provenance, reason: str) -> None:
        keep = self._live_user(c, keep_id)
        drop = self._live_user(c, drop_id)
        for table in ("biometric_keys", "memory_items", "summaries", "sessions"):
            c.execute(f"UPDATE {table} SET user_id = ? WHERE user_id = ?", (keep_id, drop_id))
        # persona: the more confident value of each dimension wins
        for dim, val, conf, ev, sid, origin, ts in c.execute(
            "SELECT dim, value, confidence, evidence, session_id, origin, updated_at FROM persona WHERE user_id = ?",
            (drop_id,)).fetchall():
            c.execute(
                "INSERT INTO persona (user_id, dim, value, confidence, evidence, session_id, origin, updated_at) "
                "VALUES (?,?,?,?,?,?,?,?) ON CONFLICT (user_id, dim) DO UPDATE SET value = excluded.value, "
                "confidence = excluded.confidence, evidence = excluded.evidence, session_id = excluded.session_id, "
                "origin = excluded.origin, updated_at = excluded.updated_at "
                "WHERE excluded.confidence > persona.confidence",
                (keep_id, dim, val, conf, ev, sid, origin, ts))
        c.execute("DELETE FROM persona WHERE user_id = ?", (drop_id,))
        c.execute("UPDATE relations SET user_id = ? WHERE user_id = ?", (keep_id, drop_id))
        c.execute("UPDATE relations SET other_user_id = ? WHERE other_user_id = ?", (keep_id, drop_id))
        c.execute("DELETE FROM relations WHERE user_id = other_user_id")
        name = keep.name if keep.name != UNKNOWN_USER else drop.name
        c.execute("UPDATE users SET name = ? WHERE user_id = ?", (name, keep_id))
        c.execute("UPDATE users SET merged_into = ? WHERE user_id = ?", (keep_id, drop_id))
        c.execute("UPDATE users SET merged_into = ? WHERE merged_into = ?", (keep_id, drop_id))
        self._touch(c, keep_id)
        self._touch(c, drop_id)
        self._bump_keys_generation(c)
        self._log(c, "merge_users", prov, keep_id, f"users:{drop_id}", reason, related_user_id=drop_id)

    def forget_user(self, user_id: str, prov: Provenance = MANUAL, reason: str = "") -> ForgetReceipt:
        forget_id = uuid.uuid4().hex
        with self._write() as c:
            self._live_user(c, user_id)
            merged = c.execute("SELECT user_id FROM users WHERE merged_into = ?", (user_id,)).fetchall()
            ids = [user_id] + [r[0] for r in merged]
            names = self._name_history(c, ids)  # a tombstone / an earlier name is the same person too
            marks = ",".join("?" * len(ids))
            keys = c.execute(f"SELECT modality, vector FROM biometric_keys WHERE user_id IN ({marks})", ids).fetchall()
            vectors = [np.frombuffer(v, dtype="<f4") for _, v in keys]
            others = c.execute(f"SELECT modality, vector FROM biometric_keys WHERE user_id NOT IN ({marks})",
                               ids).fetchall()
            pat = name_pattern(names)
            chunks, unreadable = self._redact_chunks(c, pat, keys, others)
            sessions = [r[0] for r in c.execute(f"SELECT session_id FROM sessions WHERE user_id IN ({marks})", ids)]
            smarks = ",".join("?" * len(sessions))
            deleted: dict[str, int] = {}

            def delete(table: str, where: str, params: Sequence[Any]) -> None:
                n = c.execute(f"DELETE FROM {table} WHERE {where}", params).rowcount
                deleted[table] = deleted.get(table, 0) + n

            delete("biometric_keys", f"user_id IN ({marks})", ids)
            delete("memory_items", f"user_id IN ({marks})", ids)
            delete("summaries", f"user_id IN ({marks})", ids)
            delete("persona", f"user_id IN ({marks})", ids)
            neighbours = {r[0] for r in c.execute(
                f"SELECT other_user_id FROM relations WHERE user_id IN ({marks}) UNION "
                f"SELECT user_id FROM relations WHERE other_user_id IN ({marks})", ids + ids)} - set(ids)
            delete("relations", f"user_id IN ({marks}) OR other_user_id IN ({marks})", ids + ids)
            if sessions:
                delete("llm_calls", f"session_id IN ({smarks})", sessions)
                delete("dead_letters", f"session_id IN ({smarks})", sessions)
            delete("dead_letters", f"user_id IN ({marks})", ids)
            delete("sessions", f"user_id IN ({marks})", ids)
            c.execute("INSERT INTO forget_guard (active) VALUES (1)")
            delete("op_log", f"user_id IN ({marks}) OR related_user_id IN ({marks})", ids + ids)
            c.execute("DELETE FROM forget_guard")
            delete("users", f"user_id IN ({marks})", ids)
            for n in sorted(neighbours):  # people only this user mentioned: nothing else refers to them
                if self._is_orphan(c, n):
                    c.execute("INSERT INTO forget_guard (active) VALUES (1)")
                    c.execute("DELETE FROM op_log WHERE user_id = ? OR related_user_id = ?", (n, n))
                    c.execute("DELETE FROM forget_guard")
                    delete("users", "user_id = ?", (n,))
            redacted = self._redact(c, pat) if pat is not None else {}
            self._bump_keys_generation(c)
            self._log(c, "forget", prov, None, None, "",  # the log keeps only that a forget happened
                      detail={"forget_id": forget_id, "deleted": deleted, "redacted": redacted,
                              "names": len(names), "chunks": chunks})
        clean = self._scrub()
        leftovers = self.verify_forgotten(user_id, vectors, names)
        leftovers += [f"chunk {f} (unreadable, so not redacted; its job fails on it too)" for f in unreadable]
        return ForgetReceipt(forget_id, deleted, leftovers, clean, redacted)

    def _scrub(self) -> bool:
        """VACUUM (every page rewritten from the live rows: no stale copy of a deleted cell survives in a
        page's unallocated gap or on the freelist), then checkpoint the WAL back and truncate it.
        False when a long reader kept old WAL frames alive (they go at the next checkpoint) or the
        VACUUM could not get the database (the raw-byte scan then says what is left)."""
        c = self._conn()
        try:
            c.execute("VACUUM")
        except sqlite3.OperationalError as e:  # e.g. busy past busy_timeout: the forget itself is committed
            log.error("forget: VACUUM failed (%s); deleted data may stay in free page space until the next one", e)
            return False
        for _ in range(50):  # readers in other connections can hold old frames for a moment
            busy, _log, _done = c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if busy == 0:
                return True
            time.sleep(0.1)
        return False

    def _name_history(self, c: sqlite3.Connection, ids: Sequence[str]) -> list[str]:
        """Every name of these users: current ones, and each name their op-log rows recorded
        (create_user, rename: PATCH and names learnt from sessions), oldest first."""
        marks = ",".join("?" * len(ids))
        names = [r[0] for r in c.execute(f"SELECT name FROM users WHERE user_id IN ({marks})", list(ids))]
        for (detail,) in c.execute(f"SELECT detail FROM op_log WHERE user_id IN ({marks}) "
                                   "AND op IN ('create_user', 'rename') ORDER BY op_id", list(ids)):
            d = json.loads(detail or "{}")
            names += [d[k] for k in ("name", "old", "new") if isinstance(d.get(k), str)]
        out: list[str] = []
        for n in names:
            n = " ".join(n.split())
            if n and n.lower() != UNKNOWN_USER and n not in out:
                out.append(n)
        return out

    def name_history(self, user_id: str) -> list[str]:
        with self._read() as c:
            ids = [user_id] + [r[0] for r in c.execute("SELECT user_id FROM users WHERE merged_into = ?", (user_id,))]
            return self._name_history(c, ids)

    def _redact_chunks(self, c: sqlite3.Connection, pat: re.Pattern[str] | None, keys: Sequence[tuple[str, bytes]],
                       others: Sequence[tuple[str, bytes]]) -> tuple[dict[str, int], list[str]]:
        """Remove the person from the chunk files of every memory job not done yet (queued, leased,
        dead and waiting for a requeue). The job is kept (others' words in the chunk are memory
        too); its `redactions` goes up so a session read before this is refused at commit, and a
        leased job gets one more attempt for that refusal. Returns (counts for the forget's log row,
        folders that could not be read)."""
        if pat is None and not keys:
            return {}, []
        by = lambda rows: {m: [np.frombuffer(v, dtype="<f4") for mm, v in rows if mm == m]  # noqa: E731
                           for m in ("face", "voice")}
        forgotten, known = by(keys), by(others)
        total: dict[str, int] = {}
        unreadable: list[str] = []
        status_of = dict(c.execute("SELECT job_id, status FROM jobs WHERE kind = ?", (JOB_KIND,)).fetchall())
        for job_id, folder in self._pending_chunks(c):
            status = status_of[job_id]
            try:
                counts = redact_chunk(folder, pat, forgotten, known, self._forget_distance)
            except Exception as e:  # noqa: BLE001 — unreadable: reported as a leftover; its own job fails on it too
                log.error("forget: chunk %s of job %s could not be redacted: %s", folder, job_id, e)
                unreadable.append(str(folder))
                continue
            if not counts:
                continue
            redactions = int(json.loads((folder / "meta.json").read_text()).get("redactions", 0))
            c.execute("UPDATE jobs SET redactions = ?, max_attempts = max_attempts + ?, updated_at = ? "
                      "WHERE job_id = ?", (redactions, 1 if status == "running" else 0, self._clock(), job_id))
            total["chunks"] = total.get("chunks", 0) + 1
            for k, v in counts.items():
                total[k] = total.get(k, 0) + v
        return total, unreadable

    def _pending_chunks(self, c: sqlite3.Connection) -> list[tuple[str, Path]]:
        """(job id, chunk folder) of every memory job not done yet whose folder is there."""
        out = []
        for job_id, payload in c.execute("SELECT job_id, payload FROM jobs WHERE kind = ? AND status != 'done' "
                                         "AND payload IS NOT NULL", (JOB_KIND,)).fetchall():
            folder = Path(str((json.loads(payload) or {}).get("chunk_dir", "")))
            if (folder / "meta.json").is_file():
                out.append((job_id, folder))
        return out

    @staticmethod
    def _text_columns(c: sqlite3.Connection) -> Iterator[tuple[str, str]]:
        """(table, column) of every column that may hold a mention of a person. Skipped: primary keys
        (generated ids), `users.name` (another user's own name is not a mention of the forgotten
        one), and op-log columns other than its free text (reason, detail)."""
        for t in [r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]:
            for _cid, col, _type, _nn, _default, pk in c.execute(f"PRAGMA table_info({t})").fetchall():
                if pk or (t, col) == ("users", "name") or (t == "op_log" and col not in ("reason", "detail")):
                    continue
                yield t, col

    def _redact(self, c: sqlite3.Connection, pat: re.Pattern[str]) -> dict[str, int]:
        """Replace the forgotten name in every remaining text cell (other users' rows, history rows
        too); returns '<table>.<column>' -> rows changed. Runs inside forget's write transaction:
        the op log accepts these UPDATEs only while `forget_guard` is set, and only of reason/detail."""
        c.create_function("egomem_redact", 1, lambda v: redact(v, pat), deterministic=True)
        out: dict[str, int] = {}
        c.execute("INSERT INTO forget_guard (active) VALUES (1)")
        try:
            for t, col in list(self._text_columns(c)):
                n = c.execute(f"UPDATE {t} SET {col} = egomem_redact({col}) "
                              f"WHERE typeof({col}) = 'text' AND egomem_redact({col}) != {col}").rowcount
                if n:
                    out[f"{t}.{col}"] = n
        finally:
            c.execute("DELETE FROM forget_guard")
        return out

    @staticmethod
    def _is_orphan(c: sqlite3.Connection, user_id: str) -> bool:
        """A user with no keys, memories, sessions or relations (a person someone only mentioned)."""
        for table, col in (("biometric_keys", "user_id"), ("memory_items", "user_id"), ("summaries", "user_id"),
                           ("persona", "user_id"), ("sessions", "user_id"), ("relations", "user_id"),
                           ("relations", "other_user_id"), ("users", "merged_into")):
            if c.execute(f"SELECT 1 FROM {table} WHERE {col} = ? LIMIT 1", (user_id,)).fetchone():
                return False
        return True

    def verify_forgotten(self, user_id: str, vectors: Sequence[np.ndarray] = (),
                         name: str | Sequence[str] | None = None) -> list[str]:
        """Id and vector bytes: searched in every cell of every table. Name(s): every text cell
        except `users.name` (other users' own names), matched as redaction matches them. Then the
        raw bytes of the database file and its WAL (free space, stale page areas, old frames):
        '<file> (<what>, N)' for the id, a vector, or more occurrences of a name than the live
        `users.name` cells and the schema account for."""
        c = self._conn()
        needles: list[tuple[str, bytes]] = [("id", user_id.encode())]
        needles += [(f"vector{i}", np.asarray(v, dtype="<f4").tobytes()) for i, v in enumerate(vectors)]
        hits = []
        tables = [r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for t in tables:
            for col in [r[1] for r in c.execute(f"PRAGMA table_info({t})")]:
                for what, needle in needles:
                    n = c.execute(f"SELECT COUNT(*) FROM {t} WHERE instr(CAST({col} AS BLOB), ?) > 0",
                                  (needle,)).fetchone()[0]
                    if n:
                        hits.append(f"{t}.{col} ({what}, {n} rows)")
        names = [name] if isinstance(name, str) else list(name or [])
        pat = name_pattern(names)
        if pat is not None:
            c.create_function("egomem_mentions", 1, lambda v: mentions(v, pat), deterministic=True)
            for t in tables:
                for col in [r[1] for r in c.execute(f"PRAGMA table_info({t})")]:
                    if (t, col) == ("users", "name"):
                        continue
                    n = c.execute(f"SELECT COUNT(*) FROM {t} WHERE typeof({col}) = 'text' AND egomem_mentions({col})"
                                  ).fetchone()[0]
                    if n:
                        hits.append(f"{t}.{col} (name, {n} rows)")
        return hits + self._raw_hits(c, needles, names) + self._chunk_hits(c, pat)

    def _chunk_hits(self, c: sqlite3.Connection, pat: re.Pattern[str] | None) -> list[str]:
        """Text of the chunks still waiting for the worker that names the person (as `redact_chunk` matches)."""
        if pat is None:
            return []
        hits = []
        for job_id, folder in self._pending_chunks(c):
            try:
                meta = json.loads((folder / "meta.json").read_text())
            except (OSError, ValueError) as e:
                hits.append(f"chunk {folder} of job {job_id} (unreadable: {e})")
                continue
            n = sum(redact_pieces([(int(t), str(x)) for t, x in meta.get(k, [])], pat)[1]
                    for k in ("client_transcript", "monologue"))
            if n:
                hits.append(f"chunk {folder} of job {job_id} (name, {n} matches)")
        return hits

    def _raw_hits(self, c: sqlite3.Connection, needles: Sequence[tuple[str, bytes]], names: Sequence[str]) -> list[str]:
        """The verification's byte scan of the files themselves (see `verify_forgotten`)."""
        pat = _raw_name_pattern(names)
        legit = 0
        if pat is not None:  # another user of the same name, or a word of the schema, is not a leftover
            for (text,) in c.execute("SELECT name FROM users UNION ALL SELECT sql FROM sqlite_master "
                                     "WHERE sql IS NOT NULL UNION ALL SELECT name FROM sqlite_master"):
                legit += len(pat.findall(str(text).encode()))
        hits = []
        for f in (self.path, Path(f"{self.path}-wal")):
            try:
                fh = open(f, "rb")
            except FileNotFoundError:
                continue
            with fh:
                if os.fstat(fh.fileno()).st_size == 0:
                    continue
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as raw:  # no copy of a large file
                    for what, needle in needles:
                        n = len(re.findall(re.escape(needle), raw))
                        if n:
                            hits.append(f"{f.name} ({what}, {n} byte matches)")
                    if pat is not None:
                        n = len(pat.findall(raw))
                        if n > legit:
                            hits.append(f"{f.name} (name, {n - legit} unexplained matches)")
        return hits

    # ------------------------------------------------------------------ biometric keys

    def _insert_key(self, c: sqlite3.Connection, key_id: str, user_id: str, modality: str, model_id: str,
                    vector: np.ndarray, prov: Provenance) -> None:
        if modality not in ("face", "voice"):
            raise StoreError(f"modality {modality!r}; allowed: 'face', 'voice'")
        blob = _vec_bytes(vector)
        c.execute("INSERT INTO biometric_keys (key_id, user_id, modality, model_id, dim, vector, session_id, created_at) "
                  "VALUES (?,?,?,?,?,?,?,?)",
                  (key_id, user_id, modality, model_id, len(blob) // 4, blob, prov.session_id, self._clock()))
        self._bump_keys_generation(c)
        self._log(c, "add_key", prov, user_id, f"biometric_keys:{key_id}", detail={"modality": modality,
                                                                                    "model_id": model_id})

    def add_key(self, user_id: str, modality: Modality, model_id: str, vector: np.ndarray,
                prov: Provenance = MANUAL) -> str:
        key_id = uuid.uuid4().hex
        with self._write() as c:
            self._live_user(c, user_id)
            self._insert_key(c, key_id, user_id, modality, model_id, vector, prov)
            self._touch(c, user_id)
        return key_id

    def list_keys(self, modality: Modality | None = None, model_id: str | None = None,
                  user_id: str | None = None) -> list[BiometricKey]:
        q = ("SELECT k.key_id, k.user_id, k.modality, k.model_id, k.vector, k.session_id, k.created_at "
             "FROM biometric_keys k JOIN users u ON u.user_id = k.user_id WHERE u.merged_into IS NULL")
        params: list[Any] = []
        if user_id:
            q += " AND k.user_id = ?"
            params.append(user_id)
        if modality:
            q += " AND k.modality = ?"
            params.append(modality)
        if model_id:
            q += " AND k.model_id = ?"
            params.append(model_id)
        rows = self._conn().execute(q + " ORDER BY k.created_at, k.key_id", params)
        return [BiometricKey(r[0], r[1], r[2], r[3], np.frombuffer(r[4], dtype="<f4").copy(), r[5], r[6]) for r in rows]

    def keys_generation(self) -> int:
        return int(self._conn().execute("SELECT value FROM meta WHERE name = 'keys_generation'").fetchone()[0])

    # ------------------------------------------------------------------ facts and preferences

    def _insert_item(self, c: sqlite3.Connection, item_id: str, user_id: str, kind: str, text: str,
                     key: str | None, polarity: str | None, valid_from: float, prov: Provenance, reason: str) -> None:
        if kind not in ("fact", "preference"):
            raise StoreError(f"item kind {kind!r}; allowed: 'fact', 'preference'")
        if kind == "preference" and polarity not in ("like", "dislike"):
            raise StoreError(f"a preference needs polarity 'like' or 'dislike', got {polarity!r}")
        if not text.strip():
            raise StoreError("a memory item needs text")
        c.execute(f"INSERT INTO memory_items ({_ITEM_COLS}, created_at) VALUES (?,?,?,?,?,?,?,NULL,NULL,?,?,?)",
                  (item_id, user_id, kind, key, text.strip(), polarity if kind == "preference" else None,
                   valid_from, prov.session_id, prov.origin, self._clock()))
        self._log(c, "add", prov, user_id, f"memory_items:{item_id}", reason,
                  detail={"kind": kind, "key": key, "text": text.strip(), "polarity": polarity})

    def _close_item(self, c: sqlite3.Connection, user_id: str, item_id: str, at: float, superseded_by: str | None,
                    prov: Provenance, reason: str) -> None:
        row = c.execute("SELECT user_id, invalid_at FROM memory_items WHERE item_id = ?", (item_id,)).fetchone()
        if row is None or row[0] != user_id:
            raise StoreError(f"memory item {item_id!r} is not one of user {user_id!r}'s")
        if row[1] is not None:
            raise StoreError(f"memory item {item_id!r} is no longer current (already superseded or retracted)")
        c.execute("UPDATE memory_items SET invalid_at = ?, superseded_by = ? WHERE item_id = ?",
                  (at, superseded_by, item_id))
        self._log(c, "supersede" if superseded_by else "retract", prov, user_id, f"memory_items:{item_id}", reason,
                  detail={"superseded_by": superseded_by} if superseded_by else {})

    def _item_row(self, c: sqlite3.Connection, item_id: str) -> MemoryItem:
        row = c.execute(f"SELECT {_ITEM_COLS} FROM memory_items WHERE item_id = ?", (item_id,)).fetchone()
        if row is None:
            raise StoreError(f"unknown memory item {item_id!r}")
        return MemoryItem(*row)

    def add_item(self, user_id: str, kind: str, text: str, key: str | None = None,
                 polarity: Polarity | None = None, prov: Provenance = MANUAL, reason: str = "") -> str:
        item_id = uuid.uuid4().hex
        with self._write() as c:
            self._live_user(c, user_id)
            self._insert_item(c, item_id, user_id, kind, text, key, polarity, self._clock(), prov, reason)
            self._touch(c, user_id)
        return item_id

    def supersede_item(self, item_id: str, text: str, prov: Provenance = MANUAL, reason: str = "",
                       polarity: Polarity | None = None) -> str:
        new_id = uuid.uuid4().hex
        with self._write() as c:
            old = self._item_row(c, item_id)
            self._live_user(c, old.user_id)
            now = self._clock()
            self._close_item(c, old.user_id, item_id, now, new_id, prov, reason)
            self._insert_item(c, new_id, old.user_id, old.kind, text, old.key, polarity or old.polarity, now, prov,
                              reason)
            self._touch(c, old.user_id)
        return new_id

    def retract_item(self, item_id: str, prov: Provenance = MANUAL, reason: str = "") -> None:
        with self._write() as c:
            old = self._item_row(c, item_id)
            self._close_item(c, old.user_id, item_id, self._clock(), None, prov, reason)
            self._touch(c, old.user_id)

    def items(self, user_id: str, kind: str | None = None, history: bool = False) -> list[MemoryItem]:
        return self._items(self._conn(), user_id, kind, history)

    def _items(self, c: sqlite3.Connection, user_id: str, kind: str | None, history: bool) -> list[MemoryItem]:
        q = f"SELECT {_ITEM_COLS} FROM memory_items WHERE user_id = ?"
        params: list[Any] = [user_id]
        if kind:
            q += " AND kind = ?"
            params.append(kind)
        if not history:
            q += " AND invalid_at IS NULL"
        return [MemoryItem(*r) for r in c.execute(q + " ORDER BY valid_from, created_at, item_id", params)]

    # ------------------------------------------------------------------ summaries, persona, relations

    def add_summary(self, user_id: str, text: str, prov: Provenance = MANUAL) -> str:
        sid = uuid.uuid4().hex
        with self._write() as c:
            self._live_user(c, user_id)
            self._insert_summary(c, sid, user_id, text, self._clock(), prov)
            self._touch(c, user_id)
        return sid

    def _insert_summary(self, c: sqlite3.Connection, summary_id: str, user_id: str, text: str, at: float,
                        prov: Provenance) -> None:
        c.execute("INSERT INTO summaries (summary_id, user_id, session_id, text, origin, created_at) VALUES (?,?,?,?,?,?)",
                  (summary_id, user_id, prov.session_id, text.strip(), prov.origin, at))
        self._log(c, "add", prov, user_id, f"summaries:{summary_id}", detail={"text": text.strip()})

    def summaries(self, user_id: str, limit: int = 20) -> list[Summary]:
        return self._summaries(self._conn(), user_id, limit)

    def _summaries(self, c: sqlite3.Connection, user_id: str, limit: int) -> list[Summary]:
        rows = c.execute("SELECT summary_id, user_id, session_id, text, origin, created_at FROM summaries "
                         "WHERE user_id = ? ORDER BY created_at DESC, summary_id LIMIT ?", (user_id, limit))
        return [Summary(*r) for r in rows]

    def persona(self, user_id: str) -> dict[int, PersonaValue]:
        return self._persona(self._conn(), user_id)

    def _persona(self, c: sqlite3.Connection, user_id: str) -> dict[int, PersonaValue]:
        rows = c.execute("SELECT dim, value, confidence, evidence, origin FROM persona WHERE user_id = ? ORDER BY dim",
                         (user_id,))
        return {r[0]: PersonaValue(*r) for r in rows}

    def _merge_persona(self, c: sqlite3.Connection, user_id: str, updates: Sequence[PersonaUpdate],
                       prov: Provenance) -> None:
        have = self._persona(c, user_id)
        for u in updates:
            if not (0 <= u.dim < 90 and 0.0 <= u.value <= 1.0 and 0.0 <= u.confidence <= 1.0):
                raise StoreError(f"persona update out of range: {u}")
            old = have.get(u.dim)
            if old is None:
                value, conf = u.value, u.confidence
            else:  # confidence-weighted mean; independent evidence raises confidence
                w = old.confidence + u.confidence
                value = (old.value * old.confidence + u.value * u.confidence) / w if w > 0 else u.value
                conf = 1.0 - (1.0 - old.confidence) * (1.0 - u.confidence)
            value, conf = round(value, 6), round(conf, 6)
            c.execute(
                "INSERT INTO persona (user_id, dim, value, confidence, evidence, session_id, origin, updated_at) "
                "VALUES (?,?,?,?,?,?,?,?) ON CONFLICT (user_id, dim) DO UPDATE SET value = excluded.value, "
                "confidence = excluded.confidence, evidence = excluded.evidence, session_id = excluded.session_id, "
                "origin = excluded.origin, updated_at = excluded.updated_at",
                (user_id, u.dim, value, conf, u.evidence[:500], prov.session_id, prov.origin, self._clock()))
            have[u.dim] = PersonaValue(u.dim, value, conf, u.evidence, prov.origin)
            self._log(c, "persona_update", prov, user_id, f"persona:{u.dim}",
                      detail={"dim": u.dim, "value": value, "confidence": conf, "evidence": u.evidence[:500]})

    def update_persona(self, user_id: str, updates: Sequence[PersonaUpdate], prov: Provenance = MANUAL) -> None:
        with self._write() as c:
            self._live_user(c, user_id)
            self._merge_persona(c, user_id, updates, prov)
            self._touch(c, user_id)

    def _insert_relation(self, c: sqlite3.Connection, relation_id: str, user_id: str, other: str, relation: str,
                         at: float, prov: Provenance) -> bool:
        relation = " ".join(relation.lower().split())
        if not relation:
            raise StoreError("a relation needs words (e.g. 'sister')")
        if c.execute("SELECT 1 FROM relations WHERE user_id = ? AND other_user_id = ? AND relation = ? "
                     "AND invalid_at IS NULL", (user_id, other, relation)).fetchone():
            return False
        c.execute(f"INSERT INTO relations ({_REL_COLS}, created_at) VALUES (?,?,?,?,?,NULL,?,?,?)",
                  (relation_id, user_id, other, relation, at, prov.session_id, prov.origin, self._clock()))
        self._log(c, "add", prov, user_id, f"relations:{relation_id}", related_user_id=other,
                  detail={"relation": relation})
        return True

    def add_relation(self, user_id: str, other_user_id: str, relation: str, prov: Provenance = MANUAL) -> str:
        rid = uuid.uuid4().hex
        if user_id == other_user_id:
            raise StoreError("a relation links two different users")
        with self._write() as c:
            self._live_user(c, user_id)
            self._live_user(c, other_user_id)
            if self._insert_relation(c, rid, user_id, other_user_id, relation, self._clock(), prov):
                self._touch(c, user_id)
        return rid

    def relations(self, user_id: str) -> list[tuple[Relation, str]]:
        return self._relations(self._conn(), user_id)

    def _relations(self, c: sqlite3.Connection, user_id: str) -> list[tuple[Relation, str]]:
        cols = ", ".join(f"r.{x.strip()}" for x in _REL_COLS.split(","))
        rows = c.execute(
            f"SELECT {cols}, u.name FROM relations r JOIN users u ON u.user_id = "
            "CASE WHEN r.user_id = ? THEN r.other_user_id ELSE r.user_id END "
            "WHERE (r.user_id = ? OR r.other_user_id = ?) AND r.invalid_at IS NULL ORDER BY r.valid_from, r.relation_id",
            (user_id, user_id, user_id))
        return [(Relation(*r[:-1]), r[-1]) for r in rows]

    # ------------------------------------------------------------------ profile, sessions

    def profile(self, user_id: str, summaries: int = 5) -> Profile:
        with self._read() as c:
            row = c.execute(f"SELECT {_USER_COLS} FROM users WHERE user_id = ?", (user_id,)).fetchone()
            if row is None:
                raise StoreError(f"unknown user {user_id!r}")
            user = User(*row)
            if user.merged_into:
                raise StoreError(f"user {user_id!r} was merged into {user.merged_into!r}")
            return Profile(user, self._items(c, user_id, "fact", False), self._items(c, user_id, "preference", False),
                           self._summaries(c, user_id, summaries), self._persona(c, user_id),
                           self._relations(c, user_id))

    def get_session(self, session_id: str) -> SessionRecord | None:
        row = self._conn().execute(f"SELECT {_SESSION_COLS} FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return SessionRecord(*row) if row else None

    def list_sessions(self, user_id: str | None = None, stream_id: str | None = None) -> list[SessionRecord]:
        q, params = f"SELECT {_SESSION_COLS} FROM sessions WHERE 1 = 1", []
        if user_id:
            q += " AND user_id = ?"
            params.append(user_id)
        if stream_id:
            q += " AND stream_id = ?"
            params.append(stream_id)
        rows = self._conn().execute(q + " ORDER BY stream_id, chunk_index, start_step", params)
        return [SessionRecord(*r) for r in rows]

    def commit_session(self, m: SessionCommit) -> bool:
        try:
            return self._commit_session(m)
        except ChunkRedacted:  # LLM answers / dead letters made from the unredacted text: never replayed or kept
            with self._write() as c:
                c.execute("DELETE FROM llm_calls WHERE session_id = ?", (m.session_id,))
                c.execute("DELETE FROM dead_letters WHERE session_id = ? AND source = 'llm' AND resolved_at IS NULL",
                          (m.session_id,))
            self._scrub()  # rare (a forget raced a running job): no stale page copy or WAL frame keeps them
            raise

    def _commit_session(self, m: SessionCommit) -> bool:
        prov = m.provenance
        with self._write() as c:
            if c.execute("SELECT 1 FROM sessions WHERE session_id = ?", (m.session_id,)).fetchone():
                return False  # already committed: processing a session twice changes nothing
            if m.chunk_redactions is not None:
                row = c.execute("SELECT redactions FROM jobs WHERE job_key = ?",
                                (job_key(m.stream_id, m.chunk_index),)).fetchone()
                if row is not None and row[0] > m.chunk_redactions:  # read before a forget rewrote it
                    raise ChunkRedacted(f"session {m.session_id}: a forget redacted chunk {m.stream_id}/"
                                        f"{m.chunk_index} after it was read; the job re-runs on the redacted files")
            if m.name and MARKER in m.name:  # "my name is [forgotten person]": not a name to learn
                m = dataclasses.replace(m, name=None, name_reason="")
            if m.user_id is None and not m.new_user_id:  # nobody to attribute it to, and nothing said
                c.execute(f"INSERT INTO sessions ({_SESSION_COLS}) VALUES (?,?,?,?,?,NULL,?,?,'done',?)",
                          (m.session_id, m.stream_id, m.chunk_index, m.start_step, m.end_step, m.transcript,
                           m.transcript_source, self._clock()))
                return True
            if m.user_id is None:
                user_id = m.new_user_id
                self._insert_user(c, user_id, (m.name or UNKNOWN_USER).strip(), prov, m.name_reason or "new user")
            else:
                user_id = m.user_id
                u = self._live_user(c, user_id)
                if m.expected_version is not None and u.version != m.expected_version:
                    raise VersionConflict(f"user {user_id} is at version {u.version}, "
                                          f"the decisions were made at {m.expected_version}")
                if m.name and m.name.strip() and m.name.strip() != u.name:
                    c.execute("UPDATE users SET name = ? WHERE user_id = ?", (m.name.strip(), user_id))
                    self._log(c, "rename", prov, user_id, f"users:{user_id}", m.name_reason,
                              detail={"old": u.name, "new": m.name.strip()})
            if m.name and m.name.strip():
                self._absorb_placeholder(c, user_id, m.name.strip(), prov)
            for i, k in enumerate(m.keys):
                self._insert_key(c, derived_id(m.session_id, "key", i), user_id, k.modality, k.model_id, k.vector, prov)
            for i, d in enumerate(m.decisions):
                new_id = derived_id(m.session_id, "item", i)
                if d.action in ("supersede", "retract"):
                    if not d.target_id:
                        raise StoreError(f"decision {i} ({d.action}) needs target_id")
                    self._close_item(c, user_id, d.target_id, m.valid_from,
                                     new_id if d.action == "supersede" else None, prov, d.reason)
                if d.action in ("add", "supersede"):
                    key, polarity = d.key, d.polarity
                    if d.action == "supersede":
                        old = self._item_row(c, d.target_id)  # type: ignore[arg-type]
                        key, polarity = key or old.key, polarity or old.polarity
                    self._insert_item(c, new_id, user_id, d.kind, d.text, key, polarity, m.valid_from, prov, d.reason)
            if m.persona:
                self._merge_persona(c, user_id, m.persona, prov)
            if m.summary and m.summary.strip():
                self._insert_summary(c, derived_id(m.session_id, "summary"), user_id, m.summary, m.valid_from, prov)
            for i, (person, relation) in enumerate(m.relations):
                other = self._person(c, user_id, person, derived_id(m.session_id, "person", person.lower()), prov)
                if other is not None:
                    self._insert_relation(c, derived_id(m.session_id, "relation", i), user_id, other, relation,
                                          m.valid_from, prov)
            c.execute(f"INSERT INTO sessions ({_SESSION_COLS}) VALUES (?,?,?,?,?,?,?,?,'done',?)",
                      (m.session_id, m.stream_id, m.chunk_index, m.start_step, m.end_step, user_id, m.transcript,
                       m.transcript_source, self._clock()))
            self._touch(c, user_id)
        return True

    def _absorb_placeholder(self, c: sqlite3.Connection, user_id: str, name: str, prov: Provenance) -> None:
        """A user who says their name may be someone others already mentioned (a keyless user of
        that name, made from "my sister Marta"): if exactly one such user exists, merge it in, so
        the social graph reaches the real person."""
        rows = c.execute("SELECT u.user_id FROM users u WHERE lower(u.name) = lower(?) AND u.merged_into IS NULL "
                         "AND u.user_id != ? AND NOT EXISTS (SELECT 1 FROM biometric_keys k WHERE k.user_id = u.user_id)"
                         " AND NOT EXISTS (SELECT 1 FROM sessions s WHERE s.user_id = u.user_id)",
                         (name, user_id)).fetchall()
        if len(rows) == 1:
            self._merge(c, user_id, rows[0][0], prov, f"'{name}' was mentioned by others before they met us")

    def _person(self, c: sqlite3.Connection, user_id: str, person: str, new_id: str, prov: Provenance) -> str | None:
        """The user a mentioned person is: a unique live user of that name, else a new user (no keys yet)."""
        person = " ".join(person.split())
        if not person or person.lower() == UNKNOWN_USER or MARKER in person:  # a forgotten person stays gone
            return None
        rows = c.execute("SELECT user_id FROM users WHERE lower(name) = lower(?) AND merged_into IS NULL "
                         "AND user_id != ?", (person, user_id)).fetchall()
        if len(rows) == 1:
            return rows[0][0]
        if c.execute("SELECT 1 FROM users WHERE user_id = ?", (new_id,)).fetchone():
            return new_id
        self._insert_user(c, new_id, person, prov, "mentioned by a user")
        return new_id

    # ------------------------------------------------------------------ operation log

    def op_log(self, user_id: str | None = None, after_op_id: int = 0, limit: int = 1000) -> list[OpLogEntry]:
        q = ("SELECT op_id, ts, op, actor, user_id, related_user_id, target, session_id, llm_model, prompt_hash, "
             "reason, detail FROM op_log WHERE op_id > ?")
        params: list[Any] = [after_op_id]
        if user_id:
            q += " AND (user_id = ? OR related_user_id = ?)"
            params += [user_id, user_id]
        rows = self._conn().execute(q + " ORDER BY op_id LIMIT ?", params + [limit])
        return [OpLogEntry(*r[:-1], json.loads(r[-1] or "{}")) for r in rows]

    # ------------------------------------------------------------------ job queue

    @staticmethod
    def _job(row: Sequence[Any]) -> Job:
        return Job(row[0], row[1], row[2], json.loads(row[3]) if row[3] else None, row[4], row[5], row[6], row[7],
                   row[8], json.loads(row[9]) if row[9] else None, row[10])

    def enqueue_job(self, kind: str, key: str, payload: dict[str, Any], max_attempts: int | None = None) -> Job:
        now = self._clock()
        with self._write() as c:
            c.execute("INSERT INTO jobs (job_id, job_key, kind, payload, status, attempts, max_attempts, available_at, "
                      "created_at, updated_at) VALUES (?,?,?,?,'queued',0,?,?,?,?) ON CONFLICT (job_key) DO NOTHING",
                      (uuid.uuid4().hex, key, kind, json.dumps(payload, sort_keys=True),
                       max_attempts or self._job_max_attempts, now, now, now))
            return self._job(c.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE job_key = ?", (key,)).fetchone())

    def claim_job(self, worker: str, lease_s: float, kinds: Sequence[str] | None = None) -> Job | None:
        while True:
            now = self._clock()
            with self._write() as c:
                q = (f"SELECT {_JOB_COLS} FROM jobs WHERE ((status = 'queued' AND available_at <= ?) "
                     "OR (status = 'running' AND lease_until < ?))")
                params: list[Any] = [now, now]
                if kinds:
                    q += f" AND kind IN ({','.join('?' * len(kinds))})"
                    params += list(kinds)
                row = c.execute(q + " ORDER BY available_at, created_at LIMIT 1", params).fetchone()
                if row is None:
                    return None
                job = self._job(row)
                if job.attempts >= job.max_attempts:  # its last worker died holding it
                    self._kill_job(c, job, job.error or "lease expired on the last attempt (worker died?)")
                    continue
                c.execute("UPDATE jobs SET status = 'running', attempts = attempts + 1, lease_until = ?, worker = ?, "
                          "updated_at = ? WHERE job_id = ?", (now + lease_s, worker, now, job.job_id))
                return self._job(c.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE job_id = ?", (job.job_id,)).fetchone())

    def _kill_job(self, c: sqlite3.Connection, job: Job, error: str) -> None:
        now = self._clock()
        c.execute("UPDATE jobs SET status = 'dead', error = ?, lease_until = NULL, updated_at = ? WHERE job_id = ?",
                  (error, now, job.job_id))
        c.execute(f"INSERT INTO dead_letters ({_DL_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,NULL,NULL)",
                  (uuid.uuid4().hex, "job", job.kind, job.job_id, None, None,
                   json.dumps({"job_key": job.key, "payload": job.payload}, sort_keys=True), error, job.attempts, now))

    def heartbeat_job(self, job_id: str, worker: str, lease_s: float) -> bool:
        with self._write() as c:
            n = c.execute("UPDATE jobs SET lease_until = ? WHERE job_id = ? AND worker = ? AND status = 'running'",
                          (self._clock() + lease_s, job_id, worker)).rowcount
        return n == 1

    def complete_job(self, job_id: str, worker: str, result: dict[str, Any]) -> bool:
        with self._write() as c:
            n = c.execute("UPDATE jobs SET status = 'done', payload = NULL, result = ?, error = NULL, lease_until = NULL, "
                          "updated_at = ? WHERE job_id = ? AND worker = ? AND status = 'running'",
                          (json.dumps(result, sort_keys=True), self._clock(), job_id, worker)).rowcount
        return n == 1

    def fail_job(self, job_id: str, worker: str, error: str, retry_in_s: float) -> Job:
        with self._write() as c:
            row = c.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            if row is None:
                raise StoreError(f"unknown job {job_id!r}")
            job = self._job(row)
            if job.status == "running" and job.worker == worker:
                if job.attempts >= job.max_attempts:
                    self._kill_job(c, job, error)
                else:
                    c.execute("UPDATE jobs SET status = 'queued', available_at = ?, error = ?, lease_until = NULL, "
                              "updated_at = ? WHERE job_id = ?",
                              (self._clock() + retry_in_s, error, self._clock(), job_id))
            return self._job(c.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone())

    def get_job(self, job_id: str) -> Job | None:
        row = self._conn().execute(f"SELECT {_JOB_COLS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return self._job(row) if row else None

    def list_jobs(self, status: str | None = None) -> list[Job]:
        q, params = f"SELECT {_JOB_COLS} FROM jobs", []
        if status:
            q += " WHERE status = ?"
            params.append(status)
        return [self._job(r) for r in self._conn().execute(q + " ORDER BY created_at, job_id", params)]

    def job_counts(self) -> dict[str, int]:
        return dict(self._conn().execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall())

    def dead_letter_count(self, unresolved_only: bool = True) -> int:
        q = "SELECT COUNT(*) FROM dead_letters" + (" WHERE resolved_at IS NULL" if unresolved_only else "")
        return int(self._conn().execute(q).fetchone()[0])

    # ------------------------------------------------------------------ dead letters

    def add_dead_letter(self, source: str, stage: str, payload: dict[str, Any], error: str, attempts: int,
                        job_id: str | None = None, session_id: str | None = None, user_id: str | None = None) -> str:
        dl_id = uuid.uuid4().hex
        with self._write() as c:
            c.execute(f"INSERT INTO dead_letters ({_DL_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,NULL,NULL)",
                      (dl_id, source, stage, job_id, session_id, user_id, json.dumps(payload, sort_keys=True), error,
                       attempts, self._clock()))
        return dl_id

    def dead_letters(self, unresolved_only: bool = True) -> list[DeadLetter]:
        q = f"SELECT {_DL_COLS} FROM dead_letters" + (" WHERE resolved_at IS NULL" if unresolved_only else "")
        rows = self._conn().execute(q + " ORDER BY created_at, dl_id")
        return [DeadLetter(*r[:6], json.loads(r[6]), *r[7:]) for r in rows]

    def resolve_dead_letters(self, resolution: str, dl_id: str | None = None, session_id: str | None = None) -> int:
        if not (dl_id or session_id):
            raise StoreError("resolve_dead_letters needs dl_id or session_id")
        col, val = ("dl_id", dl_id) if dl_id else ("session_id", session_id)
        with self._write() as c:
            return c.execute(f"UPDATE dead_letters SET resolved_at = ?, resolution = ? WHERE {col} = ? "
                             "AND resolved_at IS NULL", (self._clock(), resolution, val)).rowcount

    def requeue_dead_letter(self, dl_id: str) -> Job | None:
        with self._write() as c:
            row = c.execute("SELECT job_id FROM dead_letters WHERE dl_id = ?", (dl_id,)).fetchone()
            if row is None:
                raise StoreError(f"unknown dead letter {dl_id!r}")
            job_id = row[0]
            c.execute("UPDATE dead_letters SET resolved_at = ?, resolution = 'requeued' WHERE dl_id = ?",
                      (self._clock(), dl_id))
            if job_id is None:
                return None
            c.execute("UPDATE jobs SET status = 'queued', attempts = 0, available_at = ?, lease_until = NULL, "
                      "worker = NULL, updated_at = ? WHERE job_id = ? AND status = 'dead'",
                      (self._clock(), self._clock(), job_id))
            return self._job(c.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone())

    # ------------------------------------------------------------------ LLM answers

    def get_llm_response(self, prompt_hash: str) -> dict[str, Any] | None:
        row = self._conn().execute("SELECT response FROM llm_calls WHERE prompt_hash = ?", (prompt_hash,)).fetchone()
        return json.loads(row[0]) if row else None

    def put_llm_response(self, prompt_hash: str, session_id: str | None, model: str, stage: str,
                         response: dict[str, Any]) -> None:
        with self._write() as c:
            c.execute("INSERT INTO llm_calls (prompt_hash, session_id, model, stage, response, created_at) "
                      "VALUES (?,?,?,?,?,?) ON CONFLICT (prompt_hash) DO NOTHING",
                      (prompt_hash, session_id, model, stage, json.dumps(response, sort_keys=True), self._clock()))


def _private_files(db: Path) -> None:
    """Create the database file 0600 before SQLite does (its -wal / -shm copy the database's mode);
    narrow an existing database (and -wal / -shm) that others could read."""
    if not db.exists():
        os.close(os.open(db, os.O_RDWR | os.O_CREAT, 0o600))
    for f in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        with contextlib.suppress(FileNotFoundError):
            if f.stat().st_mode & 0o077:
                os.chmod(f, 0o600)


def _raw_name_pattern(names: Sequence[str]) -> re.Pattern[bytes] | None:
    """A bytes pattern for the names as they may sit in the file: UTF-8 in any ASCII case, lower /
    upper / title case for the rest, whitespace runs between words, and JSON's \\uXXXX escapes."""
    alts: set[bytes] = set()
    for name in names:
        name = " ".join(name.split())
        if not name or name.lower() == UNKNOWN_USER:
            continue
        for form in {name, name.lower(), name.upper(), name.title()}:
            for text in {form, json.dumps(form)[1:-1]}:
                alts.add(rb"\s+".join(re.escape(w.encode()) for w in text.split()))
    if not alts:
        return None
    return re.compile(rb"(?<![A-Za-z0-9_])(?:" + b"|".join(sorted(alts, key=len, reverse=True)) + rb")(?![A-Za-z0-9_])",
                      re.IGNORECASE)


def _split_sql(script: str) -> list[str]:
    """Split a migration into complete statements (trigger bodies hold ';' until their END)."""
    out, buf = [], ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    if buf.strip():
        raise StoreError(f"incomplete SQL statement in a migration: {buf.strip()[:80]!r}")
    return out
