"""Which dialog model a config serves (the shipped fine-tuned tiny model by default), the serving settings a
checkpoint records about itself, and `egomem ship-dialog`, which writes such a checkpoint from a finetune run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from egomem.cli import main as cli_main
from egomem.config import DialogConfig
from egomem.dialog.card import SHIPPED_TINY_DIALOG, checkpoint_metadata, dialog_weights, serving_settings
from egomem.dialog.checkpoint import build_lm
from egomem.training.ship import ShipError, ship

TINY = dict(dim=32, num_heads=2, num_layers=1, card=16, text_card=260, context=32, depformer_dim=16,
            depformer_dim_feedforward=32, depformer_num_heads=2, depformer_num_layers=1)


def finetune_run(folder: Path, context: str = "dialog") -> Path:
    """A run folder as `egomem finetune` leaves it: float32 lm.safetensors (its metadata) and model_card.json."""
    folder.mkdir(parents=True)
    lm = build_lm("tiny", seed=3, **TINY)
    save_file({k: v.contiguous() for k, v in lm.state_dict().items()}, str(folder / "lm.safetensors"),
              metadata={"format": "moshi-lm", "preset": "tiny", "trained_by": "egomem finetune", "context": context})
    card = {"preset": "tiny", "steps": 7, "config": {"context": context},
            "data": {"codec": "abc123", "fingerprint_sha256": "f00", "samples": 12}}
    (folder / "model_card.json").write_text(json.dumps(card))
    return folder


def test_the_default_is_the_shipped_model_and_random_init_is_a_switch(tmp_path):
    assert dialog_weights(DialogConfig()) == SHIPPED_TINY_DIALOG
    assert dialog_weights(DialogConfig(random_init=True)) is None
    assert dialog_weights(DialogConfig(preset="7b")) is None  # nothing ships at 7B: its weights are the user's
    assert dialog_weights(DialogConfig(weights=tmp_path / "x.safetensors", random_init=True)) == tmp_path / "x.safetensors"
    random = serving_settings(DialogConfig(random_init=True))
    assert (random.weights, random.new_person, random.start_temperature) == (None, "swap", None)


def test_auto_settings_come_from_the_checkpoint_and_explicit_ones_win(tmp_path):
    run = finetune_run(tmp_path / "run")
    shipped = tmp_path / "shipped.safetensors"
    ship(run, shipped, start_temperature=1.0)
    s = serving_settings(DialogConfig(weights=shipped))
    assert (s.new_person, s.start_temperature) == ("restart", 1.0)
    s = serving_settings(DialogConfig(weights=shipped, new_person="swap", start_temperature=None))
    assert (s.new_person, s.start_temperature) == ("swap", None)
    # a run fine-tuned on whole streams ("stream" context), shipped without a start temperature
    ship(finetune_run(tmp_path / "stream", context="stream"), shipped)
    s = serving_settings(DialogConfig(weights=shipped))
    assert (s.new_person, s.start_temperature) == ("swap", None)
    # a file that is not safetensors has no settings; loading it is where the error is raised
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 16)
    assert checkpoint_metadata(junk) == {} and checkpoint_metadata(tmp_path / "missing") == {}
    assert serving_settings(DialogConfig(weights=junk)).new_person == "swap"


def test_ship_writes_a_half_size_checkpoint_that_loads_and_predicts_like_the_run(tmp_path):
    run = finetune_run(tmp_path / "run")
    out = tmp_path / "shipped.safetensors"
    meta = ship(run, out, "bfloat16", 1.0, note="test")
    assert meta["context"] == "dialog" and meta["codec"] == "abc123" and meta["steps"] == "7"
    assert checkpoint_metadata(out) == meta
    assert out.stat().st_size < 0.6 * (run / "lm.safetensors").stat().st_size
    full = build_lm("tiny", run / "lm.safetensors", **TINY)
    half = build_lm("tiny", out, **TINY)  # cast up to float32 on loading, as the CPU engine runs it
    assert half.dtype == torch.float32
    x = torch.randint(0, 16, (1, full.num_codebooks, 6))
    x[:, 0] = torch.randint(0, 260, (1, 6))
    a, b = full(x).text_logits, half(x).text_logits
    assert not torch.equal(a, b) and torch.allclose(a, b, atol=0.05, rtol=0.05)  # rounded, not another model


def test_ship_refuses_a_folder_that_is_not_a_finished_run(tmp_path, capsys):
    with pytest.raises(ShipError, match="lm.safetensors not found"):
        ship(tmp_path, tmp_path / "out.safetensors")
    run = finetune_run(tmp_path / "run")
    with pytest.raises(ShipError, match="start-temperature"):
        ship(run, tmp_path / "out.safetensors", start_temperature=-1.0)
    with pytest.raises(ShipError, match="learnt the codes of codec abc123"):
        ship(run, tmp_path / "out.safetensors", codec="another")
    assert cli_main(["ship-dialog", "--run", str(tmp_path / "nowhere")]) == 2
    assert "finished `egomem finetune` run folder" in capsys.readouterr().out


def test_the_shipped_model_is_small_learnt_the_shipped_codec_greets_new_people_by_name_and_replays():
    """The offline default is a trained model, not a random one: on a restart with the profile of a held-out
    person (names never in training) and the user silent, it says their first name within a few seconds.
    Turn starts drawn at its recorded T = 1 from a seeded generator, words greedy (as it is served)."""
    import numpy as np

    from egomem.codec.mimi import build_mimi
    from egomem.config import MimiConfig
    from egomem.dialog.serving import DialogRequest, DialogStreamPool, build_engine
    from egomem.training.corpus import first_name, make_household
    from egomem.training.memory_text import MemoryTexts
    from egomem.training.streams import silence_code
    from egomem.trigger.codec import codec_fingerprint

    assert SHIPPED_TINY_DIALOG.stat().st_size < 60 * 2**20
    meta = checkpoint_metadata(SHIPPED_TINY_DIALOG)
    assert meta["trained_by"] == "egomem finetune" and meta["shipped_by"] == "egomem ship-dialog"
    codec = build_mimi(MimiConfig())
    assert meta["codec"] == codec_fingerprint(codec)
    silent = silence_code(codec)
    cfg = DialogConfig(max_streams=4)
    engine, tokenizer = build_engine(cfg, "cpu")
    assert engine.start_temperature == 1.0
    pool = DialogStreamPool(engine, tokenizer, seed=7)  # turn starts drawn per stream from (7, stream id)
    homes = [make_household("heldout", 5, i) for i in range(4)]
    memory = MemoryTexts(homes, l1_bytes=cfg.l1_steps, l2_bytes=cfg.l2_steps)

    def talk(which: list[int], torch_seed: int) -> list[str]:
        said = ["" for _ in which]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(torch_seed)  # the process's generator plays no part in the served draws
            for t in range(50):  # 4 s
                reqs = []
                for i in which:
                    req = DialogRequest(i + 1, start=t == 0, listen=silent.astype(np.int64))
                    if t == 0:
                        req.memchunk_level, req.memchunk_text = 1, memory.l1(homes[i].main.user_id)
                    reqs.append(req)
                for k, res in enumerate(pool.serve(reqs)):
                    said[k] += res.text_piece
        for i in which:
            pool.close(i + 1)
        return said

    try:
        said = talk([0, 1, 2, 3], 0)
        alone = talk([2], 1)  # the same stream again, alone in the batch: word for word what it said
    finally:
        memory.close()
    greeted = [first_name(h.main) in text for h, text in zip(homes, said, strict=True)]
    assert sum(greeted) >= 3, said  # held-out greetings by name: 0.9 of them in the eval (README model card)
    assert alone == [said[2]]
