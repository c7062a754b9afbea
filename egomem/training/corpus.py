"""The offline corpus generator (paper §4.1): people, relation graphs and dialogs from templates.

`make_households(n, split, seed)` draws a main user and 3-5 related people from the split's pools
(egomem/training/vocab.py: held-out names, relations and fact values never occur in training);
`make_dialogs(household, rng)` writes short dialogs about them:

- Level 1: the model opens (`Turn(user="")`) by greeting the recognised person by name with one of
  their profile facts ("Hi Ada! How is life in Lisbon?"), then answers questions the Level-1
  MemChunk (their rendered profile) answers ("Where do I live again?" -> "You live in Lisbon.").
- Level 2: questions about the main user's relation graph; each turn carries its ground-truth query
  (relation words, keywords; either group may be empty) and the reply the retrieved facts support
  ("What does my sister like to eat?" -> `Query(("sister",), ("eat", "food"))`, "Your sister Bea loves ramen.").
- Level 0: general instructions that need no memory ("What is two plus three?" -> "Five.").
- A return visit: the main user comes back for another Level-1 dialog (a greeting, 0-1 questions),
  so that a stream can hold the same person twice in a row, as the Level-2 dialogs make it do, and
  the model learns to greet a person again who comes back without anyone else in between.
  With `visit_asks` > 0 the return visit may end with a Level-2 question (`egomem demo`'s day 2: a
  greeting, then "What does my colleague do for work?"), so that a question about the relation graph
  also comes inside a visit that opened with a profile greeting, not only in dialogs of its own.

Replies stay short (the byte-level tiny model speaks ~1 byte per 80 ms step): at most
`MAX_REPLY_CHARS`, greetings at most `MAX_GREETING_CHARS`. Every dialog records `GENERATOR`.
Deterministic: the same arguments give byte-identical output on every machine (`random.Random`
seeded with strings, no set iteration).
"""

from __future__ import annotations

import random

from egomem.training.types import Dialog, Edge, Household, Profile, Query, Split, Turn
from egomem.training.vocab import FACT_KINDS, Pools, article, fact_kind, general_pairs, parse_fact, pools, words

GENERATOR = "template:v2"  # v2: the return visit (drawn last: v1's dialogs stay as they were)
MAX_REPLY_CHARS = 60  # ~5 s of text steps at one byte per 80 ms step
MAX_GREETING_CHARS = 40
OWN_QUESTIONS = (1, 2)  # questions about their own profile in the main user's Level-1 dialog (min, max)
RETURN_VISIT = 0.75  # chance of the main user's return visit (module docstring)
GRAPH_DIALOGS = 2  # Level-2 dialogs about the main user's relation graph per household
SUMMARY = "Talked about {}."  # how a summary line reads in the profile
_KIN_WORDS = frozenset(("sister brother mother father son daughter cousin aunt uncle grandmother grandfather niece "
                        "nephew twin mum dad grandma grandpa stepbrother stepsister").split())
_SPOUSES = frozenset("wife husband partner girlfriend boyfriend".split())

# kind -> greeting phrases after "Hi <name>! " ("{v}" value, "{a}" its article)
_GREETINGS: dict[str, tuple[str, ...]] = {
    "city": ("How is life in {v}?", "How is {v} today?"),
    "job": ("Busy day as {a} {v}?", "How is work as {a} {v}?"),
    "hobby": ("Any time for {v} lately?", "How is the {v} going?"),
    "pet": ("How is your {v}?", "How is your {v} doing?"),
    "sport": ("How is the {v} going?", "Played any {v} lately?"),
    "food": ("Had any {v} lately?", "Craving {v} today?"),
    "instrument": ("Still playing the {v}?", "How is the {v} going?"),
    "language": ("How is your {v}?", "Practising your {v}?"),
    "like": ("Enjoying some {v} lately?", "Still into {v}?"),
}
_OPENERS = ("Hi {n}!", "Hello {n}!", "Hey {n}!", "Good to see you, {n}!")

