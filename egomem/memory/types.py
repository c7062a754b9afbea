"""Plain records the memory store hands out and takes in (no SQL, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

UNKNOWN_USER = "unknown_user"  # the name of a user whose name nobody has said yet
Modality = Literal["face", "voice"]
ItemKind = Literal["fact", "preference"]
Polarity = Literal["like", "dislike"]
FALLBACK_ORIGIN = "rule_fallback"  # origin of every record the offline rule-based extractor writes


@dataclass(frozen=True)
class User:
    user_id: str
    name: str
    created_at: float
    updated_at: float
    version: int  # bumped by every write for this user
    merged_into: str | None = None


@dataclass(frozen=True)
class BiometricKey:
    key_id: str
    user_id: str
    modality: Modality
    model_id: str
    vector: np.ndarray  # [D] float32, L2-normalised
    session_id: str | None
    created_at: float


@dataclass(frozen=True)
class KeyChanges:
    """What changed in the biometric keys since a generation (`MemoryStore.key_changes`), read in one snapshot."""

    generation: int  # keys_generation of that snapshot: pass it as `since` next time
    rebuild: bool  # keys were removed or moved (forget, merge) after `since`: `keys` holds every live key
    keys: list[BiometricKey]  # rebuild: all live keys; else the keys added after `since`


@dataclass(frozen=True)
class MemoryItem:
    """A fact or a preference. Current when `invalid_at is None`; history otherwise."""

    item_id: str
    user_id: str
    kind: ItemKind
    key: str | None
    text: str
    polarity: Polarity | None
    valid_from: float
    invalid_at: float | None
    superseded_by: str | None
    session_id: str | None
    origin: str


@dataclass(frozen=True)
class Summary:
    summary_id: str
    user_id: str
    session_id: str | None
    text: str
    origin: str
    created_at: float


@dataclass(frozen=True)
class PersonaValue:
    dim: int  # index into persona.PERSONA_DIMENSIONS
    value: float  # 1 = positive pole, 0 = negative pole, 0.5 = neutral (AlignX scale)
    confidence: float
    evidence: str
    origin: str = ""


@dataclass(frozen=True)
class Relation:
    relation_id: str
    user_id: str
    other_user_id: str
    relation: str  # "other is user's <relation>", e.g. "sister"
    valid_from: float
    invalid_at: float | None
    session_id: str | None
    origin: str


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    stream_id: str
    chunk_index: int
    start_step: int
    end_step: int
    user_id: str | None
    transcript: str | None
    transcript_source: str | None
    status: str
    created_at: float


@dataclass(frozen=True)
class OpLogEntry:
    op_id: int
    ts: float
    op: str
    actor: str
    user_id: str | None
    related_user_id: str | None
    target: str | None
    session_id: str | None
    llm_model: str | None
    prompt_hash: str | None
    reason: str | None
    detail: dict[str, Any]


@dataclass(frozen=True)
class Job:
    job_id: str
    key: str
    kind: str
    payload: dict[str, Any] | None
    status: Literal["queued", "running", "done", "dead"]
    attempts: int
    max_attempts: int
    lease_until: float | None
    worker: str | None
    result: dict[str, Any] | None
    error: str | None


@dataclass(frozen=True)
class DeadLetter:
    dl_id: str
    source: Literal["llm", "job"]
    stage: str
    job_id: str | None
    session_id: str | None
    user_id: str | None
    payload: dict[str, Any]
    error: str
    attempts: int
    created_at: float
    resolved_at: float | None
    resolution: str | None


@dataclass(frozen=True)
class NeighbourMemory:
    """One related user and what we remember about them (documents for Level-2 retrieval)."""

    user_id: str
    name: str
    relation: str  # relation words as the asking user would say them ("sister"; an inverted edge: "child")
    inverse: bool  # True: the edge was stored from the neighbour's side and `relation` is its inverse
    items: list[str]


@dataclass(frozen=True)
class Provenance:
    """Who wrote something and why; copied into every op-log row of the write."""

    actor: str  # 'memory_manager', 'rule_extractor (offline fallback)', 'admin:<token id>', ...
    origin: str  # stored on each record: 'llm:<model>', 'rule_fallback', 'manual'
    session_id: str | None = None
    llm_model: str | None = None
    prompt_hash: str | None = None


@dataclass(frozen=True)
class Profile:
    """A user's current memory, read in one snapshot (`user.version` tells if it changed since)."""

    user: User
    facts: list[MemoryItem]
    preferences: list[MemoryItem]
    summaries: list[Summary]
    persona: dict[int, PersonaValue]
    relations: list[tuple[Relation, str]]  # (relation, other user's name)


# ---- the one-transaction write the memory manager makes per session ----


@dataclass(frozen=True)
class ItemDecision:
    """What the update agent (or the rules) decided about one extracted fact / preference."""

    action: Literal["add", "supersede", "retract"]
    kind: ItemKind
    text: str = ""
    key: str | None = None
    polarity: Polarity | None = None
    target_id: str | None = None  # the stored item superseded / retracted
    reason: str = ""


@dataclass(frozen=True)
class PersonaUpdate:
    dim: int
    value: float
    confidence: float
    evidence: str


@dataclass(frozen=True)
class NewKey:
    modality: Modality
    model_id: str
    vector: np.ndarray  # [D]


@dataclass
class SessionCommit:
    """Everything one processed session writes, applied atomically by `MemoryStore.commit_session`.

    `user_id` None creates a user with id `new_user_id` (deterministic, so a re-run after a crash
    creates the same one). `expected_version` guards the update agent's read-modify-write: the
    commit fails with `VersionConflict` if the user changed since the profile was read.
    """

    session_id: str
    stream_id: str
    chunk_index: int
    start_step: int
    end_step: int
    valid_from: float  # wall-clock time of the session start: facts are valid from then
    provenance: Provenance
    user_id: str | None = None
    new_user_id: str | None = None
    expected_version: int | None = None
    name: str | None = None  # set / change the user's name
    name_reason: str = ""
    keys: list[NewKey] = field(default_factory=list)
    decisions: list[ItemDecision] = field(default_factory=list)
    persona: list[PersonaUpdate] = field(default_factory=list)
    summary: str | None = None
    relations: list[tuple[str, str]] = field(default_factory=list)  # (person name, relation words)
    transcript: str | None = None
    transcript_source: str | None = None
    chunk_redactions: int | None = None  # StreamChunk.redactions as read; a forget's rewrite since refuses the commit


@dataclass(frozen=True)
class ForgetReceipt:
    """What `forget` removed, what it redacted (the name in other users' rows, see memory/redact.py),
    and the proof scan's result (`leftovers` must be empty)."""

    forget_id: str
    deleted: dict[str, int]  # table -> rows
    leftovers: list[str]  # '<table>.<column>' still matching the user's id / name / vectors
    wal_clean: bool = True  # False: a long reader kept old WAL frames alive; they go at the next checkpoint
    redacted: dict[str, int] = field(default_factory=dict)  # '<table>.<column>' -> rows of others that named them


@dataclass(frozen=True)
class ForgetAnnouncement:
    """Phase 1 of a two-phase forget (memory/sql/coordination.py): `user_id` is about to be forgotten
    through the orchestrator `origin`; the others acknowledge `request_id` once they have redacted."""

    request_id: str
    user_id: str
    origin: str
    created_at: float


@dataclass(frozen=True)
class OrchestratorRecord:
    """An orchestrator sharing the store: `origin` (its store object's id), `label` (host:port, for
    people), and its last heartbeat (live while recent: `memory.orchestrator_live_s`)."""

    origin: str
    label: str
    started_at: float
    heartbeat_at: float
