"""`egomem eval-dialog`: the offline rule judge on hand-written replies, query-word scores, the LLM judge
against a local OpenAI-protocol server (validated, cached, never a made-up score), and `evaluate` driving
the real DialogEngine through the dialog pool on hand-made streams: with a tiny random model, and with a
tiny model whose weights are set by hand so its text channel writes a known script (greeting, query, reply)
from the listen codes, so every figure of the report is known in advance."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import test_config
from llm_server import FakeOpenAIServer

from egomem.config import load_config
from egomem.dialog import DialogEngine
from egomem.dialog.checkpoint import build_lm
from egomem.dialog.memchunk_text import fit
from egomem.dialog.tokenizer import ByteTokenizer
from egomem.memory.llm import LLMClient
from egomem.memory.sqlite import SQLiteMemoryStore
from egomem.retrieval.query import RetrievalQuery, parse_query
from egomem.training.corpus import make_corpus
from egomem.training.dataset import Dataset, write_dataset
from egomem.training.eval_dialog import _print_row, add_eval_args, fact_vocabulary, load_people, main, run_eval
from egomem.training.evaluate import EvalError, evaluate
from egomem.training.judge import JudgeError, LLMJudge, RuleJudge, TurnCase, make_judge, query_scores
from egomem.training.memory_text import MemoryTexts
from egomem.training.streams import DialogLayout, Stream, StreamLayout, TurnLayout, noise_draw
from egomem.training.throughput import ServedTickError, served_fps
from egomem.training.types import Dialog, Edge, Household, Profile, Query, Turn, to_json

CARD = 48  # listen codes 0..47 (the scripted model needs card + 1 <= dim orthonormal embeddings)
TINY = dict(dim=64, num_heads=2, num_layers=2, card=CARD, text_card=260, context=64, depformer_dim=32,
            depformer_dim_feedforward=64, depformer_num_heads=2, depformer_num_layers=1)
TOK = ByteTokenizer()

ADA = Profile("ada", "Ada Stone", ("lives in Oslo", "works as a nurse"), (("like", "knitting"),), "Talked about boats.")
BEA = Profile("bea", "Bea Stone", ("plays tennis", "lives in Rome"), (("like", "jazz"),))
CYD = Profile("cyd", "Cyd Marsh", ("has a parrot", "works as a baker"), (("like", "green tea"),))
HOME = Household(ADA, (BEA, CYD), (Edge("bea", "sister"), Edge("cyd", "coworker")), "heldout")
HOUSE_TRAIN = Household(ADA, (BEA, CYD), HOME.edges)  # as a people JSONL line may come: split "train"
SISTER_Q = Query(("sister",), ("play",))
DIALOGS = [
    Dialog("ada", "ada", 1, (Turn("", "Hi Ada!", 1, None, ("Ada",), ()),
                             Turn("Where do I live?", "You live in Oslo.", 1, None, (), ("Oslo",))), "hand", "heldout"),
    Dialog("ada", "ada", 2, (Turn("What does my sister play?", "Bea plays tennis.", 2, SISTER_Q, ("Bea",), ("tennis",)),
                             Turn("Say ok.", "ok", 0)), "hand", "heldout"),
    Dialog("ada", "cyd", 1, (Turn("", "Hi Cyd!", 1, None, ("Cyd",), ()),
                             Turn("How are you?", "Fine.", 1)), "hand", "heldout"),  # nothing to check: unjudged
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def memory():
    with MemoryTexts([HOME]) as m:  # the real store + Level-2 retrieval (BM25 + MiniLM re-rank)
        yield m


def case(dialog: int, turn: int, reply: str) -> TurnCase:
    return TurnCase(DIALOGS[dialog], DIALOGS[dialog].turns[turn], reply)


# ---------------------------------------------------------------------------- rule judge


def test_rule_judge_right_name_or_fact_scores_one_and_quality_is_not_measured():
    judge = RuleJudge([HOME], DIALOGS)
    for reply in ("Hi Ada!", "HI, ADA!!", "Good morning, Ada Stone."):
        v = judge.judge(case(0, 0, reply))
        assert (v.fact_score, v.answer_quality, v.judge) == (1, None, "rules"), (reply, v)
    assert judge.judge(case(0, 1, "You live in oslo.")).fact_score == 1
    assert judge.judge(case(1, 0, "Ada, your sister Bea plays tennis.")).fact_score == 1  # naming the user is fine
    assert judge.judge(case(1, 0, "She plays tennis.")).fact_score == 1  # the fact alone is enough
    for reply in ("", "Hi Adamant!", "Hello there."):  # a name must be a whole word
        v = judge.judge(case(0, 0, reply))
        assert v.fact_score == 0 and "neither" in v.reason
    v = judge.judge(case(2, 1, "Fine."))
    assert v.fact_score is None and v.answer_quality is None  # nothing this rule can check


def test_rule_judge_wrong_person_is_zero():
    judge = RuleJudge([HOME], DIALOGS)
    v = judge.judge(case(0, 0, "Hi Bea!"))
    assert v.fact_score == 0 and "'bea'" in v.reason
    v = judge.judge(case(0, 0, "Hi Ada! Say hello to Cyd Marsh."))
    assert v.fact_score == 0 and "cyd" in v.reason
    assert judge.judge(case(1, 0, "Your sister Cyd plays tennis.")).fact_score == 0


def test_rule_judge_contradicting_facts_are_zero():
    judge = RuleJudge([HOME], DIALOGS)
    # (F) someone else's statement: Cyd likes green tea, Ada does not
    v = judge.judge(case(0, 1, "You live in Oslo and love green tea."))
    assert v.fact_score == 0 and "green tea" in v.reason
    # (T) learned from the dialogs: "Oslo" inside "lives in Oslo" makes "lives in {}" a type, Bea's Rome is one
    # of its values once a dialog asks about it; Ada holds another value of that type
    rome = Dialog("ada", "ada", 2, (Turn("Where does my sister live?", "In Rome.", 2, Query(("sister",), ("live",)),
                                         ("Bea",), ("Rome",)),), "hand", "heldout")
    judge = RuleJudge([HOME], [*DIALOGS, rome])
    v = judge.judge(case(0, 1, "You live in Oslo, near Rome."))
    assert v.fact_score == 0 and "lives in {}" in v.reason
    assert judge.judge(case(1, 0, "Bea plays tennis in Rome.")).fact_score == 1  # Bea's own city: true
    # (T) from the generator's vocabulary: a city nobody here has, a sport Bea does not play
    judge = RuleJudge([HOME], DIALOGS, fact_vocabulary())
    v = judge.judge(case(0, 1, "You live in Paris."))
    assert v.fact_score == 0 and "'paris'" in v.reason and "city" in v.reason
    v = judge.judge(case(1, 0, "Your sister Bea plays golf."))
    assert v.fact_score == 0 and "sport" in v.reason
    assert judge.judge(case(0, 0, "Hi Ada! How is life in Oslo?")).fact_score == 1
    # a kind the person has no value of cannot be contradicted: Ada has no sport
    assert judge.judge(case(0, 0, "Hi Ada! Fancy some tennis?")).fact_score == 1


def test_rule_judge_on_the_generated_corpus():
    """Every reference reply of the template generator scores 1 (no false contradiction from relation words,
    shared surnames or other households); the same greeting with a household member's name scores 0."""
    households, dialogs = make_corpus(20, "heldout", 0)
    judge = RuleJudge(households, dialogs, fact_vocabulary())
    turns = [(d, t) for d in dialogs for t in d.turns if t.level]
    verdicts = [judge.judge(TurnCase(d, t, t.reply)) for d, t in turns]
    assert len(turns) > 100 and [v.reason for v in verdicts if v.fact_score != 1] == []
    homes = {h.main.user_id: h for h in households}
    wrong = 0
    for d, t in turns:
        if t.user == "":  # a greeting: "Hi <first name>! ..."
            other = next(p for p in (homes[d.household].main, *homes[d.household].related) if p.user_id != d.user_id)
            reply = t.reply.replace(t.names[0], other.name.split()[0])
            wrong += 1
            assert judge.judge(TurnCase(d, t, reply)).fact_score == 0, reply
    assert wrong >= 20


