"""Forget on SQLite: what the shared forget (egomem/memory/sql/forget.py) needs from this database.

Redaction and the name scan run the Python rule (memory/redact.py) inside SQL as application
functions. The scrub is VACUUM and a TRUNCATE checkpoint: `secure_delete` zeroes deleted cells, but
a page rebalanced while the person's cells still existed keeps stale copies of them in its
unallocated gap, and old WAL frames keep old pages; VACUUM rewrites every page from the live rows.
The raw scan reads the database file and its WAL.
"""

from __future__ import annotations

import logging
import re
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from egomem.memory.redact import mentions, redact
from egomem.memory.sql.forget import Forget, scan_files

log = logging.getLogger(__name__)

CHECKPOINT_TRIES, CHECKPOINT_WAIT_S = 50, 0.1  # readers in other connections can hold old WAL frames a moment


class SQLiteForget(Forget):
    """The SQLite half of forget: scrub, redaction of every text cell, the cell and file scans."""

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
        for _ in range(CHECKPOINT_TRIES):
            busy, _log, _done = c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if busy == 0:
                return True
            time.sleep(CHECKPOINT_WAIT_S)
        return False

    @staticmethod
    def _columns(c: sqlite3.Connection) -> Iterator[tuple[str, str, bool]]:
        """(table, column, is primary key) of every column of every table."""
        for t in [r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]:
            for _cid, col, _type, _nn, _default, pk in c.execute(f"PRAGMA table_info({t})").fetchall():
                yield t, col, bool(pk)

    def _text_columns(self, c: sqlite3.Connection) -> Iterator[tuple[str, str]]:
        """(table, column) of every column that may hold a mention of a person. Skipped: primary keys
        (generated ids), `users.name` (another user's own name is not a mention of the forgotten
        one), and op-log columns other than its free text (reason, detail)."""
        for t, col, pk in self._columns(c):
            if pk or (t, col) == ("users", "name") or (t == "op_log" and col not in ("reason", "detail")):
                continue
            yield t, col

    def _redact(self, c: sqlite3.Connection, pat: re.Pattern[str], names: Sequence[str]) -> dict[str, int]:
        """Replace the forgotten name in every remaining text cell (other users' rows, history rows
        too); returns '<table>.<column>' -> rows changed."""
        c.create_function("egomem_redact", 1, lambda v: redact(v, pat), deterministic=True)
        out: dict[str, int] = {}
        for t, col in list(self._text_columns(c)):
            n = c.execute(f"UPDATE {t} SET {col} = egomem_redact({col}) "
                          f"WHERE typeof({col}) = 'text' AND egomem_redact({col}) != {col}").rowcount
            if n:
                out[f"{t}.{col}"] = n
        return out

    def _cell_hits(self, c: sqlite3.Connection, needles: Sequence[tuple[str, bytes]]) -> list[str]:
        hits = []
        for t, col, _pk in list(self._columns(c)):
            for what, needle in needles:
                n = c.execute(f"SELECT COUNT(*) FROM {t} WHERE instr(CAST({col} AS BLOB), ?) > 0",
                              (needle,)).fetchone()[0]
                if n:
                    hits.append(f"{t}.{col} ({what}, {n} rows)")
        return hits

    def _name_hits(self, c: sqlite3.Connection, pat: re.Pattern[str], names: Sequence[str]) -> list[str]:
        c.create_function("egomem_mentions", 1, lambda v: mentions(v, pat), deterministic=True)
        hits = []
        for t, col, _pk in list(self._columns(c)):
            if (t, col) == ("users", "name"):
                continue
            n = c.execute(f"SELECT COUNT(*) FROM {t} WHERE typeof({col}) = 'text' AND egomem_mentions({col})"
                          ).fetchone()[0]
            if n:
                hits.append(f"{t}.{col} (name, {n} rows)")
        return hits

    def _raw_hits(self, c: sqlite3.Connection, needles: Sequence[tuple[str, bytes]], names: Sequence[str]) -> list[str]:
        """The database file and its WAL; another user of the same name, or a word of the schema, is no leftover."""
        legit = [r[0] for r in c.execute("SELECT name FROM users UNION ALL SELECT sql FROM sqlite_master "
                                         "WHERE sql IS NOT NULL UNION ALL SELECT name FROM sqlite_master")]
        return scan_files([self.path, Path(f"{self.path}-wal")], needles, names, legit)
