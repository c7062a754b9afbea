"""Memories in a SQL store (both backends): facts and preferences (superseded, never overwritten), summaries,
the persona, relations, and the whole-profile snapshot."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from egomem.memory import checks
from egomem.memory import persona as persona_dims
from egomem.memory.errors import StoreError
from egomem.memory.sql.base import USER_COLS, Conn, where_equal
from egomem.memory.store import MANUAL
from egomem.memory.types import (
    MemoryItem,
    PersonaUpdate,
    PersonaValue,
    Polarity,
    Profile,
    Provenance,
    Relation,
    Summary,
    User,
)

_ITEM_COLS = ("item_id, user_id, kind, item_key, text, polarity, valid_from, invalid_at, superseded_by, "
              "session_id, origin")
_REL_COLS = "relation_id, user_id, other_user_id, relation, valid_from, invalid_at, session_id, origin"


class Items:
    """Facts, preferences, summaries, persona and relations of one user; `profile` reads them all at once."""

    def _insert_item(self, c: Conn, item_id: str, user_id: str, kind: str, text: str,
                     key: str | None, polarity: str | None, valid_from: float, prov: Provenance, reason: str) -> None:
        checks.memory_item(kind, text, polarity)
        c.execute(f"INSERT INTO memory_items ({_ITEM_COLS}, created_at) VALUES (?,?,?,?,?,?,?,NULL,NULL,?,?,?)",
                  (item_id, user_id, kind, key, text.strip(), polarity if kind == "preference" else None,
                   valid_from, prov.session_id, prov.origin, self._clock()))
        self._log(c, "add", prov, user_id, f"memory_items:{item_id}", reason,
                  detail={"kind": kind, "key": key, "text": text.strip(), "polarity": polarity})

    def _close_item(self, c: Conn, user_id: str, item_id: str, at: float, superseded_by: str | None,
                    prov: Provenance, reason: str) -> None:
        row = c.execute(f"SELECT user_id, invalid_at FROM memory_items WHERE item_id = ?{self.ROW_LOCK}",
                        (item_id,)).fetchone()
        if row is None or row[0] != user_id:
            raise StoreError(f"memory item {item_id!r} is not one of user {user_id!r}'s")
        if row[1] is not None:
            raise StoreError(f"memory item {item_id!r} is no longer current (already superseded or retracted)")
        c.execute("UPDATE memory_items SET invalid_at = ?, superseded_by = ? WHERE item_id = ?",
                  (at, superseded_by, item_id))
        self._log(c, "supersede" if superseded_by else "retract", prov, user_id, f"memory_items:{item_id}", reason,
                  detail={"superseded_by": superseded_by} if superseded_by else {})

    def _item_row(self, c: Conn, item_id: str) -> MemoryItem:
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
            self._lock_users(c, [old.user_id])
            self._close_item(c, old.user_id, item_id, self._clock(), None, prov, reason)
            self._touch(c, old.user_id)

    def items(self, user_id: str, kind: str | None = None, history: bool = False) -> list[MemoryItem]:
        return self._items(self._conn(), user_id, kind, history)

    def _items(self, c: Conn, user_id: str, kind: str | None, history: bool) -> list[MemoryItem]:
        q, params = where_equal(f"SELECT {_ITEM_COLS} FROM memory_items WHERE user_id = ?", kind=kind)
        params.insert(0, user_id)
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

    def _insert_summary(self, c: Conn, summary_id: str, user_id: str, text: str, at: float,
                        prov: Provenance) -> None:
        c.execute("INSERT INTO summaries (summary_id, user_id, session_id, text, origin, created_at) VALUES (?,?,?,?,?,?)",
                  (summary_id, user_id, prov.session_id, text.strip(), prov.origin, at))
        self._log(c, "add", prov, user_id, f"summaries:{summary_id}", detail={"text": text.strip()})

    def summaries(self, user_id: str, limit: int = 20) -> list[Summary]:
        return self._summaries(self._conn(), user_id, limit)

    def _summaries(self, c: Conn, user_id: str, limit: int) -> list[Summary]:
        rows = c.execute("SELECT summary_id, user_id, session_id, text, origin, created_at FROM summaries "
                         "WHERE user_id = ? ORDER BY created_at DESC, summary_id LIMIT ?", (user_id, limit))
        return [Summary(*r) for r in rows]

    def persona(self, user_id: str) -> dict[int, PersonaValue]:
        return self._persona(self._conn(), user_id)

    def _persona(self, c: Conn, user_id: str) -> dict[int, PersonaValue]:
        rows = c.execute("SELECT dim, value, confidence, evidence, origin FROM persona WHERE user_id = ? ORDER BY dim",
                         (user_id,))
        return {r[0]: PersonaValue(*r) for r in rows}

    def _merge_persona(self, c: Conn, user_id: str, updates: Sequence[PersonaUpdate],
                       prov: Provenance) -> None:
        have = self._persona(c, user_id)
        for u in updates:
            checks.persona_update(u)
            value, conf = persona_dims.combine(have.get(u.dim), u.value, u.confidence)
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

    def _insert_relation(self, c: Conn, relation_id: str, user_id: str, other: str, relation: str,
                         at: float, prov: Provenance) -> bool:
        relation = checks.relation_words(relation)
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
            self._lock_users(c, sorted((user_id, other_user_id)))
            self._live_user(c, user_id)
            self._live_user(c, other_user_id)
            if self._insert_relation(c, rid, user_id, other_user_id, relation, self._clock(), prov):
                self._touch(c, user_id)
        return rid

    def relations(self, user_id: str) -> list[tuple[Relation, str]]:
        return self._relations(self._conn(), user_id)

    def _relations(self, c: Conn, user_id: str) -> list[tuple[Relation, str]]:
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
            row = c.execute(f"SELECT {USER_COLS} FROM users WHERE user_id = ?", (user_id,)).fetchone()
            if row is None:
                raise StoreError(f"unknown user {user_id!r}")
            user = User(*row)
            if user.merged_into:
                raise StoreError(f"user {user_id!r} was merged into {user.merged_into!r}")
            return Profile(user, self._items(c, user_id, "fact", False), self._items(c, user_id, "preference", False),
                           self._summaries(c, user_id, summaries), self._persona(c, user_id),
                           self._relations(c, user_id))