def test_people_jsonl_is_checked_and_made_held_out(tmp_path):
    good = json.dumps(to_json(HOUSE_TRAIN))
    (tmp_path / "ok.jsonl").write_text(good + "\n\n")
    (h,) = load_people(tmp_path / "ok.jsonl")
    assert h.split == "heldout" and h.main == ADA and h.edges == HOME.edges  # evaluated with held-out voices
    for name, text, match in [("bad", good + "\n{\"main\": {}}\n", r"bad.jsonl:2: not a household"),
                              ("dup", good + "\n" + good + "\n", r"dup.jsonl:2: user_ids must be unique"),
                              ("edge", good.replace('"other": "bea"', '"other": "zed"'), "edge.jsonl:1: each edge"),
                              ("empty", "\n", "holds no household")]:
        (tmp_path / f"{name}.jsonl").write_text(text)
        with pytest.raises(EvalError, match=match):
            load_people(tmp_path / f"{name}.jsonl")


# ---------------------------------------------------------------------------- query words


def test_a_reply_reading_its_memchunk_aloud_is_counted_and_a_reply_is_not():
    from egomem.memory.store import PROFILE_LINE_LABELS
    from egomem.training.judge import reads_memchunk

    profile = "name: Ada\npeople: Bea (sister)\nfact: lives in Oslo\nlikes: jazz\nearlier: Talked about tea."
    assert all(line.split(": ", 1)[0] in PROFILE_LINE_LABELS for line in profile.splitlines())
    assert reads_memchunk("Hi Ada! fact: lives in Oslo fact: plays") and reads_memchunk("ner earlier: Talked")
    assert reads_memchunk(profile.replace("\n", " "))
    for reply in ("Hi Ada! How is life in Oslo?", "You live in Oslo.", "Your sister Bea likes jazz.",
                  "What is my sister's name?", "Bea is your sister.", ""):
        assert not reads_memchunk(reply)


