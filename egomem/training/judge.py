"""Judging one dialog turn of `egomem eval-dialog` (paper Table 3): Fact Score and Answer Quality.

Fact Score is 0/1: the reply is personalised, consistent with the profile and makes no factual error.
Answer Quality is 1-5. Two judges:

- `LLMJudge`: the project's OpenAI-compatible endpoint (`egomem.memory.llm.LLMClient`), with the
  prompt `JUDGE_PROMPT` and the answer checked against `JUDGE_SCHEMA`; answers are cached by prompt
  hash in a SQLite memory store exactly as the memory agents' are, so a re-run asks nothing twice. A
  failed or invalid answer stops the evaluation (`JudgeError`); no score is ever made up for it.
- `RuleJudge`: offline and deterministic. It scores Fact Score only; Answer Quality is `None`
  ("not measured"). The rule, on normalised text (`norm`: NFKC, case-folded, every run of
  non-alphanumerics one space) with `contains(a, b)` = b occurs in a as whole tokens:

  Fact Score = 1 iff (the reply contains one of `Turn.names` OR one of `Turn.facts`)
                     AND the reply contradicts nothing, where it contradicts when it contains
    (N) a name form (full name or first name) of a corpus person that is not an allowed form: the forms
        of `Turn.names`, of the people they name and of the dialog's user; a form inside an allowed form
        the reply contains, or part of a true statement (below), is not counted;
    (F) a corpus statement (any person's fact, preference or summary text) that is not part of a true
        statement;
    (T) a typed value u (see `typed_values`) not part of a true statement, of a type that a true
        statement already has a value of: "a different value of the same fact type".
  True statements of a turn: the facts, preference and summary texts of the dialog's user and of the
  people `Turn.names` names (by full or first name), the relation words of the household's edges that
  touch one of them ("tennis coach" names no sport), plus `Turn.facts`. "Part of": contains(t, x) for
  some true statement t. A turn with neither names nor facts cannot be scored by this rule: its Fact
  Score is None. Not checked: preference polarity ("likes" vs "dislikes"), and whether a relation word
  the reply uses is the right one.

`query_scores` compares the model's parsed Level-2 query with `Turn.query`.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from egomem.memory.llm import LLMClient, LLMFailed, LLMNotConfigured
from egomem.memory.store import PROFILE_LINE_LABELS
from egomem.retrieval.query import RetrievalQuery

from .types import Dialog, Household, Profile, Query, Turn

NOT_MEASURED = "not measured"


class JudgeError(RuntimeError):
    """A turn could not be judged (the LLM endpoint failed or answered outside the schema)."""


@dataclass(frozen=True)
class TurnCase:
    """What a judge sees of one turn: the dialog, the turn, the model's reply, and the memory in view."""

    dialog: Dialog
    turn: Turn
    reply: str
    profile: str = ""  # the Level-1 MemChunk text of the dialog's user
    retrieved: str = ""  # Level-2 turns: what retrieval returns for the ground-truth query


@dataclass(frozen=True)
class Verdict:
    fact_score: int | None  # 0/1; None: this judge cannot score the turn
    answer_quality: int | None  # 1-5; None: not measured
    judge: str  # "rules" or "llm:<model>"
    reason: str = ""


class Judge(Protocol):
    name: str

    def judge(self, case: TurnCase) -> Verdict: ...


# ---------------------------------------------------------------------------- text matching

_NON_WORD = re.compile(r"[\W_]+")


def norm(text: str) -> str:
    """NFKC, case-folded, every run of non-alphanumerics one space, stripped."""
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def contains(haystack: str, needle: str) -> bool:
    """`needle` occurs in `haystack` as whole tokens (both already `norm`ed); an empty needle never does."""
    return bool(needle) and f" {needle} " in f" {haystack} "


_READ_OUT = re.compile(r"\b(?:" + "|".join(PROFILE_LINE_LABELS) + r"): ")


def reads_memchunk(reply: str) -> bool:
    """The reply says a Level-1 MemChunk line label ("fact: ", "likes: ", ... `PROFILE_LINE_LABELS`): the model
    reading its profile aloud, which no corpus reply does (session 52: the query-stage models do it, mostly at a
    returning person's greeting). Reported beside the Fact Score, which such a reply may still pass."""
    return bool(_READ_OUT.search(reply))


