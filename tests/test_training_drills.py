"""Fresh names and reading drills (egomem/training/drills.py): exact frames on hand-made rows."""

from __future__ import annotations

import random

import numpy as np
import pytest

from egomem.dialog.tokenizer import ByteTokenizer
from egomem.training.drills import (
    DRILL_LEAD,
    DrillMix,
    check_tokenizer,
    name_words,
    random_l1,
    reading_drill,
    rename_people,
)
from egomem.training.types import Sample, Span

TOK = ByteTokenizer()
L1 = "name: Ada Lovelace\nlikes: tea and chess\npeople: Bob Lovelace (son); Cy Ng (friend)"


def _row(T: int = 120, at: int = 30, reply: str = "Hi Ada! Is Bob well? Ada") -> tuple[Sample, np.ndarray]:
    tokens = np.random.default_rng(0).integers(0, 2048, (17, T))
    tokens[0] = TOK.pad_id
    ids = TOK.encode(reply)
    tokens[0, at:at + len(ids)] = ids
    sample = Sample(stream="s0", kind="l1_response", l1_text=L1, l2_text="", text=(Span(at - 2, at + len(ids)),),
                    speak=(Span(at, at + len(ids)),), generator="test")
    return sample, tokens


def _text(tokens: np.ndarray, a: int, b: int) -> str:
    return TOK.decode(tokens[0, a:b].tolist())


def test_name_words_reads_name_and_people_lines():
    assert name_words(L1) == ["Ada", "Lovelace", "Bob", "Lovelace", "Cy", "Ng"]


def first_surname(sample: Sample) -> str:
    return sample.l1_text.splitlines()[0].split()[2]


def test_rename_people_keeps_every_frame_in_place():
    sample, tokens = _row()
    new, out = rename_people(sample, tokens, random.Random(3))
    old_reply, new_reply = _text(tokens, 30, 54), _text(out, 30, 54)
    first = new.l1_text.splitlines()[0].split()[1]  # Ada's new name
    bob = new.l1_text.splitlines()[2].split()[1]
    assert first != "Ada" and len(first) == 3 and first[0].isupper()
    assert new_reply == f"Hi {first}! Is {bob} well? {first}" and len(new_reply) == len(old_reply)
    # the other lines, the pad frames and all audio rows are untouched; the surname is renamed consistently
    assert new.l1_text.splitlines()[1] == "likes: tea and chess"
    assert new.l1_text.count(new.l1_text.splitlines()[0].split()[2]) == 2 and "Lovelace" not in new.l1_text
    assert np.array_equal(out[1:], tokens[1:]) and np.array_equal(out[0, :30], tokens[0, :30])
    assert (new.text, new.speak) == (sample.text, sample.speak)
    # a Level-2 row: its L2 MemChunk names the same people, renamed alike (the answer copies from either)
    l2 = Sample(**{**sample.__dict__, "kind": "l2_response", "l2_text": "Bob Lovelace (son): plays chess\nZed (pal): x"})
    new2, _ = rename_people(l2, tokens, random.Random(3))
    assert new2.l2_text == f"{bob} {first_surname(new2)} (son): plays chess\nZed (pal): x"
    assert new2.l1_text == new.l1_text  # the same draws as the L1-only row
    # no name line: the row is returned as it was
    plain = Sample(**{**sample.__dict__, "l1_text": "likes: tea"})
    assert rename_people(plain, tokens, random.Random(0))[0] is plain


def test_reading_drill_writes_a_span_of_l1_under_its_own_mask():
    sample, tokens = _row(T=400)
    for seed in range(20):
        new, out = reading_drill(sample, tokens, random.Random(seed), (20, 40), window=192)
        (span,) = new.text
        start = span.start + DRILL_LEAD
        n = span.end - start
        assert 20 <= n <= 40 and new.speak == ()
        assert _text(out, start, span.end) in L1  # the bytes it writes are a piece of its L1 text
        assert (out[0, span.start:start] == TOK.pad_id).all()  # on cue: pads before the first byte
        assert span.end > sample.text[0].end - 192  # inside the trained window that ends at the old sample's end
        assert np.array_equal(out[1:], tokens[1:])


def test_drill_mix_and_its_checks():
    sample, tokens = _row(T=400)
    off = DrillMix()
    assert not off.active and off.apply(sample, tokens, random.Random(0), 192, 512)[0] is sample
    always = DrillMix(fresh_names=1.0, drills=1.0, random_l1=1.0, span=(30, 60))
    new, out = always.apply(sample, tokens, random.Random(1), 192, 512)
    assert new.l1_text != L1 and "name:" not in new.l1_text and 330 <= len(new.l1_text) <= 380
    assert _text(out, new.text[0].start + DRILL_LEAD, new.text[0].end) in new.l1_text
    assert DrillMix(drills=1.5, span=(9, 3)).check() == ["drills must be in [0, 1] (got 1.5)",
                                                         "drill span must be 1 <= min <= max (got (9, 3))"]
    assert random_l1(random.Random(0)) == random_l1(random.Random(0)) != random_l1(random.Random(1))
    assert len(always.apply(sample, tokens, random.Random(1), 192, n1=64)[0].l1_text) == 64  # fits a small L1


def test_only_the_byte_tokenizer_can_be_drilled():
    check_tokenizer(TOK)

    class Pieces:
        vocab_size, pad_id = 32000, 3

    with pytest.raises(ValueError, match="byte-level tokenizer.*--fresh-names 0 --drills 0"):
        check_tokenizer(Pieces())