def test_query_scores():
    s = query_scores(RetrievalQuery(("sister",), ("play",)), Query(("Sister",), ("play ",)))
    assert (s.precision, s.recall, s.exact, s.found) == (1.0, 1.0, True, True)
    s = query_scores(RetrievalQuery(("sister",), ()), SISTER_Q)
    assert (s.precision, s.recall, s.exact) == (1.0, 0.5, False)
    assert (s.relations_exact, s.keywords_exact) == (True, False)  # who was asked about, not what
    s = query_scores(RetrievalQuery(("brother",), SISTER_Q.keywords), SISTER_Q)
    assert (s.exact, s.relations_exact, s.keywords_exact) == (False, False, True)
    s = query_scores(RetrievalQuery(("sister",), ("tennis", "play", "golf")), SISTER_Q)
    assert (s.precision, s.recall, s.exact) == (pytest.approx(2 / 4), 1.0, False)
    s = query_scores(RetrievalQuery((), ("sister",)), Query(("sister",), ()))  # a word counts in its own group only
    assert (s.precision, s.recall) == (0.0, 0.0)
    s = query_scores(None, SISTER_Q)
    assert (s.precision, s.recall, s.exact, s.found) == (0.0, 0.0, False, False)
    s = query_scores(None, Query((), ("tennis",)))  # no relation to name, but a query not written names none
    assert (s.relations_exact, s.keywords_exact) == (False, False)
    assert query_scores(None, Query()).exact  # nothing to ask, nothing asked
    truth = Query(("best friend",), ("tennis", "birthday"))
    assert query_scores(parse_query("blah " + truth.text()), truth).exact  # what the model writes, parsed


# ---------------------------------------------------------------------------- LLM judge


@pytest.fixture()
def server():
    srv = FakeOpenAIServer().start()
    yield srv
    srv.stop()


def llm_cfg(server: FakeOpenAIServer, monkeypatch, max_attempts: int = 1):
    monkeypatch.setenv("EGOMEM_TEST_LLM_KEY", "k")
    cfg = load_config(env={}).llm
    cfg.base_url, cfg.model, cfg.api_key_env = server.base_url, "fake-model", "EGOMEM_TEST_LLM_KEY"
    cfg.timeout_s, cfg.max_attempts, cfg.backoff_base_s = 2.0, max_attempts, 0.01
    return cfg


def test_llm_judge_answer_validated_used_and_cached(server, monkeypatch, tmp_path):
    judge = make_judge("llm", llm_cfg(server, monkeypatch), [HOME], DIALOGS, tmp_path / "judge.sqlite3")
    assert isinstance(judge, LLMJudge) and judge.name == "llm:fake-model"
    server.push(("ok", {"fact_score": 1, "answer_quality": 4, "reason": "greets Ada by name"}))
    c = TurnCase(DIALOGS[0], DIALOGS[0].turns[0], "Hi Ada!", profile="name: Ada Stone")
    v = judge.judge(c)
    assert (v.fact_score, v.answer_quality, v.reason) == (1, 4, "greets Ada by name")
    body = json.loads(server.requests[0]["messages"][1]["content"])
    assert body["assistant_reply"] == "Hi Ada!" and body["profile"] == "name: Ada Stone"
    assert body["expected_names"] == ["Ada"]
    assert judge.judge(c) == v and len(server.requests) == 1  # replayed from the cache, the server not asked
    # a new judge on the same cache file (a re-run) asks nothing either
    again = make_judge("llm", llm_cfg(server, monkeypatch), [HOME], DIALOGS, tmp_path / "judge.sqlite3")
    assert again.judge(c) == v and len(server.requests) == 1


@pytest.mark.parametrize("bad", [("ok", {"fact_score": 3, "answer_quality": 4, "reason": "x"}),
                                 ("ok", {"fact_score": 1, "answer_quality": 0, "reason": "x"}),
                                 ("ok", {"fact_score": 1, "reason": "no quality"}),
                                 ("malformed", "{not json")])
def test_llm_judge_invalid_answer_is_an_error_not_a_score(server, monkeypatch, tmp_path, bad):
    store = SQLiteMemoryStore(tmp_path / "judge.sqlite3")
    judge = LLMJudge(LLMClient(llm_cfg(server, monkeypatch), store))
    server.push(bad)
    with pytest.raises(JudgeError, match="No score is made up"):
        judge.judge(case(0, 0, "Hi Ada!"))
    server.push(("ok", {"fact_score": 0, "answer_quality": 2, "reason": "fine now"}))  # nothing bad was cached
    assert judge.judge(case(0, 0, "Hi Ada!")).fact_score == 0


def test_make_judge_auto_without_key_is_the_rules(monkeypatch):
    cfg = load_config(env={}).llm
    monkeypatch.delenv(cfg.api_key_env, raising=False)
    assert isinstance(make_judge("auto", cfg, [HOME], DIALOGS), RuleJudge)
    with pytest.raises(Exception, match="--judge rules"):
        make_judge("llm", cfg, [HOME], DIALOGS)


# ---------------------------------------------------------------------------- evaluate, end to end

# (dialog, start, turns as (user_start, user_end, model text written from user_end + 1 [or from this frame]))
# per stream; frames by hand
QUERY = "<retr>:\nsister\n<answer>"
# The greeting's text ends on the frame before the next user turn starts, and the model "says" x on the first
# and last frames of that user's audio: neither belongs to a reply, so the windows are checked to the frame.
# Cyd's greeting starts before its turn's frame (9): a greeting is read from its dialog's L1 write (frame 0).
PLAN = [
    [(0, 2, [(2, 2, "Hi Ada!"), (10, 14, "You live in Oslo.")]),
     (1, 42, [(42, 46, QUERY + "Bea plays tennis."), (90, 94, "ok")])],
    [(2, 3, [(9, 9, "Hi Cyd!", 4), (14, 18, "Fine.")])],
]
NOISED = {"Hi Ada!": "Hi Bea!", "You live in Oslo.": "You live in Rome.", QUERY + "Bea plays tennis.":
          "<retr>:\ncousin\n<answer>Cyd plays tennis."}
