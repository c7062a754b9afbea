"""Turn per-step trigger labels into dialog sessions (start step, end step inclusive).

A clean session is `1 2 2 ... 2 3` (or `1 3`, or a lone `1`... see below) surrounded by 0s. A tagger
makes mistakes, so decoding is a small state machine with these rules for broken sequences:

  R1 start (1) opens a session. A start while a session is open closes the open one at its last
     non-0 step and opens a new one here (adjacent starts = a user switch without an end label).
  R2 end (3) closes the open session at this step. An end with no open session (after 0s or right
     after another end; 2s before it would have opened one by R3) is a one-step session, which
     R6 drops unless `min_len` <= 1.
  R3 in-session (2) with no open session opens one there (the start label was missed).
  R4 no-dialog (0) while a session is open: a run of 0s shorter than `max_gap` steps is absorbed
     (a flicker inside a session); a run of `max_gap` or more closes the session at the last
     non-0 step before the run.
  R5 the chunk ends while a session is open: it closes at the last non-0 step (a session cut by
     the chunk boundary; the caller may stitch it to the next chunk).
  R6 sessions shorter than `min_len` steps are dropped (isolated label noise).

The labeler does not decode the per-step argmax: `viterbi_labels` finds the most probable
well-formed sequence under duration rules, and `refine_boundaries` then moves each of its
boundaries to where the tagger's start (end) probability lies; `configured_decode` runs both as a
`TriggerConfig` says.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from egomem.trigger.model import END, IN_SESSION, NO_DIALOG, START

if TYPE_CHECKING:
    from egomem.config import TriggerConfig


def decode_sessions(labels: np.ndarray, max_gap: int = 13, min_len: int = 3) -> list[tuple[int, int]]:
    """labels [T] in {0,1,2,3} -> [(start, end)] sorted, non-overlapping, end inclusive.

    `max_gap`: 0-runs shorter than this (default 13 steps, about 1 s) do not split a session.
    `min_len`: shorter sessions (default 3 steps, 0.24 s) are dropped.
    """
    labels = np.asarray(labels).reshape(-1)
    if labels.size and (labels.min() < 0 or labels.max() > 3):
        raise ValueError("trigger labels must be in {0, 1, 2, 3}")
    sessions: list[tuple[int, int]] = []
    open_at: int | None = None  # start of the open session
    last_active = -1  # last non-0 step of the open session
    zeros = 0  # length of the current 0-run inside an open session

    def close(end: int) -> None:
        nonlocal open_at
        if open_at is not None and end >= open_at:
            sessions.append((open_at, end))
        open_at = None

    for t, lab in enumerate(labels.tolist()):
        if lab == NO_DIALOG:
            if open_at is not None:
                zeros += 1
                if zeros >= max_gap:  # R4
                    close(last_active)
            continue
        zeros = 0
        if lab == START:  # R1
            close(last_active)
            open_at = t
        elif lab == IN_SESSION:
            if open_at is None:  # R3
                open_at = t
        elif lab == END:
            if open_at is None:  # R2
                open_at = t
            last_active = t
            close(t)
            continue
        last_active = t
    if open_at is not None:  # R5
        close(last_active)
    return [(a, b) for a, b in sessions if b - a + 1 >= min_len]  # R6


def sessions_to_labels(sessions: list[tuple[int, int]], T: int) -> np.ndarray:
    """Inverse of decoding for clean spans: [(start, end)] -> labels [T]."""
    out = np.full(T, NO_DIALOG, np.int64)
    for a, b in sessions:
        out[a:b + 1] = IN_SESSION
        out[a] = START
        out[b] = END
    return out


# Allowed label transitions of a well-formed sequence: 0* (1 2* 3 0*)*, a session may follow an
# end directly (3 -> 1, a user switch). A session is at least 2 steps (1 then 3).
_ALLOWED = np.array([
    # to: 0     1      2      3
    [True, True, False, False],   # from 0 (no dialog)
    [False, False, True, True],   # from 1 (start)
    [False, False, True, True],   # from 2 (in session)
    [True, True, False, False],   # from 3 (end)
])


def _lattice(min_gap: int, min_len: int, short_gap_cost: float = math.inf
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decoding states, each emitting one label:
      Z_1 .. Z_G  k steps of no dialog since a session ended (Z_G = "G or more", also the state before
                  any session); from Z_k only to Z_k+1 until Z_G, which may start a session;
      S           a session's first step;
      C_2 .. C_L-1  its next steps (in session), counted, so that no session is shorter than L;
      I           in session from step L on;  E  its end, then Z_1 or straight to S (a user switch).
    So two sessions are adjacent or at least G = `min_gap` steps apart, and every session lasts at
    least L = `min_len` steps. G = 1, L = 2 is the plain well-formed grammar (`_ALLOWED`). With a
    finite `short_gap_cost` c, Z_1 .. Z_G-1 may also start a session, each such start paying c (a
    log-probability): a gap shorter than G is possible where the tagger is sure of it (a new user
    after a short pause), not forced to adjacency or a merge.
    Returns (label of each state, transition log-score [from, to] (-inf: forbidden), may start a
    chunk, may end a chunk)."""
    G, L = max(1, int(min_gap)), max(2, int(min_len))
    S = G
    chain = list(range(G + 1, G + L - 1))  # C_2 .. C_L-1
    I, E = G + L - 1, G + L  # noqa: E741 - the lattice's "in session" state, named as in the docstring
    n = G + L + 1
    label = np.array([0] * G + [1] + [2] * len(chain) + [2, 3])
    allowed = np.zeros((n, n), bool)
    for k in range(G - 1):
        allowed[k, k + 1] = True
    allowed[G - 1, G - 1] = allowed[G - 1, S] = True
    steps = [S] + chain  # session steps 1 .. L-1
    for a, b in zip(steps, steps[1:]):
        allowed[a, b] = True
    allowed[steps[-1], I] = allowed[steps[-1], E] = True  # step L: in session or the end
    allowed[I, I] = allowed[I, E] = True
    allowed[E, 0] = allowed[E, S] = True
    trans = np.where(allowed, 0.0, -np.inf)
    if math.isfinite(short_gap_cost):
        trans[: G - 1, S] = -float(short_gap_cost)  # a session after a gap of 1 .. G-1 steps, at a price
    first = np.zeros(n, bool)
    first[G - 1] = first[S] = True  # a chunk starts outside a session or at its start
    last = np.zeros(n, bool)
    last[:G] = last[E] = True  # ... and ends outside one or at its end
    return label, trans, first, last


