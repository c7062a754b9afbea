"""Forget in the SQLite store: delete a person, redact their names, prove it.

`forget_user`, in one write transaction: delete the person's rows; redact every name they ever had
(the current one, earlier names from PATCH / the op log's create_user and rename rows, and the names
of users merged into them) wherever others' rows mention it (egomem/memory/redact.py); rewrite the
chunk files of memory jobs not yet done so the person is not in them either (memory/chunk.py
`redact_chunk`; the job's `redactions` counter goes up, and `commit_session` refuses, with
`ChunkRedacted`, a session read from the chunk before that rewrite: the job retries on the redacted
files, and the refused attempt is given back). Then VACUUM and a TRUNCATE checkpoint:
`secure_delete` zeroes deleted cells, but a page rebalanced while the person's cells still existed
keeps stale copies of them in its unallocated gap, and old WAL frames keep old pages; VACUUM
rewrites every page from the live rows. `verify_forgotten` checks every cell and also the raw bytes
of the database file and WAL.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import sqlite3
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from egomem.memory.chunk import JOB_KIND, redact_chunk, redact_pieces
from egomem.memory.redact import mentions, name_pattern, redact
from egomem.memory.store import MANUAL
from egomem.memory.types import UNKNOWN_USER, ForgetReceipt, Provenance

log = logging.getLogger(__name__)


class Forget:
    """`forget_user`, its redaction of others' rows and queued chunks, and `verify_forgotten`."""

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
            self._bump_keys_generation(c, removal=True)
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