STRAY = {0: {10: "x", 13: "x"}}  # stream -> frame -> a character the model writes while the user speaks
CHARS = sorted({c for s in [*NOISED, *NOISED.values(), "ok", "Hi Cyd!", "Fine.", "x"] for c in s})
assert len(CHARS) < CARD


def make_streams(rng: np.random.Generator, plan: list = PLAN) -> list[Stream]:
    """Hand-made streams: listen codebook 0 carries the scripted model's text (code c -> CHARS[c - 1]), the
    text row the reference (the clean script), the other rows random codes; the noised copy's script says the
    wrong things (NOISED)."""
    out = []
    for i, dialogs in enumerate(plan):
        n = 100 if i == 0 else 28
        clean, noised = (rng.integers(1, CARD, (17, n)).astype(np.int16) for _ in range(2))
        clean[9] = noised[9] = 0  # code 0: text pad
        clean[0] = noised[0] = TOK.pad_id
        layouts = []
        for d, start, turns in dialogs:
            tl = []
            for j, (us, ue, text, *at) in enumerate(turns):
                ts = at[0] if at else ue + 1
                clean[0, ts:ts + len(text)] = noised[0, ts:ts + len(text)] = TOK.encode(text)
                for row, t in ((clean, text), (noised, NOISED.get(text, text))):
                    row[9, ts:ts + len(t)] = [CHARS.index(c) + 1 for c in t]
                end = ts + len(text)
                tl.append(TurnLayout(j, us, ue, None, None, ts, end, ts + 2, end, False))
            layouts.append(DialogLayout(d, DIALOGS[d].user_id, "v", start, tl[-1].reply_end, tuple(tl)))
        for f, c in STRAY.get(i, {}).items():
            clean[9, f] = noised[9, f] = CHARS.index(c) + 1
        out.append(Stream(StreamLayout(f"s{i}", n, tuple(layouts)), clean, noised))
    return out


