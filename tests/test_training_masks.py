"""The three supervision masks (egomem/training/masks.py) and the on-disk dataset (dataset.py).

Masks are checked twice: on a hand-made `StreamLayout` whose every span is written out here, and on
a stream built from real audio (eSpeak NG + the tiny Mimi), where the text tokens under each mask
must be exactly the words the mask is meant to teach. The dataset is built, read back, rebuilt
bit-exactly, and refused when its manifest is damaged.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from egomem.config import MimiConfig
from egomem.dialog.tokenizer import ByteTokenizer
from egomem.training.dataset import FORMAT, Dataset, DatasetError, build_dataset, check_chunk_texts, write_dataset
from egomem.training.masks import count_kinds, frame_mask, stream_samples
from egomem.training.streams import DialogLayout, StreamBuilder, StreamLayout, StreamSpec, TurnLayout
from egomem.training.types import Dialog, Edge, Household, Profile, Query, Sample, Span, Turn
from egomem.trigger.codec import build_codec

HOME = Household(
    Profile("ada", "Ada", ("plays tennis in Lisbon",), (("like", "green tea"),), "a retired pilot"),
    (Profile("bob", "Bob", ("works as a nurse",)), Profile("cleo", "Cleo", ("is a vet",))),
    (Edge("bob", "brother"), Edge("cleo", "sister")),
)
Q1 = Query(("sister",), ())
Q2 = Query(("sister",), ("job",))
UNUSED = Dialog("ada", "ada", 1, (Turn("Hi.", "Hello."),), "template:1")
A = Dialog("ada", "ada", 1, (Turn("", "Hi Ada."), Turn("Any news?", "Bob called.")), "template:1")
B = Dialog("ada", "bob", 2, (Turn("Hello.", "Hi Bob."), Turn("Who is my sister?", "Cleo.", 2, Q1),
                             Turn("And her job?", "She is a vet.", 2, Q2)), "llm:test-model")
C = Dialog("ada", "cleo", 0, (Turn("What is two plus two?", "Four."),), "template:1")
CORPUS = [UNUSED, A, B, C]


class HouseTexts:
    """MemChunk texts of HOME: L1 a rendered profile, L2 the relatives a query's relations name."""

    def __init__(self, home: Household = HOME):
        self.home = home
        self.l2_calls: list[tuple[str, Query]] = []

    def l1(self, user_id: str) -> str:
        p = self.home.person(user_id)
        return f"{p.name}: {'; '.join(p.facts)}"

    def l2(self, user_id: str, query: Query) -> str:
        self.l2_calls.append((user_id, query))
        rel = {e.relation: self.home.person(e.other) for e in self.home.edges}
        found = [rel[r] for r in query.relations if r in rel]
        return " | ".join(f"{user_id}'s {r}: {p.name}, {'; '.join(p.facts)}" for r, p in zip(query.relations, found,
                                                                                            strict=False))


# dialog frames of a hand-made stream: A (greeting interrupted by the user), B (plain + 2 Level-2 turns), C
LAYOUT = StreamLayout("hand", 234, (
    DialogLayout(1, "ada", "v", 3, 40, (
        TurnLayout(0, 3, 3, None, None, 5, 12, 7, 15, True),
        TurnLayout(1, 15, 25, None, None, 27, 40, 29, 38, False))),
    DialogLayout(2, "bob", "v", 60, 180, (
        TurnLayout(0, 60, 66, None, None, 68, 75, 70, 80, False),
        TurnLayout(1, 85, 95, 97, 110, 111, 115, 113, 125, False),
        TurnLayout(2, 130, 140, 142, 160, 161, 170, 163, 180, False))),
    DialogLayout(3, "cleo", "v", 200, 230, (
        TurnLayout(0, 200, 210, None, None, 212, 216, 214, 230, False),)),
))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def codec():
    return build_codec(MimiConfig())


def spans(*pairs: tuple[int, int]) -> tuple[Span, ...]:
    return tuple(Span(a, b) for a, b in pairs)


