"""bench/blend_dialog_weights.py: base + alpha x (tuned - base), the tuned file's metadata kept."""

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

spec = importlib.util.spec_from_file_location("blend_dialog_weights",
                                              Path(__file__).parents[1] / "bench" / "blend_dialog_weights.py")
blend_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(blend_module)


def test_blend_interpolates_float_tensors_keeps_the_tuned_card_and_refuses_another_model(tmp_path):
    base, tuned = tmp_path / "base.safetensors", tmp_path / "tuned.safetensors"
    save_file({"w": torch.zeros(2, 3, dtype=torch.bfloat16), "step": torch.tensor([1])}, base)
    save_file({"w": torch.full((2, 3), 4.0, dtype=torch.bfloat16), "step": torch.tensor([7])}, tuned,
              metadata={"context": "dialog", "start_temperature": "1.0"})
    out = tmp_path / "mix.safetensors"
    blend_module.blend(base, tuned, 0.25, out)
    mix = load_file(out)
    assert mix["w"].dtype == torch.bfloat16 and torch.equal(mix["w"], torch.full((2, 3), 1.0, dtype=torch.bfloat16))
    assert torch.equal(mix["step"], torch.tensor([7]))  # integer tensors are the tuned file's
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert meta["context"] == "dialog" and meta["start_temperature"] == "1.0" and "0.25" in meta["blend"]
    save_file({"w": torch.zeros(3, 3)}, other := tmp_path / "other.safetensors")
    with pytest.raises(SystemExit, match="not the same model"):
        blend_module.blend(other, tuned, 0.5, tmp_path / "x.safetensors")
