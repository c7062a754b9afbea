"""Sessions in a SQL store (both backends): reading them, and `commit_session` — the rules of a commit
are in egomem/memory/commit.py (`apply_session`); this module gives them the store's primitives
inside one write transaction (`_Writer`) and cleans up after a refused, redacted chunk."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from egomem.memory.commit import apply_session
from egomem.memory.errors import ChunkRedacted
from egomem.memory.sql.base import Conn, where_equal
from egomem.memory.types import (
    MemoryItem,
    PersonaUpdate,
    Provenance,
    SessionCommit,
    SessionRecord,
    User,
)

_SESSION_COLS = ("session_id, stream_id, chunk_index, start_step, end_step, user_id, transcript, "
                 "transcript_source, status, created_at")


class Sessions:
    """Session rows and the one-transaction session write."""

    def get_session(self, session_id: str) -> SessionRecord | None:
        row = self._conn().execute(f"SELECT {_SESSION_COLS} FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return SessionRecord(*row) if row else None

    def list_sessions(self, user_id: str | None = None, stream_id: str | None = None) -> list[SessionRecord]:
        q, params = where_equal(f"SELECT {_SESSION_COLS} FROM sessions WHERE 1 = 1", user_id=user_id,
                                stream_id=stream_id)
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
        with self._write() as c:
            self._lock_directory(c)  # it may create or merge users by name
            return apply_session(_Writer(self, c), m)


class _Writer:
    """commit.py's `SessionWriter` on one write transaction of the store `s`."""

    def __init__(self, s: Any, c: Conn):
        self.s, self.c = s, c

    def session_exists(self, session_id: str) -> bool:
        return self.c.execute("SELECT 1 FROM sessions WHERE session_id = ?", (session_id,)).fetchone() is not None

    def chunk_redactions(self, job_key: str) -> int | None:
        row = self.c.execute("SELECT redactions FROM jobs WHERE job_key = ?", (job_key,)).fetchone()
        return None if row is None else row[0]

    def insert_session(self, m: SessionCommit, user_id: str | None) -> None:
        self.c.execute(f"INSERT INTO sessions ({_SESSION_COLS}) VALUES (?,?,?,?,?,?,?,?,'done',?)",
                       (m.session_id, m.stream_id, m.chunk_index, m.start_step, m.end_step, user_id, m.transcript,
                        m.transcript_source, self.s._clock()))

    def insert_user(self, user_id: str, name: str, prov: Provenance, reason: str) -> User:
        return self.s._insert_user(self.c, user_id, name, prov, reason)

    def live_user(self, user_id: str) -> User:
        return self.s._live_user(self.c, user_id)

    def set_name(self, user_id: str, old: str, new: str, prov: Provenance, reason: str) -> None:
        self.c.execute("UPDATE users SET name = ? WHERE user_id = ?", (new, user_id))
        self.s._log(self.c, "rename", prov, user_id, f"users:{user_id}", reason, detail={"old": old, "new": new})

    def user_exists(self, user_id: str) -> bool:
        return self.c.execute("SELECT 1 FROM users WHERE user_id = ?", (user_id,)).fetchone() is not None

    def users_named(self, name: str, exclude: str) -> list[str]:
        return [r[0] for r in self.c.execute("SELECT user_id FROM users WHERE lower(name) = lower(?) "
                                             "AND merged_into IS NULL AND user_id != ?", (name, exclude))]

    def placeholders_named(self, name: str, exclude: str) -> list[str]:
        return [r[0] for r in self.c.execute(
            "SELECT u.user_id FROM users u WHERE lower(u.name) = lower(?) AND u.merged_into IS NULL "
            "AND u.user_id != ? AND NOT EXISTS (SELECT 1 FROM biometric_keys k WHERE k.user_id = u.user_id)"
            " AND NOT EXISTS (SELECT 1 FROM sessions s WHERE s.user_id = u.user_id)", (name, exclude))]

    def merge_users(self, keep_id: str, drop_id: str, prov: Provenance, reason: str) -> None:
        self.s._merge(self.c, keep_id, drop_id, prov, reason)

    def insert_key(self, key_id: str, user_id: str, modality: str, model_id: str, vector: np.ndarray,
                   prov: Provenance) -> None:
        self.s._insert_key(self.c, key_id, user_id, modality, model_id, vector, prov)

    def item(self, item_id: str) -> MemoryItem:
        return self.s._item_row(self.c, item_id)

    def close_item(self, user_id: str, item_id: str, at: float, superseded_by: str | None, prov: Provenance,
                   reason: str) -> None:
        self.s._close_item(self.c, user_id, item_id, at, superseded_by, prov, reason)

    def insert_item(self, item_id: str, user_id: str, kind: str, text: str, key: str | None,
                    polarity: str | None, valid_from: float, prov: Provenance, reason: str) -> None:
        self.s._insert_item(self.c, item_id, user_id, kind, text, key, polarity, valid_from, prov, reason)

    def merge_persona(self, user_id: str, updates: Sequence[PersonaUpdate], prov: Provenance) -> None:
        self.s._merge_persona(self.c, user_id, updates, prov)

    def insert_summary(self, summary_id: str, user_id: str, text: str, at: float, prov: Provenance) -> None:
        self.s._insert_summary(self.c, summary_id, user_id, text, at, prov)

    def insert_relation(self, relation_id: str, user_id: str, other: str, relation: str, at: float,
                        prov: Provenance) -> bool:
        return self.s._insert_relation(self.c, relation_id, user_id, other, relation, at, prov)

    def touch(self, user_id: str) -> None:
        self.s._touch(self.c, user_id)
