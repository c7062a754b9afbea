"""The SQLite connections, transactions, migrations and operation log that every part of the store uses.

WAL mode, one connection per thread, explicit write transactions. Durability: `synchronous=FULL` by
default, so a committed transaction survives a killed process and a power cut. Every write runs in
`BEGIN IMMEDIATE` (one writer at a time across threads and processes; others wait up to
`busy_timeout_s`), which also serialises writes for one user. Files: the database and its -wal /
-shm are 0600 (SQLite gives the WAL and shm the database file's mode, so the database is created
0600 before SQLite opens it; an older, wider file is narrowed), a folder it creates is 0700.
Migrations: schema.py (`MIGRATIONS`, `SCHEMA_VERSION`), run in order when a store opens.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from egomem.memory.errors import StoreError
from egomem.memory.sqlite.schema import MIGRATIONS, SCHEMA_VERSION
from egomem.memory.types import OpLogEntry, Provenance, User

USER_COLS = "user_id, name, created_at, updated_at, version, merged_into"


def where_equal(query: str, **columns: Any) -> tuple[str, list[Any]]:
    """`query` (which ends in a WHERE clause) narrowed by `AND column = ?` for every given value
    (None or "" leaves that column unfiltered); returns the query and its parameters."""
    params: list[Any] = []
    for column, value in columns.items():
        if value:
            query += f" AND {column} = ?"
            params.append(value)
    return query, params


class Connections:
    """The base of `SQLiteMemoryStore`: opening, transactions, migrations, the op log, shared row helpers."""

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
            self._enable_wal(c)
            c.execute(f"PRAGMA synchronous = {self._sync}")
            c.execute("PRAGMA foreign_keys = ON")
            c.execute("PRAGMA secure_delete = ON")  # deleted rows are zeroed, not left in free pages
            self._local.conn = c
            with self._all_lock:
                self._all.append(c)
        return c

    def _enable_wal(self, c: sqlite3.Connection) -> None:
        """Switch a new database to WAL. The switch needs the database to itself and SQLite may refuse it at
        once, without its busy handler, while another process opens the same new file (a worker and an
        orchestrator starting together): retry for the busy timeout instead of failing the open."""
        deadline = time.monotonic() + self._busy_ms / 1000
        while True:
            try:
                c.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as e:
                if not ("locked" in str(e) or "busy" in str(e)) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

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
        row = c.execute(f"SELECT {USER_COLS} FROM users WHERE user_id = ?", (user_id,)).fetchone()
        if row is None:
            raise StoreError(f"unknown user {user_id!r}")
        u = User(*row)
        if u.merged_into is not None:
            raise StoreError(f"user {user_id!r} was merged into {u.merged_into!r}; write to that one")
        return u

    def _touch(self, c: sqlite3.Connection, user_id: str) -> None:
        c.execute("UPDATE users SET version = version + 1, updated_at = ? WHERE user_id = ?", (self._clock(), user_id))

    def _bump_keys_generation(self, c: sqlite3.Connection, removal: bool = False) -> int:
        """Next keys generation (inside the caller's write transaction); `removal`: keys were deleted or
        moved to another user, so readers must rebuild rather than add (schema v4). Returns it."""
        c.execute("UPDATE meta SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT) WHERE name = 'keys_generation'")
        gen = int(c.execute("SELECT value FROM meta WHERE name = 'keys_generation'").fetchone()[0])
        if removal:
            c.execute("UPDATE meta SET value = ? WHERE name = 'keys_removed_generation'", (str(gen),))
        return gen

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


def _private_files(db: Path) -> None:
    """Create the database file 0600 before SQLite does (its -wal / -shm copy the database's mode);
    narrow an existing database (and -wal / -shm) that others could read."""
    if not db.exists():
        os.close(os.open(db, os.O_RDWR | os.O_CREAT, 0o600))
    for f in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        with contextlib.suppress(FileNotFoundError):
            if f.stat().st_mode & 0o077:
                os.chmod(f, 0o600)


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
