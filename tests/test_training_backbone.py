"""`egomem train-backbone`: synthetic reading drills, the loop, bit-exact resume, the checkpoint finetune starts from.

A tiny LMModel (dim 64, 2 layers, the byte tokenizer's 260 text ids) on short rows; whether the real tiny
preset learns to copy is the benchmark's (docs/training.md, "A backbone that copies"), not a unit test's.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from safetensors.torch import load_file

from egomem.dialog.checkpoint import build_lm
from egomem.dialog.tokenizer import ByteTokenizer
from egomem.training.backbone import BackboneConfig, main, make_row, train_backbone

TINY = dict(dim=64, num_heads=2, num_layers=2, card=32, context=96, depformer_dim=32,
            depformer_dim_feedforward=64, depformer_num_heads=2, depformer_num_layers=1)
TOK = ByteTokenizer()

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def config(out, **kw) -> BackboneConfig:
    base = dict(model_overrides=TINY, steps=30, batch_size=8, lr=3e-3, warmup=5, chunk=40, dialog=16, span=(4, 8),
                eval_every=10, ckpt_every=10)
    return BackboneConfig(out, **(base | kw))


def test_a_drill_row_writes_a_span_of_its_chunk():
    cfg = config("unused")
    for seed in range(20):
        chunk, dialog, sup = make_row(random.Random(seed), cfg, TOK)
        assert len(chunk) == cfg.chunk and len(dialog) == len(sup) == cfg.dialog
        chunk = [t for t in chunk if t != TOK.pad_id]
        written = [t for t, s in zip(dialog, sup, strict=True) if s]
        first = sup.index(True)
        assert sup[first:first + len(written)] == [True] * len(written)  # one contiguous span ...
        assert cfg.span[0] <= len(written) <= cfg.span[1] and first >= 1  # ... after the initial tick
        assert any(chunk[i:i + len(written)] == written for i in range(len(chunk)))  # copied from the chunk
        assert all(t == TOK.pad_id for t, s in zip(dialog, sup, strict=True) if not s)
        text = TOK.decode(chunk)
        assert text.startswith(":") and set(text) <= set("abcdefghijklmnopqrstuvwxyz:;=.\n")


def test_training_lowers_the_loss_resumes_bit_exactly_and_finetune_can_start_from_it(tmp_path):
    whole = train_backbone(config(tmp_path / "whole"), progress=False)
    assert whole.complete and whole.step == 30 and 0.0 <= whole.held_copy <= 1.0
    records = [json.loads(x) for x in (tmp_path / "whole" / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert [r["step"] for r in records if "held_copy" in r] == [10, 20, 30]
    losses = [r["loss"] for r in records]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses

    part = train_backbone(config(tmp_path / "split", stop_after=13), progress=False)
    assert not part.complete and part.step == 13 and part.path.name == "state.pt"
    done = train_backbone(config(tmp_path / "split", resume=True, threads=1), progress=False)  # threads may change
    a, b = load_file(str(whole.path)), load_file(str(done.path))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    resumed = [json.loads(x) for x in (tmp_path / "split" / "loss.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in resumed] == losses  # one record per step across the two invocations

    card = json.loads((tmp_path / "whole" / "model_card.json").read_text())
    assert card["steps"] == 30 and card["held_copy"] == whole.held_copy and card["preset"] == "tiny"
    lm = build_lm("tiny", weights=whole.path, **TINY)  # what `egomem finetune --weights` loads
    assert torch.equal(lm.text_emb.weight, a["text_emb.weight"])


def test_bad_settings_are_refused_with_what_to_do(tmp_path, capsys):
    with pytest.raises(ValueError, match="dialog - 2"):
        train_backbone(config(tmp_path / "a", span=(4, 15)), progress=False)
    with pytest.raises(ValueError, match="chunk 20 must hold"):
        train_backbone(config(tmp_path / "a", chunk=20), progress=False)
    train_backbone(config(tmp_path / "b", stop_after=10), progress=False)
    with pytest.raises(FileExistsError, match="--resume"):
        train_backbone(config(tmp_path / "b"), progress=False)
    with pytest.raises(ValueError, match=r"other settings for \['lr'\]"):
        train_backbone(dataclasses.replace(config(tmp_path / "b", resume=True), lr=1e-2), progress=False)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train_backbone(config(tmp_path / "c", resume=True), progress=False)
    assert main(["--out", str(tmp_path / "d"), "--span", "50", "60", "--no-progress"]) == 2
    assert "egomem train-backbone: span (50, 60)" in capsys.readouterr().err
