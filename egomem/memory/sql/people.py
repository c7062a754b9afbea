"""People in a SQL store (both backends): users, renames, merges, name history, biometric keys."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

import numpy as np

from egomem.memory import checks
from egomem.memory.errors import StoreError
from egomem.memory.sql.base import USER_COLS, Conn, marks, where_equal
from egomem.memory.store import MANUAL
from egomem.memory.types import UNKNOWN_USER, BiometricKey, KeyChanges, Modality, Provenance, User


class People:
    """Users (create, rename, merge), every name a user had, and the biometric keys (vector index source)."""

    def _insert_user(self, c: Conn, user_id: str, name: str, prov: Provenance, reason: str) -> User:
        now = self._clock()
        c.execute("INSERT INTO users (user_id, name, created_at, updated_at, version) VALUES (?,?,?,?,0)",
                  (user_id, name, now, now))
        self._log(c, "create_user", prov, user_id, f"users:{user_id}", reason, detail={"name": name})
        return User(user_id, name, now, now, 0)

    def create_user(self, name: str = UNKNOWN_USER, prov: Provenance = MANUAL) -> User:
        with self._write() as c:
            return self._insert_user(c, uuid.uuid4().hex, name.strip() or UNKNOWN_USER, prov, "")

    def get_user(self, user_id: str) -> User | None:
        row = self._conn().execute(f"SELECT {USER_COLS} FROM users WHERE user_id = ?", (user_id,)).fetchone()
        return User(*row) if row else None

    def resolve_user(self, user_id: str) -> User | None:
        seen = set()
        u = self.get_user(user_id)
        while u is not None and u.merged_into is not None and u.user_id not in seen:
            seen.add(u.user_id)
            u = self.get_user(u.merged_into)
        return u

    def list_users(self, include_merged: bool = False) -> list[User]:
        where = "" if include_merged else "WHERE merged_into IS NULL"
        rows = self._conn().execute(f"SELECT {USER_COLS} FROM users {where} ORDER BY created_at, user_id")
        return [User(*r) for r in rows]

    def rename_user(self, user_id: str, name: str, prov: Provenance = MANUAL, reason: str = "") -> User:
        name = checks.user_name(name)
        with self._write() as c:
            old = self._live_user(c, user_id)
            c.execute("UPDATE users SET name = ? WHERE user_id = ?", (name, user_id))
            self._touch(c, user_id)
            self._log(c, "rename", prov, user_id, f"users:{user_id}", reason, detail={"old": old.name, "new": name})
        return self.get_user(user_id)

    def merge_users(self, keep_id: str, drop_id: str, prov: Provenance = MANUAL, reason: str = "") -> User:
        if keep_id == drop_id:
            raise StoreError("cannot merge a user into itself")
        with self._write() as c:
            self._merge(c, keep_id, drop_id, prov, reason)
        return self.get_user(keep_id)

    def _merge(self, c: Conn, keep_id: str, drop_id: str, prov: Provenance, reason: str) -> None:
        self._lock_directory(c)
        self._lock_users(c, sorted((keep_id, drop_id)))
        keep = self._live_user(c, keep_id)
        drop = self._live_user(c, drop_id)
        for table in ("biometric_keys", "memory_items", "summaries", "sessions"):
            c.execute(f"UPDATE {table} SET user_id = ? WHERE user_id = ?", (keep_id, drop_id))
        # persona: the more confident value of each dimension wins
        for dim, val, conf, ev, sid, origin, ts in c.execute(
            "SELECT dim, value, confidence, evidence, session_id, origin, updated_at FROM persona WHERE user_id = ?",
            (drop_id,)).fetchall():
            c.execute(
                "INSERT INTO persona (user_id, dim, value, confidence, evidence, session_id, origin, updated_at) "
                "VALUES (?,?,?,?,?,?,?,?) ON CONFLICT (user_id, dim) DO UPDATE SET value = excluded.value, "
                "confidence = excluded.confidence, evidence = excluded.evidence, session_id = excluded.session_id, "
                "origin = excluded.origin, updated_at = excluded.updated_at "
                "WHERE excluded.confidence > persona.confidence",
                (keep_id, dim, val, conf, ev, sid, origin, ts))
        c.execute("DELETE FROM persona WHERE user_id = ?", (drop_id,))
        c.execute("UPDATE relations SET user_id = ? WHERE user_id = ?", (keep_id, drop_id))
        c.execute("UPDATE relations SET other_user_id = ? WHERE other_user_id = ?", (keep_id, drop_id))
        c.execute("DELETE FROM relations WHERE user_id = other_user_id")
        name = keep.name if keep.name != UNKNOWN_USER else drop.name
        c.execute("UPDATE users SET name = ? WHERE user_id = ?", (name, keep_id))
        c.execute("UPDATE users SET merged_into = ? WHERE user_id = ?", (keep_id, drop_id))
        c.execute("UPDATE users SET merged_into = ? WHERE merged_into = ?", (keep_id, drop_id))
        self._touch(c, keep_id)
        self._touch(c, drop_id)
        self._bump_keys_generation(c, removal=True)  # the dropped user's keys now answer as keep_id
        self._changed(c, "merge", (keep_id, drop_id))
        self._log(c, "merge_users", prov, keep_id, f"users:{drop_id}", reason, related_user_id=drop_id)

    def _name_history(self, c: Conn, ids: Sequence[str]) -> list[str]:
        """Every name of these users: current ones, and each name their op-log rows recorded
        (create_user, rename: PATCH and names learnt from sessions), oldest first."""
        names = [r[0] for r in c.execute(f"SELECT name FROM users WHERE user_id IN ({marks(ids)})", list(ids))]
        for (detail,) in c.execute(f"SELECT detail FROM op_log WHERE user_id IN ({marks(ids)}) "
                                   "AND op IN ('create_user', 'rename') ORDER BY op_id", list(ids)):
            d = json.loads(detail or "{}")
            names += [d[k] for k in ("name", "old", "new") if isinstance(d.get(k), str)]
        out: list[str] = []
        for n in names:
            n = " ".join(n.split())
            if n and n.lower() != UNKNOWN_USER and n not in out:
                out.append(n)
        return out

    def name_history(self, user_id: str) -> list[str]:
        with self._read() as c:
            ids = [user_id] + [r[0] for r in c.execute("SELECT user_id FROM users WHERE merged_into = ?", (user_id,))]
            return self._name_history(c, ids)

    # ------------------------------------------------------------------ biometric keys

    def _insert_key(self, c: Conn, key_id: str, user_id: str, modality: str, model_id: str,
                    vector: np.ndarray, prov: Provenance) -> None:
        blob = checks.key_vector(modality, vector).tobytes()
        gen = self._bump_keys_generation(c)
        c.execute("INSERT INTO biometric_keys (key_id, user_id, modality, model_id, dim, vector, session_id, created_at, "
                  "added_generation) VALUES (?,?,?,?,?,?,?,?,?)",
                  (key_id, user_id, modality, model_id, len(blob) // 4, blob, prov.session_id, self._clock(), gen))
        self._log(c, "add_key", prov, user_id, f"biometric_keys:{key_id}", detail={"modality": modality,
                                                                                    "model_id": model_id})

    def add_key(self, user_id: str, modality: Modality, model_id: str, vector: np.ndarray,
                prov: Provenance = MANUAL) -> str:
        key_id = uuid.uuid4().hex
        with self._write() as c:
            self._live_user(c, user_id)
            self._insert_key(c, key_id, user_id, modality, model_id, vector, prov)
            self._touch(c, user_id)
        return key_id

    def list_keys(self, modality: Modality | None = None, model_id: str | None = None,
                  user_id: str | None = None) -> list[BiometricKey]:
        q, params = where_equal(
            "SELECT k.key_id, k.user_id, k.modality, k.model_id, k.vector, k.session_id, k.created_at "
            "FROM biometric_keys k JOIN users u ON u.user_id = k.user_id WHERE u.merged_into IS NULL",
            **{"k.user_id": user_id, "k.modality": modality, "k.model_id": model_id})
        rows = self._conn().execute(q + " ORDER BY k.created_at, k.key_id", params)
        return [BiometricKey(r[0], r[1], r[2], r[3], np.frombuffer(r[4], dtype="<f4").copy(), r[5], r[6]) for r in rows]

    def keys_generation(self) -> int:
        return int(self._conn().execute("SELECT value FROM meta WHERE name = 'keys_generation'").fetchone()[0])

    def key_changes(self, since: int | None) -> KeyChanges:
        with self._read() as c:  # generation, removal mark and keys from one snapshot
            meta = dict(c.execute("SELECT name, value FROM meta WHERE name IN "
                                  "('keys_generation', 'keys_removed_generation')").fetchall())
            gen, removed = int(meta["keys_generation"]), int(meta["keys_removed_generation"])
            rebuild = since is None or removed > since or since > gen  # since > gen: another database
            q = ("SELECT k.key_id, k.user_id, k.modality, k.model_id, k.vector, k.session_id, k.created_at "
                 "FROM biometric_keys k JOIN users u ON u.user_id = k.user_id WHERE u.merged_into IS NULL")
            rows = c.execute(q + " ORDER BY k.created_at, k.key_id" if rebuild else
                             q + " AND k.added_generation > ? ORDER BY k.added_generation", () if rebuild else (since,))
            keys = [BiometricKey(r[0], r[1], r[2], r[3], np.frombuffer(r[4], dtype="<f4").copy(), r[5], r[6])
                    for r in rows]
        return KeyChanges(gen, rebuild, keys)
