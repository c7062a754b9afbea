"""Loading the dialog model and its tokenizer from local files; clear errors for anything wrong."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from egomem.dialog.checkpoint import CheckpointError, build_lm
from egomem.dialog.tokenizer import ByteTokenizer, SentencePieceTokenizer, load_tokenizer

TINY = dict(dim=64, num_heads=2, num_layers=2, card=32, text_card=40, context=32, depformer_dim=32,
            depformer_dim_feedforward=64, depformer_num_heads=2, depformer_num_layers=1)


def _state(lm) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in lm.state_dict().items()}


def test_random_weights_are_seeded():
    a, b, c = build_lm("tiny", seed=1, **TINY), build_lm("tiny", seed=1, **TINY), build_lm("tiny", seed=2, **TINY)
    assert torch.equal(a.text_linear.weight, b.text_linear.weight)
    assert not torch.equal(a.text_linear.weight, c.text_linear.weight)


def test_safetensors_round_trip_and_fused_in_proj(tmp_path):
    lm = build_lm("tiny", seed=3, **TINY)
    state = _state(lm)
    # Moshi's published checkpoints store the temporal attention as one fused `in_proj_weight`
    for k in [k for k in state if k.startswith("transformer.") and k.endswith("in_projs.0.weight")]:
        state[k.replace("in_projs.0.weight", "in_proj_weight")] = state.pop(k)
    path = tmp_path / "lm.safetensors"
    save_file(state, str(path))
    loaded = build_lm("tiny", weights=path, **TINY)
    for (k, v), (k2, v2) in zip(lm.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    assert not loaded.training and loaded.text_linear.weight.device.type == "cpu"


def test_final_norm_follows_the_preset_and_the_checkpoint(tmp_path):
    """tiny has no final norm, so its checkpoints carry no `out_norm.alpha`; a checkpoint that carries one
    (a tiny model trained before the preset dropped it) loads with its norm; a preset that keeps the norm
    (7b) refuses a checkpoint without it, naming the key."""
    tiny = build_lm("tiny", seed=5, **TINY)
    assert tiny.out_norm is None and not any(k.startswith("out_norm.") for k in tiny.state_dict())
    normed = build_lm("tiny", seed=5, out_norm=True, **TINY)
    with torch.no_grad():
        normed.out_norm.alpha.mul_(3.0)  # not the init, so a load that dropped or re-initialised it would show
    path, plain = tmp_path / "normed.safetensors", tmp_path / "plain.safetensors"
    save_file(_state(normed), str(path))
    save_file(_state(tiny), str(plain))
    loaded = build_lm("tiny", weights=path, **TINY)
    assert torch.equal(loaded.out_norm.alpha, normed.out_norm.alpha)
    assert build_lm("tiny", weights=plain, **TINY).out_norm is None
    with pytest.raises(CheckpointError, match=r"plain.safetensors.*missing keys: out_norm.alpha"):
        build_lm("tiny", weights=plain, out_norm=True, **TINY)



def test_text_embedding_init_follows_the_preset(tmp_path):
    """tiny draws its random text embedding at std 1 (presets.py: the text stands out of the 16 summed audio
    embeddings), moshi's init is 1/sqrt(dim); only the text embedding differs, and a checkpoint's weights win."""
    wide = TINY | dict(dim=256)  # moshi's std 1/16: far from 1
    tiny, moshi_init = build_lm("tiny", seed=6, **wide), build_lm("tiny", seed=6, text_emb_std=None, **wide)
    assert 0.9 < tiny.text_emb.weight.std().item() < 1.1
    assert 0.8 / 16 < moshi_init.text_emb.weight.std().item() < 1.2 / 16
    differ = [k for k, v in tiny.state_dict().items() if not torch.equal(v, moshi_init.state_dict()[k])]
    assert differ == ["text_emb.weight"]
    path = tmp_path / "moshi_init.safetensors"
    save_file(_state(moshi_init), str(path))
    assert torch.equal(build_lm("tiny", weights=path, **wide).text_emb.weight, moshi_init.text_emb.weight)

def test_missing_checkpoint_names_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere.safetensors.*never downloaded"):
        build_lm("tiny", weights=tmp_path / "nowhere.safetensors", **TINY)


@pytest.mark.parametrize("corruption", ["missing", "unexpected", "shape", "garbage"])
def test_corrupt_checkpoint_names_file_and_keys(tmp_path, corruption):
    state = _state(build_lm("tiny", seed=4, **TINY))
    path = tmp_path / "bad.safetensors"
    if corruption == "missing":
        del state["text_linear.weight"]
        expect = "missing keys: text_linear.weight"
    elif corruption == "unexpected":
        state["extra.weight"] = torch.zeros(2)
        expect = "unexpected keys: extra.weight"
    elif corruption == "shape":
        state["emb.3.weight"] = torch.zeros(5, 64)
        expect = r"emb.3.weight \(5, 64\) != \(33, 64\)"
    if corruption == "garbage":
        path.write_bytes(b"not a safetensors file at all")
        expect = "not a readable safetensors"
    else:
        save_file(state, str(path))
    with pytest.raises(CheckpointError, match=expect) as err:
        build_lm("tiny", weights=path, **TINY)
    assert "bad.safetensors" in str(err.value)


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 260
    ids = tok.encode("Ada mag grünen Tee")
    assert min(ids) >= 4 and max(ids) < 260 and tok.decode(ids + [tok.pad_id]) == "Ada mag grünen Tee"


def test_sentencepiece_tokenizer_from_local_file(tmp_path):
    import sentencepiece

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"Ada likes tea number {i} and talks about Bob {i % 7}" for i in range(200)))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "spm"), vocab_size=40,
                                             minloglevel=2)
    tok = load_tokenizer(tmp_path / "spm.model")
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 40
    assert tok.decode(tok.encode("Ada likes tea")) == "Ada likes tea"
    (tmp_path / "junk.model").write_bytes(b"junk")
    with pytest.raises(ValueError, match="junk.model is not a SentencePiece model"):
        load_tokenizer(tmp_path / "junk.model")
    with pytest.raises(FileNotFoundError, match="absent.model"):
        load_tokenizer(tmp_path / "absent.model")