def viterbi_labels(log_probs: np.ndarray, min_gap: int = 1, min_len: int = 2,
                   short_gap_cost: float = math.inf) -> np.ndarray:
    """The most probable WELL-FORMED label sequence under per-step log-probabilities [T, 4].

    Per-step argmax lets one stray 1 or 3 split a session in two; this decoding only considers
    sequences that decode cleanly (see `_ALLOWED`), so a split must be paid for by both an end and
    a start label. With `min_gap` > 1 two sessions are either adjacent (3 -> 1: a user switch) or
    at least `min_gap` steps of no dialog apart: a pause shorter than that inside one person's
    conversation no longer splits it (a person change across a short pause is the identity split's
    job, `egomem.trigger.identity_split`). `min_len` keeps that pause from being decoded as a tiny
    session of its own between two adjacent ones. A finite `short_gap_cost` softens the gap rule:
    a gap of 1 .. `min_gap` - 1 steps costs that much log-probability instead of being impossible.
    The result is what `decode_sessions` expects.
    """
    lp = np.asarray(log_probs, dtype=np.float64)
    T = lp.shape[0]
    if T == 0:
        return np.zeros(0, np.int64)
    label, trans, first, last = _lattice(min_gap, min_len, short_gap_cost)  # trans [from, to]
    emit = lp[:, label]  # T, states
    score = np.where(first, emit[0], -np.inf)
    back = np.zeros((T, len(label)), np.int16)
    for t in range(1, T):
        cand = score[:, None] + trans  # from,to
        back[t] = cand.argmax(0)
        score = cand.max(0) + emit[t]
    state = int(np.where(last, score, -np.inf).argmax())
    out = np.empty(T, np.int64)
    for t in range(T - 1, -1, -1):
        out[t] = label[state]
        state = back[t, state]
    return out


PEAK_WEIGHT = 0.3  # in `refine_boundaries`, a step's own probability counts this much more than its neighbours'