# ---------------------------------------------------------------------------- query words


@dataclass(frozen=True)
class QueryScore:
    precision: float
    recall: float
    exact: bool
    found: bool  # the model wrote a complete query at all
    relations_exact: bool  # the relation group alone equal as sets (who was asked about: heard and read)
    keywords_exact: bool  # the keyword group alone (what was asked: the question's kind, or its value)


def _words(relations: Iterable[str], keywords: Iterable[str]) -> set[tuple[str, str]]:
    return ({("relation", " ".join(r.lower().split())) for r in relations if r.strip()}
            | {("keyword", " ".join(k.lower().split())) for k in keywords if k.strip()})


def query_scores(parsed: RetrievalQuery | None, truth: Query) -> QueryScore:
    """Precision, recall and exact match of the query words, relations and keywords as two lower-case sets
    (a word counts only in its own group). An empty side: precision of no prediction is 0 unless the truth
    is empty too; recall of an empty truth is 1; exact means both groups equal as sets (and each group alone:
    `relations_exact`, `keywords_exact`, which a query not written never gets unless nothing was to be asked)."""
    pred = _words(parsed.relations, parsed.keywords) if parsed is not None else set()
    gold = _words(truth.relations, truth.keywords)
    hit = len(pred & gold)
    precision = hit / len(pred) if pred else float(not gold)
    recall = hit / len(gold) if gold else 1.0

    def group(g: str) -> bool:  # a query not written gets a group right only when nothing was to be asked
        return (parsed is not None or not gold) and {w for w in pred if w[0] == g} == {w for w in gold if w[0] == g}

    return QueryScore(precision, recall, pred == gold, parsed is not None, group("relation"), group("keyword"))


# ---------------------------------------------------------------------------- offline rule judge


def _statements(p: Profile) -> list[str]:
    return [norm(s) for s in (*p.facts, *(text for _, text in p.preferences), p.summary) if norm(s)]


def name_forms(p: Profile) -> tuple[str, ...]:
    """How a reply may name `p`: the full name and the first name (the dialogs greet by first name)."""
    full = norm(p.name)
    return (full, full.split()[0]) if " " in full else (full,)


def _by_name(people: Iterable[Profile]) -> dict[str, list[Profile]]:
    out: dict[str, list[Profile]] = defaultdict(list)
    for p in people:
        for form in name_forms(p):
            out[form].append(p)
    return out


def _people(households: Iterable[Household]) -> tuple[dict[str, Profile], dict[str, set[str]]]:
    """(user_id -> profile, household main id -> its members' user_ids)."""
    people, members = {}, {}
    for h in households:
        members[h.main.user_id] = {p.user_id for p in (h.main, *h.related)}
        people.update({p.user_id: p for p in (h.main, *h.related)})
    return people, members


def _named(by_name: Mapping[str, list[Profile]], members: Mapping[str, set[str]], dialog: Dialog,
           names: Iterable[str]) -> list[Profile]:
    """The people `names` name: in the dialog's household when someone there has that name, else anywhere."""
    out = []
    for n in names:
        found = by_name.get(norm(n), [])
        local = [p for p in found if p.user_id in members.get(dialog.household, ())]
        out += local or found
    return out


def typed_values(households: Iterable[Household], dialogs: Iterable[Dialog]) -> dict[str, set[str]]:
    """Fact value -> its types, learned from the dialogs: a turn's expected fact v found inside a fact f
    of the people in scope makes f with v cut out a type (e.g. "lives in {}" for v = "Oslo" in
    "lives in Oslo"); all values of one template are one type."""
    people, members = _people(households)
    by_name = _by_name(people.values())
    out: dict[str, set[str]] = defaultdict(set)
    for d in dialogs:
        for t in d.turns:
            scope = ([people[d.user_id]] if d.user_id in people else []) + _named(by_name, members, d, t.names)
            for v in map(norm, t.facts):
                for f in (s for p in scope for s in _statements(p)):
                    if f != v and contains(f, v):
                        out[v].add("template:" + f" {f} ".replace(f" {v} ", " {} ", 1).strip())
    return dict(out)


