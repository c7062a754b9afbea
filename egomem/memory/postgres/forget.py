"""Forget on PostgreSQL: what the shared forget (egomem/memory/sql/forget.py) needs from this database.

Redaction and the name scan run the Python rule (memory/redact.py) on the cells a cheap SQL filter
lets through (`ILIKE` on an ASCII word of each name, which JSON escaping never changes; a name with
no ASCII word reads every cell). The scrub is VACUUM FULL of the store's tables: a DELETE or UPDATE
leaves the old row version in the table file until vacuumed, and VACUUM FULL writes new files from
the live rows (and rebuilds the indexes); it also copies a deleted row version that a transaction begun
before the delete may still see, so it first waits (at most `OLDER_TRANSACTIONS_WAIT_S`) for those to end.
The raw scan reads those files (tables, their TOAST
tables and indexes) when this process can read the server's data directory (a local server run
as the same OS user, as in the tests); otherwise it is skipped and says so in the log. Not reached
by either: the server's write-ahead log and backups, which keep the rows until the server recycles
them (the operator's retention policy).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from egomem.memory.postgres.connection import PgConn, psycopg
from egomem.memory.redact import mentions, redact
from egomem.memory.sql.forget import Forget, scan_files

log = logging.getLogger(__name__)

_ASCII_WORD = re.compile(r"[A-Za-z0-9]+")
OLDER_TRANSACTIONS_WAIT_S = 10.0  # longest wait for transactions begun before the scrub (a worker's job is short)
OLDER_TRANSACTIONS_POLL_S = 0.05
# (table, column, type, is primary key) of every column of the store's own tables
_COLUMNS = """
SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod),
       EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary AND a.attnum = ANY (i.indkey))
FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY c.relname, a.attnum
"""
# the files of the store's tables, their TOAST tables and all their indexes
_FILES = """
WITH t AS (SELECT oid, reltoastrelid FROM pg_class
           WHERE relnamespace = current_schema()::regnamespace AND relkind = 'r'),
     rel AS (SELECT oid FROM t UNION SELECT reltoastrelid FROM t WHERE reltoastrelid <> 0)
