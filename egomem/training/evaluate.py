"""`egomem eval-dialog` (paper Table 3): how well a dialog model uses its MemChunks, on held-out streams.

`evaluate` drives the real `DialogEngine` through `DialogStreamPool`, the code `dialog_lm` serves with:
per stream one sequence (START opens a slot, END frees it), one batched tick per frame over all the
streams under evaluation, the user's listen codes of the held-out stream (clean or noised) fed frame by
frame. Memory enters as the orchestrator puts it there: when a dialog starts, an L1 refresh with the
dialog user's profile (`MemoryTexts.l1`; identification is not evaluated: the user is known; the refresh
clears L2, as every training sample's dialog starts with L2 empty); when the model's text channel holds a complete query
(`parse_query`, looked for whenever a piece holds ">"), the real Level-2 retrieval with the PARSED query
(`MemoryTexts.l2`) and an L2 refresh before the next tick. The empty-MemChunk peer writes nothing.

A turn's reply is the model's decoded text from the end of the user's audio (for a greeting: the frame
its dialog's L1 refresh is written, since the model may open as soon as it knows who is there; for the same
person's next dialog, whose refresh rewrites the same L1, the end of the dialog before: `greeting_opens`) until
the next user turn starts, at most `reply_frames` frames, with any `<retr>...<answer>` cut out; the judge
(judge.py) scores it. Beside it the judge scores the held-out stream's own text channel over the same window
(`reference`: the ceiling, below 1 where an interruption cuts a reply before its fact) and the model's Fact
Score on the turns the reference passes (`reachable`). Level-2 turns also score the first query the model
wrote between the start of the user's audio and the end of that window. Level-1 figures come also `by_person`:
the stream's first person, a new person later (an L1 refresh), the same person's next dialog (none); and
`by_snr_db`: per 5 dB band of the background SNR to the user's speech of the stream's noised copy (the layout's
`noise_snr_db`), in the clean condition too (the same streams without it: the pair, band by band).

The command around it (held-out people -> dialogs -> streams, models x conditions, throughput, the
JSON report and PNG) is egomem/training/eval_dialog.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from moshi.models.lm import LMModel

from egomem.dialog.engine import DialogEngine
from egomem.dialog.memchunk_text import fit
from egomem.dialog.serving import DialogRequest, DialogResult, DialogStreamPool
from egomem.dialog.tokenizer import TextTokenizer
from egomem.retrieval.query import RetrievalQuery, parse_query

from .judge import NOT_MEASURED, Judge, TurnCase, query_scores, reads_memchunk
from .streams import Stream, StreamLayout, dialog_persons
from .types import Dialog, Query

TEXT, LISTEN = 0, slice(9, 17)  # the text row and the listen rows of the aligned 17-row stream
SNR_BAND_DB = 5  # Level 1 also per band of this many dB of the noised copy's background SNR (`by_snr_db`)
_QUERY_MARKUP = re.compile(r"<retr>.*?(<answer>|$)", re.S)


class EvalError(RuntimeError):
    """The evaluation cannot run on this input; the message says what to change."""


class MemorySource(Protocol):
    """What the memory holds for a user: the Level-1 profile text and the Level-2 text for a query."""

    def l1(self, user_id: str) -> str: ...

    def l2(self, user_id: str, query: Query) -> str: ...


def fit_tokens(tokenizer: TextTokenizer, text: str, cap: int) -> tuple[list[int], bool]:
    """`text` cut to `cap` MemChunk steps as serving cuts it (`memchunk_text.fit`), as token ids; and whether
    anything was cut."""
    kept = fit(text, cap)
    return tokenizer.encode(kept), kept != text


def decode(tokenizer: TextTokenizer, ids: Sequence[int]) -> str:
    """Text of text-channel ids, without warm-up (-2), end-of-padding (0) and text pad."""
    return tokenizer.decode([i for i in ids if i > 0 and i != tokenizer.pad_id])


def strip_queries(text: str) -> str:
    """The reply without `<retr>...<answer>` query markup (an unfinished query to the end is cut too)."""
    return " ".join(_QUERY_MARKUP.sub(" ", text).split())


@dataclass
class _Run:
    """One stream under evaluation: its schedule of L1 refreshes and what the model wrote."""

    sid: int
    stream: Stream
    listen: np.ndarray  # [8, T] int64
    l1_at: dict[int, str]  # frame -> user whose profile is written before that frame's tick
    texts: list[int] = field(default_factory=list)  # text id per frame (-2 while warming up)
    queries: list[tuple[int, RetrievalQuery]] = field(default_factory=list)  # (frame, parsed query)
    channel: str = ""  # text pieces since the last query found (the orchestrator's QueryDetector)
    user: str | None = None
    pending_l2: list[int] | None = None

    @property
    def n(self) -> int:
        return self.listen.shape[1]


def _engine(lm_or_engine: LMModel | DialogEngine, batch: int, l1_steps: int, l2_steps: int) -> DialogEngine:
    if isinstance(lm_or_engine, DialogEngine):
        return lm_or_engine
    return DialogEngine(lm_or_engine, max_streams=batch, l1_steps=l1_steps, l2_steps=l2_steps)


def _condition_frames(stream: Stream, noised: bool) -> np.ndarray:
    tokens = stream.noised if noised else stream.tokens
    if tokens is None:
        raise EvalError(f"stream {stream.layout.stream} has no noised copy: build the streams with noised=True, "
                        f"or evaluate the clean condition only")
    return np.asarray(tokens[LISTEN], dtype=np.int64)


@torch.no_grad()
def evaluate(lm_or_engine: LMModel | DialogEngine, tokenizer: TextTokenizer, dialogs: Sequence[Dialog],
             streams: Sequence[Stream], memory: MemorySource, judge: Judge, noised: bool = False,
             use_memory: bool = True, batch: int = 8, reply_frames: int = 250, l1_steps: int = 512,
             l2_steps: int = 256, max_query_chars: int = 2000, seed: int = 0,
             new_person: str = "swap", draws: int = 1) -> dict[str, Any]:
    """Run held-out `streams` (their dialogs: `dialogs[DialogLayout.index]`) through the engine and judge
    each Level-1 and Level-2 turn (module docstring). `use_memory=False` is the empty-MemChunk peer. An engine
    is used as it is (its free slots step together); for an LMModel one is built (`batch`, `l1_steps`, `l2_steps`).
    A sampling engine (temperature > 0) draws from torch's generator, seeded here with `seed` (in a fork of its
    state): a run repeats. `draws` > 1 decodes every stream that many times (seeds `seed`, `seed` + 1, ...):
    the figures pool all draws' turns (each record names its `draw`), `per_draw` gives each draw's own.
    `new_person` as `[dialog] new_person`: "restart" opens the stream afresh (START) with the L1 of each dialog
    whose person differs from the previous dialog's, as the orchestrator then does.
    Returns the condition's report: Fact Scores, query-word scores, Answer Quality and per-turn records."""
    if draws < 1:
        raise EvalError(f"draws must be at least 1, got {draws}")
    engine = _engine(lm_or_engine, batch, l1_steps, l2_steps)
    pool = DialogStreamPool(engine, tokenizer, ttl_s=float("inf"))
    n1, n2 = engine.cache.n1, engine.cache.n2
    width = len(engine.free)
    if width == 0:
        raise EvalError("the engine has no free stream slot: close its streams or pass an LMModel")
    stats = {"l1_writes": 0, "l2_writes": 0, "l1_cut": 0, "l2_cut": 0, "frames": 0}
    records, per_draw, seconds = [], [], 0.0
    cuda = [engine.device] if torch.device(engine.device).type == "cuda" else []
    for k in range(draws):
        runs = []
        for i, s in enumerate(streams):
            l1_at = {(0 if j == 0 else d.start): d.user_id for j, d in enumerate(s.layout.dialogs)}
            runs.append(_Run(i + 1, s, _condition_frames(s, noised), l1_at))
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=cuda):  # seeded draws; the caller's generator state is left as it was
            torch.manual_seed(seed + k)
            try:
                for g in range(0, len(runs), width):
                    _drive(pool, runs[g:g + width], memory, tokenizer, use_memory, n1, n2, max_query_chars, stats,
                           new_person == "restart")
            finally:  # a failed run leaves no slot taken (END frees them when all goes well)
                for r in runs:
                    pool.close(r.sid)
        seconds += time.perf_counter() - t0
        # the background SNR of the stream's noised copy; clean, the same streams without it: the pair per band
        drawn = [rec | ({"draw": k} if draws > 1 else {}) | _snr(run.stream.layout) for run in runs
                 for rec in _judge_stream(run, dialogs, memory, judge, tokenizer, reply_frames)]
        records += drawn
        if draws > 1:  # the pooled figures below, and each draw's own beside them
            figures = _aggregate(drawn)
            per_draw.append({"seed": seed + k, "l1": figures["l1"]["fact_score"], "l2": figures["l2"]["fact_score"]})
    report = _aggregate(records)
    if per_draw:
        report["per_draw"] = per_draw
    report.update(noised=noised, memory=use_memory, judge=judge.name, temperature=engine.temperature,
                  start_temperature=engine.start_temperature, seed=seed, draws=draws,
                  new_person=new_person,
                  streams=len(streams), frames=stats["frames"],
                  loop_frames_per_s=stats["frames"] / seconds if seconds else None, writes=stats, turns=records)
    return report


