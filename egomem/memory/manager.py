"""The memory manager: a recorded stream chunk in, durable per-user memories out (docs/architecture.md#recording-to-memory).

    tokens -> trigger labels -> sessions -> identity split (one person per session) -> for each session:
        identify the user (face / voice keys) -> transcript (ASR or client + monologue)
        -> extractor -> new user (keys + initial profile) | update agent (conflicts, reasons)
        -> one atomic `commit_session` (with the session row: the idempotency mark)

Retry safety: session ids, new user ids and record ids derive from (stream, chunk, span), LLM
answers are replayed from the store, and a committed session is skipped; so re-running a chunk
after a crash, or twice, reaches the same state. The update agent's read-modify-write is guarded
by the user's version: if another writer changed the user meanwhile, it re-reads and decides again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from egomem.memory.agents import AgentInfo, Extraction, Extractor, UpdateAgent, UpdatePlan
from egomem.memory.chunk import STEP_S, STEP_SAMPLES, StreamChunk
from egomem.memory.commit import derived_id
from egomem.memory.errors import VersionConflict
from egomem.memory.identify import Identifier, mean_direction, user_of
from egomem.memory.segment import TriggerLabeler, decode_sessions, label_stream
from egomem.memory.store import MemoryStore
from egomem.memory.transcribe import Transcriber
from egomem.memory.types import ItemDecision, NewKey, Provenance, SessionCommit

if TYPE_CHECKING:  # imported lazily: `egomem.trigger` pulls in torch, and the orchestrator imports egomem.memory
    from egomem.trigger.identity_split import Piece, SplitRule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionOutcome:
    session_id: str
    start_step: int
    end_step: int
    user_id: str | None
    status: Literal["committed", "already_done"]
    new_user: bool = False


class MemoryManager:
    def __init__(self, store: MemoryStore, labeler: TriggerLabeler, identifier: Identifier, extractor: Extractor,
                 updater: UpdateAgent, transcriber: Transcriber, trigger_chunk_steps: int = 8192,
                 max_conflict_retries: int = 5, split_rule: SplitRule | None = None):
        self.store, self.labeler, self.identifier = store, labeler, identifier
        self.extractor, self.updater, self.transcriber = extractor, updater, transcriber
        self.window = trigger_chunk_steps
        self.max_conflict_retries = max_conflict_retries
        self.split_rule = split_rule  # None: trigger sessions as decoded (trigger.identity_split = false)

    def pieces_of(self, chunk: StreamChunk) -> list[Piece]:
        """The chunk's sessions, each holding one person, with the polls that belong to it."""
        from egomem.trigger.identity_split import Piece, SplitRule, borrow_trailing_polls, split_sessions

        sessions = decode_sessions(label_stream(self.labeler, chunk.tokens, self.window, chunk.voices))
        if self.split_rule is None:
            pieces = [Piece(a, b, _within(chunk.faces, a, b), _within(chunk.voices, a, b)) for a, b in sessions]
            pieces = borrow_trailing_polls(pieces, chunk.faces, chunk.voices, SplitRule.window_steps)
        else:
            pieces = split_sessions(sessions, chunk.tokens, chunk.faces, chunk.voices, self.split_rule)
        if not pieces and chunk.client_transcript:  # words with no session around them still reach memory
            pieces = [_session_for_lines(chunk)]
        return pieces

    def sessions_of(self, chunk: StreamChunk) -> list[tuple[int, int]]:
        return [(p.start, p.end) for p in self.pieces_of(chunk)]

    def process_chunk(self, chunk: StreamChunk, job_id: str | None = None,
                      before_commit: Callable[[], None] | None = None) -> list[SessionOutcome]:
        """Every session of the chunk. `before_commit` runs before each session's commit and may raise
        to stop the job there (the worker renews its lease, and stops if another worker took the job)."""
        out = []
        pieces = self.pieces_of(chunk)
        for p, lines in zip(pieces, assign_lines([(p.start, p.end) for p in pieces], chunk.client_transcript)):
            out.append(self.process_session(chunk, p.start, p.end, job_id, (p.face_steps, p.voice_steps), lines,
                                            before_commit))
        return out

    def process_session(self, chunk: StreamChunk, start: int, end: int, job_id: str | None = None,
                        evidence: tuple[list[int], list[int]] | None = None,
                        user_lines: list[tuple[int, str]] | None = None,
                        before_commit: Callable[[], None] | None = None) -> SessionOutcome:
        """One session; `evidence` = the (face, voice) poll steps that belong to it (from the identity
        split; default: every poll in start..end); `user_lines` = the client transcript lines it owns
        (`assign_lines`; default: those in start..end). Ids derive from start/end only: re-runs agree."""
        sid = derived_id("session", chunk.stream_id, chunk.chunk_index, start, end)
        done = self.store.get_session(sid)
        if done is not None:
            return SessionOutcome(sid, start, end, done.user_id, "already_done")
        if evidence is None:
            faces, voices = chunk.embeddings("faces", start, end), chunk.embeddings("voices", start, end)
        else:
            faces, voices = _rows(chunk.faces, evidence[0]), _rows(chunk.voices, evidence[1])
        face, voice = mean_direction(faces), mean_direction(voices)  # the session's [D] each, or None
        found = user_of(self.identifier.identify(None if face is None else face[None], voice))  # face [1, D]
        user = self.store.resolve_user(found) if found else None
        audio = None
        if chunk.listen_audio is not None:
            audio = chunk.listen_audio[start * STEP_SAMPLES:(end + 1) * STEP_SAMPLES]  # [S] of this session
        transcript = self.transcriber.transcribe(
            audio, chunk.sample_rate,
            user_lines if user_lines is not None else [p for p in chunk.client_transcript if start <= p[0] <= end],
            [p for p in chunk.monologue if start <= p[0] <= end])
        ex, ex_info = self.extractor.extract(transcript.text, user.name if user else None, sid, job_id,
                                             user.user_id if user else None)
        base = dict(session_id=sid, stream_id=chunk.stream_id, chunk_index=chunk.chunk_index, start_step=start,
                    end_step=end, valid_from=chunk.start_time + start * STEP_S, transcript=transcript.text,
                    transcript_source=transcript.source, persona=list(ex.persona), summary=ex.summary or None,
                    relations=list(ex.relations), chunk_redactions=chunk.redactions)
        if user is None:
            keys = self._keys(faces, voices, have=set())
            plan = UpdatePlan([ItemDecision("add", "fact", t, k, None, None, "new user") for k, t in ex.facts]
                              + [ItemDecision("add", "preference", i, None, p, None, "new user")
                                 for i, p in ex.preferences], ex.name, "user said their name" if ex.name else "")
            commit = SessionCommit(**base, provenance=self._prov(sid, ex_info, None), new_user_id=(
                derived_id("user", sid) if (keys or _has_content(ex)) else None), name=plan.name,
                name_reason=plan.name_reason, keys=keys, decisions=plan.decisions)
            applied = self._commit(commit, before_commit)  # False: another worker committed it meanwhile
            return SessionOutcome(sid, start, end, commit.new_user_id, "committed" if applied else "already_done",
                                  new_user=applied)
        for attempt in range(self.max_conflict_retries):
            profile = self.store.profile(user.user_id)
            plan, up_info = self.updater.decide(profile, ex, sid, job_id)
            have = {(k.modality, k.model_id) for k in self.store.list_keys(user_id=user.user_id)}
            commit = SessionCommit(**base, provenance=self._prov(sid, ex_info, up_info), user_id=user.user_id,
                                   expected_version=profile.user.version, name=plan.name, name_reason=plan.name_reason,
                                   keys=self._keys(faces, voices, have), decisions=plan.decisions)
            try:
                applied = self._commit(commit, before_commit)
                return SessionOutcome(sid, start, end, user.user_id, "committed" if applied else "already_done")
            except VersionConflict as e:
                log.info("session %s: %s; deciding again (%d)", sid, e, attempt + 1)
        raise VersionConflict(f"session {sid}: user {user.user_id} kept changing; gave up after "
                              f"{self.max_conflict_retries} tries (the job will be retried)")

    def _commit(self, commit: SessionCommit, before_commit: Callable[[], None] | None) -> bool:
        if before_commit is not None:
            before_commit()
        return self.store.commit_session(commit)

    def _keys(self, faces: np.ndarray, voices: np.ndarray, have: set[tuple[str, str]]) -> list[NewKey]:
        """One key per modality (the session's mean embedding) unless the user already has one of that model."""
        keys = []
        for modality, obs in (("face", faces), ("voice", voices)):
            v = mean_direction(obs)
            model_id = self.identifier.face_model_id if modality == "face" else self.identifier.voice_model_id
            if v is not None and (modality, model_id) not in have:
                keys.append(NewKey(modality, model_id, v))
        return keys

    @staticmethod
    def _prov(sid: str, ex: AgentInfo, up: AgentInfo | None) -> Provenance:
        infos = [ex] + ([up] if up else [])
        fallback = [i for i in infos if i.origin == "rule_fallback"]
        hashes = ";".join(f"{name}={i.prompt_hash}" for name, i in zip(("extract", "update"), infos) if i.prompt_hash)
        return Provenance(
            actor="memory_manager: " + " + ".join(i.actor for i in infos),
            origin="rule_fallback" if fallback else ex.origin,
            session_id=sid,
            llm_model=",".join(sorted({i.model for i in infos})),
            prompt_hash=hashes or None,
        )