def refine_boundaries(sessions: list[tuple[int, int]], log_probs: np.ndarray, window: int, search: int,
                      min_len: int = 2, min_gain: float = 0.0) -> list[tuple[int, int]]:
    """Move each decoded boundary to where the tagger puts the most start (end) probability within
    +-`window` steps, looking up to `search` steps either side of where the Viterbi path put it, when
    that window holds at least `min_gain` more of it than the window around the path's step.

    Viterbi places a start on one step, the most probable under its path; over noise the tagger's
    start probability spreads over a second or more around a user's first words (it hears them late),
    and the path's step is often its late end. A boundary is right when the true one lies within a
    few steps of it (span_match@5: 0.4 s), so the best place is the centre of the window holding the
    most probability mass (plus `PEAK_WEIGHT` times the step's own, so a sharp peak keeps its exact
    step over the flat top of its window). `min_gain` (a probability: the window's share of a start)
    leaves a boundary the path placed well where it is, so exact boundaries stay exact. Sessions
    keep their order, do not overlap and keep at least `min_len` steps; two adjacent sessions (a user
    switch) move their shared boundary together, scored by the end mass before it plus the start mass
    on it. `window` 0 returns `sessions` as given.
    """
    if window <= 0 or not sessions:
        return list(sessions)
    p = np.exp(np.asarray(log_probs, dtype=np.float64))  # T,4
    T = p.shape[0]
    box = np.ones(2 * window + 1)
    start_score = np.convolve(p[:, START], box, mode="same") + PEAK_WEIGHT * p[:, START]  # T
    end_score = np.convolve(p[:, END], box, mode="same") + PEAK_WEIGHT * p[:, END]  # T
    switch_score = start_score + np.concatenate([[0.0], end_score[:-1]])  # T: an end at c - 1 and a start at c
    out = [list(s) for s in sessions]

    def best(lo: int, hi: int, score: np.ndarray, keep: int) -> int:
        if lo > hi:
            return keep
        cand = np.arange(lo, hi + 1)
        c = int(cand[score[cand].argmax()])
        return c if score[c] > score[keep] + min_gain else keep

    for i, (a, b) in enumerate(out):  # starts (and the shared boundary of adjacent sessions)
        adjacent = i > 0 and out[i - 1][1] == a - 1
        floor = out[i - 1][0] + min_len if adjacent else (out[i - 1][1] + 2 if i > 0 else 0)  # a gap stays a gap
        lo, hi = max(floor, a - search), min(b - min_len + 1, a + search)
        if adjacent:
            c = best(lo, hi, switch_score, a)
            out[i - 1][1], out[i][0] = c - 1, c
        else:
            out[i][0] = best(lo, hi, start_score, a)
    for i, (a, b) in enumerate(out):  # ends not shared with a next session
        nxt = out[i + 1][0] if i + 1 < len(out) else T
        if nxt == b + 1:
            continue
        out[i][1] = best(max(a + min_len - 1, b - search), min(nxt - 2, b + search, T - 1), end_score, b)
    return [(a, b) for a, b in out]


def configured_decode(log_probs: np.ndarray, cfg: TriggerConfig, short_gap_cost: float | None = None,
                      boundary_window: int | None = None, boundary_min_gain: float | None = None) -> np.ndarray:
    """Per-step log-probabilities [T, 4] -> labels [T], decoded as the labeler decodes under a trigger
    config: `viterbi_labels` with its gap rule (`min_gap_steps`, `short_gap_cost` unless given) and
    minimum session length, then `refine_boundaries` (`boundary_window_steps` unless given, within
    `boundary_search_steps`, moving by at least `boundary_min_gain`). For whoever holds only
    log-probabilities (benchmarks, the trainer's eval)."""
    cost = cfg.short_gap_cost if short_gap_cost is None else short_gap_cost
    window = cfg.boundary_window_steps if boundary_window is None else boundary_window
    labels = viterbi_labels(log_probs, cfg.min_gap_steps, cfg.min_session_steps, cost)
    if window <= 0:
        return labels
    sessions = decode_sessions(labels, min_len=1)
    gain = cfg.boundary_min_gain if boundary_min_gain is None else boundary_min_gain
    refined = refine_boundaries(sessions, log_probs, window, cfg.boundary_search_steps, cfg.min_session_steps, gain)
    return sessions_to_labels(refined, len(labels))