def _drive(pool: DialogStreamPool, runs: list[_Run], memory: MemorySource, tokenizer: TextTokenizer,
           use_memory: bool, n1: int, n2: int, max_query_chars: int, stats: dict[str, int], restart: bool) -> None:
    """Tick a group of streams (one pool step per frame) to their ends, as `dialog_lm` serves them; `restart`:
    a new person's L1 restarts the stream (the old stream's last `max_delay` aligned frames are never emitted:
    the restarted one's warm-up, -2, takes their place, as when served)."""
    delay = pool.engine.max_delay
    for t in range(max(r.n for r in runs)):
        live = [r for r in runs if t < r.n]
        requests = []
        for r in live:
            req = DialogRequest(r.sid, start=t == 0, end=t == r.n - 1, listen=r.listen[:, t])
            if t in r.l1_at:
                req.start = req.start or (restart and r.l1_at[t] != r.user)  # serving restarts for a new person
                r.user, r.pending_l2 = r.l1_at[t], None  # a new L1 clears L2 (and any refill on its way)
                if use_memory:
                    ids, cut = fit_tokens(tokenizer, memory.l1(r.user), n1)
                    req.memchunk_level, req.memchunk_tokens = 1, np.asarray(ids, np.int64)
                    stats["l1_writes"] += 1
                    stats["l1_cut"] += cut
            elif r.pending_l2 is not None:
                req.memchunk_level, req.memchunk_tokens = 2, np.asarray(r.pending_l2, np.int64)
                r.pending_l2 = None
                stats["l2_writes"] += 1
            requests.append(req)
        for r, res in zip(live, pool.serve(requests), strict=True):
            if not isinstance(res, DialogResult):
                raise EvalError(f"stream {r.stream.layout.stream}, frame {t}: the dialog pool refused the tick: {res}")
            stats["frames"] += 1
            if t >= delay:
                r.texts.append(res.text_token)  # aligned output of tick t is text frame t - max_delay
            r.channel = (r.channel + res.text_piece)[-4000:]
            if ">" not in res.text_piece:
                continue
            query = parse_query(r.channel, max_query_chars)
            if query is None:
                continue
            r.channel = ""
            r.queries.append((t - delay, query))
            if use_memory and r.user is not None:
                ids, cut = fit_tokens(tokenizer, memory.l2(r.user, Query(query.relations, query.keywords)), n2)
                r.pending_l2 = ids
                stats["l2_cut"] += cut


