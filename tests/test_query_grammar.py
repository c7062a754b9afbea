"""The query grammar (egomem/dialog/query_grammar.py): a `<retr>` query's relation line names only relations
the slot's Level-1 profile holds; everything else on the text channel stays free."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from egomem.dialog import DialogEngine
from egomem.dialog.checkpoint import build_lm
from egomem.dialog.query_grammar import HEADER, GrammarTokens, QueryGrammar, profile_relations
from egomem.dialog.serving import DialogRequest, DialogStreamPool
from egomem.dialog.tokenizer import ByteTokenizer
from egomem.retrieval import parse_query

# the tiny test model with the byte tokenizer's text vocabulary, so its text channel writes bytes
TINY = dict(dim=64, num_heads=2, num_layers=2, card=32, text_card=ByteTokenizer.vocab_size, context=64,
            depformer_dim=32, depformer_dim_feedforward=64, depformer_num_heads=2, depformer_num_layers=1)
BT = ByteTokenizer()
TOKENS = GrammarTokens.from_tokenizer(BT)
PROFILE = ("name: Fleno Whufield\npeople: Nami Trucott (niece's doctor); Rano Giman (son); Taitha (Tai) Prowood "
           "(son's teacher); Braibel Whomore (neighbour's partner); Kovi Lund (son)\nfact: lives in Houston")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def lm():
    return build_lm("tiny", seed=0, **TINY)


def test_profile_relations_reads_the_people_line_in_order_without_repeats():
    assert profile_relations(PROFILE) == ["niece's doctor", "son", "son's teacher", "neighbour's partner"]
    assert profile_relations("name: A\nfact: has a dog") == []
    # a relation holding the separator could not be written on the line: left out
    assert profile_relations("people: A (boss, ex); B (aunt)") == ["aunt"]


def test_the_relation_line_allows_exactly_the_continuations_of_the_profile_relations():
    g = QueryGrammar(TOKENS, slots=2, device="cpu")
    rels = profile_relations(PROFILE)
    assert g.relations(1, [BT.encode(r) for r in rels]) == len(rels)
    V = BT.vocab_size

    def allowed(slot: int, written: str) -> set[str]:
        g.state[slot] = g.H  # the header was just written: the relation line's root
        rows = torch.tensor([slot])
        for tok in BT.encode(written):
            g.advance(rows, torch.tensor([tok]), BT.pad_id, None)
        ids = torch.nonzero(g.mask(torch.zeros(1, V), rows)[0] == 0).flatten().tolist()
        return {BT.decode([i]) for i in ids} if len(ids) < 128 else set(ids)  # a few characters, or every id

    assert allowed(1, "") == {"n", "s", "\n"}  # niece's / neighbour's, son / son's, or no relation
    assert allowed(1, "ne") == {"i"}
    assert allowed(1, "son") == {"'", ",", "\n"}  # "son" is whole; "son's teacher" goes on
    assert allowed(1, "son,") == {" "}
    assert allowed(1, "son, ") == {"n", "s"}  # a second relation, not an empty one
    assert allowed(1, "son's teacher") == {",", "\n"}
    assert allowed(0, "") == {"\n"}  # slot 0 holds no relation: only the empty line
    # the newline leaves the line: free text again, every token allowed
    assert allowed(1, "son\n") == set(range(V)) and int(g.state[1]) == 0


def test_the_header_is_found_in_free_text_and_a_pad_neither_opens_nor_breaks_it():
    g = QueryGrammar(TOKENS, slots=1, device="cpu")
    rows = torch.tensor([0])

    def feed(ids: list[int]) -> int:
        for tok in ids:
            g.advance(rows, torch.tensor([tok]), BT.pad_id, None)
        return int(g.state[0])

    assert feed(BT.encode("Hi <re<ret")) == 4  # "<ret" matched so far; the broken "<re" restarted on '<'
    assert feed([BT.pad_id, BT.pad_id]) == 4
    assert feed(BT.encode("r>:\n")) == g.H  # the relation line's root
    g.state[0] = 0
    assert feed(BT.encode("<retx>:\n")) == 0  # not a header


def test_a_relation_that_overflows_the_table_is_left_out_and_the_rest_still_fit():
    g = QueryGrammar(TOKENS, slots=1, device="cpu", max_states=len(HEADER) + 24)
    fitted = g.relations(0, [BT.encode("mother"), BT.encode("a very long relation indeed"), BT.encode("son")])
    assert fitted == 2
    assert g.state.tolist() == [0]
    with pytest.raises(ValueError, match="no room"):
        QueryGrammar(TOKENS, slots=1, device="cpu", max_states=len(HEADER))


def _relation_line(engine: DialogEngine, slots: list[int], ticks: int, fixed_shape: bool) -> list[str]:
    """Put `slots` at the relation line's root, tick greedily, and return each slot's text up to its newline."""
    for s in slots:
        engine.grammar.state[s] = engine.grammar.H
    written: dict[int, list[int]] = {s: [] for s in slots}
    for tick in range(ticks + engine.max_delay):
        listen = torch.zeros(len(slots), 8, dtype=torch.long)
        if fixed_shape:
            full = torch.zeros(engine.max_streams, 8, dtype=torch.long)
            mask = torch.zeros(engine.max_streams, dtype=torch.bool)
            mask[slots] = True
            text = engine.step_all(full, mask)[0][slots]
        else:
            text = engine.step(slots, listen)[0]
        for s, t in zip(slots, text.tolist(), strict=True):
            if tick >= engine.max_delay:  # the aligned text lags the drawn token by max_delay ticks
                written[s].append(t)
    return [BT.decode(written[s]).split("\n")[0] + ("\n" if "\n" in BT.decode(written[s]) else "") for s in slots]


@pytest.mark.parametrize("fixed_shape", [False, True])
def test_the_engine_writes_only_the_slot_relations_on_the_relation_line(lm, fixed_shape):
    """A random model writes bytes at random; with the grammar each slot's relation line is its own profile's
    relations joined by ', ' and closed by a newline; the same model without it writes none of them."""
    rel_sets = [["son", "son's teacher"], ["niece's doctor", "aunt", "pastor"], [], ["coworker"]]
    engine = DialogEngine(lm, max_streams=5, l1_steps=0, l2_steps=0, query_grammar=TOKENS)
    slots = [engine.open(seed=i) for i in range(4)]
    idle = engine.open(seed=9)  # open, never stepped: its state must not move
    for s, rels in zip(slots, rel_sets, strict=True):
        assert engine.set_query_relations(s, [BT.encode(r) for r in rels]) == len(rels)
    lines = _relation_line(engine, slots, ticks=40, fixed_shape=fixed_shape)
    for line, rels in zip(lines, rel_sets, strict=True):
        body = line.rstrip("\n")
        items = body.split(", ") if body else []
        assert all(it in rels for it in items), (line, rels)
        assert line.endswith("\n") and len(items) <= TOKENS.max_relations, line  # closed after at most two
    assert lines[2] == "\n"  # no relation in the profile: the empty line at once
    assert int(engine.grammar.state[idle]) == 0

    free = DialogEngine(lm, max_streams=4, l1_steps=0, l2_steps=0)
    free_slots = [free.open(seed=i) for i in range(4)]
    texts = []
    for _ in range(20 + free.max_delay):
        texts.append(free.step(free_slots, torch.zeros(4, 8, dtype=torch.long))[0].tolist())
    for k, rels in enumerate(rel_sets):
        line = BT.decode([t[k] for t in texts if t[k] >= 0]).split("\n")[0]
        assert not any(line.startswith(r) for r in rels), line  # the model alone does not write them


def test_the_pool_loads_the_relations_of_each_level_1_write_and_a_query_parses_to_them(lm):
    engine = DialogEngine(lm, max_streams=2, l1_steps=0 + 400, l2_steps=16, ring_steps=32, query_grammar=TOKENS)
    pool = DialogStreamPool(engine, BT, ttl_s=float("inf"))
    listen = torch.zeros(8, dtype=torch.long).numpy()
    [res] = pool.serve([DialogRequest(1, start=True, listen=listen, memchunk_level=1, memchunk_text=PROFILE)])
    slot = pool._slots[1]
    assert engine.grammar.loaded[slot] == 4
    [line] = _relation_line(engine, [slot], ticks=30, fixed_shape=False)
    query = parse_query(HEADER + line + "work<answer>")
    assert query is not None and set(query.relations) <= set(profile_relations(PROFILE))
    # the next person's profile, sent as tokens, replaces the table (and leaves the line)
    pool.serve([DialogRequest(1, listen=listen, memchunk_level=1,
                              memchunk_tokens=np.asarray(BT.encode("name: B\npeople: C (aunt)")))])
    assert engine.grammar.loaded[slot] == 1 and int(engine.grammar.state[slot]) == 0


def test_set_query_relations_needs_the_grammar_and_an_open_slot(lm):
    engine = DialogEngine(lm, max_streams=1, l1_steps=0, l2_steps=0)
    slot = engine.open(seed=0)
    with pytest.raises(ValueError, match="no query grammar"):
        engine.set_query_relations(slot, [[70]])
    with_grammar = DialogEngine(lm, max_streams=1, l1_steps=0, l2_steps=0, query_grammar=TOKENS)
    with pytest.raises(KeyError, match="not open"):
        with_grammar.set_query_relations(0, [[70]])