SELECT pg_relation_filepath(oid) FROM rel
UNION SELECT pg_relation_filepath(indexrelid) FROM pg_index WHERE indrelid IN (SELECT oid FROM rel)
"""


def _prefilter(names: Sequence[str]) -> list[str] | None:
    """ILIKE patterns of which every cell mentioning one of `names` matches one (the longest ASCII
    word of each name); None when some name has no ASCII word (then every cell is read)."""
    out = []
    for name in names:
        words = _ASCII_WORD.findall(name)
        if not words:
            return None
        out.append(f"%{max(words, key=len)}%")
    return out


class PostgresForget(Forget):
    """The PostgreSQL half of forget: scrub, redaction of every text cell, the cell and file scans."""

    def _scrub(self) -> bool:
        """VACUUM FULL of the store's tables; False when it could not run (the raw scan then says what is left)."""
        c = self._conn()
        tables = [t for t, *_ in self._columns(c)]
        older = self._wait_for_older_transactions(c)
        if older:
            log.warning("forget: %d transactions begun before the forget were still open after %.0f s; a row "
                        "version they can see stays in the table files until the next scrub", older,
                        OLDER_TRANSACTIONS_WAIT_S)
        try:
            c.execute("VACUUM (FULL) " + ", ".join(sorted(set(tables))))
        except psycopg.Error as e:  # e.g. a lock not granted in time: the forget itself is committed
            log.error("forget: VACUUM FULL failed (%s); old row versions stay in the table files until the next one", e)
            return False
        return True

    @staticmethod
    def _wait_for_older_transactions(c: PgConn) -> int:
        """Wait until no other session of this database is in a transaction begun before now (the forget
        has committed, so only those can still see its deleted rows); how many were left when the wait
        gave up (0: none)."""
        since = c.execute("SELECT statement_timestamp()").fetchone()[0]
        deadline = time.monotonic() + OLDER_TRANSACTIONS_WAIT_S
        while True:
            older = c.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() "
                              "AND pid <> pg_backend_pid() AND xact_start < ?", (since,)).fetchone()[0]
            if older == 0 or time.monotonic() >= deadline:
                return older
            time.sleep(OLDER_TRANSACTIONS_POLL_S)

    @staticmethod
    def _columns(c: PgConn) -> list[tuple[str, str, str, bool]]:
        return [tuple(r) for r in c.execute(_COLUMNS).fetchall()]

    def _text_cells(self, c: PgConn, names: Sequence[str], skip: Sequence[tuple[str, str]] = (),
                    free_text_only: bool = False) -> Iterator[tuple[str, str, str, str]]:
        """(table, column, ctid, value) of every text cell that may mention one of `names`, outside
        `skip`; with `free_text_only`, outside primary keys and, of the op log, only reason and detail."""
        likes = _prefilter(names)
        for t, col, typ, pk in self._columns(c):
            if typ != "text" or (t, col) in skip or (pk and free_text_only):
                continue
            if free_text_only and t == "op_log" and col not in ("reason", "detail"):
                continue
            q = f"SELECT ctid::text, {col} FROM {t} WHERE {col} IS NOT NULL"
            rows = (c.execute(q + f" AND {col} ILIKE ANY (?)", (likes,)) if likes is not None
                    else c.execute(q)).fetchall()
            for ctid, value in rows:
                yield t, col, ctid, value

    def _redact(self, c: PgConn, pat: re.Pattern[str], names: Sequence[str]) -> dict[str, int]:
        """Replace the forgotten name in every remaining text cell (other users' rows, history rows
        too) except `users.name` (another user's own name); returns '<table>.<column>' -> rows changed."""
        out: dict[str, int] = {}
        # lazily, column by column: an UPDATE moves the row (new ctid), so the next column is read afterwards
        for t, col, ctid, value in self._text_cells(c, names, skip=[("users", "name")], free_text_only=True):
            new = redact(value, pat)
            if new != value:
                c.execute(f"UPDATE {t} SET {col} = ? WHERE ctid = ?::tid", (new, ctid))
                out[f"{t}.{col}"] = out.get(f"{t}.{col}", 0) + 1
        return out

    def _cell_hits(self, c: PgConn, needles: Sequence[tuple[str, bytes]]) -> list[str]:
        hits = []
        for t, col, typ, _pk in self._columns(c):
            as_bytes = col if typ == "bytea" else f"convert_to({col}::text, 'UTF8')"
            for what, needle in needles:
                n = c.execute(f"SELECT COUNT(*) FROM {t} WHERE position(?::bytea in {as_bytes}) > 0",
                              (needle,)).fetchone()[0]
                if n:
                    hits.append(f"{t}.{col} ({what}, {n} rows)")
        return hits

    def _name_hits(self, c: PgConn, pat: re.Pattern[str], names: Sequence[str]) -> list[str]:
        counts: dict[str, int] = {}
        for t, col, _ctid, value in self._text_cells(c, names, skip=[("users", "name")]):
            if mentions(value, pat):
                counts[f"{t}.{col}"] = counts.get(f"{t}.{col}", 0) + 1
        return [f"{cell} (name, {n} rows)" for cell, n in counts.items()]

    def _data_files(self, c: PgConn) -> list[Path]:
        """The table, TOAST and index files of the store (with their 1 GB segments), or [] when the
        server's data directory cannot be read from here."""
        try:
            root = Path(c.execute("SELECT current_setting('data_directory')").fetchone()[0])
        except psycopg.Error:  # needs superuser or pg_read_all_settings
            return []
        if not os.access(root, os.R_OK | os.X_OK):
            return []
        files: list[Path] = []
        for (rel,) in c.execute(_FILES).fetchall():
            main = root / rel
            files += [main] + sorted(main.parent.glob(main.name + ".[0-9]*"))
        return [f for f in files if f.is_file()]

    def _raw_hits(self, c: PgConn, needles: Sequence[tuple[str, bytes]], names: Sequence[str]) -> list[str]:
        """The store's table files, when readable; another user of the same name is no leftover."""
        files = self._data_files(c)
        if not files:
            log.info("forget: the server's data files are not readable from here; the raw-byte scan is skipped")
            return []
        if self._is_superuser(c):
            c.execute("CHECKPOINT")  # the shared buffers' pages written out first
        legit = [r[0] for r in c.execute("SELECT name FROM users").fetchall()]
        return scan_files(files, needles, names, legit)

    @staticmethod
    def _is_superuser(c: PgConn) -> bool:
        return c.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0]