def greeting_opens(layout: StreamLayout, persons: Sequence[str], n: int) -> int:
    """The first frame of dialog `n`'s greeting window: where the model can first know a conversation opens.
    For the stream's first person and a new person, their L1 write (frame 0, the dialog's start: _Run.l1_at).
    The same person's next dialog rewrites their L1 as it was (L2 emptied): nothing marks its start but the
    silence after the previous dialog, whose length (StreamSpec.dialog_gap) the model cannot know, so the
    window opens where that dialog ended; the previous turn's window still runs to this dialog's start (the two
    share the silence between them). `persons`: `dialog_persons(layout)`."""
    if persons[n] == "first":
        return 0
    return layout.dialogs[n - 1].end if persons[n] == "same" else layout.dialogs[n].start


def _judge_stream(run: _Run, dialogs: Sequence[Dialog], memory: MemorySource, judge: Judge,
                  tokenizer: TextTokenizer, reply_frames: int) -> list[dict[str, Any]]:
    layout = run.stream.layout
    starts = [u.user_start for d in layout.dialogs for u in d.turns] + [layout.n_steps]
    out, k = [], 0
    persons = dialog_persons(layout)  # first / new / same: the by_person split
    for n, d in enumerate(layout.dialogs):
        dialog = dialogs[d.index]
        if dialog.user_id != d.user_id:
            raise EvalError(f"stream {layout.stream}: dialog {d.index} is {dialog.user_id!r}'s, the layout says "
                            f"{d.user_id!r}: pass the dialog list the streams were built from")
        profile = memory.l1(dialog.user_id)
        for u in d.turns:
            k += 1
            turn = dialog.turns[u.turn]
            if turn.level == 0:
                continue
            a = u.user_end if turn.user.strip() else greeting_opens(layout, persons, n)
            b = min(starts[k], a + reply_frames)
            reply = strip_queries(decode(tokenizer, run.texts[a:b]))
            retrieved = memory.l2(dialog.user_id, turn.query) if turn.query is not None else ""
            v = judge.judge(TurnCase(dialog, turn, reply, profile, retrieved))
            # the ceiling: the held-out stream's own text channel over the same window, judged alike (a reply
            # the next user turn interrupts may end before its fact: no model can score that turn)
            reference = strip_queries(decode(tokenizer, run.stream.tokens[TEXT, a:b].tolist()))
            ref = judge.judge(TurnCase(dialog, turn, reference, profile, retrieved))
            rec: dict[str, Any] = {"stream": layout.stream, "dialog": d.index, "person": persons[n], "turn": u.turn,
                                   "level": turn.level, "greeting": not turn.user.strip(), "frames": [a, b], "reply": reply, "fact_score": v.fact_score,
                                   "answer_quality": v.answer_quality, "reason": v.reason,
                                   "reads_memchunk": reads_memchunk(reply),
                                   "expected": {"names": list(turn.names), "facts": list(turn.facts)},
                                   "reference": {"reply": reference, "fact_score": ref.fact_score}}
            if turn.level == 2 and turn.query is not None:
                at, query = next(((f, q) for f, q in run.queries if u.user_start <= f < b), (None, None))
                qs = query_scores(query, turn.query)
                rec["query"] = None if query is None else {"relations": list(query.relations),
                                                           "keywords": list(query.keywords),
                                                           # frame its last byte was written, from the end of the
                                                           # question's audio (negative: before it ended)
                                                           "frames_after_question": at - u.user_end}
                rec["query_scores"] = {"precision": qs.precision, "recall": qs.recall, "exact": qs.exact,
                                       "found": qs.found, "relations_exact": qs.relations_exact,
                                       "keywords_exact": qs.keywords_exact}
            out.append(rec)
    return out