# kind -> (questions the user asks about themselves, reply)
_OWN: dict[str, tuple[tuple[str, ...], str]] = {
    "city": (("Where do I live again?", "Which city do I live in?", "Remind me where I live."), "You live in {v}."),
    "job": (("What do I do for work?", "What is my job again?"), "You work as {a} {v}."),
    "hobby": (("What is my hobby?", "What do I do for fun?"), "You enjoy {v}."),
    "pet": (("What pet do I have?", "Do I have a pet?"), "You have {a} {v}."),
    "sport": (("What sport do I play?", "Which sport do I play?"), "You play {v}."),
    "food": (("What is my favourite food?", "What do I love to eat?"), "Your favourite food is {v}."),
    "instrument": (("Which instrument do I play?", "What instrument do I play?"), "You play the {v}."),
    "school": (("Where did I study?", "Which school did I go to?"), "You studied at {v}."),
    "language": (("What language do I speak?", "Which language do I speak?"), "You speak {v}."),
    "like": (("Do I like {v}?",), "Yes, you like {v}."),
    "dislike": (("Do I like {v}?",), "No, you dislike {v}."),
    "summary": (("What did we talk about last time?", "What did we discuss before?"), "We talked about {v}."),
}

# questions about the user's name (reply with "{n}", their first name)
_NAME_QUESTIONS = (("What is my name?", "You are {n}."), ("Do you know who I am?", "Of course, you are {n}."))

# kind -> (questions about "my <r>", ground-truth keywords, reply); "{r}" relation, "{n}" their first name
_ABOUT: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "city": (("Where does my {r} live?", "Which city does my {r} live in?"), ("live", "city"),
             "Your {r} {n} lives in {v}."),
    "job": (("What does my {r} do for work?", "What is my {r}'s job?"), ("work", "job"),
            "Your {r} {n} works as {a} {v}."),
    "hobby": (("What is my {r}'s hobby?", "What does my {r} do for fun?"), ("hobby", "fun"),
              "Your {r} {n} enjoys {v}."),
    "pet": (("Does my {r} have a pet?", "What pet does my {r} have?"), ("pet",), "Your {r} {n} has {a} {v}."),
    "sport": (("What sport does my {r} play?",), ("sport",), "Your {r} {n} plays {v}."),
    "food": (("What does my {r} like to eat?", "What is my {r}'s favourite food?"), ("eat", "food"),
             "Your {r} {n} loves {v}."),
    "instrument": (("What instrument does my {r} play?",), ("instrument", "music"), "Your {r} {n} plays the {v}."),
    "school": (("Where did my {r} study?",), ("study", "school"), "Your {r} {n} studied at {v}."),
    "language": (("What language does my {r} speak?",), ("language",), "Your {r} {n} speaks {v}."),
    "dislike": (("Is there anything my {r} dislikes?", "What does my {r} dislike?"), ("dislike",),
                "Your {r} {n} dislikes {v}."),
}
# kind -> (question with the value, reply): Level-2 queries with an empty relation group (keywords = the value)
_WHO: dict[str, tuple[str, str]] = {
    "city": ("Who do I know in {v}?", "Your {r} {n} lives in {v}."),
    "job": ("Do I know {a} {v}?", "Yes, your {r} {n} works as {a} {v}."),
    "hobby": ("Who do I know that enjoys {v}?", "Your {r} {n} enjoys {v}."),
    "pet": ("Who do I know with {a} {v}?", "Your {r} {n} has {a} {v}."),
    "sport": ("Who do I know that plays {v}?", "Your {r} {n} plays {v}."),
    "food": ("Who do I know that loves {v}?", "Your {r} {n} loves {v}."),
    "instrument": ("Do I know anyone who plays the {v}?", "Yes, your {r} {n} plays the {v}."),
    "language": ("Who do I know that speaks {v}?", "Your {r} {n} speaks {v}."),
}


def first_name(p: Profile) -> str:
    return p.name.split()[0]


