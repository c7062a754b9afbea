"""What every SQL backend's store is built on: the connection shape the shared modules write to,
the operation log, the user-row helpers, and the hooks where the databases' locking differs.

The shared SQL is written once, with `?` placeholders and the subset of SQL that SQLite and
PostgreSQL both accept (a PostgreSQL connection translates the placeholders). Locking hooks: SQLite
takes the whole database's write lock in `BEGIN IMMEDIATE`, so they do nothing there; PostgreSQL
locks rows (`FOR UPDATE` on the user row: per-user serialised writes) and takes advisory locks where
a write reads more than one user (egomem/memory/postgres/connection.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from egomem.memory.changes import ChangeKind, new_origin
from egomem.memory.errors import StoreError
from egomem.memory.types import OpLogEntry, Provenance, User

USER_COLS = "user_id, name, created_at, updated_at, version, merged_into"


class Conn(Protocol):
    """A DB-API connection as the shared modules use it: `execute(sql with ?, params)` returns a
    cursor (fetchone, fetchall, rowcount, iteration)."""

    def execute(self, sql: str, params: Sequence[Any] = ..., /) -> Any: ...


def where_equal(query: str, **columns: Any) -> tuple[str, list[Any]]:
    """`query` (which ends in a WHERE clause) narrowed by `AND column = ?` for every given value
    (None or "" leaves that column unfiltered); returns the query and its parameters."""
    params: list[Any] = []
    for column, value in columns.items():
        if value:
            query += f" AND {column} = ?"
            params.append(value)
    return query, params


def marks(values: Sequence[Any]) -> str:
    """'?,?,?' for an IN list of these values."""
    return ",".join("?" * len(values))


class SQLBase:
    """Row helpers and the operation log, over a backend's `_conn`, `_write` and `_read`."""

    _clock: Callable[[], float]
    # appended to a SELECT that reads a row the transaction then changes (PostgreSQL: " FOR UPDATE")
    ROW_LOCK = ""
    # appended to the job-claim SELECT (PostgreSQL: " FOR UPDATE SKIP LOCKED": workers never queue on a row)
    CLAIM_LOCK = ""

    def _settings(self, job_max_attempts: int, clock: Callable[[], float], forget_face_distance: float,
                  forget_voice_distance: float) -> None:
        """What every backend's constructor sets (the arguments as `SQLiteMemoryStore` documents them)."""
        self._job_max_attempts = job_max_attempts
        self._clock = clock
        # a queued chunk's face / voice poll within this cosine distance of a forgotten person's key
        # (and nearer to it than to anyone else's) is theirs and removed (memory/chunk.py redact_chunk)
        self._forget_distance = {"face": forget_face_distance, "voice": forget_voice_distance}
        self.origin = new_origin()  # names this store object's changes on the change feed (changes.py)

    def _conn(self) -> Conn:
        raise NotImplementedError

    def _write(self) -> contextlib.AbstractContextManager[Conn]:
        raise NotImplementedError

    def _read(self) -> contextlib.AbstractContextManager[Conn]:
        raise NotImplementedError

    # ------------------------------------------------------------------ locking hooks

    def _lock_users(self, c: Conn, user_ids: Sequence[str]) -> None:
        """Hold these users' rows until the transaction ends (always in one order: no deadlock)."""

    def _lock_directory(self, c: Conn) -> None:
        """Serialise writes that read who is called what (session commits, merges): they create and
        merge users by name, so two at once could each create the same person."""

    def _lock_everything(self, c: Conn) -> None:
        """Keep every other writer out until the transaction ends (forget redacts any user's rows)."""

    def _changed(self, c: Conn, kind: ChangeKind, user_ids: Sequence[str] = (), request: str = "") -> None:
        """Announce a change on the change feed when this transaction commits (PostgreSQL: NOTIFY).
        SQLite does nothing here: its feed reads the op log (egomem/memory/changes.py)."""

    # ------------------------------------------------------------------ helpers

    def _log(self, c: Conn, op: str, prov: Provenance, user_id: str | None, target: str | None,
             reason: str = "", related_user_id: str | None = None, detail: dict[str, Any] | None = None) -> None:
        c.execute(
            "INSERT INTO op_log (ts, op, actor, user_id, related_user_id, target, session_id, llm_model, "
            "prompt_hash, reason, detail) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (self._clock(), op, prov.actor, user_id, related_user_id, target, prov.session_id, prov.llm_model,
             prov.prompt_hash, reason, json.dumps(detail or {}, sort_keys=True)),
        )

    def _live_user(self, c: Conn, user_id: str) -> User:
        """The user, its row locked for this transaction; `StoreError` when unknown or merged away."""
        row = c.execute(f"SELECT {USER_COLS} FROM users WHERE user_id = ?{self.ROW_LOCK}", (user_id,)).fetchone()
        if row is None:
            raise StoreError(f"unknown user {user_id!r}")
        u = User(*row)
        if u.merged_into is not None:
            raise StoreError(f"user {user_id!r} was merged into {u.merged_into!r}; write to that one")
        return u

    def _touch(self, c: Conn, user_id: str) -> None:
        c.execute("UPDATE users SET version = version + 1, updated_at = ? WHERE user_id = ?", (self._clock(), user_id))
        self._changed(c, "profile", (user_id,))

    def _bump_keys_generation(self, c: Conn, removal: bool = False) -> int:
        """Next keys generation (inside the caller's write transaction); `removal`: keys were deleted or
        moved to another user, so readers must rebuild rather than add (SQLite schema v4, PostgreSQL v2).
        Returns it."""
        c.execute("UPDATE meta SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT) WHERE name = 'keys_generation'")
        gen = int(c.execute("SELECT value FROM meta WHERE name = 'keys_generation'").fetchone()[0])
        if removal:
            c.execute("UPDATE meta SET value = ? WHERE name = 'keys_removed_generation'", (str(gen),))
        return gen

    # ------------------------------------------------------------------ operation log

    def last_op_id(self) -> int:
        return int(self._conn().execute("SELECT COALESCE(MAX(op_id), 0) FROM op_log").fetchone()[0])

    def op_log(self, user_id: str | None = None, after_op_id: int = 0, limit: int = 1000) -> list[OpLogEntry]:
        q = ("SELECT op_id, ts, op, actor, user_id, related_user_id, target, session_id, llm_model, prompt_hash, "
             "reason, detail FROM op_log WHERE op_id > ?")
        params: list[Any] = [after_op_id]
        if user_id:
            q += " AND (user_id = ? OR related_user_id = ?)"
            params += [user_id, user_id]
        rows = self._conn().execute(q + " ORDER BY op_id LIMIT ?", params + [limit])
        return [OpLogEntry(*r[:-1], json.loads(r[-1] or "{}")) for r in rows]