class CountingEngine(DialogEngine):
    """The real engine, recording each MemChunk write: (slot, level, tokens, ticks the slot had taken)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.writes: list[tuple[int, int, list[int], int]] = []

    def write_memchunk(self, slot, level, text_tokens):
        self.writes.append((slot, level, [int(t) for t in text_tokens], self.steps(slot)))
        super().write_memchunk(slot, level, text_tokens)


def scripted_lm():
    """A tiny LMModel whose greedy text token at tick t is CHARS[c - 1] for listen code c of codebook 0 (text
    pad for code 0 and the initial token): the temporal transformer is zeroed (the residual carries the
    input embedding through), only that codebook's embedding is non-zero (orthonormal rows), and the text
    head maps each row to its character."""
    lm = build_lm("tiny", seed=0, **TINY)
    with torch.no_grad():
        for p in lm.transformer.parameters():
            p.zero_()
        for e in (*lm.emb, lm.text_emb):
            e.weight.zero_()
        basis = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))[0].T
        lm.emb[8].weight.copy_(basis[:CARD + 1])  # listen codebook 0 (delay 0: read at the tick it arrives)
        lm.text_linear.weight.zero_()
        for c, ch in enumerate(CHARS, 1):
            lm.text_linear.weight[TOK.encode(ch)[0]] += basis[c]
        lm.text_linear.weight[TOK.pad_id] += basis[0] + basis[CARD]
    return lm


def assert_by_person_adds_up(r, by_person):
    """The first / new / same split of each Level-1 part holds every judged turn of it, with its fact scores."""
    for part in ("greetings", "answers"):
        split = [by_person[who][part] for who in ("first", "new", "same")]
        assert sum(x["n"] for x in split) == r["l1"][part]["n"]
        ones = sum(x["fact_score"] * x["n"] for x in split if x["n"])
        assert ones == pytest.approx(r["l1"][part]["fact_score"] * r["l1"][part]["n"])


def test_evaluate_scripted_model_every_figure_known(memory):
    streams = make_streams(np.random.default_rng(0))
    engine = CountingEngine(scripted_lm(), max_streams=2, l1_steps=512, l2_steps=256, ring_steps=32)
    judge = RuleJudge([HOME], DIALOGS, fact_vocabulary())
    r = evaluate(engine, TOK, DIALOGS, streams, memory, judge)
    by_person = r["l1"].pop("by_person")
    assert r["l1"] == {"fact_score": 1.0, "n": 3, "unjudged": 1, "greetings": {"fact_score": 1.0, "n": 2},
                       "answers": {"fact_score": 1.0, "n": 1}, "reference": {"fact_score": 1.0, "n": 3},
                       "reachable": {"fact_score": 1.0, "n": 3}, "read_outs": {"share": 0.0, "n": 0}}
    assert_by_person_adds_up(r, by_person)
    assert r["l2"]["fact_score"] == 1.0 and r["l2"]["n"] == 1
    assert r["l2"]["query"] == {"precision": 1.0, "recall": 0.5, "exact": 0.0, "found": 1.0, "n": 1,
                                "relations_exact": 1.0, "keywords_exact": 0.0}  # the right person, half the words
    assert r["answer_quality"] == "not measured"
    assert [(t["frames"], t["reply"]) for t in r["turns"]] == [
        ([0, 10], "Hi Ada!"), ([14, 42], "You live in Oslo."), ([46, 90], "Bea plays tennis."),  # query cut out
        ([0, 14], "Hi Cyd!"), ([18, 28], "Fine.")]  # the level-0 turn is not judged
    assert [t["expected"] for t in r["turns"]] == [  # what the judge looked for, beside each reply
        {"names": ["Ada"], "facts": []}, {"names": [], "facts": ["Oslo"]}, {"names": ["Bea"], "facts": ["tennis"]},
        {"names": ["Cyd"], "facts": []}, {"names": [], "facts": []}]
    l2 = [rec for rec in r["turns"] if rec["level"] == 2][0]
    # written right after the question (frame 46), one byte a frame: its last byte len(QUERY) frames on
    assert l2["query"] == {"relations": ["sister"], "keywords": [], "frames_after_question": len(QUERY)}
    # L1 at each dialog's start (stream 0: ticks 0 and 42; stream 1: tick 0), each the user's profile
    l1 = [(w[2], w[3]) for w in engine.writes if w[1] == 1]
    assert sorted(t for _, t in l1) == [0, 0, 42]
    assert all(toks == TOK.encode(fit(memory.l1(u), 512)) for (toks, _), u in
               zip(l1, ["ada", "cyd", "ada"], strict=True) if toks) and all(toks for toks, _ in l1)
    # L2: the real retrieval for the PARSED query (relations only), before the tick after '>' came out
    (_, _, l2_tokens, at), = [w for w in engine.writes if w[1] == 2]
    expected = memory.l2("ada", Query(("sister",), ()))
    assert "Bea" in expected and l2_tokens == TOK.encode(expected)
    assert at == 46 + 1 + len(QUERY) + engine.max_delay  # query's last frame + output delay + next tick
    assert r["writes"]["l1_writes"] == 3 and r["writes"]["l2_writes"] == 1 and r["frames"] == 128

    noisy = evaluate(engine, TOK, DIALOGS, streams, memory, judge, noised=True)
    assert noisy["l1"]["fact_score"] == 1 / 3  # "Hi Bea!" and "Rome" wrong; "Hi Cyd!" right
    # the reference is the text channel, the same in both conditions; every turn of it reachable
    assert noisy["l1"]["reference"] == {"fact_score": 1.0, "n": 3} and noisy["l1"]["reachable"]["fact_score"] == 1 / 3
    assert [t["reference"]["reply"] for t in noisy["turns"]] == [t["reply"] for t in r["turns"]]
    assert noisy["l1"]["greetings"]["fact_score"] == 0.5 and noisy["l1"]["answers"]["fact_score"] == 0.0
    assert noisy["l2"]["fact_score"] == 0.0 and noisy["l2"]["query"]["precision"] == 0.0


def test_noised_level_one_by_snr_band(memory, capsys):
    """Each turn carries the background SNR of its stream's noised copy and Level 1 is also split per 5 dB band
    of it, noised and clean (the same streams without it); the scripted model of the test above: noised, stream 0
    wrong twice and stream 1's greeting right; clean, all right."""
    streams = [Stream(replace(s.layout, meta={"noise_snr_db": snr}), s.tokens, s.noised)
               for s, snr in zip(make_streams(np.random.default_rng(0)), (3.2, 12.0), strict=True)]
    engine = DialogEngine(scripted_lm(), max_streams=2, l1_steps=512, l2_steps=256, ring_steps=32)
    judge = RuleJudge([HOME], DIALOGS, fact_vocabulary())
    noisy = evaluate(engine, TOK, DIALOGS, streams, memory, judge, noised=True)
    assert [t["snr_db"] for t in noisy["turns"]] == [3.2, 3.2, 3.2, 12.0, 12.0]
    assert noisy["l1"]["by_snr_db"] == {
        "0-5": {"all": {"fact_score": 0.0, "n": 2}, "greetings": {"fact_score": 0.0, "n": 1},
                "answers": {"fact_score": 0.0, "n": 1}},
        "10-15": {"all": {"fact_score": 1.0, "n": 1}, "greetings": {"fact_score": 1.0, "n": 1},
                  "answers": {"fact_score": None, "n": 0}}}
    _print_row({"name": "scripted", "noised": noisy}, ["noised"])  # eval-dialog's summary line under the model's
    assert "L1 fact by SNR: 0-5 dB 0.000 (n=2; answers 0.000), 10-15 dB 1.000 (n=1; answers   -  )" in capsys.readouterr().out
    clean = evaluate(engine, TOK, DIALOGS, streams, memory, judge)  # the same streams without the background
    assert [t["snr_db"] for t in clean["turns"]] == [3.2, 3.2, 3.2, 12.0, 12.0]
    assert clean["l1"]["by_snr_db"] == {
        "0-5": {"all": {"fact_score": 1.0, "n": 2}, "greetings": {"fact_score": 1.0, "n": 1},
                "answers": {"fact_score": 1.0, "n": 1}},
        "10-15": {"all": {"fact_score": 1.0, "n": 1}, "greetings": {"fact_score": 1.0, "n": 1},
                  "answers": {"fact_score": None, "n": 0}}}
    unknown = evaluate(engine, TOK, DIALOGS, make_streams(np.random.default_rng(0)), memory, judge, noised=True)
    assert "by_snr_db" not in unknown["l1"]  # streams that do not say their SNR: no split, not a guessed one


