"""Sessions that never mix two people: split a trigger session where the person changes (issue #5).

The tagger hears turn-taking, not who is talking: when a new user takes over right after the last
one left, it often decodes ONE session over both, and the memory manager would then give that
session the mean of two people's embeddings and one transcript. This module splits such sessions
with the identity evidence the orchestrator recorded (`StreamChunk.faces` / `.voices`: one
(step, embedding) per 2 s poll; a voice embedding describes the last 3 s of the user's audio).

Rules, per decoded session (start..end):
  E1 Evidence: the session's face and voice polls (steps start..end), each modality on its own,
     in step order; a voice poll whose 3 s window also heard user speech before the session start
     is left out (it may describe the previous person). A session with no evidence, or too few polls
     to confirm a change (E3), stays as it is.
  E2 Same person: a face poll is the same person as the current piece when its cosine distance
     to the piece's mean face is below the face threshold (identity config, per face model); a
     voice poll when its score against the piece's mean voice is above the voice threshold (the
     adaptive s-norm score and threshold of `egomem.identity`, or raw cosine similarity when no
     cohort is given). The reference is the running mean of the piece, not the previous poll, so
     one off poll does not drag it.
  E3 Persistence: a change needs `min_polls` (default 2, ~4 s) consecutive polls that differ from
     the piece AND agree with each other. A lone off poll (a cough, a noisy window, a window that
     straddles both people) is dropped and the piece goes on; a poll that agrees with neither the
     piece nor the next poll is dropped as a transition (the straddling window of a switch).
     At the end, neighbouring pieces whose MEAN embeddings are the same person are joined back
     (a few off polls in a row were not a new person).
  E4 Modalities: a change found by EITHER modality splits the session (face and voice disagreeing,
     or only one of them present, still splits). Wrongly splitting one person's session costs a
     second session that identification then puts in the same profile; wrongly merging two people
     leaks one person's memories into the other's profile, which must never happen. Changes whose
     search ranges overlap are one cut.
  E5 Where to cut: between the last poll of the old piece (t_i) and the first poll of the new one
     (t_j) lies the switch. Faces are instants: search [t_i, t_j]. A voice poll heard the last
     `window_steps` (3 s): if t_i heard only the old person and t_j only the new one, the switch
     lies after the last user speech in t_i's window and before the first user speech in t_j's
     (the narrow range, searched first); a mixed window breaks that, so the wide range
     [t_i - window_steps + 1, t_j] is the fallback. In the range the cut is a run of steps in
     which nobody speaks (`activity`), the pause before the new person talks: the longest run
     after which the USER speaks first (a person who walks up addresses the assistant; the
     assistant answering its current user is a turn, not a switch), else the longest run. The
     old piece ends on the last active step before the run, the new one starts on the first
     active step after it. No silent step in either range (overlapping speech): cut in the
     middle of the wide range.
  E6 Pieces: each piece is trimmed to its first and last active step and must be at least
     `min_len` steps; its evidence is, among the polls from its first step to the next piece's
     first step, those of the person (change-point group) with the most polls there; polls of
     the other person there (a window that still heard the previous one) and dropped polls
     belong to no piece.
  E7 Borrowed evidence: a piece with no poll of its own (shorter than the 2 s poll interval, e.g. the
     end of a turn that the trigger cut off after a pause) takes, per modality, the first poll after its
     end when that poll comes within `window_steps` of the end and before the next piece starts: a
     voice poll there heard the piece, and the face in view is the one that just spoke. A voice poll
     whose 3 s window also reaches back into the piece before is taken only when it is that piece's
     person (E2): a window that heard two people must not make one of them. Without such a poll the
     piece keeps no evidence and becomes a new unnamed user, never someone else's session.
  Not done: joining two sessions the trigger cut apart, even when the evidence says "same person"
     (tried: in noised benchmark streams it joined different people, i.e. leaked).

Activity (what the tokens tell): the text channel carries a word (not a pad) when the assistant
speaks; the speak and listen channels carry Mimi codes of audio. Background audio (silence, room
noise) produces a few codes over and over, speech many different ones. The background code set of
each channel (per codebook) is taken from the chunk's steps OUTSIDE every decoded session (the
trigger says nobody talks there; fallback when there are under `min_background` such steps: codes
that fill >= 2 % of the chunk's steps); a step is active on a channel when any of its codebooks
carries a code outside the background set (random-init Mimi maps quiet speech to the silence code
in most codebooks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

TEXT_PADS = (0, 3, -1, -2)  # moshi's end-of-padding (0), padding (3), "no token" (-1) and warm-up (-2) ids
FREQUENT_CODE = 0.02  # fallback background: a code that fills >= 2 % of the chunk's steps is background
MIN_FRESH = 1  # a step is speech when any codebook leaves the background: random-init Mimi maps quiet speech
# to the silence code in most codebooks (held-out streams: requiring 4 of 8 lost whole quiet turns, and
# halved the user switches recovered within 5 steps)


class ScoreNorm(Protocol):
    """What the splitter needs from `egomem.identity.snorm.AdaptiveSNorm`."""

    def stats(self, vecs: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass
class SplitRule:
    """Thresholds and knobs of the identity split (see the module docstring, rules E1-E7).
    `egomem.memory.worker.split_rule(cfg)` builds the one the memory manager uses from config."""

    face_threshold: float  # cosine distance: below = same face (IdentityConfig.face_threshold_<backend>)
    voice_threshold: float  # s-normed score (or cosine similarity without `snorm`): above = same voice
    snorm: ScoreNorm | None = None  # AS-norm cohort statistics for voice scores; None: raw cosine similarity
    min_polls: int = 2  # consecutive agreeing polls that confirm a change (E3)
    window_steps: int = 38  # a voice poll hears the last 3 s (orchestrator.identify_window_s); also E7's reach
    min_len: int = 3  # shorter pieces are dropped (the trigger decoder's own minimum)
    min_background: int = 25  # outside-session steps (2 s) needed to learn the background codes

    def same_face(self, ref: np.ndarray, v: np.ndarray) -> bool:
        return 1.0 - _cos(ref, v) < self.face_threshold

    def same_voice(self, ref: np.ndarray, v: np.ndarray) -> bool:
        s = _cos(ref, v)
        if self.snorm is None:
            return s > self.voice_threshold
        mu, sd = self.snorm.stats(np.stack([ref, v]))  # [2] each: the "enrolment" (piece) and test side
        return 0.5 * ((s - mu[0]) / sd[0] + (s - mu[1]) / sd[1]) > self.voice_threshold


@dataclass
class Piece:
    """One person's session: start..end inclusive and the poll steps attributed to it (E6)."""

    start: int
    end: int
    face_steps: list[int] = field(default_factory=list)
    voice_steps: list[int] = field(default_factory=list)
    split: bool = False  # True when this piece came out of a split session


