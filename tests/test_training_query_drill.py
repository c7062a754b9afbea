"""Query drills (egomem/training/query_drill.py): a spoken question about "my <relation>" and the `<retr>` query
written after it, the relation one entry of the Level-1 profile's `people:` line."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from egomem.config import MimiConfig
from egomem.dialog.tokenizer import ByteTokenizer
from egomem.training.corpus import fits_with, relation_questions
from egomem.training.listen import ClipBank
from egomem.training.query_drill import QueryRows, bank_questions, bank_voices, query_scores_teacher_forced
from egomem.training.streams import StreamSpec, silence_code
from egomem.training.tts import HELDOUT_VOICES, TRAIN_VOICES
from egomem.training.types import Query
from egomem.training.vocab import CORE_RELATIONS, pools
from egomem.trigger.codec import build_codec

TOK = ByteTokenizer()
QUESTIONS = {"Where does my aunt live?": ("aunt", Query(("aunt",), ("live", "city"))),
             "Tell me about my best friend's sister.": ("best friend's sister", Query(("best friend's sister",), ())),
             "What is my roommate's name?": ("roommate", Query(("roommate",), ()))}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def codec():
    return build_codec(MimiConfig())


@pytest.fixture(scope="module")
def rows(codec):
    bank = ClipBank(codec, TRAIN_VOICES[:1], sorted(QUESTIONS), seed=0, progress=False, copies=1)
    r = QueryRows(bank, QUESTIONS, silence_code(codec))
    yield r
    r.close()


def test_the_bank_speaks_every_core_relation_and_each_question_carries_its_query():
    qs = bank_questions(40, 2, seed=0)
    assert bank_questions(40, 2, seed=0) == qs  # seeded
    relations = {rel for rel, _ in qs.values()}
    assert CORE_RELATIONS <= relations and len(relations) == 40
    assert {rel for rel, _ in bank_questions(40, 2, seed=1).values()} != relations  # the rest is a seeded draw
    for q, (rel, query) in qs.items():
        assert f"my {rel}" in q and query.relations == (rel,)
        assert (q, query) in relation_questions(rel)
    assert ("Where does my aunt live?", Query(("aunt",), ("live", "city"))) in relation_questions("aunt")
    assert ("What is my aunt's name?", Query(("aunt",), ())) in relation_questions("aunt")
    assert len(bank_voices(24)) == 24 and len(set(bank_voices(24))) == 24
    assert len({v.name.split("+")[0] for v in bank_voices(24)}) > 1  # spread over the accents, not the first 24
    held = {rel for rel, _ in bank_questions(10, 2, seed=1, split="heldout").values()}  # to score a model on
    assert len(held) == 10 and held <= set(pools("heldout").relations) and not held & set(pools("train").relations)
    assert set(bank_voices(6, "heldout")) <= set(HELDOUT_VOICES) and not set(HELDOUT_VOICES) & set(TRAIN_VOICES)


def test_a_query_drill_asks_about_a_listed_relation_and_writes_its_query(rows):
    silence = rows.silence
    for seed in range(12):
        row = rows.row(random.Random(seed))
        sample, tokens = row.as_sample()
        (tick, question), = row.spoken
        rel, query = QUESTIONS[question]
        assert sample.kind == "l2_query" and sample.l2_text == "" and sample.generator == "query-drill"
        people = next(line for line in sample.l1_text.splitlines() if line.startswith("people: "))
        listed = [e.rsplit(" (", 1)[1].rstrip(")") for e in people[len("people: "):].split("; ")]
        assert listed.count(rel) == 1 and fits_with(rel, [x for x in listed if x != rel])
        T = tokens.shape[1]
        ids = TOK.encode(query.text())
        assert tokens[0, T - len(ids):].tolist() == ids  # the row ends with the query words
        start = T - len(ids)
        clip = rows.bank.clean[(question, row.voice)] if row.noise_copy is None else \
            rows.bank.noised[(question, row.voice, row.noise_copy)]
        lo, hi = StreamSpec().query_gap
        assert tick + rows.bank.speech_frames(clip) + lo <= start <= tick + rows.bank.speech_frames(clip) + hi
        n = min(len(clip), T - tick)
        assert np.array_equal(tokens[9:, tick:tick + n], clip[:n].T)  # heard where the row says
        assert (tokens[1:9] == silence[:, None]).all() and not sample.speak  # the model says nothing aloud
        assert [(s.start, s.end) for s in sample.text] == [(0, T)]
        before = TOK.decode([int(x) for x in tokens[0, :tick] if x != TOK.pad_id])
        assert (tokens[0, tick:start] == TOK.pad_id).all()  # silent while the user asks
        assert before == "" or before.split("!")[0].split()[-1] in sample.l1_text  # a greeting names them
    assert len({rows.row(random.Random(s)).spoken[0][1] for s in range(12)}) == len(QUESTIONS)


def test_a_bank_that_lacks_the_drill_questions_is_refused(rows, codec):
    with pytest.raises(ValueError, match="does not speak 1 of the drill questions"):
        QueryRows(rows.bank, {**QUESTIONS, "Where does my uncle live?": ("uncle", Query(("uncle",), ("live",)))},
                  silence_code(codec))


class _Scripted:
    """A stand-in model: a real tiny model's attributes (to lay rows out), text logits all mass on given tokens."""

    def __init__(self, lm, tokens):
        self.lm, self.training = lm, False
        self.logits = torch.nn.functional.one_hot(tokens, lm.text_card).float()[:, None]

    def __getattr__(self, name):
        return getattr(self.lm, name)

    def forward_text(self, inputs):
        return None, self.logits

    def eval(self):
        return self

    def train(self, mode=True):
        return self