def test_a_dataset_built_before_layouts_said_their_snr_recovers_it(tmp_path):
    """Layouts without `noise_snr_db` get the build's draw (`noise_draw(seed, index)`) when a noised copy exists;
    one that says it keeps its own; a stream without a noised copy gets none."""
    streams = make_streams(np.random.default_rng(0))
    layouts = [StreamLayout(f"s{i:06d}", s.layout.n_steps, s.layout.dialogs, 0, {"split": "heldout"} | extra)
               for i, (s, extra) in enumerate(zip(streams + streams[:1], ({}, {}, {"noise_snr_db": 7.5}), strict=True))]
    tokens = {lay.stream: s.tokens for lay, s in zip(layouts, streams + streams[:1], strict=True)}
    tokens |= {f"{lay.stream}-noised": s.noised for lay, s in zip(layouts[1:], streams[1:] + streams[:1], strict=True)}
    manifest = {"n1": 512, "n2": 256, "tokenizer": "byte", "codec": "hand-made", "seed": 4,
                "spec": {"noise_snr_db": [0.0, 20.0]}}
    write_dataset(tmp_path / "data", manifest, [HOME], DIALOGS, tokens, [], layouts)
    got = [lay.meta.get("noise_snr_db") for lay in Dataset(tmp_path / "data").layouts]
    assert got == [None, noise_draw(4, 1, (0.0, 20.0))[1], 7.5]


def test_evaluate_new_person_restart_opens_the_stream_afresh(memory):
    """new_person="restart" (serving's [dialog] new_person): a dialog of another person restarts the stream
    with their L1 (the slot had taken no tick when it is written); the same person's next dialog does not."""
    switch = [[(0, 2, [(2, 2, "Hi Ada!"), (10, 14, "You live in Oslo.")]),
               (2, 34, [(41, 41, "Hi Cyd!", 35), (44, 48, "Fine.")]),
               (0, 60, [(60, 60, "Hi Ada!", 61), (70, 74, "You live in Oslo.")])]]  # ada again after cyd: new too
    streams = make_streams(np.random.default_rng(0), switch)
    judge = RuleJudge([HOME], DIALOGS, fact_vocabulary())
    runs = {}
    for mode in ("swap", "restart"):
        engine = CountingEngine(scripted_lm(), max_streams=1, l1_steps=512, l2_steps=256, ring_steps=32)
        runs[mode] = evaluate(engine, TOK, DIALOGS, streams, memory, judge, new_person=mode), engine
    (swap, e_swap), (restart, e_restart) = runs["swap"], runs["restart"]
    assert [w[3] for w in e_swap.writes if w[1] == 1] == [0, 34, 60]
    assert [w[3] for w in e_restart.writes if w[1] == 1] == [0, 0, 0]  # written into a fresh slot each time
    assert swap["new_person"] == "swap" and restart["new_person"] == "restart"
    # the scripted model speaks from the listen codes: the same replies either way, judged alike
    assert [t["reply"] for t in restart["turns"]] == [t["reply"] for t in swap["turns"]]
    assert restart["l1"] == swap["l1"] and restart["l1"]["greetings"] == {"fact_score": 1.0, "n": 3}
    assert [t["person"] for t in restart["turns"]] == ["first"] * 2 + ["new"] * 4
    by = restart["l1"]["by_person"]
    assert by["first"]["greetings"] == {"fact_score": 1.0, "n": 1} and by["new"]["greetings"]["n"] == 2
    assert by["same"]["greetings"] == {"fact_score": None, "n": 0}
    same = [[(0, 2, [(2, 2, "Hi Ada!"), (10, 14, "You live in Oslo.")]), (1, 42, [(42, 46, "ok")])]]
    engine = CountingEngine(scripted_lm(), max_streams=1, l1_steps=512, l2_steps=256, ring_steps=32)
    r = evaluate(engine, TOK, DIALOGS, make_streams(np.random.default_rng(0), same), memory, judge,
                 new_person="restart")
    assert [w[3] for w in engine.writes if w[1] == 1] == [0, 42]  # ada twice: no restart
    assert [t["person"] for t in r["turns"]] == ["first", "first", "same"]


def test_evaluate_same_persons_greeting_window_and_the_reference(memory):
    """The same person's next dialog changes nothing in L1 (it is rewritten as it was): its greeting
    window opens where the dialog before ended, so a greeting in the silence between (frame 36, the dialog
    starts at 50) counts. The reference (the text channel) is judged over the same windows: a reply cut before
    its fact fails there (an interruption does that), and `reachable` leaves that turn out."""
    plan = [[(0, 2, [(2, 2, "Hi Ada!"), (10, 14, "You live in Oslo.")]),
             (0, 50, [(50, 50, "Hi Ada!", 36), (60, 64, "You live in Oslo.")])]]
    stream, = make_streams(np.random.default_rng(0), plan)
    stream.tokens[0, 65 + len("You live in"):65 + len("You live in Oslo.")] = TOK.pad_id  # cut before "Oslo"
    engine = DialogEngine(scripted_lm(), max_streams=1, l1_steps=512, l2_steps=256, ring_steps=32)
    judge = RuleJudge([HOME], DIALOGS, fact_vocabulary())
    r = evaluate(engine, TOK, DIALOGS, [stream], memory, judge, new_person="restart")
    assert [(t["person"], t["frames"], t["reply"]) for t in r["turns"]] == [
        ("first", [0, 10], "Hi Ada!"), ("first", [14, 50], "You live in Oslo.Hi Ada!"),
        ("same", [32, 60], "Hi Ada!"), ("same", [64, 100], "You live in Oslo.")]  # 32: the first dialog's end
    assert [t["reference"] for t in r["turns"]][2:] == [{"reply": "Hi Ada!", "fact_score": 1},
                                                        {"reply": "You live in", "fact_score": 0}]
    assert r["l1"]["by_person"]["same"]["greetings"] == {"fact_score": 1.0, "n": 1}
    assert (r["l1"]["fact_score"], r["l1"]["reference"], r["l1"]["reachable"]) == (
        1.0, {"fact_score": 0.75, "n": 4}, {"fact_score": 1.0, "n": 3})