Track = Sequence[tuple[int, np.ndarray]]


def activity(tokens: np.ndarray, sessions: Sequence[tuple[int, int]], min_background: int = 25) -> np.ndarray:
    """Per step and side: who speaks? tokens [T, 17] (text, 8 speak, 8 listen) -> [T, 2] bool:
    column 0 the assistant (a text word or speak codes), column 1 the user (listen codes)."""
    tokens = np.asarray(tokens)
    T = tokens.shape[0]
    outside = np.ones(T, bool)
    for a, b in sessions:
        outside[a:b + 1] = False
    active = np.zeros((T, 2), bool)
    active[:, 0] = ~np.isin(tokens[:, 0], TEXT_PADS)  # a text word
    for side, lo in ((0, 1), (1, 9)):  # speak codebooks 1..8, listen codebooks 9..16
        codes = tokens[:, lo:lo + 8]  # [T, 8]
        fresh = np.zeros(codes.shape, bool)  # code not in its codebook's background set
        for k in range(8):
            col = codes[:, k]
            if outside.sum() >= min_background:
                background = np.unique(col[outside])
            else:
                vals, counts = np.unique(col, return_counts=True)
                background = vals[counts >= FREQUENT_CODE * T]
            fresh[:, k] = ~np.isin(col, background)
        active[:, side] |= fresh.sum(axis=1) >= MIN_FRESH
    return active


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))


def _unit_mean(vs: list[np.ndarray]) -> np.ndarray:
    m = np.mean([v / max(float(np.linalg.norm(v)), 1e-12) for v in vs], axis=0)
    return m / max(float(np.linalg.norm(m)), 1e-12)