def test_masks_exact_spans_on_a_hand_made_layout():
    texts = HouseTexts()
    got = stream_samples(LAYOUT, CORPUS, texts, meta={"noised": False})
    kinds = [(s.kind, s.dialog, s.turn) for s in got]
    assert kinds == [("l1_response", 0, 0), ("l1_response", 1, 0), ("l2_query", 1, 1), ("l2_response", 1, 1),
                     ("l2_query", 1, 2), ("l2_response", 1, 2), ("l1_response", 2, 0)]
    a, b, q1, r1, q2, r2, c = got
    # Level-1 response: that dialog only, from its first turn's start to where the model stops after its last
    # reply, and through the silence after the dialog's last turn up to the next dialog's start
    assert a.text == a.speak == spans((3, 60)) and (a.l1_text, a.l2_text) == ("Ada: plays tennis in Lisbon", "")
    assert b.text == spans((60, 80)) and b.l1_text == "Bob: works as a nurse" and b.l2_text == ""  # no L2 turns
    assert c.text == spans((200, 234)) and c.l1_text == "Cleo: is a vet" and c.meta["level"] == 0  # to the stream's end
    # Level-2 query words: from the user's audio start to the end of the query, the previous context in view
    assert q1.text == q1.speak == spans((85, 110)) and q1.l2_text == ""
    assert q2.text == q2.speak == spans((130, 160)) and q2.l2_text == texts.l2("bob", Q1)  # what turn 1 retrieved
    # Level-2 response: from the end of the query to where the model stops, L2 = retrieval for the gt query
    assert r1.text == r1.speak == spans((110, 125)) and r1.l2_text == "bob's sister: Cleo, is a vet"
    assert r2.text == spans((160, 200)) and r2.l2_text == texts.l2("bob", Q2)  # the dialog's last turn: to C's start
    assert {s.l1_text for s in (b, q1, r1, q2, r2)} == {"Bob: works as a nurse"}
    # spans stay inside their own dialog and the silence after it; samples carry who made the dialog and where
    # it came from
    ends = [60, 200, 234]
    for s in got:
        d = LAYOUT.dialogs[s.dialog]
        assert all(d.start <= sp.start < sp.end <= ends[s.dialog] for sp in s.text + s.speak)
        assert s.generator == CORPUS[d.index].generator and s.meta["corpus_dialog"] == d.index
        assert s.meta["noised"] is False and s.meta["split"] == "train" and s.stream == "hand"
    assert count_kinds(got) == {"l1_response": 3, "l2_query": 2, "l2_response": 2}  # N + 2 * sum T


def test_level1_stream_of_n_dialogs_gives_n_samples():
    dialogs = [Dialog("ada", u, 1, (Turn("Hi.", f"Hello {u}."), Turn("Bye.", "Bye.")), "template:1")
               for u in ("ada", "bob", "cleo", "ada")]
    lay = StreamLayout("l1", 400, tuple(
        DialogLayout(i, d.user_id, "v", 100 * i, 100 * i + 60, (
            TurnLayout(0, 100 * i, 100 * i + 10, None, None, 100 * i + 12, 100 * i + 20, 100 * i + 14, 100 * i + 30,
                       False),
            TurnLayout(1, 100 * i + 35, 100 * i + 40, None, None, 100 * i + 42, 100 * i + 46, 100 * i + 44,
                       100 * i + 60, False))) for i, d in enumerate(dialogs)))
    got = stream_samples(lay, dialogs, HouseTexts())
    assert [s.kind for s in got] == ["l1_response"] * 4 and [s.dialog for s in got] == [0, 1, 2, 3]
    for i, s in enumerate(got):
        assert s.text == spans((100 * i, 100 * i + 100))  # the dialog and the silence up to the next one
        assert s.l1_text == HouseTexts().l1(dialogs[i].user_id)
    masks = np.stack([frame_mask(s.text, 400) for s in got])
    assert masks.sum(0).max() == 1  # no frame is supervised for two dialogs


