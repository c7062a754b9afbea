"""`egomem soup-dialog`: the weighted average of fine-tuned dialog models, as a run folder that eval-dialog,
ship-dialog and serving take; refusing ingredients that cannot be averaged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from egomem.cli import main as cli_main
from egomem.config import Config, DialogConfig
from egomem.dialog.card import checkpoint_metadata
from egomem.dialog.checkpoint import build_lm
from egomem.doctor import check_dialog
from egomem.training.ship import ship
from egomem.training.soup import SoupError, soup

TINY = dict(dim=32, num_heads=2, num_layers=1, card=16, text_card=260, context=32, depformer_dim=16,
            depformer_dim_feedforward=32, depformer_num_heads=2, depformer_num_layers=1)


def run_folder(folder: Path, seed: int, codec: str = "abc123", context: str = "dialog", **overrides) -> Path:
    """A finetune run folder (float32 lm.safetensors + model_card.json) holding a seeded random tiny LM."""
    folder.mkdir(parents=True)
    lm = build_lm("tiny", seed=seed, **{**TINY, **overrides})
    save_file({k: v.contiguous() for k, v in lm.state_dict().items()}, str(folder / "lm.safetensors"),
              metadata={"format": "moshi-lm", "preset": "tiny", "trained_by": "egomem finetune", "context": context})
    card = {"preset": "tiny", "steps": seed * 100, "config": {"context": context},
            "data": {"codec": codec, "tokenizer": "byte", "fingerprint_sha256": "f00", "samples": 12}}
    (folder / "model_card.json").write_text(json.dumps(card))
    return folder / "lm.safetensors"


def test_a_soup_is_the_weighted_mean_of_its_ingredients_and_ships_and_loads_like_a_run(tmp_path):
    a, b = run_folder(tmp_path / "a", seed=1), run_folder(tmp_path / "b", seed=2)
    shipped_a = tmp_path / "a_shipped.safetensors"
    ship(a.parent, shipped_a, "float32")  # an ingredient may be a shipped file: it carries its codec itself
    card = soup([shipped_a, b], tmp_path / "soup", mix=[1.0, 3.0])  # normalised to 0.25 / 0.75
    assert [i["mix"] for i in card["soup"]] == [0.25, 0.75]
    assert [i["steps"] for i in card["soup"]] == ["100", 200]
    assert card["data"] == {"codec": "abc123", "tokenizer": "byte"} and card["config"]["context"] == "dialog"
    sa, sb, ss = (load_file(str(p)) for p in (a, b, tmp_path / "soup" / "lm.safetensors"))
    assert ss.keys() == sa.keys()
    moved = 0
    for k in ss:
        assert torch.allclose(ss[k], 0.25 * sa[k] + 0.75 * sb[k], atol=1e-6), k
        moved += not torch.equal(sa[k], sb[k])
    assert moved > len(ss) // 2  # the two ingredients differ, so the mean is neither

    lm = build_lm("tiny", tmp_path / "soup" / "lm.safetensors", **TINY)
    x = torch.randint(0, 16, (1, lm.num_codebooks, 5))
    x[:, 0] = torch.randint(0, 260, (1, 5))
    assert torch.isfinite(lm(x).text_logits).all()

    out = tmp_path / "soup_shipped.safetensors"
    meta = ship(tmp_path / "soup", out, codec="abc123")  # ship-dialog's codec check passes on the soup's codec
    assert meta["context"] == "dialog" and meta["codec"] == "abc123"
    assert [i["mix"] for i in json.loads(checkpoint_metadata(out)["soup"])] == [0.25, 0.75]
    cfg = Config(dialog=DialogConfig(weights=out))
    (line,) = [f.what for f in check_dialog(cfg) if "fine-tuned model" in f.what]
    assert "a soup of 2 fine-tunes" in line


def test_the_same_model_twice_is_itself_and_the_default_mix_is_uniform(tmp_path):
    a, b = run_folder(tmp_path / "a", seed=1), run_folder(tmp_path / "b", seed=2)
    soup([a, a], tmp_path / "self")
    sa, ss = load_file(str(a)), load_file(str(tmp_path / "self" / "lm.safetensors"))
    assert all(torch.allclose(ss[k], sa[k], atol=1e-7) for k in sa)
    card = soup([a, b], tmp_path / "half")
    assert [i["mix"] for i in card["soup"]] == [0.5, 0.5]


def test_ingredients_that_cannot_be_averaged_are_refused_by_name(tmp_path, capsys):
    a = run_folder(tmp_path / "a", seed=1)
    with pytest.raises(SoupError, match="disagree on codec"):
        soup([a, run_folder(tmp_path / "other_codec", seed=2, codec="zzz999")], tmp_path / "x")
    with pytest.raises(SoupError, match="disagree on context"):
        soup([a, run_folder(tmp_path / "stream", seed=2, context="stream")], tmp_path / "x")
    wide = run_folder(tmp_path / "wide", seed=2, dim=48)
    with pytest.raises(SoupError, match=f"{wide}: .* is"):
        soup([a, wide], tmp_path / "x")
    deeper = run_folder(tmp_path / "deeper", seed=2, num_layers=2)
    with pytest.raises(SoupError, match="another architecture"):
        soup([a, deeper], tmp_path / "x")
    with pytest.raises(SoupError, match="at least two"):
        soup([a], tmp_path / "x")
    with pytest.raises(SoupError, match="2 weights for 3"):
        soup([a, a, a], tmp_path / "x", mix=[1, 1])
    with pytest.raises(SoupError, match="non-negative"):
        soup([a, a], tmp_path / "x", mix=[1, -1])
    broken = run_folder(tmp_path / "broken", seed=2)
    (broken.parent / "model_card.json").write_text("{not json")
    with pytest.raises(SoupError, match="model_card.json is not JSON"):
        soup([a, broken], tmp_path / "x")
    assert not (tmp_path / "x").exists()  # nothing written for a refused soup

    assert cli_main(["soup-dialog", "--weights", str(a), str(tmp_path / "missing.safetensors"),
                     "--out", str(tmp_path / "y")]) == 2
    assert "missing.safetensors not found" in capsys.readouterr().out
    with pytest.raises(SoupError, match="configured Mimi is 3d55"):
        soup([a, a], tmp_path / "x", codec="3d555703c05a13fc")
    # the CLI checks the configured codec (the shipped tiny one here; the test runs learnt "abc123")
    assert cli_main(["soup-dialog", "--weights", str(a), str(a), "--out", str(tmp_path / "y")]) == 2
    assert "learnt the codes of codec abc123" in capsys.readouterr().out
    assert cli_main(["soup-dialog", "--weights", str(a), str(a), "--mix", "3", "1", "--out", str(tmp_path / "y"),
                     "--any-codec"]) == 0
    assert "0.75 x" in capsys.readouterr().out


def test_integer_tensors_are_kept_when_equal_and_refused_when_not(tmp_path):
    a, b, c = (tmp_path / f"{n}.safetensors" for n in "abc")
    scalars = {"scale": torch.tensor(2.0), "on": torch.tensor(True), "none": torch.zeros(0, 4)}  # 0-dim, bool, empty
    save_file({"w": torch.zeros(2, 3, dtype=torch.bfloat16), "step": torch.tensor([7])} | scalars, a,
              metadata={"codec": "x"})
    save_file({"w": torch.full((2, 3), 4.0, dtype=torch.bfloat16), "step": torch.tensor([7])}
              | scalars | {"scale": torch.tensor(6.0, dtype=torch.float16)}, b)
    save_file({"w": torch.ones(2, 3), "step": torch.tensor([8])} | scalars, c)
    card = soup([a, b], tmp_path / "mix", mix=[3, 1])  # b as a blend a + 0.25 x (b - a)
    # written tensor by tensor (safetensors' own reader takes the file): floats as float32, the rest as they were
    mix = load_file(tmp_path / "mix" / "lm.safetensors")
    assert mix["w"].dtype == torch.float32 and torch.equal(mix["w"], torch.full((2, 3), 1.0))
    assert torch.equal(mix["step"], torch.tensor([7])) and card["data"]["codec"] == "x"
    assert torch.equal(mix["scale"], torch.tensor(3.0)) and torch.equal(mix["on"], torch.tensor(True))
    assert mix["none"].shape == (0, 4) and mix["none"].dtype == torch.float32
    assert checkpoint_metadata(tmp_path / "mix" / "lm.safetensors")["trained_by"] == "egomem finetune"
    with pytest.raises(SoupError, match="integer tensor step differs"):
        soup([a, c], tmp_path / "x")
    assert not (tmp_path / "x").exists()  # refused before anything is written
