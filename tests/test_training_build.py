"""`egomem make-corpus`: the command writes a dataset the trainer reads, and refuses what it cannot do."""

from __future__ import annotations

import json

import numpy as np
import pytest

from egomem.cli import main
from egomem.training.corpus import GENERATOR, RETURN_VISIT
from egomem.training.dataset import Dataset
from egomem.training.vocab import pools

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_make_corpus_writes_a_heldout_level1_dataset(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DEEPSEEK_API_KEY", raising=False)  # auto = templates without a key
    out = tmp_path / "ds"
    assert main(["make-corpus", "--out", str(out), "--households", "1", "--split", "heldout", "--levels", "1",
                 "--no-noised", "--seed", "3", "--own-questions", "2,2"]) == 0
    ds = Dataset(out)
    assert ds.manifest["n1"] == 512 and ds.manifest["n2"] == 256 and ds.manifest["tokenizer"] == "byte"
    assert ds.manifest["corpus_options"] == {"own_questions": [2, 2], "return_visit": RETURN_VISIT}
    main_dialog = next(d for d in ds.dialogs if d.user_id == ds.households[0].main.user_id and d.level == 1)
    assert sum(t.user != "" and t.level == 1 for t in main_dialog.turns) == 2
    assert ds.samples and {s.kind for s in ds.samples} == {"l1_response"}
    assert {s.generator for s in ds.samples} == {GENERATOR} and GENERATOR in capsys.readouterr().out
    assert all(s.meta["split"] == "heldout" and not s.meta["noised"] for s in ds.samples)
    people = {p.user_id: p for h in ds.households for p in (h.main, *h.related)}
    for s in ds.samples:  # each sample's L1 is its own dialog's user's profile, and the stream holds the frames
        user = ds.dialogs[s.meta["corpus_dialog"]].user_id
        assert s.l1_text.startswith(f"name: {people[user].name}") and s.l2_text == ""
        assert max(sp.end for sp in s.text) <= ds.tokens(s.stream).shape[1]
    assert not list(out.glob("streams/*-noised.npy"))
    assert ds.manifest["spec"]["pause"] == [3, 12] and ds.manifest["spec"]["dialog_gap"] == [12, 38]  # defaults
    with pytest.raises(SystemExit, match="already holds a dataset"):  # never overwrites one
        main(["make-corpus", "--out", str(out), "--households", "1", "--levels", "1"])
    assert json.loads((out / "manifest.json").read_text())["counts"]["households"] == 1
    # the listen row as serving writes it (one pass over the microphone audio) unless --listen spliced
    assert ds.manifest["spec"]["listen"] == "whole"
    assert main(["make-corpus", "--out", str(tmp_path / "spliced"), "--households", "1", "--split", "heldout",
                 "--levels", "1", "--no-noised", "--seed", "3", "--own-questions", "2,2", "--listen", "spliced"]) == 0
    old = Dataset(tmp_path / "spliced")
    assert old.manifest["spec"]["listen"] == "spliced"
    stream = ds.samples[0].stream
    assert np.array_equal(old.tokens(stream)[:9], ds.tokens(stream)[:9])  # same layout, text and speak rows
    assert not np.array_equal(old.tokens(stream)[9:], ds.tokens(stream)[9:])


def test_make_corpus_heldout_people_with_training_relation_words(tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPSEEK_API_KEY", raising=False)
    out = tmp_path / "known"
    assert main(["make-corpus", "--out", str(out), "--households", "1", "--split", "heldout", "--levels", "2",
                 "--no-noised", "--seed", "3", "--relation-words", "train"]) == 0
    ds = Dataset(out)
    assert ds.manifest["corpus_options"]["relation_words"] == "train"
    assert {s.kind for s in ds.samples} == {"l2_query", "l2_response"}
    asked = {r for d in ds.dialogs for t in d.turns if t.query for r in t.query.relations}
    assert asked and asked <= set(pools("train").relations)
    assert all(s.meta["split"] == "heldout" for s in ds.samples)


def _two_heldout_households(out, *flags: str) -> Dataset:
    """A two-household held-out corpus without noised copies, built by the CLI with `flags`."""
    assert main(["make-corpus", "--out", str(out), "--households", "2", "--split", "heldout", "--no-noised",
                 "--seed", "3", *flags]) == 0
    return Dataset(out)


def test_make_corpus_lays_out_the_pauses_and_dialog_gaps_it_is_given(tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPSEEK_API_KEY", raising=False)
    ds = _two_heldout_households(tmp_path / "patient", "--levels", "1", "--own-questions", "2,2", "--pause", "40,50",
                                 "--dialog-gap", "90,95")
    assert ds.manifest["spec"]["pause"] == [40, 50] and ds.manifest["spec"]["dialog_gap"] == [90, 95]
    pauses, gaps = [], []
    for layout in ds.layouts:
        for before, after in zip(layout.dialogs, layout.dialogs[1:]):
            gaps.append(after.start - before.end)
        for d in layout.dialogs:
            pauses += [b.user_start - a.reply_end for a, b in zip(d.turns, d.turns[1:]) if not a.interrupted]
    assert pauses and all(40 <= p <= 50 for p in pauses)
    assert gaps and all(90 <= g <= 95 for g in gaps)


def test_make_corpus_asks_in_the_return_visit_and_records_it(tmp_path, monkeypatch):
    """--visit-asks 1 --graph-dialogs 0: every Level-2 sample comes from a greeted return visit, and the
    manifest records both options."""
    monkeypatch.delenv("DEEPSEEK_API_KEY", raising=False)
    ds = _two_heldout_households(tmp_path / "visit", "--levels", "1,2", "--return-visit", "1", "--graph-dialogs", "0",
                                 "--visit-asks", "1")
    assert ds.manifest["corpus_options"]["graph_dialogs"] == 0 and ds.manifest["corpus_options"]["visit_asks"] == 1.0
    level2 = [d for d in ds.dialogs if d.level == 2]
    assert len(level2) == 2 and all(d.turns[0].user == "" and d.turns[-1].query for d in level2)
    assert {"l2_query", "l2_response", "l1_response"} <= {s.kind for s in ds.samples}


def test_make_corpus_refuses_llm_without_a_key_and_bad_levels(tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPSEEK_API_KEY", raising=False)
    refused = [  # (folder, flags, what the error says)
        ("a", ["--generator", "llm"], "needs an \\[llm\\] endpoint with an API key"),
        ("b", ["--levels", "1,3"], "--levels takes 0, 1 and/or 2"),
        ("c", ["--own-questions", "3"], "--own-questions takes min,max"),
        ("c", ["--own-questions", "2,1"], "--own-questions needs 0 <= min <= max"),
        ("c", ["--return-visit", "1.5"], "--return-visit is a probability"),
        ("c", ["--visit-asks", "-0.1"], "--visit-asks is a probability"),
        ("c", ["--graph-dialogs", "-1"], "--graph-dialogs takes a count"),
        ("c", ["--pause", "9,3"], "--pause needs 0 <= min <= max"),
        ("c", ["--dialog-gap", "long"], "--dialog-gap takes min,max"),
        ("c", ["--dialogs-per-stream", "two"], "--dialogs-per-stream takes min,max"),
    ]
    for folder, flags, says in refused:
        with pytest.raises(SystemExit, match=says):
            main(["make-corpus", "--out", str(tmp_path / folder), *flags])
    monkeypatch.setenv("DEEPSEEK_API_KEY", "sk-test")  # an endpoint with a key: the LLM writes the dialogs
    with pytest.raises(SystemExit, match="--relation-words train needs the template generator"):
        main(["make-corpus", "--out", str(tmp_path / "d"), "--relation-words", "train"])
    assert not any((tmp_path / x).exists() for x in "abcd")