def test_frame_mask():
    m = frame_mask(spans((2, 4), (7, 8)), 10)
    assert m.tolist() == [False, False, True, True, False, False, False, True, False, False]
    with pytest.raises(ValueError, match="outside a 10-frame stream"):
        frame_mask(spans((8, 12)), 10)


def test_layout_and_corpus_must_match():
    with pytest.raises(ValueError, match="pass the corpus the layout was built from"):
        stream_samples(LAYOUT, [A, C, B, UNUSED], HouseTexts())


def test_masks_on_a_built_stream_hold_exactly_the_words_they_teach(codec):
    b = StreamBuilder(codec, spec=StreamSpec(interrupt_p=0.5), seed=5)
    ids = ByteTokenizer().encode
    stream = b.build("real", [(1, A), (2, B), (3, C)], index=0, noised=False)
    text, speak = stream.tokens[0], stream.tokens[1:9]
    got = stream_samples(stream.layout, CORPUS, HouseTexts())
    assert count_kinds(got) == {"l1_response": 3, "l2_query": 2, "l2_response": 2}

    def words(span: Span) -> list[int]:
        return [int(t) for t in text[span.start:span.end] if t != ByteTokenizer.pad_id]

    for s in got:
        d = stream.layout.dialogs[s.dialog]
        dialog = CORPUS[d.index]
        if s.kind == "l1_response":
            plain = [u for u in d.turns if dialog.turns[u.turn].query is None]
            said = [t for u in plain for t in ids(dialog.turns[u.turn].reply)[:u.reply_text_end - u.reply_text_start]]
            assert [t for span in s.text for t in words(span)] == said and said  # replies cut where interrupted
            assert s.text[0].start == plain[0].user_start
            if plain[-1] is d.turns[-1]:  # the silence after the dialog, to the next one (or the stream's end)
                following = [e.start for e in stream.layout.dialogs if e.start > d.start]
                assert s.text[-1].end == (following[0] if following else stream.layout.n_steps)
                assert (text[plain[-1].reply_end:s.text[-1].end] == ByteTokenizer.pad_id).all()
            else:
                assert s.text[-1].end == plain[-1].reply_end
        else:
            u = next(u for u in d.turns if u.turn == s.turn)
            q = dialog.turns[u.turn].query
            if s.kind == "l2_query":
                assert words(s.text[0]) == ids(q.text())  # pads while the user speaks, then the query words
                assert (speak[:, s.text[0].start:s.text[0].end] == b.silence[:, None]).all()  # the model is silent
            else:
                n = u.reply_text_end - u.reply_text_start
                assert words(s.text[0]) == ids(dialog.turns[u.turn].reply)[:n]
                assert s.text[0].start == u.query_end
                assert s.text[0].end == (u.reply_end if u is not d.turns[-1] else min(
                    [e.start for e in stream.layout.dialogs if e.start > d.start] or [stream.layout.n_steps]))


# -- dataset ----------------------------------------------------------------------------------------------


