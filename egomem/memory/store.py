"""The memory store interface (`MemoryStore`); `open_store(cfg)` is in factory.py.

The store is the source of truth for everything remembered about people (docs/architecture.md#memory-store): users,
biometric keys, facts and preferences (superseded, never overwritten), summaries, the 90-dimension
persona, relations, sessions, the durable job queue, dead letters and the append-only operation
log. Every index (faiss vectors, BM25) is rebuilt from it: `list_keys()` + `keys_generation()` (and
`key_changes()` for incremental adds) for vectors, `neighbour_memories()` for Level-2 documents.

`MemoryStore` is three interfaces in one backend: people, memories and sessions (here), the job
queue (jobqueue.py `JobQueue`) and the LLM answer cache (llmcache.py `LLMCache`). Backends:
`SQLiteMemoryStore` (egomem/memory/sqlite/, WAL, embedded default) and `PostgresMemoryStore`
(egomem/memory/postgres/), both on the SQL of egomem/memory/sql/; they implement the abstract methods
and storage only: `render_profile` / `neighbour_memories` are written once here on top of them, and
the rules of a session commit once in commit.py. Errors: errors.py. The two-phase forget's registry
of orchestrators and its announcements: egomem/memory/sql/coordination.py.
All methods are thread-safe; several processes may open the same database.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np

from egomem.memory import persona as persona_dims
from egomem.memory.changes import ChangeFeed, OnChange, OpLogChangeFeed
from egomem.memory.jobqueue import JobQueue
from egomem.memory.llmcache import LLMCache
from egomem.memory.types import (
    UNKNOWN_USER,
    BiometricKey,
    ForgetAnnouncement,
    ForgetReceipt,
    KeyChanges,
    MemoryItem,
    Modality,
    NeighbourMemory,
    OpLogEntry,
    OrchestratorRecord,
    PersonaUpdate,
    PersonaValue,
    Polarity,
    Profile,
    Provenance,
    Relation,
    SessionCommit,
    SessionRecord,
    Summary,
    User,
)
from egomem.relations import inverse_relation

MANUAL = Provenance(actor="api", origin="manual")  # default provenance of direct (REST / admin) edits
# the labels `render_profile` opens its lines with (the Level-1 MemChunk text): "name: Ada", "fact: lives in Paris"
PROFILE_LINE_LABELS = ("name", "people", "fact", "likes", "dislikes", "persona", "earlier")


class MemoryStore(JobQueue, LLMCache):
    """What the memory manager, the worker and the orchestrator call. See the module docstring."""

    # ---- users ----
    @abc.abstractmethod
    def create_user(self, name: str = UNKNOWN_USER, prov: Provenance = MANUAL) -> User: ...
    @abc.abstractmethod
    def get_user(self, user_id: str) -> User | None:
        """The user row as stored (a merged-away user comes back with `merged_into` set)."""
    @abc.abstractmethod
    def resolve_user(self, user_id: str) -> User | None:
        """Follow `merged_into` to the live user; None when unknown or forgotten."""
    @abc.abstractmethod
    def list_users(self, include_merged: bool = False) -> list[User]: ...
    @abc.abstractmethod
    def rename_user(self, user_id: str, name: str, prov: Provenance = MANUAL, reason: str = "") -> User: ...
    @abc.abstractmethod
    def merge_users(self, keep_id: str, drop_id: str, prov: Provenance = MANUAL, reason: str = "") -> User:
        """Move everything of `drop_id` to `keep_id`; `drop_id` stays as a tombstone pointing at it."""
    @abc.abstractmethod
    def forget_user(self, user_id: str, prov: Provenance = MANUAL, reason: str = "") -> ForgetReceipt:
        """Remove the user's keys, memories, relations, sessions, transcripts, LLM answers, dead
        letters and log rows; redact every name they had where other users' rows mention it
        (memory/redact.py); remove them from the chunks of memory jobs not done yet (memory/chunk.py);
        append one 'forget' row that names no one; prove it by a scan (cells, raw file bytes, chunks)."""

    def name_history(self, user_id: str) -> list[str]:
        """Every name the user (and the users merged into them) has had: forget redacts them all."""
        u = self.get_user(user_id)
        return [u.name] if u else []

    @abc.abstractmethod
    def verify_forgotten(self, user_id: str, vectors: Sequence[np.ndarray] = (),
                         name: str | Sequence[str] | None = None) -> list[str]:
        """'<table>.<column>' cells that still hold the id, a vector's bytes, or a mention of the name(s);
        then the same in the database files' raw bytes and in the text of chunks still to be processed."""

    # ---- biometric keys (vector index source) ----
    @abc.abstractmethod
    def add_key(self, user_id: str, modality: Modality, model_id: str, vector: np.ndarray,
                prov: Provenance = MANUAL) -> str: ...
    @abc.abstractmethod
    def list_keys(self, modality: Modality | None = None, model_id: str | None = None,
                  user_id: str | None = None) -> list[BiometricKey]:
        """Keys of live users, for (re)building the vector index."""
    @abc.abstractmethod
    def keys_generation(self) -> int:
        """Changes whenever a key is added or removed (forget, merge): rebuild the index when it does."""
    def key_changes(self, since: int | None) -> KeyChanges:
        """The keys added after generation `since`, or every live key (`rebuild`) when keys were removed or
        moved since then (or `since` is None), with the generation they bring a reader to.

        This default always answers with a rebuild, which is correct for any backend; one that can list
        keys by the generation that added them (SQLite, schema v4) answers additions incrementally. The
        generation is read first, so a key added meanwhile is listed again at the next call, never missed."""
        gen = self.keys_generation()
        return KeyChanges(gen, True, self.list_keys())

    # ---- facts and preferences ----
    @abc.abstractmethod
    def add_item(self, user_id: str, kind: str, text: str, key: str | None = None,
                 polarity: Polarity | None = None, prov: Provenance = MANUAL, reason: str = "") -> str: ...
    @abc.abstractmethod
    def supersede_item(self, item_id: str, text: str, prov: Provenance = MANUAL, reason: str = "",
                       polarity: Polarity | None = None) -> str:
        """Close the item (invalid_at = now, superseded_by = new) and add its replacement; returns the new id."""
    @abc.abstractmethod
    def retract_item(self, item_id: str, prov: Provenance = MANUAL, reason: str = "") -> None: ...
    @abc.abstractmethod
    def items(self, user_id: str, kind: str | None = None, history: bool = False) -> list[MemoryItem]:
        """Current facts / preferences (history=True: also superseded and retracted ones)."""

    def add_fact(self, user_id: str, text: str, key: str | None = None, prov: Provenance = MANUAL,
                 reason: str = "") -> str:
        return self.add_item(user_id, "fact", text, key=key, prov=prov, reason=reason)

    def add_preference(self, user_id: str, item: str, polarity: Polarity, prov: Provenance = MANUAL,
                       reason: str = "") -> str:
        return self.add_item(user_id, "preference", item, polarity=polarity, prov=prov, reason=reason)

    def facts(self, user_id: str, history: bool = False) -> list[MemoryItem]:
        return self.items(user_id, "fact", history)

    def preferences(self, user_id: str, history: bool = False) -> list[MemoryItem]:
        return self.items(user_id, "preference", history)

    # ---- summaries, persona, relations ----
    @abc.abstractmethod
    def add_summary(self, user_id: str, text: str, prov: Provenance = MANUAL) -> str: ...
    @abc.abstractmethod
    def summaries(self, user_id: str, limit: int = 20) -> list[Summary]:
        """Newest first."""
    @abc.abstractmethod
    def persona(self, user_id: str) -> dict[int, PersonaValue]: ...
    @abc.abstractmethod
    def update_persona(self, user_id: str, updates: Sequence[PersonaUpdate], prov: Provenance = MANUAL) -> None:
        """Confidence-weighted merge of new evidence into each dimension."""
    @abc.abstractmethod
    def add_relation(self, user_id: str, other_user_id: str, relation: str, prov: Provenance = MANUAL) -> str:
        """Record "other is user's <relation>" (e.g. sister). Idempotent for the same triplet."""
    @abc.abstractmethod
    def relations(self, user_id: str) -> list[tuple[Relation, str]]:
        """Current relations touching the user, both directions, with the other user's name."""

    # ---- whole profile, sessions, the one-transaction session write ----
    @abc.abstractmethod
    def profile(self, user_id: str, summaries: int = 5) -> Profile:
        """A consistent snapshot (one read transaction) of the user's current memory."""
    @abc.abstractmethod
    def get_session(self, session_id: str) -> SessionRecord | None: ...
    @abc.abstractmethod
    def list_sessions(self, user_id: str | None = None, stream_id: str | None = None) -> list[SessionRecord]: ...
    @abc.abstractmethod
    def commit_session(self, commit: SessionCommit) -> bool:
        """Apply everything one session produced atomically. False (and no change) when the
        session was already committed; `VersionConflict` when `expected_version` is stale."""

    # ---- the operation log ----
    @abc.abstractmethod
    def op_log(self, user_id: str | None = None, after_op_id: int = 0, limit: int = 1000) -> list[OpLogEntry]: ...

    def last_op_id(self) -> int:
        """The newest op-log row's id (0 when empty): where a follower of the log starts."""
        last = 0
        while batch := self.op_log(after_op_id=last, limit=10_000):
            last = batch[-1].op_id
        return last

    @abc.abstractmethod
    def close(self) -> None: ...

    # ---- the two-phase forget across orchestrators (sql/coordination.py) ----
    @abc.abstractmethod
    def announce_forget(self, user_id: str, prov: Provenance = MANUAL) -> str:
        """Phase 1: tell every orchestrator (change feed `forget_prepare`, naming the id only) that
        `user_id` is about to be forgotten; returns the request id they acknowledge."""
    @abc.abstractmethod
    def forget_announcements(self, max_age_s: float) -> list[ForgetAnnouncement]:
        """Announced forgets not yet carried out, at most `max_age_s` old."""
    @abc.abstractmethod
    def ack_forget(self, request_id: str, origin: str | None = None) -> bool:
        """Orchestrator `origin` (default: this store object) has redacted its recordings for the request."""
    @abc.abstractmethod
    def forget_acks(self, request_id: str) -> set[str]: ...
    @abc.abstractmethod
    def heartbeat(self, label: str, origin: str | None = None) -> None:
        """Register orchestrator `origin` (default: this store object) as live now."""
    @abc.abstractmethod
    def leave(self, origin: str | None = None) -> None: ...
    @abc.abstractmethod
    def live_orchestrators(self, max_age_s: float) -> list[OrchestratorRecord]: ...
    @abc.abstractmethod
    def purge_coordination(self, announcement_ttl_s: float, orchestrator_gone_s: float) -> None:
        """Drop announcements of forgets never carried out, and orchestrators long silent."""

    # ---- the change feed (changes.py): what other processes changed ----
    origin: str = ""  # this store object's id on the feed (SQLBase sets one)

    def change_feed(self, on_change: OnChange, poll_s: float = 0.5) -> ChangeFeed:
        """Start following committed forgets, merges and profile changes, whichever process made them:
        `on_change(Change)` is called from the feed's thread. Default: the op log polled every `poll_s`
        (PostgreSQL overrides it with LISTEN/NOTIFY). `close()` the feed before the store."""
        return OpLogChangeFeed(self, on_change, poll_s).start()

    # ---- written once on top of the primitives ----

    def render_profile(self, user_id: str, max_chars: int = 2000) -> str:
        """The user's profile as plain text for the Level-1 MemChunk, most important lines first,
        cut at a line boundary to `max_chars` (the MemChunk holds 512 text steps)."""
        p = self.profile(user_id)
        lines = [f"name: {p.user.name}"]
        people = [f"{name} ({r.relation if r.user_id == p.user.user_id else inverse_relation(r.relation)})"
                  for r, name in p.relations]  # an edge stored from the other side reads inverted
        if people:
            lines.append("people: " + "; ".join(people))
        lines += [f"fact: {f.text}" for f in p.facts]
        lines += [f"{pr.polarity or 'likes'}s: {pr.text}" for pr in p.preferences]
        leaning = [
            persona_dims.describe(d, v.value)
            for d, v in sorted(p.persona.items(), key=lambda kv: -kv[1].confidence)
            if v.confidence >= 0.5
        ]
        leaning = [t for t in leaning if t]
        if leaning:
            lines.append("persona: " + "; ".join(leaning))
        lines += [f"earlier: {s.text}" for s in p.summaries]
        out: list[str] = []
        used = 0
        for line in lines:
            if used + len(line) + 1 > max_chars:
                break
            out.append(line)
            used += len(line) + 1
        return "\n".join(out)

    def neighbour_memories(self, user_id: str, per_neighbour: int = 20) -> list[NeighbourMemory]:
        """Related users and their memory items: the documents of Level-2 retrieval
        ((neighbour name, relation words, one memory item) each). The relation reads from `user_id`'s
        side: an edge the neighbour stored ("Bob is Ada's mother", read by Bob) comes out inverted
        ("child"), never as the neighbour's own word."""
        out = []
        for rel, name in self.relations(user_id):
            inverse = rel.user_id != user_id
            other = rel.user_id if inverse else rel.other_user_id
            items = [i.text if i.kind == "fact" else f"{i.polarity}s {i.text}" for i in self.items(other)]
            items += [s.text for s in self.summaries(other, limit=3)]
            word = inverse_relation(rel.relation) if inverse else rel.relation
            out.append(NeighbourMemory(other, name, word, inverse, items[:per_neighbour]))
        return out