def test_evaluate_tiny_random_model_and_empty_memchunk_peer(memory):
    streams = make_streams(np.random.default_rng(1))
    lm = build_lm("tiny", seed=3, **TINY)
    engine = CountingEngine(lm, max_streams=1, l1_steps=512, l2_steps=256, ring_steps=32)  # streams one by one
    judge = RuleJudge([HOME], DIALOGS)
    r = evaluate(engine, TOK, DIALOGS, streams, memory, judge)
    assert (r["l1"]["n"], r["l1"]["unjudged"], r["l2"]["n"], r["l2"]["query"]["n"]) == (3, 1, 1, 1)
    figures = [r["l1"]["fact_score"], r["l2"]["fact_score"], *(r["l2"]["query"][k] for k in
                                                                ("precision", "recall", "exact", "found"))]
    assert all(0.0 <= f <= 1.0 for f in figures) and r["answer_quality"] == "not measured"
    assert len(r["turns"]) == 5 and all(isinstance(t["reply"], str) for t in r["turns"])  # level 0 not judged
    assert sum(w[1] == 1 for w in engine.writes) == 3 == r["writes"]["l1_writes"]
    engine.writes.clear()
    empty = evaluate(engine, TOK, DIALOGS, streams, memory, judge, noised=True, use_memory=False)
    assert engine.writes == [] and empty["writes"]["l1_writes"] == empty["writes"]["l2_writes"] == 0
    assert empty["memory"] is False and empty["l1"]["n"] == 3 and not engine.active  # every slot freed
    bad = streams[1].tokens.copy()
    bad[12, 5] = CARD  # a listen code the model's codebook does not have
    with pytest.raises(EvalError, match="refused the tick.*LISTEN_CODES"):
        evaluate(engine, TOK, DIALOGS, [Stream(streams[1].layout, bad, None)], memory, judge)
    assert not engine.active  # the failed run left no slot taken
    with pytest.raises(EvalError, match="noised copy"):
        evaluate(engine, TOK, DIALOGS, [Stream(streams[0].layout, streams[0].tokens, None)], memory, judge,
                 noised=True)


def test_evaluate_sampling_repeats_with_its_seed(memory):
    """A sampling engine (temperature > 0) draws from torch's generator, seeded per evaluation: the same seed
    gives the same replies, another seed others; the report says how it decoded."""
    streams = make_streams(np.random.default_rng(1))
    engine = DialogEngine(build_lm("tiny", seed=3, **TINY), max_streams=2, l1_steps=512, l2_steps=256,
                          ring_steps=32, temperature=1.0)
    judge = RuleJudge([HOME], DIALOGS)
    before = torch.get_rng_state()
    runs = [evaluate(engine, TOK, DIALOGS, streams, memory, judge, seed=s) for s in (0, 0, 1)]
    assert torch.equal(torch.get_rng_state(), before)  # seeded in a fork: the caller's generator is untouched
    replies = [[t["reply"] for t in r["turns"]] for r in runs]
    assert replies[0] == replies[1] and replies[0] != replies[2] and all(replies[0])
    both = evaluate(engine, TOK, DIALOGS, streams, memory, judge, seed=0, draws=2)  # seeds 0 and 1, pooled
    assert [t["reply"] for t in both["turns"]] == replies[0] + replies[2]
    assert [t["draw"] for t in both["turns"]] == [0] * 5 + [1] * 5 and both["draws"] == 2
    assert both["per_draw"] == [{"seed": s, "l1": runs[i]["l1"]["fact_score"], "l2": runs[i]["l2"]["fact_score"]}
                                for s, i in ((0, 0), (1, 2))]
    assert both["l1"]["n"] == 2 * runs[0]["l1"]["n"] and both["l1"]["fact_score"] == pytest.approx(
        (runs[0]["l1"]["fact_score"] + runs[2]["l1"]["fact_score"]) / 2)
    assert (runs[0]["temperature"], runs[0]["seed"], runs[2]["seed"]) == (1.0, 0, 1)


