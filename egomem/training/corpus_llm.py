"""The corpus written by an LLM (paper §4.1 uses DeepSeek-V3) through the project's OpenAI-compatible
client (`egomem.memory.llm.LLMClient`, the [llm] config section), when an endpoint is configured.

The people still come from the template generator (`corpus.make_households`): held-out names,
relations and facts come from the held-out pools; the LLM only writes the dialogs around the
people it is given. Its answer must match `DIALOGS_SCHEMA` (`complete_json` retries, then raises
`LLMFailed` and parks the call in the dead-letter table when a store is given). Each dialog is
then checked against the household (`check_dialog`): a dialog that breaks a rule raises
`DialogRejected` with a short reason code; `make_llm_corpus` counts those reasons (or, strict,
re-raises). Nothing falls back to the template generator silently. Every dialog records
`llm:<model>`.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from egomem.memory.llm import LLMClient, LLMFailed, LLMNotConfigured
from egomem.memory.store import MemoryStore
from egomem.training.corpus import MAX_GREETING_CHARS, MAX_REPLY_CHARS, first_name, make_households
from egomem.training.types import Dialog, Household, Profile, Query, Split, Turn

STAGE = "corpus_dialogs"  # the LLM cache / dead-letter stage name

SYSTEM_PROMPT = f"""You write short spoken dialogs for training a voice assistant that remembers people.
The assistant sees the profile of the person in front of it (Level 1: name, facts, likes, people they know),
and can look up what it remembers about the people that person knows (Level 2) by first writing a query.
Answer with one JSON object and nothing else:
{{"dialogs": [{{"person": the first name of the person the assistant talks to, "level": 0, 1 or 2,
  "turns": [{{"user": what the person says ("" when the assistant speaks first), "reply": the assistant's answer,
             "level": 0, 1 or 2, "query": {{"relations": [...], "keywords": [...]}} or null,
             "names": [first names the reply states], "facts": [profile values the reply states, copied exactly]}}]}}]}}
Rules:
- Level-1 dialog: with any person of the household. Its first turn has "user": "" and a reply of at most
  {MAX_GREETING_CHARS} characters that greets the person by first name and mentions one of their facts
  ("Hi Ada! How is life in Lisbon?"). Later turns answer questions about that person's own profile.
- Level-2 dialog: with the main user only. A level-2 turn asks about someone the main user knows
  ("What does my sister like to eat?"); its query lists the relation exactly as given in the household
  (or [] when the question names no relation) and one to three lower-case keywords from the question
  (or [] when there are none); at least one of the two lists is non-empty. The reply names that person and
  states the fact ("Your sister Bea loves ramen.").
- Level-0 dialog: general requests that need no memory (arithmetic, everyday knowledge); query null,
  names and facts empty.
- Turns of level 0 and 1 have "query": null. Every reply has at most {MAX_REPLY_CHARS} characters: plain
  spoken English, no emoji, no lists.
- Use only the facts given. Never invent facts about the people."""

USER_PROMPT = """Household (the main user and the people they know, with how each relates to the main user):
{household}

Write {n1} level-1 dialogs, {n2} level-2 dialogs and {n0} level-0 dialogs, each of 1 to 3 turns."""

_STR = {"type": "string", "maxLength": 300}
_WORDS = {"type": "array", "maxItems": 8, "items": {"type": "string", "minLength": 1, "maxLength": 64}}
DIALOGS_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["dialogs"],
    "properties": {"dialogs": {"type": "array", "maxItems": 20, "items": {
        "type": "object", "required": ["person", "level", "turns"],
        "properties": {
            "person": {"type": "string", "minLength": 1, "maxLength": 100},
            "level": {"enum": [0, 1, 2]},
            "turns": {"type": "array", "maxItems": 8, "items": {
                "type": "object", "required": ["user", "reply", "level", "names", "facts"],
                "properties": {
                    "user": _STR, "reply": {"type": "string", "minLength": 1, "maxLength": 300},
                    "level": {"enum": [0, 1, 2]},
                    "query": {"type": ["object", "null"], "required": ["relations", "keywords"],
                              "properties": {"relations": _WORDS, "keywords": _WORDS}},
                    "names": _WORDS, "facts": _WORDS}}}}}}},
}


class DialogRejected(ValueError):
    """An LLM dialog that breaks a corpus rule; `reason` is a short code for the counts."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def configured_client(cfg: Any, store: MemoryStore | None = None) -> LLMClient | None:
    """The [llm] endpoint's client when its key is set, else None (the template generator is the default).
    `cfg`: the whole config; `store` keeps answers by prompt hash so a re-run replays them."""
    try:
        return LLMClient(cfg.llm, store)
    except LLMNotConfigured:
        return None


def household_for_prompt(h: Household) -> dict[str, Any]:
    def person(p: Profile) -> dict[str, Any]:
        return {"first_name": first_name(p), "name": p.name, "facts": list(p.facts),
                "likes": [t for pol, t in p.preferences if pol == "like"],
                "dislikes": [t for pol, t in p.preferences if pol == "dislike"], "summary": p.summary}
    rel = {e.other: e.relation for e in h.edges}
    return {"main_user": person(h.main), "people_they_know": [{"relation": rel[p.user_id], **person(p)} for p in h.related]}


def _texts(h: Household) -> list[str]:
    """Everything a reply may state as a fact: profile facts, preferences, summaries and relations."""
    out = [e.relation for e in h.edges]
    for p in (h.main, *h.related):
        out += [*p.facts, *(t for _, t in p.preferences), p.summary]
    return [t.lower() for t in out if t]


