"""The PostgreSQL connections, transactions, locks and migrations that every part of the store uses.

One psycopg 3 connection per thread, in autocommit mode with explicit transactions (`_write`: READ
COMMITTED plus row locks; `_read`: one REPEATABLE READ snapshot). The shared SQL (egomem/memory/sql/)
is written with `?` placeholders; `PgConn` turns them into psycopg's `%s`. Locking, where SQLite
takes the whole database's write lock for every write:
- writes for one user are serialised on the user's row (`SELECT ... FOR UPDATE` in `_live_user`,
  `_lock_users` in sorted order where a write touches two users);
- writes that find or create users by name (session commits, merges) also take one advisory lock,
  so two sessions that mention the same new person cannot each create them;
- forget locks the users table against every other writer (it redacts any user's rows);
- a job is claimed with `FOR UPDATE SKIP LOCKED`: workers never wait on each other's rows.
A lock not granted within `busy_timeout_s` fails the statement (`lock_timeout`).
Migrations: schema.py (`MIGRATIONS`, `SCHEMA_VERSION`), run in order under an advisory lock when a
store opens, in one transaction (DDL is transactional in PostgreSQL).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from egomem.memory.changes import CHANGE_CHANNEL, Change, ChangeFeed, ChangeKind, OnChange, PostgresChangeFeed
from egomem.memory.errors import StoreError
from egomem.memory.postgres.schema import MIGRATIONS, SCHEMA_VERSION
from egomem.memory.sql.base import SQLBase

try:
    import psycopg
except ImportError:  # the SQLite default needs no driver; opening a PostgreSQL store says what to install
    psycopg = None

# pg_advisory_xact_lock keys (any fixed bigints; only this store takes them)
MIGRATION_LOCK = 0x45474F4D454D01  # "EGOMEM" 1: two processes opening a new database migrate it once
DIRECTORY_LOCK = 0x45474F4D454D02  # who is called what: session commits and merges


@functools.lru_cache(maxsize=1024)
def _pg_sql(sql: str) -> str:
    """The shared SQL's `?` placeholders as psycopg's `%s` (a literal % doubled)."""
    return sql.replace("%", "%%").replace("?", "%s")


class PgConn:
    """A psycopg connection that runs the shared `?`-style SQL (`execute` returns the cursor)."""

    def __init__(self, raw: Any):
        self.raw = raw

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        if params is None:  # no parameters: sent as written (a script of several statements may be)
            return self.raw.execute(sql)
        return self.raw.execute(_pg_sql(sql), params)


class Connections(SQLBase):
    """The base of `PostgresMemoryStore`.

    `PostgresMemoryStore(dsn, busy_timeout_s=30, job_max_attempts=5, clock=time.time,
    forget_face_distance=0.30, forget_voice_distance=0.35)`: `dsn` is a libpq connection string or
    URI (postgresql://user@host:5432/egomem); `busy_timeout_s` is how long a statement waits for a
    lock; the others as `SQLiteMemoryStore`'s."""

    ROW_LOCK = " FOR UPDATE"
    CLAIM_LOCK = " FOR UPDATE SKIP LOCKED"

    def __init__(self, dsn: str, busy_timeout_s: float = 30.0, job_max_attempts: int = 5,
                 clock: Callable[[], float] = time.time, forget_face_distance: float = 0.30,
                 forget_voice_distance: float = 0.35):
        if psycopg is None:
            raise StoreError("memory.backend = 'postgres' needs psycopg 3: pip install 'psycopg[binary]>=3.2'")
        if not dsn:
            raise StoreError("memory.backend = 'postgres' needs memory.dsn, e.g. "
                             "'postgresql://egomem@localhost:5432/egomem'")
        self.dsn = dsn
        self._lock_timeout_ms = int(busy_timeout_s * 1000)
        self._settings(job_max_attempts, clock, forget_face_distance, forget_voice_distance)
        self._local = threading.local()
        self._all: list[Any] = []
        self._all_lock = threading.Lock()
        self._migrate()

    # ------------------------------------------------------------------ connections, transactions

    def _conn(self) -> PgConn:
        c = getattr(self._local, "conn", None)
        if c is None or c.raw.closed:
            try:
                raw = psycopg.connect(self.dsn, autocommit=True)
            except psycopg.OperationalError as e:
                raise StoreError(f"cannot connect to PostgreSQL at memory.dsn ({e}); is the server up and the "
                                 "database created?") from e
            raw.execute(f"SET lock_timeout = {self._lock_timeout_ms}")
            c = self._local.conn = PgConn(raw)
            with self._all_lock:
                self._all.append(raw)
        return c

    @contextlib.contextmanager
    def _write(self) -> Iterator[PgConn]:
        """One write transaction (READ COMMITTED; the rows it writes are locked as it goes)."""
        c = self._conn()
        with c.raw.transaction():
            yield c
            self._before_commit(c)

    @contextlib.contextmanager
    def _read(self) -> Iterator[PgConn]:
        """A consistent snapshot across several SELECTs."""
        c = self._conn()
        with c.raw.transaction():
            c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            yield c

    def _before_commit(self, c: PgConn) -> None:
        """Called inside every write transaction just before COMMIT (a seam for crash tests)."""

    # ------------------------------------------------------------------ locks (sql/base.py hooks)

    def _lock_users(self, c: PgConn, user_ids: Sequence[str]) -> None:
        ids = sorted(set(user_ids))
        c.execute(f"SELECT user_id FROM users WHERE user_id IN ({','.join('?' * len(ids))}) "
                  "ORDER BY user_id FOR UPDATE", ids)

    def _lock_directory(self, c: PgConn) -> None:
        c.execute("SELECT pg_advisory_xact_lock(?)", (DIRECTORY_LOCK,))

    def _changed(self, c: PgConn, kind: ChangeKind, user_ids: Sequence[str] = (), request: str = "") -> None:
        # NOTIFY is transactional: delivered when this transaction commits, dropped when it rolls back
        c.execute("SELECT pg_notify(?, ?)", (CHANGE_CHANNEL, Change(kind, tuple(user_ids), time.time(),
                                                                      self.origin, request).payload()))

    def change_feed(self, on_change: OnChange, poll_s: float = 0.5) -> ChangeFeed:
        """LISTEN on the change channel from a thread of its own (changes.py `PostgresChangeFeed`)."""
        return PostgresChangeFeed(self.dsn, on_change, poll_s).start()

    def _lock_everything(self, c: PgConn) -> None:
        # the directory lock first (the order commits and merges take it in: no deadlock), so a session
        # commit reads the chunk's redaction count either wholly before or wholly after a forget; then
        # EXCLUSIVE on users: reads go on, every write locks a user row first and so waits
        self._lock_directory(c)
        c.execute("LOCK TABLE users IN EXCLUSIVE MODE")

    # ------------------------------------------------------------------ migrations

    def _migrate(self) -> None:
        with self._write() as c:
            c.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK,))
            c.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            have = c.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0
            if have > SCHEMA_VERSION:
                raise StoreError(f"the database at memory.dsn has schema version {have}, newer than this code "
                                 f"({SCHEMA_VERSION}); upgrade egomem")
            for v in range(have + 1, SCHEMA_VERSION + 1):
                c.execute(MIGRATIONS[v])
                c.execute("INSERT INTO schema_version (version) VALUES (?)", (v,))

    def schema_version(self) -> int:
        return self._conn().execute("SELECT MAX(version) FROM schema_version").fetchone()[0]

    def close(self) -> None:
        with self._all_lock:
            for raw in self._all:
                with contextlib.suppress(psycopg.Error):
                    raw.close()
            self._all.clear()
        self._local = threading.local()