def test_teacher_forced_scores_count_the_query_who_what_and_when(rows):
    from egomem.dialog.checkpoint import build_lm
    from egomem.training.listen import collate

    lm = build_lm("tiny", seed=0, card=2048, context=512 + 256 + 200)
    drawn = [rows.row(random.Random(s)) for s in range(3)]
    packed = collate(lm, drawn, (512, 256))
    assert query_scores_teacher_forced(_Scripted(lm, packed.targets), drawn, QUESTIONS, (512, 256)) == \
        {"query": 1.0, "who": 1.0, "what": 1.0, "start": 1.0}
    wrong = packed.targets.clone()
    ends = [c + row.stream.shape[1] for c, row in zip(packed.offsets, drawn)]
    lengths = [len(TOK.encode(QUESTIONS[row.spoken[0][1]][1].text())) for row in drawn]
    wrong[0, ends[0] - lengths[0] + len("<retr>:\n")] += 1  # row 0: the relation's first byte
    wrong[1, ends[1] - lengths[1]] += 1  # row 1: the query's first byte (when)
    s = query_scores_teacher_forced(_Scripted(lm, wrong), drawn, QUESTIONS, (512, 256))
    assert s == {"query": pytest.approx(1 / 3), "who": pytest.approx(2 / 3), "what": 1.0, "start": pytest.approx(2 / 3)}


def test_the_query_stage_trains_from_weights_and_resumes_bit_exactly(tmp_path):
    """`egomem train-backbone --task query`: query drills in the short layout, held-out scores on held-out
    relations in held-out voices and on training relations in held-out voices (drilled sentences and others),
    bit-exact resume, `head_weight` applied; it refuses to start from nothing."""
    import json

    from safetensors.torch import load_file, save_file

    from egomem.dialog.checkpoint import build_lm
    from egomem.training.backbone import BackboneConfig, train_backbone

    small = dict(dim=64, num_heads=2, num_layers=2, context=1024, depformer_dim=32, depformer_dim_feedforward=64,
                 depformer_num_heads=2, depformer_num_layers=1)
    start = tmp_path / "start.safetensors"
    save_file({k: v.contiguous() for k, v in build_lm("tiny", seed=9, **small).state_dict().items()}, str(start))

    def config(out, **kw):
        base = dict(task="query", weights=start, model_overrides=small, steps=6, batch_size=2, lr=2e-3, warmup=2,
                    voices=1, relations=2, eval_every=3, ckpt_every=3)
        return BackboneConfig(out, **(base | kw))

    whole = train_backbone(config(tmp_path / "whole"), progress=False)
    scores = {f"{s}_{k}" for s in ("held", "voice", "sentence") for k in ("query", "who", "what", "start")}
    assert whole.complete and set(whole.held) == scores
    card = json.loads((tmp_path / "whole" / "model_card.json").read_text())
    assert card["task"] == "query" and card["started_from"] == str(start)
    assert {p.name for p in (tmp_path / "whole").glob("query_clips_*.npz")} == {
        "query_clips_train.npz", "query_clips_heldout.npz", "query_clips_heldout_voices.npz",
        "query_clips_heldout_sentences.npz"}
    part = train_backbone(config(tmp_path / "split", stop_after=4), progress=False)
    assert not part.complete and part.step == 4
    done = train_backbone(config(tmp_path / "split", resume=True), progress=False)
    a, b = load_file(str(whole.path)), load_file(str(done.path))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["text_emb.weight"], load_file(str(start))["text_emb.weight"])
    plain = load_file(str(train_backbone(config(tmp_path / "plain", head_weight=1.0), progress=False).path))
    assert any(not torch.equal(a[k], plain[k]) for k in a)  # the query's first bytes weigh head_weight (4) times
    with pytest.raises(ValueError, match="give --weights"):
        train_backbone(config(tmp_path / "none", weights=None), progress=False)