def _find(h: Household, name: str) -> Profile:
    key = name.strip().lower()
    for p in (h.main, *h.related):
        if key in (p.name.lower(), first_name(p).lower()):
            return p
    raise DialogRejected("unknown_person", f"{name!r} is nobody in household {h.main.user_id}")


def check_dialog(h: Household, d: dict[str, Any], generator: str) -> Dialog:
    """One schema-valid dialog of the answer -> a `Dialog`, or `DialogRejected` naming the broken rule."""
    person = _find(h, d["person"])
    turns_in = d["turns"]
    if not turns_in:
        raise DialogRejected("no_turns", "a dialog needs at least one turn")
    level = d["level"]
    if level == 2 and person is not h.main:
        raise DialogRejected("level2_not_main", f"level-2 dialogs are with the main user, not {person.name}")
    firsts = {first_name(p).lower() for p in (h.main, *h.related)}
    edges = {e.relation.lower() for e in h.edges}
    texts = _texts(h)
    turns = []
    for i, t in enumerate(turns_in):
        reply, where = t["reply"].strip(), f"turn {i} ({t['reply']!r})"
        limit = MAX_GREETING_CHARS if i == 0 and level == 1 else MAX_REPLY_CHARS
        if len(reply) > limit:
            raise DialogRejected("reply_too_long", f"{where}: {len(reply)} characters, at most {limit}")
        if t["level"] > level:
            raise DialogRejected("level_mismatch", f"{where}: turn level {t['level']} in a level-{level} dialog")
        for n in t["names"]:
            if n.strip().lower() not in firsts or n.strip().lower() not in reply.lower():
                raise DialogRejected("bad_name", f"{where}: name {n!r} is not a first name of this household stated "
                                                 "in the reply")
        for f in t["facts"]:
            if f.strip().lower() not in reply.lower() or not any(f.strip().lower() in x for x in texts):
                raise DialogRejected("bad_fact", f"{where}: fact {f!r} is not both in the reply and in the household")
        if t["level"] == 0 and (t["names"] or t["facts"]):
            raise DialogRejected("level0_uses_memory", f"{where}: a level-0 turn states no names or facts")
        q = t.get("query")
        query = None
        if t["level"] == 2:
            if not q or not (q["relations"] or q["keywords"]):
                raise DialogRejected("query_missing", f"{where}: a level-2 turn needs query words")
            query = Query(tuple(r.strip().lower() for r in q["relations"]),
                          tuple(k.strip().lower() for k in q["keywords"]))
            unknown = [r for r in query.relations if r not in edges]
            if unknown:
                raise DialogRejected("query_relation_not_an_edge", f"{where}: relations {unknown} are not edges "
                                                                    f"of the household ({sorted(edges)})")
        elif q:
            raise DialogRejected("query_on_level_0_1", f"{where}: only level-2 turns carry a query")
        turns.append(Turn(t["user"].strip(), reply, t["level"], query, tuple(n.strip() for n in t["names"]),
                          tuple(f.strip() for f in t["facts"])))
    if max(t.level for t in turns) != level:
        raise DialogRejected("level_mismatch", f"dialog level {level} but its highest turn level is "
                                               f"{max(t.level for t in turns)}")
    if level == 1:
        g, n = turns[0], first_name(person)
        own = [x.lower() for x in (*person.facts, *(t for _, t in person.preferences))]
        if g.user or n not in g.reply or not any(f.lower() in x for f in g.facts for x in own):
            raise DialogRejected("bad_greeting", f"a level-1 dialog opens with user '' and a reply naming {n} and "
                                                 f"stating one of their facts (facts={list(g.facts)}): {g.reply!r}")
    return Dialog(h.main.user_id, person.user_id, level, tuple(turns), generator, h.split)


def llm_dialogs(h: Household, client: LLMClient, n1: int = 2, n2: int = 2, n0: int = 1,
                strict: bool = False) -> tuple[list[Dialog], Counter[str]]:
    """Ask the LLM for one household's dialogs. Returns the dialogs that pass `check_dialog` and the
    reasons of those that did not (strict: the first `DialogRejected` is raised). `LLMFailed` (no
    schema-valid answer after the client's retries) always propagates."""
    household = json.dumps(household_for_prompt(h), indent=1, ensure_ascii=False)
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": USER_PROMPT.format(household=household, n1=n1, n2=n2, n0=n0)}]
    answer = client.complete_json(STAGE, messages, DIALOGS_SCHEMA)
    out: list[Dialog] = []
    rejected: Counter[str] = Counter()
    for d in answer.data["dialogs"]:
        try:
            out.append(check_dialog(h, d, f"llm:{answer.model}"))
        except DialogRejected as e:
            if strict:
                raise
            rejected[e.reason] += 1
    return out, rejected


def make_llm_corpus(n: int, split: Split, seed: int, client: LLMClient, strict: bool = False
                    ) -> tuple[list[Household], list[Dialog], Counter[str]]:
    """`n` households of `split` (the template generator's people) and the LLM's dialogs about them.
    The counter holds why dialogs were rejected and `llm_failed` per household with no valid answer
    (strict: raise instead)."""
    households = make_households(n, split, seed)
    dialogs: list[Dialog] = []
    rejected: Counter[str] = Counter()
    for h in households:
        try:
            ds, why = llm_dialogs(h, client, strict=strict)
        except LLMFailed:
            if strict:
                raise
            rejected["llm_failed"] += 1
            continue
        dialogs += ds
        rejected += why
    return households, dialogs, rejected