def assign_lines(spans: list[tuple[int, int]], lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Every client transcript line to exactly one session of its chunk: the one it falls in, else the
    nearest (the earlier on a tie). A client sends a line when its own ASR or script has it, which is
    often before the trigger's session starts (a `--say` line at step 0, a session from step 6):
    dropping it would lose what the user said. With no spans, nothing is assigned."""
    out: list[list[tuple[int, str]]] = [[] for _ in spans]
    for step, text in lines:
        if spans:
            dist = [0 if a <= step <= b else (a - step if step < a else step - b) for a, b in spans]
            out[dist.index(min(dist))].append((step, text))
    return out


def _within(track: list[tuple[int, np.ndarray]], a: int, b: int) -> list[int]:
    return [t for t, _ in track if a <= t <= b]


def _session_for_lines(chunk: StreamChunk) -> Piece:
    """A session made for transcript lines the trigger found no session around: it spans the lines,
    and its evidence is the polls inside it, else the poll of each modality nearest to it."""
    from egomem.trigger.identity_split import Piece

    a, b = min(t for t, _ in chunk.client_transcript), max(t for t, _ in chunk.client_transcript)

    def evidence(track: list[tuple[int, np.ndarray]]) -> list[int]:
        inside = _within(track, a, b)
        if inside or not track:
            return inside
        return [min((t for t, _ in track), key=lambda t: a - t if t < a else t - b)]

    return Piece(a, b, evidence(chunk.faces), evidence(chunk.voices))


def _rows(track: list[tuple[int, np.ndarray]], steps: list[int]) -> np.ndarray:
    """[N, D] embeddings of the polls at `steps` (the identity split's attribution)."""
    keep = set(steps)
    rows = [np.asarray(v, np.float32) for t, v in track if t in keep]
    return np.stack(rows) if rows else np.zeros((0, 0), np.float32)


def _has_content(ex: Extraction) -> bool:
    return bool(ex.name or ex.facts or ex.preferences or ex.persona or ex.relations or ex.summary)