def test_dataset_round_trip_and_rebuild(codec, tmp_path):
    corpus = [A, B, C, Dialog("ada", "bob", 1, (Turn("Good night.", "Sleep well, Bob."),), "template:1")]
    texts = HouseTexts()
    ds = build_dataset(tmp_path / "ds", [HOME], corpus, texts, codec, seed=11, dialogs_per_stream=(2, 2),
                       progress=False)
    m = ds.manifest
    assert m["format"] == FORMAT and (m["n1"], m["n2"], m["seed"], m["tokenizer"]) == (512, 256, 11, "byte")
    assert m["generators"] == {"template:1": 3, "llm:test-model": 1} and len(m["codec"]) == 16
    assert m["counts"]["streams"] == 4 and m["counts"]["noised_streams"] == 2 and m["counts"]["layouts"] == 2
    assert ds.households == [HOME] and ds.dialogs == corpus
    assert m["counts"]["samples"] == len(ds.samples) == 2 * sum(len(stream_samples(lay, corpus, texts))
                                                                for lay in ds.layouts)
    b = StreamBuilder(codec, seed=11)
    for i, lay in enumerate(ds.layouts):
        clean, noisy = ds.tokens(lay.stream), ds.tokens(f"{lay.stream}-noised")
        assert clean.dtype == np.int64 and clean.shape == (17, lay.n_steps)
        assert np.array_equal(clean[:9], noisy[:9]) and not np.array_equal(clean[9:], noisy[9:])
        again = b.build(lay.stream, [(d.index, corpus[d.index]) for d in lay.dialogs], index=i)
        assert again.layout == lay  # a second build reproduces the dataset bit for bit
        assert np.array_equal(again.tokens, clean) and np.array_equal(again.noised, noisy)
        mine = [s for s in ds.samples if s.stream == lay.stream]
        assert mine == stream_samples(lay, corpus, texts, meta={"noised": False})
        twins = [s for s in ds.samples if s.stream == f"{lay.stream}-noised"]
        assert [(s.kind, s.text, s.l2_text) for s in twins] == [(s.kind, s.text, s.l2_text) for s in mine]
        assert all(s.meta["noised"] for s in twins)
        # finetune's context="dialog": where each dialog's conversation began (a new person restarts it)
        first, second = lay.dialogs
        restart = second.start if second.user_id != first.user_id else 0
        assert ds.conversation_starts(lay.stream) == ds.conversation_starts(f"{lay.stream}-noised") == [0, restart]
    with pytest.raises(DatasetError, match="no layout"):
        ds.conversation_starts("s999")
    with pytest.raises(FileExistsError, match="already holds a dataset"):
        build_dataset(tmp_path / "ds", [HOME], corpus, texts, codec, seed=11, progress=False)
    with pytest.raises(KeyError, match="no stream 'nope'"):
        ds.tokens("nope")


def test_write_dataset_and_damaged_manifests(tmp_path):
    tokens = np.full((17, 12), 3, np.int64)
    sample = Sample("s0", "l1_response", "Ada", "", spans((1, 5)), spans((1, 5)), generator="template:1")
    base = {"n1": 512, "n2": 256, "tokenizer": "byte", "codec": "x", "seed": 0}
    ds = Dataset(write_dataset(tmp_path / "ok", base, [HOME], [A], {"s0": tokens}, [sample]))
    assert ds.samples == [sample] and np.array_equal(ds.tokens("s0"), tokens) and ds.layouts == []
    assert ds.manifest["counts"]["samples"] == 1 and ds.manifest["generators"] == {"template:1": 1}
    with pytest.raises(ValueError, match="samples name streams that were not written"):
        write_dataset(tmp_path / "orphan", base, [HOME], [A], {}, [sample])
    with pytest.raises(ValueError, match="int16"):
        write_dataset(tmp_path / "big", base, [HOME], [A], {"s0": tokens + 40_000}, [sample])

    manifest = tmp_path / "ok" / "manifest.json"
    good = manifest.read_text()
    for damage, why in (("{not json", "not JSON"), (json.dumps({**json.loads(good), "format": "v0"}), "format is 'v0'"),
                        (json.dumps({"format": FORMAT}), "lacks")):
        manifest.write_text(damage)
        with pytest.raises(DatasetError, match=f"not an {FORMAT} dataset: {tmp_path / 'ok'} .*{why}"):
            Dataset(tmp_path / "ok")
    manifest.unlink()
    with pytest.raises(DatasetError, match="no manifest.json"):
        Dataset(tmp_path / "ok")
    manifest.write_text(good)
    (tmp_path / "ok" / "samples.jsonl").write_text('{"stream": "s0"}\n')
    with pytest.raises(DatasetError, match="samples.jsonl line 1 is not valid"):
        _ = Dataset(tmp_path / "ok").samples


def test_chunk_texts_must_fit_their_chunks():
    sample = Sample("s0", "l2_response", "Ada: plays tennis", "bob's sister: Cleo", (), ())
    check_chunk_texts([sample], ByteTokenizer(), 512, 256)
    with pytest.raises(ValueError, match="L2 MemChunk text .* 18 tokens, over the chunk's 8"):
        check_chunk_texts([sample], ByteTokenizer(), 512, 8)
