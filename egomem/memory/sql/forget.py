"""Forget in a SQL store (both backends): delete a person, redact their names, prove it.

`forget_user`, in one write transaction that keeps every other writer out: delete the person's rows;
delete the two-phase forget's announcements of them (sql/coordination.py);
redact every name they ever had (the current one, earlier names from PATCH / the op log's
create_user and rename rows, and the names of users merged into them) wherever others' rows mention
it (egomem/memory/redact.py); rewrite the chunk files of memory jobs not yet done so the person is
not in them either (memory/chunk.py `redact_chunk`; the job's `redactions` counter goes up, and
`commit_session` refuses, with `ChunkRedacted`, a session read from the chunk before that rewrite:
the job retries on the redacted files, and the refused attempt is given back). Then the backend's
`_scrub` rewrites the storage so no deleted cell survives in free space, and `verify_forgotten`
checks every cell, the raw bytes of the storage files the backend can read, and waiting chunks.

A backend supplies `_scrub`, `_redact` (every text cell), `_cell_hits` / `_name_hits` (the cell
scan) and `_raw_hits` (the file scan; `scan_files` does the byte matching for both).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from egomem.memory.chunk import JOB_KIND, redact_chunk, redact_pieces
from egomem.memory.redact import name_pattern
from egomem.memory.sql.base import Conn, marks
from egomem.memory.store import MANUAL
from egomem.memory.types import UNKNOWN_USER, ForgetReceipt, Provenance

log = logging.getLogger(__name__)

# (table, column) of what a person's rows hang off; a user none of these name is an orphan
_USER_REFERENCES = (("biometric_keys", "user_id"), ("memory_items", "user_id"), ("summaries", "user_id"),
                    ("persona", "user_id"), ("sessions", "user_id"), ("relations", "user_id"),
                    ("relations", "other_user_id"), ("users", "merged_into"))


class Forget:
    """`forget_user`, its redaction of others' rows and queued chunks, and `verify_forgotten`."""

    def forget_user(self, user_id: str, prov: Provenance = MANUAL, reason: str = "") -> ForgetReceipt:
        forget_id = uuid.uuid4().hex
        with self._write() as c:
            self._lock_everything(c)
            self._live_user(c, user_id)
            merged = c.execute("SELECT user_id FROM users WHERE merged_into = ?", (user_id,)).fetchall()
            ids = [user_id] + [r[0] for r in merged]
            names = self._name_history(c, ids)  # a tombstone / an earlier name is the same person too
            m = marks(ids)
            keys = c.execute(f"SELECT modality, vector FROM biometric_keys WHERE user_id IN ({m})", ids).fetchall()
            vectors = [np.frombuffer(v, dtype="<f4") for _, v in keys]
            others = c.execute(f"SELECT modality, vector FROM biometric_keys WHERE user_id NOT IN ({m})",
                               ids).fetchall()
            pat = name_pattern(names)
            chunks, unreadable = self._redact_chunks(c, pat, keys, others)
            sessions = [r[0] for r in c.execute(f"SELECT session_id FROM sessions WHERE user_id IN ({m})", ids)]
            deleted: dict[str, int] = {}

            def delete(table: str, where: str, params: Sequence[Any]) -> None:
                n = c.execute(f"DELETE FROM {table} WHERE {where}", params).rowcount
                deleted[table] = deleted.get(table, 0) + n

            delete("biometric_keys", f"user_id IN ({m})", ids)
            delete("memory_items", f"user_id IN ({m})", ids)
            delete("summaries", f"user_id IN ({m})", ids)
            delete("persona", f"user_id IN ({m})", ids)
            neighbours = {r[0] for r in c.execute(
                f"SELECT other_user_id FROM relations WHERE user_id IN ({m}) UNION "
                f"SELECT user_id FROM relations WHERE other_user_id IN ({m})", ids + ids)} - set(ids)
            delete("relations", f"user_id IN ({m}) OR other_user_id IN ({m})", ids + ids)
            if sessions:
                delete("llm_calls", f"session_id IN ({marks(sessions)})", sessions)
                delete("dead_letters", f"session_id IN ({marks(sessions)})", sessions)
            delete("dead_letters", f"user_id IN ({m})", ids)
            delete("sessions", f"user_id IN ({m})", ids)
            c.execute("INSERT INTO forget_guard (active) VALUES (1)")
            delete("op_log", f"user_id IN ({m}) OR related_user_id IN ({m})", ids + ids)
            c.execute("DELETE FROM forget_guard")
            delete("users", f"user_id IN ({m})", ids)
            # the two-phase forget's announcements of them (sql/coordination.py) and their acknowledgements
            announced = [r[0] for r in c.execute(f"SELECT request_id FROM forget_prepares WHERE user_id IN ({m})",
                                                 ids).fetchall()]
            deleted["forget_prepares"] = self._drop_announcements(c, announced)
            for n in sorted(neighbours):  # people only this user mentioned: nothing else refers to them
                if self._is_orphan(c, n):
                    c.execute("INSERT INTO forget_guard (active) VALUES (1)")
                    c.execute("DELETE FROM op_log WHERE user_id = ? OR related_user_id = ?", (n, n))
                    c.execute("DELETE FROM forget_guard")
                    delete("users", "user_id = ?", (n,))
            redacted = self._redacted(c, pat, names) if pat is not None else {}
            self._bump_keys_generation(c, removal=True)
            self._changed(c, "forget")  # names no one, like the op-log row: receivers ask who is gone
            self._log(c, "forget", prov, None, None, "",  # the log keeps only that a forget happened
                      detail={"forget_id": forget_id, "deleted": deleted, "redacted": redacted,
                              "names": len(names), "chunks": chunks})
        clean = self._scrub()
        leftovers = self.verify_forgotten(user_id, vectors, names)
        leftovers += [f"chunk {f} (unreadable, so not redacted; its job fails on it too)" for f in unreadable]
        return ForgetReceipt(forget_id, deleted, leftovers, clean, redacted)

    def _redacted(self, c: Conn, pat: re.Pattern[str], names: Sequence[str]) -> dict[str, int]:
        """`_redact` (the backend's pass over every text cell) with the op log's guard set, so the
        log accepts the UPDATEs of its free-text columns (reason, detail) and nothing else."""
        c.execute("INSERT INTO forget_guard (active) VALUES (1)")
        try:
            return self._redact(c, pat, names)
        finally:
            c.execute("DELETE FROM forget_guard")

    def _redact_chunks(self, c: Conn, pat: re.Pattern[str] | None, keys: Sequence[tuple[str, bytes]],
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

    def _pending_chunks(self, c: Conn) -> list[tuple[str, Path]]:
        """(job id, chunk folder) of every memory job not done yet whose folder is there."""
        out = []
        for job_id, payload in c.execute("SELECT job_id, payload FROM jobs WHERE kind = ? AND status != 'done' "
                                         "AND payload IS NOT NULL", (JOB_KIND,)).fetchall():
            folder = Path(str((json.loads(payload) or {}).get("chunk_dir", "")))
            if (folder / "meta.json").is_file():
                out.append((job_id, folder))
        return out

    @staticmethod
    def _is_orphan(c: Conn, user_id: str) -> bool:
        """A user with no keys, memories, sessions or relations (a person someone only mentioned)."""
        for table, col in _USER_REFERENCES:
            if c.execute(f"SELECT 1 FROM {table} WHERE {col} = ? LIMIT 1", (user_id,)).fetchone():
                return False
        return True

    def verify_forgotten(self, user_id: str, vectors: Sequence[np.ndarray] = (),
                         name: str | Sequence[str] | None = None) -> list[str]:
        """Id and vector bytes: searched in every cell of every table. Name(s): every text cell
        except `users.name` (other users' own names), matched as redaction matches them. Then the
        raw bytes of the storage files the backend can read (free space, stale page areas, old
        frames): '<file> (<what>, N)' for the id, a vector, or more occurrences of a name than the
        live `users.name` cells (and the schema) account for. Then the chunks still waiting."""
        c = self._conn()
        needles: list[tuple[str, bytes]] = [("id", user_id.encode())]
        needles += [(f"vector{i}", np.asarray(v, dtype="<f4").tobytes()) for i, v in enumerate(vectors)]
        names = [name] if isinstance(name, str) else list(name or [])
        pat = name_pattern(names)
        hits = self._cell_hits(c, needles)
        if pat is not None:
            hits += self._name_hits(c, pat, names)
        return hits + self._raw_hits(c, needles, names) + self._chunk_hits(c, pat)

    def _chunk_hits(self, c: Conn, pat: re.Pattern[str] | None) -> list[str]:
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


def scan_files(files: Iterable[Path], needles: Sequence[tuple[str, bytes]], names: Sequence[str],
               legit: Iterable[str]) -> list[str]:
    """The byte scan of storage files: '<file> (<what>, N byte matches)' for each needle found, and
    '<file> (name, N unexplained matches)' when a name occurs more often than in `legit` (texts that
    rightly hold it: other users' own names, the schema)."""
    pat = _raw_name_pattern(names)
    allowed = sum(len(pat.findall(str(t).encode())) for t in legit) if pat is not None else 0
    hits = []
    for f in files:
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
                    if n > allowed:
                        hits.append(f"{f.name} (name, {n - allowed} unexplained matches)")
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