def change_points(track: Track, same, min_polls: int) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Rules E2-E3 on one modality's polls in step order.

    Returns the changes [(t_i, t_j)] (last poll of the old piece, first poll of the new one) and the
    poll steps of each piece (len(changes) + 1 lists; dropped polls are in none)."""
    changes: list[tuple[int, int]] = []
    groups: list[list[int]] = []
    members: list[tuple[int, np.ndarray]] = []  # polls of the current piece
    pending: list[tuple[int, np.ndarray]] = []  # polls that differ from it, in a row, agreeing
    for t, v in track:
        v = np.asarray(v, np.float32)
        if not members:
            members.append((t, v))
            continue
        if same(_unit_mean([m[1] for m in members]), v):
            members.append((t, v))
            pending = []  # the earlier off polls were noise (E3): dropped
            continue
        if pending and not same(_unit_mean([p[1] for p in pending]), v):
            pending = []  # the pending polls agree with neither side: a transition, dropped
        pending.append((t, v))
        if len(pending) >= min_polls:
            changes.append((members[-1][0], pending[0][0]))
            groups.append([m[0] for m in members])
            members, pending = pending, []
    if members:
        groups.append([m[0] for m in members])
    # confirm with every poll: two neighbouring pieces whose MEAN embeddings are the same person were
    # one person after all (a few off polls in a row); their change is undone
    vec = {int(t): np.asarray(v, np.float32) for t, v in track}
    k = 0
    while k < len(changes):
        if same(_unit_mean([vec[t] for t in groups[k]]), _unit_mean([vec[t] for t in groups[k + 1]])):
            groups[k:k + 2] = [groups[k] + groups[k + 1]]
            del changes[k]
        else:
            k += 1
    return changes, groups


def _cut(sides: np.ndarray, lo: int, hi: int) -> tuple[int, int] | None:
    """Rule E5: (last step of the old piece, first step of the new one) inside [lo, hi], None when
    nobody is silent there. sides [T, 2]: assistant / user activity."""
    any_side = sides.any(axis=1)
    runs, t = [], lo
    while t <= hi:  # silent runs (nobody speaks) inside the range
        if any_side[t]:
            t += 1
            continue
        a = t
        while t <= hi and not any_side[t]:
            t += 1
        runs.append((a, t - 1))
    if not runs:
        return None
    user_next = [r for r in runs if r[1] + 1 < len(sides) and sides[r[1] + 1, 1] and not sides[r[1] + 1, 0]]
    a, b = max(user_next or runs, key=lambda r: r[1] - r[0])
    return a - 1, b + 1


def split_session(start: int, end: int, sides: np.ndarray, faces: Track, voices: Track,
                  rule: SplitRule) -> list[Piece]:
    """One decoded session -> one piece per person (rules E1-E6). `sides` [T, 2] from `activity`;
    tracks may hold polls outside start..end."""
    active = sides.any(axis=1)  # [T, 2] -> [T]: anybody speaks
    f = [(int(t), v) for t, v in faces if start <= t <= end]
    before = lambda t: sides[max(0, t - rule.window_steps + 1):start, 1].any()  # noqa: E731 (user speech)
    vo = [(int(t), v) for t, v in voices if start <= t <= end and not before(int(t))]
    f_changes, f_groups = change_points(f, rule.same_face, rule.min_polls)
    v_changes, v_groups = change_points(vo, rule.same_voice, rule.min_polls)
    if not f_changes and not v_changes:
        return [Piece(start, end, [t for t, _ in f], [t for t, _ in vo])]
    user = sides[:, 1]
    W = rule.window_steps

    def heard(ti: int, tj: int) -> tuple[int, int]:
        """Narrow range: after the old person's last user speech heard by poll ti, before the new
        person's first user speech heard by poll tj (exact when neither window was mixed)."""
        old_speech = np.flatnonzero(user[max(0, ti - W + 1):ti + 1]) + max(0, ti - W + 1)
        new_speech = np.flatnonzero(user[max(0, tj - W + 1):tj + 1]) + max(0, tj - W + 1)
        return (int(old_speech[-1]) if old_speech.size else ti - W + 1,
                int(new_speech[0]) if new_speech.size else tj)

    ranges = sorted([(max(start, ti), tj, ti, tj) for ti, tj in f_changes]
                    + [(max(start, ti - W + 1), tj, *heard(ti, tj)) for ti, tj in v_changes])
    merged: list[list[int]] = []
    for lo, hi, nlo, nhi in ranges:  # E4: overlapping ranges are one change (both hold the switch: intersect)
        if merged and lo <= merged[-1][1]:
            m = merged[-1]
            merged[-1] = [lo, min(m[1], hi), max(m[2], nlo), min(m[3], nhi)]
        else:
            merged.append([lo, hi, nlo, nhi])
    bounds, prev_first = [], start
    for lo, hi, nlo, nhi in merged:
        lo = max(lo, prev_first)
        if lo >= hi:
            continue
        nlo, nhi = max(nlo, lo), min(nhi, hi)
        cut = _cut(sides, nlo, nhi) if nlo < nhi else None  # the narrow range first (E5)
        if cut is None:
            cut = _cut(sides, lo, hi) or ((lo + hi) // 2, (lo + hi) // 2 + 1)
        last_old, first_new = cut
        if last_old < prev_first or first_new > end:
            continue
        bounds.append((last_old, first_new))
        prev_first = first_new
    # territory of each piece: from its first step to the step before the next piece starts (a poll in
    # the pause after a piece heard that piece)
    firsts = [start] + [fn for _, fn in bounds]
    lasts = [lo for lo, _ in bounds] + [end]
    terr_ends = [fn - 1 for _, fn in bounds] + [end]
    pieces = []
    for a, b, te in zip(firsts, lasts, terr_ends):
        idx = np.flatnonzero(active[a:b + 1])
        if idx.size == 0:
            continue
        lo_t = a
        a, b = a + int(idx[0]), a + int(idx[-1])  # E6: trimmed to activity
        if b - a + 1 < rule.min_len:
            continue
        pieces.append(Piece(a, b, _attributed(f_groups, lo_t, te), _attributed(v_groups, lo_t, te), split=True))
    return pieces or [Piece(start, end, [t for t, _ in f], [t for t, _ in vo])]


def _attributed(groups: list[list[int]], lo: int, hi: int) -> list[int]:
    """The poll steps in lo..hi of the group (one person) with the most polls there; the other
    groups' polls in that range (e.g. a window that still heard the previous person) are left out."""
    inside = [[t for t in g if lo <= t <= hi] for g in groups]
    return max(inside, key=len) if inside else []


def split_sessions(sessions: Sequence[tuple[int, int]], tokens: np.ndarray, faces: Track, voices: Track,
                   rule: SplitRule) -> list[Piece]:
    """All decoded sessions of a chunk -> pieces that each hold one person, in step order (E1-E6)."""
    act = activity(tokens, sessions, rule.min_background)
    out: list[Piece] = []
    for a, b in sessions:
        out += split_session(int(a), int(b), act, faces, voices, rule)
    return borrow_trailing_polls(out, faces, voices, rule.window_steps, rule.same_voice)


def borrow_trailing_polls(pieces: list[Piece], faces: Track, voices: Track, reach: int,
                          same_voice: Callable[[np.ndarray, np.ndarray], bool] | None = None) -> list[Piece]:
    """Rule E7: a piece without a poll of its own takes, per modality, the first poll after its end that
    lies within `reach` steps of it and before the next piece's start. A voice poll whose window (`reach`
    steps) also heard the piece before is taken only when it is that piece's person (`same_voice` against
    its voice polls' mean; without `same_voice`, never): a mixed window must not make one person of two.
    Pieces in step order."""
    def first_after(track: Track, end: int, stop: int) -> list[tuple[int, np.ndarray]]:
        return sorted(((int(t), v) for t, v in track if end < t <= end + reach and t < stop), key=lambda x: x[0])[:1]

    vectors = dict((int(t), v) for t, v in voices)
    out: list[Piece] = []
    for i, p in enumerate(pieces):
        if p.face_steps or p.voice_steps:
            out.append(p)
            continue
        stop = pieces[i + 1].start if i + 1 < len(pieces) else p.end + reach + 1
        face = [t for t, _ in first_after(faces, p.end, stop)]
        voice = first_after(voices, p.end, stop)
        prev = out[-1] if out else None
        if voice and prev is not None and voice[0][0] - reach < prev.end:  # its window heard the piece before too
            before = [vectors[t] for t in prev.voice_steps if t in vectors]
            if same_voice is None or not before or not same_voice(_unit_mean(before), voice[0][1]):
                voice = []
        out.append(Piece(p.start, p.end, face, [t for t, _ in voice], p.split))
    return out