class RuleJudge:
    """The deterministic Fact Score of the module docstring over a corpus of households.

    `vocabulary` adds typed values the dialogs do not show (value -> type name, e.g. the corpus
    generator's {"Oslo": "city", "Paris": "city"}); `dialogs` teach `typed_values`."""

    name = "rules"

    def __init__(self, households: Iterable[Household], dialogs: Iterable[Dialog] = (),
                 vocabulary: Mapping[str, str] | None = None):
        households = list(households)
        self.people, self.members = _people(households)
        self.edges = {h.main.user_id: [(h.main.user_id, e.other, norm(e.relation)) for e in h.edges] for h in households}
        self.by_name = _by_name(self.people.values())
        self.statements = {s for p in self.people.values() for s in _statements(p)}
        self.types: dict[str, set[str]] = defaultdict(set)
        for v, ts in typed_values(households, dialogs).items():
            self.types[v] |= ts
        for v, t in (vocabulary or {}).items():
            if norm(v):
                self.types[norm(v)].add("type:" + norm(t))
        self.values_of: dict[str, set[str]] = defaultdict(set)
        for v, ts in self.types.items():
            for t in ts:
                self.values_of[t].add(v)
        self.templates = {t: re.compile(re.escape(t.removeprefix("template:")).replace(r"\{\}", r"(.+)"))
                          for t in self.values_of if t.startswith("template:")}

    def true_statements(self, dialog: Dialog, turn: Turn) -> list[str]:
        scope = [self.people[dialog.user_id]] if dialog.user_id in self.people else []
        scope += _named(self.by_name, self.members, dialog, turn.names)
        ids = {p.user_id for p in scope}
        relations = [r for a, b, r in self.edges.get(dialog.household, ()) if a in ids or b in ids]
        return [s for p in scope for s in _statements(p)] + relations + [norm(f) for f in turn.facts if norm(f)]

    def _holds_type(self, kind: str, true: list[str]) -> bool:
        if any(contains(t, v) for v in self.values_of[kind] for t in true):
            return True
        pattern = self.templates.get(kind)
        return pattern is not None and any(pattern.fullmatch(t) for t in true)

    def contradictions(self, dialog: Dialog, turn: Turn, reply: str) -> list[str]:
        """Why the reply contradicts the profile ((N), (F), (T) of the module docstring); [] when it does not."""
        r = norm(reply)
        true = self.true_statements(dialog, turn)
        part_of_truth = lambda x: any(contains(t, x) for t in true)  # noqa: E731
        allowed = {norm(n) for n in turn.names}
        allowed |= {f for p in _named(self.by_name, self.members, dialog, turn.names) for f in name_forms(p)}
        if dialog.user_id in self.people:
            allowed |= set(name_forms(self.people[dialog.user_id]))
        said = [a for a in allowed if contains(r, a)]
        out = [f"names {n!r}, who is not who this turn is about" for n in sorted(self.by_name)
               if n not in allowed and contains(r, n) and not any(contains(a, n) for a in said)
               and not part_of_truth(n)]
        out += [f"states {s!r}, which is someone else's" for s in sorted(self.statements)
                if contains(r, s) and not part_of_truth(s)]
        for v in sorted(self.types):
            if contains(r, v) and not part_of_truth(v):
                kinds = [k for k in sorted(self.types[v]) if self._holds_type(k, true)]
                if kinds:
                    out.append(f"states {v!r}, a different value of {kinds[0].split(':', 1)[1]!r}")
        return out

    def judge(self, case: TurnCase) -> Verdict:
        turn, r = case.turn, norm(case.reply)
        if not turn.names and not turn.facts:
            return Verdict(None, None, self.name, "the turn names no person and no fact to check")
        named = [n for n in turn.names if contains(r, norm(n))]
        stated = [f for f in turn.facts if contains(r, norm(f))]
        wrong = self.contradictions(case.dialog, turn, case.reply)
        if wrong:
            return Verdict(0, None, self.name, "; ".join(wrong))
        if not named and not stated:
            return Verdict(0, None, self.name, "names neither the person nor the fact expected")
        return Verdict(1, None, self.name, "states " + ", ".join(repr(x) for x in named + stated))


