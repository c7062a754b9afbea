"""The three supervision masks of the paper (Figure 4), cut from a `StreamLayout`.

Every sample sees the whole stream (all its dialogs, from frame 0) behind the same two MemChunks;
what differs is the MemChunk text in view and which frames' text and speak tokens the loss counts:

- **Level-1 response** (`l1_response`), one per dialog: L1 = the dialog's user's profile, L2 empty;
  supervised over that dialog only: from the start of its first turn (the user's audio, or the
  silence before the model opens) to where the model stops after its last reply
  (`TurnLayout.reply_end`: its text or audio, whichever ends later), so the model learns when to
  stay silent and when to speak as well as what to say. A stream of N dialogs gives N samples.
  When the dialog's last turn is in the sample, the silence after it is supervised too, up to the
  next dialog's start (the stream's end after the last dialog): the person is still the one in L1
  (serving writes the next profile only when someone new is recognised), and the model must stay
  silent there, not greet again or run on into the next dialog (`hold_ends`). General-instruction dialogs (level 0) give the same kind of sample: the profile
  is in view and the model must still answer normally. On a Level-2 dialog it covers the turns
  without query words (a reply that needs the relation graph is not trained without its L2).
- **Level-2 query words** (`l2_query`), one per Level-2 turn: the context the model had before the
  turn, L1 = the profile and L2 = what the dialog's previous Level-2 turn retrieved (else empty);
  supervised from the start of the user's audio to the end of the query words (text pad while the
  user speaks, then `<retr>:...<answer>`; the speak codebooks are supervised too: silence).
- **Level-2 response** (`l2_response`), one per Level-2 turn: L2 = `texts.l2(user, ground-truth
  query)`, the project's real Level-2 retrieval; supervised from the end of the query words to
  where the model stops (on the dialog's last turn: through the silence after it, as above).

So a stream gives (dialogs with a plain turn) + 2 * (Level-2 turns) samples, as the paper counts.
Spans are half-open dialog-frame ranges (`types.Span`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from egomem.training.streams import DialogLayout, StreamLayout, TurnLayout
from egomem.training.types import Dialog, Query, Sample, Span


class ChunkTexts(Protocol):
    """The MemChunk texts of the corpus's people (`egomem.training.memory_text.MemoryTexts`)."""

    def l1(self, user_id: str) -> str: ...

    def l2(self, user_id: str, query: Query) -> str: ...


def stream_samples(layout: StreamLayout, dialogs: Sequence[Dialog], texts: ChunkTexts,
                   meta: dict[str, Any] | None = None) -> list[Sample]:
    """All samples of one stream. `dialogs` is the corpus's dialog list (`DialogLayout.index` points into
    it); `meta` is added to every sample's meta (e.g. noised=False)."""
    out: list[Sample] = []
    holds = hold_ends(layout)
    for n, d in enumerate(layout.dialogs):
        dialog = dialogs[d.index]
        if dialog.user_id != d.user_id:
            raise ValueError(f"stream {layout.stream}: dialog {d.index} is {dialog.user_id!r}'s, "
                             f"the layout says {d.user_id!r}; pass the corpus the layout was built from")
        l1 = _text(texts.l1(d.user_id), "l1", d.user_id)
        base = {"voice": d.voice, "split": dialog.split, "level": dialog.level, "corpus_dialog": d.index,
                **(meta or {})}
        plain = [u for u in d.turns if dialog.turns[u.turn].query is None]
        last = d.turns[-1]
        if plain:
            spans = _runs(d, plain, holds[n])
            out.append(Sample(layout.stream, "l1_response", l1, "", spans, spans, n, plain[0].turn,
                              dialog.generator, base))
        retrieved = ""  # what the dialog's previous Level-2 turn put into L2
        for u in d.turns:
            query = dialog.turns[u.turn].query
            if query is None:
                continue
            assert u.query_start is not None and u.query_end is not None, u
            start = u.user_start if u.user_end > u.user_start else u.query_start
            m = {**base, "interrupted": u.interrupted}
            ask = (Span(start, u.query_end),)
            out.append(Sample(layout.stream, "l2_query", l1, retrieved, ask, ask, n, u.turn, dialog.generator, m))
            retrieved = _text(texts.l2(d.user_id, query), "l2", d.user_id)
            answer = (Span(u.query_end, holds[n] if u is last else u.reply_end),)
            out.append(Sample(layout.stream, "l2_response", l1, retrieved, answer, answer, n, u.turn,
                              dialog.generator, m))
    return out


def hold_ends(layout: StreamLayout) -> list[int]:
    """Per dialog, where the silence after its last reply ends: the next dialog's start, or the stream's
    end after the last one (a dialog's last supervised span runs to it)."""
    starts = [d.start for d in layout.dialogs[1:]] + [layout.n_steps]
    return [max(s, d.end) for d, s in zip(layout.dialogs, starts, strict=True)]


def _runs(d: DialogLayout, plain: list[TurnLayout], hold_end: int) -> tuple[Span, ...]:
    """One span per run of consecutive plain turns: from the run's first turn start to its last reply's end
    (to `hold_end` when that reply is the dialog's last turn)."""
    spans: list[Span] = []
    previous = None
    for u in plain:
        end = hold_end if u is d.turns[-1] else u.reply_end
        if previous is not None and d.turns.index(u) == d.turns.index(previous) + 1:
            spans[-1] = Span(spans[-1].start, end)
        else:
            spans.append(Span(u.user_start, end))
        previous = u
    return tuple(spans)


def _text(value: Any, which: str, user_id: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"MemChunk texts: {which}({user_id!r}) returned {type(value).__name__}, expected str")
    return value


def for_stream(samples: Sequence[Sample], stream: str, **meta: Any) -> list[Sample]:
    """The same samples on another stream of the same layout (e.g. its noised copy), meta updated."""
    return [replace(s, stream=stream, meta={**s.meta, **meta}) for s in samples]


def frame_mask(spans: Sequence[Span], n_steps: int) -> np.ndarray:
    """Bool [n_steps]: True on the frames the spans cover (what `forward.masked_loss` takes per row)."""
    m = np.zeros(n_steps, bool)
    for s in spans:
        if not 0 <= s.start <= s.end <= n_steps:
            raise ValueError(f"span [{s.start}, {s.end}) lies outside a {n_steps}-frame stream")
        m[s.start:s.end] = True
    return m


def count_kinds(samples: Sequence[Sample]) -> dict[str, int]:
    counts = {"l1_response": 0, "l2_query": 0, "l2_response": 0}
    for s in samples:
        counts[s.kind] += 1
    return counts
