"""What committing one session means, written once above the backends: `apply_session` runs the
domain rules of `MemoryStore.commit_session` on a `SessionWriter`, the storage primitives a backend
offers inside one write transaction (so a second backend implements storage only).

The rules: a session is committed once (a re-run changes nothing); a session read from a chunk
before a forget rewrote it is refused (`ChunkRedacted`); "my name is [forgotten]" is no name to
learn; decisions made on a stale profile are refused (`VersionConflict`); a user who says their name
absorbs the one placeholder of that name others mentioned (placeholder absorption); a mentioned
person is the one live user of that name, else a new keyless user (person linking); every id a
session writes is derived from the session (`derived_id`), so a re-run writes the same ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from egomem.memory.chunk import job_key
from egomem.memory.errors import ChunkRedacted, StoreError, VersionConflict
from egomem.memory.redact import MARKER
from egomem.memory.types import (
    UNKNOWN_USER,
    MemoryItem,
    PersonaUpdate,
    Provenance,
    SessionCommit,
    User,
)


def derived_id(*parts: Any) -> str:
    """A deterministic id from its parts: a re-run of the same session writes the same ids."""
    return hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).hexdigest()[:32]


class SessionWriter(Protocol):
    """Storage primitives inside one write transaction (each logs its op-log row; none bumps a
    user's version except `touch`)."""

    def session_exists(self, session_id: str) -> bool: ...
    def chunk_redactions(self, job_key: str) -> int | None:
        """The `redactions` counter of the chunk's job; None when there is no such job."""
    def insert_session(self, m: SessionCommit, user_id: str | None) -> None: ...
    def insert_user(self, user_id: str, name: str, prov: Provenance, reason: str) -> User: ...
    def live_user(self, user_id: str) -> User:
        """The user; `StoreError` when unknown or merged away."""
    def set_name(self, user_id: str, old: str, new: str, prov: Provenance, reason: str) -> None: ...
    def user_exists(self, user_id: str) -> bool: ...
    def users_named(self, name: str, exclude: str) -> list[str]:
        """Live users of that name (case-insensitive), `exclude` left out."""
    def placeholders_named(self, name: str, exclude: str) -> list[str]:
        """Live users of that name with no keys and no sessions (people others only mentioned)."""
    def merge_users(self, keep_id: str, drop_id: str, prov: Provenance, reason: str) -> None: ...
    def insert_key(self, key_id: str, user_id: str, modality: str, model_id: str, vector: np.ndarray,
                   prov: Provenance) -> None: ...
    def item(self, item_id: str) -> MemoryItem: ...
    def close_item(self, user_id: str, item_id: str, at: float, superseded_by: str | None, prov: Provenance,
                   reason: str) -> None: ...
    def insert_item(self, item_id: str, user_id: str, kind: str, text: str, key: str | None,
                    polarity: str | None, valid_from: float, prov: Provenance, reason: str) -> None: ...
    def merge_persona(self, user_id: str, updates: Sequence[PersonaUpdate], prov: Provenance) -> None: ...
    def insert_summary(self, summary_id: str, user_id: str, text: str, at: float, prov: Provenance) -> None: ...
    def insert_relation(self, relation_id: str, user_id: str, other: str, relation: str, at: float,
                        prov: Provenance) -> bool: ...
    def touch(self, user_id: str) -> None:
        """Bump the user's version (optimistic lock) and updated_at."""


def apply_session(w: SessionWriter, m: SessionCommit) -> bool:
    """Apply everything one session produced (see the module docstring). False when already committed."""
    prov = m.provenance
    if w.session_exists(m.session_id):
        return False  # already committed: processing a session twice changes nothing
    if m.chunk_redactions is not None:
        have = w.chunk_redactions(job_key(m.stream_id, m.chunk_index))
        if have is not None and have > m.chunk_redactions:  # read before a forget rewrote it
            raise ChunkRedacted(f"session {m.session_id}: a forget redacted chunk {m.stream_id}/"
                                f"{m.chunk_index} after it was read; the job re-runs on the redacted files")
    if m.name and MARKER in m.name:  # "my name is [forgotten person]": not a name to learn
        m = dataclasses.replace(m, name=None, name_reason="")
    if m.user_id is None and not m.new_user_id:  # nobody to attribute it to, and nothing said
        w.insert_session(m, None)
        return True
    if m.user_id is None:
        user_id = m.new_user_id
        w.insert_user(user_id, (m.name or UNKNOWN_USER).strip(), prov, m.name_reason or "new user")
    else:
        user_id = m.user_id
        u = w.live_user(user_id)
        if m.expected_version is not None and u.version != m.expected_version:
            raise VersionConflict(f"user {user_id} is at version {u.version}, "
                                  f"the decisions were made at {m.expected_version}")
        if m.name and m.name.strip() and m.name.strip() != u.name:
            w.set_name(user_id, u.name, m.name.strip(), prov, m.name_reason)
    if m.name and m.name.strip():
        absorb_placeholder(w, user_id, m.name.strip(), prov)
    for i, k in enumerate(m.keys):
        w.insert_key(derived_id(m.session_id, "key", i), user_id, k.modality, k.model_id, k.vector, prov)
    for i, d in enumerate(m.decisions):
        new_id = derived_id(m.session_id, "item", i)
        if d.action in ("supersede", "retract"):
            if not d.target_id:
                raise StoreError(f"decision {i} ({d.action}) needs target_id")
            w.close_item(user_id, d.target_id, m.valid_from, new_id if d.action == "supersede" else None, prov,
                         d.reason)
        if d.action in ("add", "supersede"):
            key, polarity = d.key, d.polarity
            if d.action == "supersede":
                old = w.item(d.target_id)
                key, polarity = key or old.key, polarity or old.polarity
            w.insert_item(new_id, user_id, d.kind, d.text, key, polarity, m.valid_from, prov, d.reason)
    if m.persona:
        w.merge_persona(user_id, m.persona, prov)
    if m.summary and m.summary.strip():
        w.insert_summary(derived_id(m.session_id, "summary"), user_id, m.summary, m.valid_from, prov)
    for i, (person, relation) in enumerate(m.relations):
        other = link_person(w, user_id, person, derived_id(m.session_id, "person", person.lower()), prov)
        if other is not None:
            w.insert_relation(derived_id(m.session_id, "relation", i), user_id, other, relation, m.valid_from, prov)
    w.insert_session(m, user_id)
    w.touch(user_id)
    return True


def absorb_placeholder(w: SessionWriter, user_id: str, name: str, prov: Provenance) -> None:
    """A user who says their name may be someone others already mentioned (a keyless user of
    that name, made from "my sister Marta"): if exactly one such user exists, merge it in, so
    the social graph reaches the real person."""
    found = w.placeholders_named(name, user_id)
    if len(found) == 1:
        w.merge_users(user_id, found[0], prov, f"'{name}' was mentioned by others before they met us")


def link_person(w: SessionWriter, user_id: str, person: str, new_id: str, prov: Provenance) -> str | None:
    """The user a mentioned person is: a unique live user of that name, else a new user (no keys yet)."""
    person = " ".join(person.split())
    if not person or person.lower() == UNKNOWN_USER or MARKER in person:  # a forgotten person stays gone
        return None
    found = w.users_named(person, user_id)
    if len(found) == 1:
        return found[0]
    if w.user_exists(new_id):
        return new_id
    w.insert_user(new_id, person, prov, "mentioned by a user")
    return new_id