# ---------------------------------------------------------------------------- LLM judge

JUDGE_PROMPT = """\
You grade one reply of a spoken dialog assistant that has a memory of the people it talks to.
You get, as JSON: the profile of the user the assistant is talking to (its Level-1 memory), the facts \
its memory retrieved about the user's relations (Level-2, may be empty), the user's words, a reference \
reply, the names and facts a good reply states, and the assistant's reply.

Answer with one JSON object and nothing else:
{"fact_score": 0 or 1, "answer_quality": 1 to 5, "reason": "<one sentence>"}

fact_score is 1 only if all of these hold:
- the reply is personalised: it names the right person or states the expected fact;
- it is consistent with the profile and the retrieved facts;
- it states nothing factually wrong about the user or their relations (a wrong name, a fact that \
belongs to someone else, a different value of a known fact).
Otherwise fact_score is 0. An empty or unintelligible reply scores 0.

answer_quality grades the reply as an answer to the user's words, whatever the memory says:
5 complete, natural and helpful; 4 good with small flaws; 3 acceptable; 2 poor (off-topic, very \
incomplete or clumsy); 1 no answer, gibberish or harmful.
"""

JUDGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["fact_score", "answer_quality", "reason"],
    "additionalProperties": False,
    "properties": {
        "fact_score": {"type": "integer", "enum": [0, 1]},
        "answer_quality": {"type": "integer", "minimum": 1, "maximum": 5},
        "reason": {"type": "string", "maxLength": 1000},
    },
}


class LLMJudge:
    """Fact Score and Answer Quality from the LLM endpoint; answers cached in the client's store."""

    def __init__(self, client: LLMClient):
        self.client = client
        self.name = f"llm:{client.model}"

    @staticmethod
    def messages(case: TurnCase) -> list[dict[str, str]]:
        t = case.turn
        body = {"profile": case.profile, "retrieved": case.retrieved, "user_says": t.user,
                "reference_reply": t.reply, "expected_names": list(t.names), "expected_facts": list(t.facts),
                "assistant_reply": case.reply}
        return [{"role": "system", "content": JUDGE_PROMPT},
                {"role": "user", "content": json.dumps(body, ensure_ascii=False, indent=1)}]

    def judge(self, case: TurnCase) -> Verdict:
        try:
            answer = self.client.complete_json("judge", self.messages(case), JUDGE_SCHEMA,
                                               user_id=case.dialog.user_id)
        except LLMFailed as e:
            raise JudgeError(f"the LLM judge could not grade a turn of {case.dialog.user_id!r}: {e}. "
                             f"No score is made up: fix the endpoint ([llm] in the config), or judge with "
                             f"--judge rules") from e
        d = answer.data
        return Verdict(int(d["fact_score"]), int(d["answer_quality"]), self.name, str(d["reason"]))


def make_judge(kind: str, llm_cfg: Any, households: Iterable[Household], dialogs: Iterable[Dialog],
               cache: Path | None = None, vocabulary: Mapping[str, str] | None = None) -> Judge:
    """`kind` "rules", "llm", or "auto" (the LLM when its key variable is set, else the rules). The LLM's
    answers are cached in a SQLite memory store at `cache` (None: not cached)."""
    if kind not in ("auto", "rules", "llm"):
        raise ValueError(f"unknown judge {kind!r}: choose auto, rules or llm")
    if kind == "rules" or (kind == "auto" and not os.environ.get(llm_cfg.api_key_env)):
        return RuleJudge(households, dialogs, vocabulary)
    store = None
    if cache is not None:
        from egomem.memory.sqlite import SQLiteMemoryStore  # the memory agents' answer cache (llmcache.py)

        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        store = SQLiteMemoryStore(Path(cache))
    try:
        return LLMJudge(LLMClient(llm_cfg, store))
    except LLMNotConfigured as e:
        raise LLMNotConfigured(f"--judge llm: {e} (or use --judge rules for the offline Fact Score)") from e