def _fill(template: str, **kw: str) -> str:
    v = kw.get("v", "")
    return template.format(a=article(v) if v else "", **kw)


def _contains(a: str, b: str) -> bool:
    """`b` occurs in `a` as whole words."""
    wa, wb = words(a), words(b)
    return any(wa[i:i + len(wb)] == wb for i in range(len(wa) - len(wb) + 1))


# ---------------------------------------------------------------------------- households


def _profile(rng: random.Random, pool: Pools, user_id: str, name: str, n_facts: int, n_prefs: int) -> Profile:
    kinds = rng.sample([k.name for k in FACT_KINDS], n_facts)
    facts = tuple(fact_kind(k).text(rng.choice(pool.facts[k])) for k in kinds)
    prefs = tuple(("like" if rng.random() < 0.65 else "dislike", p) for p in rng.sample(pool.preferences, n_prefs))
    return Profile(user_id, name, facts, prefs, SUMMARY.format(rng.choice(pool.summary_topics)))


def _relations(rng: random.Random, pool: Pools, k: int) -> list[str]:
    """k distinct relations, none inside another ("sister" and "sister's coworker" would make the
    ground-truth query ambiguous), and one spouse-like word at most ("wife" and "wife's sister" may
    meet, "wife" and "boyfriend's coworker" do not)."""
    out: list[str] = []
    while len(out) < k:
        core = pool.core_relations and rng.random() < 0.45  # held-out pools have no core words
        r = rng.choice(pool.core_relations if core else pool.relations)
        if fits_with(r, out):
            out.append(r)
    return out


def fits_with(relation: str, others: list[str]) -> bool:
    """`relation` may join a graph of `others`: none inside another, one spouse-like word at most (`_relations`)."""
    if any(_contains(relation, o) or _contains(o, relation) for o in others):
        return False
    return len({w for x in (*others, relation) for w in words(x)} & _SPOUSES) <= 1


def make_household(split: Split, seed: int, index: int, relation_words: Split | None = None) -> Household:
    """Household `index` of (split, seed): its own RNG, so any one can be made without the others.
    `relation_words`: the split whose relation pool the graph's relations come from (None: `split`'s own; "train"
    with a held-out split makes new people, names, facts and voices asked about relations a model was taught)."""
    pool = pools(split)
    relation_pool = pools(relation_words or split)
    rng = random.Random(f"egomem-households/{split}/{seed}/{index}")
    k = rng.randint(3, 5)
    firsts = rng.sample(pool.first_names, k + 1)
    surname = rng.choice(pool.surnames)
    uid = f"{split}-{seed}-{index}"
    main = _profile(rng, pool, f"{uid}-0", f"{firsts[0]} {surname}", 5, rng.randint(2, 3))
    related, edges = [], []
    for j, rel in enumerate(_relations(rng, relation_pool, k), start=1):
        kin = "'" not in rel and bool(set(words(rel)) & _KIN_WORDS)
        sur = surname if kin and rng.random() < 0.7 else rng.choice(pool.surnames)
        related.append(_profile(rng, pool, f"{uid}-{j}", f"{firsts[j]} {sur}", rng.randint(3, 4), rng.randint(1, 2)))
        edges.append(Edge(related[-1].user_id, rel))
    return Household(main, tuple(related), tuple(edges), split)