def test_evaluate_with_llm_judge_reports_answer_quality(memory, server, monkeypatch, tmp_path):
    def grade(req):
        body = json.loads(req["messages"][1]["content"])
        said = any(x.lower() in body["assistant_reply"].lower() for x in body["expected_names"] + body["expected_facts"])
        return {"fact_score": int(said), "answer_quality": 5 if said else 2, "reason": "stand-in grader"}

    server.responder = grade
    judge = make_judge("llm", llm_cfg(server, monkeypatch), [HOME], DIALOGS, tmp_path / "j.sqlite3")
    engine = DialogEngine(scripted_lm(), max_streams=2, l1_steps=512, l2_steps=256, ring_steps=32)
    r = evaluate(engine, TOK, DIALOGS, make_streams(np.random.default_rng(0)), memory, judge)
    assert r["judge"] == "llm:fake-model" and len(server.requests) == 5
    by_person = r["l1"].pop("by_person")
    assert r["l1"] == {"fact_score": 0.75, "n": 4, "unjudged": 0,  # the LLM grades "Fine." too (expects nothing)
                       "greetings": {"fact_score": 1.0, "n": 2}, "answers": {"fact_score": 0.5, "n": 2},
                       # the reference says what the model said: judged alike, from the cache (5 requests)
                       "reference": {"fact_score": 0.75, "n": 4}, "reachable": {"fact_score": 1.0, "n": 3},
                       "read_outs": {"share": 0.0, "n": 0}}
    assert_by_person_adds_up(r, by_person)
    assert r["answer_quality"] == {"mean": (5 * 4 + 2) / 5, "n": 5}


def test_run_eval_on_a_dataset_folder(tmp_path, monkeypatch):
    """The command on a dataset folder's held-out streams: the model and its empty-MemChunk peer in one run,
    a JSON report and a PNG (the tiny preset at full size: one stream, the clean condition)."""
    monkeypatch.delenv("EGOMEM_CONFIG", raising=False)
    streams = make_streams(np.random.default_rng(0))
    layouts = [StreamLayout(s.layout.stream, s.layout.n_steps, s.layout.dialogs, 0, {"split": "heldout"})
               for s in streams]
    tokens = {s.layout.stream: s.tokens for s in streams} | {f"{s.layout.stream}-noised": s.noised for s in streams}
    manifest = {"n1": 512, "n2": 256, "tokenizer": "byte", "codec": "hand-made", "seed": 0}
    write_dataset(tmp_path / "data", manifest, [HOME], DIALOGS, tokens, [], layouts)
    out = tmp_path / "report" / "eval.json"
    data = str(tmp_path / "data")
    assert main(["--data", data, "--judge", "rules", "--peer-empty", "--peer-grammar", "--conditions", "clean",
                 "--limit-streams", "1", "--fps-ticks", "2", "--batch", "2", "--temperature", "0.5",
                 "--out", str(out)]) == 0  # `egomem eval-dialog`
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert [m["name"] for m in report["models"]] == ["model", "model + query grammar", "model (empty MemChunks)"]
    model, grammar, empty = report["models"]
    assert (report["query_grammar"], model["query_grammar"], grammar["query_grammar"]) == (False, False, True)
    assert grammar["clean"]["writes"]["l1_writes"] == 2 and grammar["clean"]["l1"]["n"] == 2
    assert report["streams"] == 1 and report["conditions"] == ["clean"] and report["judge"] == "rules"
    assert report["temperature"] == 0.5 == model["clean"]["temperature"] == empty["clean"]["temperature"]
    # the model under test is the shipped one (dialog.weights unset): its own serving settings ("auto")
    assert (report["start_temperature"], report["new_person"], report["start_floor"]) == (1.0, "restart", 0.0)
    assert empty["clean"]["writes"]["l1_writes"] == 0 and model["clean"]["writes"]["l1_writes"] == 2
    assert model["clean"]["l1"]["n"] == 2 and model["clean"]["l2"]["n"] == 1 and "fps" not in empty
    fps = model["fps"]["engine"]
    assert fps["l1"]["streams"] == 2 and fps["l1"]["ticks"] == 2 and fps["l2"]["frames_per_s"] > 0
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    add_eval_args(p)
    assert run_eval(p.parse_args(["--data", data, "--peer", "nope", "--out", str(out)])) == 2
    assert run_eval(p.parse_args(["--data", data, "--temperature", "-1", "--out", str(out)])) == 2
    assert run_eval(p.parse_args(["--data", data, "--start-temperature", "-1", "--out", str(out)])) == 2
    assert run_eval(p.parse_args(["--data", data, "--start-floor", "1", "--out", str(out)])) == 2
    assert run_eval(p.parse_args(["--data", data, "--query-grammar", "--peer-grammar", "--out", str(out)])) == 2
    assert p.parse_args(["--data", data, "--no-query-grammar"]).query_grammar is False  # over dialog.query_grammar
    assert run_eval(p.parse_args(["--data", data, "--draws", "3", "--start-temperature", "0",
                                  "--out", str(out)])) == 2  # greedy: the same each draw


def test_served_fps_through_a_real_tritonserver(tmp_path):
    """Throughput of `dialog_lm` as served (tiny preset, its full MemChunk sizes): L1 then L2 written through the
    wire, timed ticks of every stream; a refresh the model refuses is an error naming why, not a figure."""
    cfg = test_config(tmp_path)
    r = served_fps(cfg, ["name: Ada Stone\nlives in Oslo"], ["Bea is Ada's sister. Bea plays tennis."], streams=2,
                   ticks=3, warmup=1)
    assert r["device"] == "cpu"
    for level in ("l1", "l2"):
        assert r[level]["streams"] == 2 and r[level]["ticks"] == 3
        assert r[level]["frames_per_s"] > 0 and r[level]["p99_ms"] >= r[level]["p50_ms"] > 0
    with pytest.raises(ServedTickError, match="holds 256 steps"):  # an L2 text longer than its chunk
        served_fps(test_config(tmp_path / "again"), ["Ada"], ["x" * 400], streams=2,
                   ticks=1, warmup=0)