def _snr(layout: StreamLayout) -> dict[str, float]:
    return {"snr_db": layout.meta["noise_snr_db"]} if "noise_snr_db" in layout.meta else {}


def _snr_band(snr_db: float) -> int:
    """The lower edge of the SNR_BAND_DB-wide band holding `snr_db`."""
    return int(snr_db // SNR_BAND_DB) * SNR_BAND_DB


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for level in (1, 2):
        rs = [r for r in records if r["level"] == level]
        scored = [r["fact_score"] for r in rs if r["fact_score"] is not None]
        out[f"l{level}"] = {"fact_score": _mean(scored), "n": len(scored), "unjudged": len(rs) - len(scored)}
        # the reference's own Fact Score (the ceiling), and the model's on the turns the reference scores
        judged = [r for r in rs if r["fact_score"] is not None and r["reference"]["fact_score"] is not None]
        out[f"l{level}"]["reference"] = {"fact_score": _mean([r["reference"]["fact_score"] for r in judged]),
                                         "n": len(judged)}
        reachable = [r["fact_score"] for r in judged if r["reference"]["fact_score"] == 1]
        out[f"l{level}"]["reachable"] = {"fact_score": _mean(reachable), "n": len(reachable)}
    def value(r: dict[str, Any], k: str) -> Any:
        return _snr_band(r["snr_db"]) if k == "snr_band" else r[k]

    def l1(**match: Any) -> dict[str, Any]:
        scored = [r["fact_score"] for r in records if r["level"] == 1 and r["fact_score"] is not None
                  and all(value(r, k) == v for k, v in match.items())]
        return {"fact_score": _mean(scored), "n": len(scored)}

    parts = (("greetings", True), ("answers", False))  # L1: the model's opening vs its answers
    out["l1"].update({part: l1(greeting=g) for part, g in parts})
    out["l1"]["by_person"] = {who: {part: l1(person=who, greeting=g) for part, g in parts}
                              for who in ("first", "new", "same")}
    snrs = [r.get("snr_db") for r in records if r["level"] == 1]
    if snrs and all(v is not None for v in snrs):  # per 5 dB band of the (noised copy's) background SNR
        bands = sorted({_snr_band(v) for v in snrs})
        out["l1"]["by_snr_db"] = {
            f"{lo:g}-{lo + SNR_BAND_DB:g}": {"all": l1(snr_band=lo), **{part: l1(snr_band=lo, greeting=g)
                                                                      for part, g in parts}}
            for lo in bands}
    read = [r["reads_memchunk"] for r in records if r["level"] == 1]
    out["l1"]["read_outs"] = {"share": _mean([float(x) for x in read]), "n": sum(read)}  # `judge.reads_memchunk`
    qs = [r["query_scores"] for r in records if "query_scores" in r]
    out["l2"]["query"] = {"precision": _mean([q["precision"] for q in qs]), "recall": _mean([q["recall"] for q in qs]),
                          **{k: _mean([float(q[k]) for q in qs])
                             for k in ("exact", "found", "relations_exact", "keywords_exact")},
                          "n": len(qs)}
    aq = [r["answer_quality"] for r in records if r["answer_quality"] is not None]
    out["answer_quality"] = {"mean": _mean(aq), "n": len(aq)} if aq else NOT_MEASURED
    return out


# ---------------------------------------------------------------------------- the command