def make_households(n: int, split: Split, seed: int, relation_words: Split | None = None) -> list[Household]:
    """`n` households of `split` (names, relations, facts from that split's pools only; relations from
    `relation_words`' pool when given, `make_household`)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [make_household(split, seed, i, relation_words) for i in range(n)]


# ---------------------------------------------------------------------------- dialogs


def _items(p: Profile) -> list[tuple[str, str]]:
    """(kind, value) of everything in `p` a template can talk about."""
    out = [parsed for f in p.facts if (parsed := parse_fact(f))]
    out += [(pol, text) for pol, text in p.preferences]
    if p.summary.startswith(SUMMARY[:-3]) and p.summary.endswith("."):
        out.append(("summary", p.summary[len(SUMMARY) - 3:-1]))
    return out


def greeting(p: Profile, rng: random.Random) -> Turn:
    """The model's opening turn: the person's first name and one profile fact, <= MAX_GREETING_CHARS."""
    n = first_name(p)
    options = [(_fill(o, n=n) + " " + _fill(g, v=v), v) for kind, v in _items(p) for g in _GREETINGS.get(kind, ())
               for o in _OPENERS]
    if not options:
        raise ValueError(f"{p.user_id}: no fact a greeting template knows (facts {p.facts}, preferences "
                         f"{p.preferences}); give the person a fact such as 'lives in <city>'")
    short = [o for o in options if len(o[0]) <= MAX_GREETING_CHARS]
    reply, v = rng.choice(short) if short else min(options, key=lambda o: len(o[0]))
    return Turn("", reply, 1, None, (n,), (v,))


def fixed_questions() -> tuple[str, ...]:
    """The Level-1 questions whose words are the same for everyone ("Where do I live again?", not "Do I like
    jazz?" or "Who is Bea?"): what the listening drills' clip bank speaks once per voice (listen.py)."""
    return (*(q for qs, _ in _OWN.values() for q in qs if "{v}" not in q), *(q for q, _ in _NAME_QUESTIONS))


def own_turns(h: Household, p: Profile) -> list[Turn]:
    """Level-1 questions about `p` that `p`'s profile (the L1 MemChunk) answers."""
    out = []
    for kind, v in _items(p):
        qs, reply = _OWN[kind]
        out += [Turn(_fill(q, v=v), _fill(reply, v=v), 1, None, (), (v,)) for q in qs]
    n = first_name(p)
    out += [Turn(q, r.format(n=n), 1, None, (n,), ()) for q, r in _NAME_QUESTIONS]
    if p is h.main:  # the L1 profile lists the main user's people with their relation
        for e in h.edges:
            o = first_name(h.person(e.other))
            out.append(Turn(f"Who is {o}?", f"{o} is your {e.relation}.", 1, None, (o,), (e.relation,)))
    return [t for t in out if len(t.reply) <= MAX_REPLY_CHARS]


def _graph_turns(h: Household) -> list[Turn]:
    """Level-2 questions about the main user's related people, with their ground-truth queries."""
    out = []
    counts: dict[tuple[str, str], int] = {}
    for p in h.related:
        for kind, v in _items(p):
            counts[(kind, v.lower())] = counts.get((kind, v.lower()), 0) + 1
    for e in h.edges:
        p, r = h.person(e.other), e.relation
        n = first_name(p)
        for kind, v in _items(p):
            if kind in _ABOUT:
                qs, kw, reply = _ABOUT[kind]
                out += [Turn(_fill(q, r=r), _fill(reply, r=r, n=n, v=v), 2, Query((r,), kw), (n,), (v,)) for q in qs]
            if kind in _WHO and counts[(kind, v.lower())] == 1:  # the value names one person only
                q, reply = _WHO[kind]
                out.append(Turn(_fill(q, v=v), _fill(reply, r=r, n=n, v=v), 2, Query((), (v.lower(),)), (n,), (v,)))
        out.append(Turn(f"What is my {r}'s name?", f"Your {r} is {n}.", 2, Query((r,), ()), (n,), ()))
        facts = [(k, v) for k, v in _items(p) if k in _ABOUT and k != "dislike"]
        if facts:  # "tell me about": no keywords, so the answer is the neighbour's first stored item
            k, v = facts[0]
            tail = _fill(_ABOUT[k][2], r=r, n=n, v=v)
            out.append(Turn(f"Tell me about my {r}.", tail, 2, Query((r,), ()), (n,), (v,)))
    return [t for t in out if len(t.reply) <= MAX_REPLY_CHARS]


def relation_questions(relation: str) -> tuple[tuple[str, Query], ...]:
    """Every Level-2 question about "my <relation>" whose words (and so its ground-truth query) do not depend on
    who that person is: the name and "tell me about" questions (relation words only) and each `_ABOUT` question
    (relation words and the kind's keywords). What the query drills speak (query_drill.py)."""
    r = relation
    return ((f"What is my {r}'s name?", Query((r,), ())), (f"Tell me about my {r}.", Query((r,), ())),
            *((_fill(q, r=r), Query((r,), kw)) for qs, kw, _ in _ABOUT.values() for q in qs))


def _general(rng: random.Random) -> Turn:
    q, a = rng.choice(general_pairs())
    return Turn(q, a, 0)


def make_dialogs(household: Household, rng: random.Random, own_questions: tuple[int, int] = OWN_QUESTIONS,
                 return_visit: float = RETURN_VISIT, graph_dialogs: int = GRAPH_DIALOGS,
                 visit_asks: float = 0.0) -> list[Dialog]:
    """The dialogs of one household: Level 1 with the main user (a greeting, then `own_questions` (min, max)
    questions about their profile; some related people too), `graph_dialogs` Level-2 dialogs about the main
    user's relation graph, Level 0 general instructions, and maybe the main user's return visit (Level 1, or
    Level 2 when it ends with a relation-graph question: chance `visit_asks`)."""
    h, out = household, []

    def dialog(user: Profile, turns: list[Turn]) -> None:
        out.append(Dialog(h.main.user_id, user.user_id, max(t.level for t in turns), tuple(turns), GENERATOR, h.split))

    def pick(turns: list[Turn], k: int) -> list[Turn]:
        return rng.sample(turns, min(k, len(turns)))

    main_turns = [greeting(h.main, rng), *pick(own_turns(h, h.main), rng.randint(*own_questions))]
    dialog(h.main, main_turns + ([_general(rng)] if rng.random() < 0.25 else []))  # mixed with an instruction
    for p in h.related:
        if rng.random() < 0.5:
            dialog(p, [greeting(p, rng), *pick(own_turns(h, p), rng.randint(0, 1))])
    graph = _graph_turns(h)
    for _ in range(graph_dialogs):
        turns = pick(graph, rng.randint(1, 2))
        if turns:
            dialog(h.main, ([greeting(h.main, rng)] if rng.random() < 0.5 else []) + turns)
    if rng.random() < 0.6:
        dialog(h.main, [_general(rng) for _ in range(rng.randint(1, 2))])
    if rng.random() < return_visit:  # drawn last, so the dialogs above are those template:v1 wrote
        visit = [greeting(h.main, rng), *pick(own_turns(h, h.main), rng.randint(0, 1))]
        if visit_asks > 0 and rng.random() < visit_asks and graph:  # no draw at 0: template:v2's visits stay
            visit.append(rng.choice(graph))
        dialog(h.main, visit)
    return out


def make_corpus(n: int, split: Split, seed: int, own_questions: tuple[int, int] = OWN_QUESTIONS,
                return_visit: float = RETURN_VISIT, relation_words: Split | None = None,
                graph_dialogs: int = GRAPH_DIALOGS, visit_asks: float = 0.0
                ) -> tuple[list[Household], list[Dialog]]:
    """`n` households of `split` and all their dialogs (each household's dialogs from its own RNG;
    `return_visit` 0: the dialogs template:v1 wrote; `relation_words`: `make_household`; `graph_dialogs`,
    `visit_asks`: `make_dialogs`)."""
    if not 0 <= own_questions[0] <= own_questions[1]:
        raise ValueError(f"own_questions must be 0 <= min <= max, got {own_questions}")
    if graph_dialogs < 0 or not 0.0 <= visit_asks <= 1.0:
        raise ValueError(f"graph_dialogs must be >= 0 and visit_asks in [0, 1], got {graph_dialogs}, {visit_asks}")
    households = make_households(n, split, seed, relation_words)
    dialogs = [d for i, h in enumerate(households)
               for d in make_dialogs(h, random.Random(f"egomem-dialogs/{split}/{seed}/{i}"), own_questions,
                                     return_visit, graph_dialogs, visit_asks)]
    return households, dialogs
