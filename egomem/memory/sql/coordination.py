"""The two-phase forget's bookkeeping in a SQL store (both backends): who shares the store, which
forgets are announced, who has acknowledged them.

Several orchestrators share one store, and each holds recordings not yet cut into chunks. A forget
deletes the person's names and keys, which another orchestrator needs to find them in its recordings,
so the forgetting orchestrator first announces it (`announce_forget`: a `forget_prepares` row and,
in the same transaction, a `forget_prepare` change on the feed: PostgreSQL NOTIFY, SQLite an op-log
row the poller reads; both name the user id only). Every other live orchestrator redacts its
recordings while names and keys are still there and acknowledges (`ack_forget`); the forgetting one
waits for the acknowledgements of the live orchestrators (`live_orchestrators`: a heartbeat within
`max_age_s`, refreshed by each orchestrator's change applier) for at most its timeout, then forgets.
The forget deletes the announcement and its acknowledgements with the person (sql/forget.py), so the
proof scan finds nothing of them here; `purge_coordination` drops those of forgets never carried out.
"""

from __future__ import annotations

import uuid

from egomem.memory.sql.base import Conn, marks
from egomem.memory.store import MANUAL
from egomem.memory.types import ForgetAnnouncement, OrchestratorRecord, Provenance


class ForgetCoordination:
    """Orchestrator registry, forget announcements and their acknowledgements (the module docstring)."""

    def announce_forget(self, user_id: str, prov: Provenance = MANUAL) -> str:
        """Phase 1: announce that `user_id` is about to be forgotten through this store object; returns the
        request id the others acknowledge. `StoreError` when the user is unknown or merged away."""
        request_id = uuid.uuid4().hex
        with self._write() as c:
            self._live_user(c, user_id)
            c.execute("INSERT INTO forget_prepares (request_id, user_id, origin, created_at) VALUES (?,?,?,?)",
                      (request_id, user_id, self.origin, self._clock()))
            self._changed(c, "forget_prepare", (user_id,), request_id)
            # the op-log row is SQLite's announcement (changes.py reads it); the forget deletes it with the user's rows
            self._log(c, "forget_prepare", prov, user_id, None, detail={"request_id": request_id, "origin": self.origin})
        return request_id

    def forget_announcements(self, max_age_s: float) -> list[ForgetAnnouncement]:
        """Announced forgets not yet carried out, at most `max_age_s` old, oldest first (an orchestrator
        that starts, or whose feed reconnects, takes them up as if it had heard them)."""
        rows = self._conn().execute(
            "SELECT request_id, user_id, origin, created_at FROM forget_prepares WHERE created_at >= ? "
            "ORDER BY created_at", (self._clock() - max_age_s,)).fetchall()
        return [ForgetAnnouncement(*r) for r in rows]

    def ack_forget(self, request_id: str, origin: str | None = None) -> bool:
        """Record that orchestrator `origin` (default: this store object) has redacted its recordings for
        `request_id`. False (nothing recorded) when the announcement is gone: forgotten or purged already."""
        with self._write() as c:
            n = c.execute("INSERT INTO forget_acks (request_id, origin, acked_at) SELECT ?, ?, ? "
                          "WHERE EXISTS (SELECT 1 FROM forget_prepares WHERE request_id = ?) "
                          "ON CONFLICT (request_id, origin) DO NOTHING",
                          (request_id, origin or self.origin, self._clock(), request_id)).rowcount
        return n > 0

    def forget_acks(self, request_id: str) -> set[str]:
        """The origins that have acknowledged `request_id`."""
        rows = self._conn().execute("SELECT origin FROM forget_acks WHERE request_id = ?", (request_id,)).fetchall()
        return {r[0] for r in rows}

    def heartbeat(self, label: str, origin: str | None = None) -> None:
        """Register orchestrator `origin` (default: this store object) as live now, or refresh it."""
        now = self._clock()
        with self._write() as c:
            c.execute("INSERT INTO orchestrators (origin, label, started_at, heartbeat_at) VALUES (?,?,?,?) "
                      "ON CONFLICT (origin) DO UPDATE SET heartbeat_at = excluded.heartbeat_at, label = excluded.label",
                      (origin or self.origin, label, now, now))

    def leave(self, origin: str | None = None) -> None:
        """Unregister orchestrator `origin` (default: this store object): a clean shutdown, so no forget waits for it."""
        with self._write() as c:
            c.execute("DELETE FROM orchestrators WHERE origin = ?", (origin or self.origin,))

    def live_orchestrators(self, max_age_s: float) -> list[OrchestratorRecord]:
        """The orchestrators whose last heartbeat is at most `max_age_s` old."""
        rows = self._conn().execute(
            "SELECT origin, label, started_at, heartbeat_at FROM orchestrators WHERE heartbeat_at >= ? ORDER BY origin",
            (self._clock() - max_age_s,)).fetchall()
        return [OrchestratorRecord(*r) for r in rows]

    def purge_coordination(self, announcement_ttl_s: float, orchestrator_gone_s: float) -> None:
        """Drop announcements older than `announcement_ttl_s` (a forget never carried out: its orchestrator
        died) with their acknowledgements, and orchestrators silent for longer than `orchestrator_gone_s`."""
        now = self._clock()
        with self._write() as c:
            old = [r[0] for r in c.execute("SELECT request_id FROM forget_prepares WHERE created_at < ?",
                                           (now - announcement_ttl_s,)).fetchall()]
            self._drop_announcements(c, old)
            c.execute("DELETE FROM orchestrators WHERE heartbeat_at < ?", (now - orchestrator_gone_s,))

    @staticmethod
    def _drop_announcements(c: Conn, request_ids: list[str]) -> int:
        """Delete these announcements and their acknowledgements (inside the caller's write transaction)."""
        if not request_ids:
            return 0
        c.execute(f"DELETE FROM forget_acks WHERE request_id IN ({marks(request_ids)})", request_ids)
        return c.execute(f"DELETE FROM forget_prepares WHERE request_id IN ({marks(request_ids)})",
                         request_ids).rowcount