def test_new_voice_questions_keep_every_question_of_the_first_relations():
    """The query stage's `voice_*` rows ask the training questions of the first N training relations (sorted), all
    of their templates, and nothing else."""
    from egomem.training.query_drill import bank_questions, new_voice_questions

    questions = bank_questions(10, 2, 3)
    first = sorted({rel for rel, _ in questions.values()})[:4]
    got = new_voice_questions(questions, 4)
    assert {rel for rel, _ in got.values()} == set(first)
    assert got == {q: v for q, v in questions.items() if v[0] in first} and len(got) == 8


def test_new_sentence_questions_ask_the_same_relations_in_sentences_the_bank_does_not_hold():
    """The new-sentence rows ask the first N training relations (sorted) in other sentences of
    `corpus.relation_questions`, each with its own ground-truth query, the same on every call."""
    from egomem.training.corpus import relation_questions
    from egomem.training.query_drill import bank_questions, new_sentence_questions

    questions = bank_questions(10, 2, 3)
    first = sorted({rel for rel, _ in questions.values()})[:4]
    got = new_sentence_questions(questions, 4, per_relation=3)
    assert len(got) == 12 and {rel for rel, _ in got.values()} == set(first)
    assert not set(got) & set(questions)  # no drilled sentence
    for q, (rel, query) in got.items():
        assert (q, query) in relation_questions(rel)
    assert new_sentence_questions(questions, 4, per_relation=3) == got
    assert new_sentence_questions(questions, 4, per_relation=3, seed=1) != got


def test_a_bank_built_per_question_speaks_each_sentence_in_its_own_draw_of_voices(codec):
    """per_question=k: each question in a seeded draw of k of the bank's voices (many sentences, a bank of the
    same size), the rows asking it drawn in those voices only; its own fingerprint; k beyond the voices refused."""
    voices = TRAIN_VOICES[:3]
    bank = ClipBank(codec, voices, sorted(QUESTIONS), seed=0, progress=False, copies=1, per_question=1)
    assert all(len(bank.speakers[q]) == 1 and bank.speakers[q][0] in voices for q in QUESTIONS)
    assert set(bank.clean) == {(q, bank.speakers[q][0]) for q in QUESTIONS}
    assert {(q, v) for q, v, _ in bank.noised} == set(bank.clean)
    speaking = {bank.speakers[q][0] for q in QUESTIONS}
    assert len(speaking) < len(voices)  # (this draw leaves a voice silent)
    assert {v for v, _ in bank.background} == speaking  # a silent voice has no background
    again = ClipBank(codec, voices, sorted(QUESTIONS), seed=0, progress=False, copies=1, per_question=1)
    assert again.speakers == bank.speakers  # seeded
    full = ClipBank(codec, voices[:1], sorted(QUESTIONS), seed=0, progress=False, copies=1)
    assert full.speakers == {q: voices[:1] for q in QUESTIONS} and full.fingerprint != bank.fingerprint
    rows = QueryRows(bank, QUESTIONS, silence_code(codec))
    try:
        r = random.Random(0)
        for _ in range(12):
            row = rows.row(r)
            assert row.voice == bank.speakers[row.spoken[0][1]][0]
    finally:
        rows.close()
    with pytest.raises(ValueError, match=r"per_question must be in \[1, 3\]"):
        ClipBank(codec, voices, sorted(QUESTIONS), seed=0, progress=False, copies=1, per_question=4)
