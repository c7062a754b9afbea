"""`egomem train-codec`: seeded and resumable, codebooks from speech latents, checkpoints that
`build_mimi` loads (and refuses when they do not fit); the shipped trained codec is the default."""

from pathlib import Path

import numpy as np
import pytest
import torch

from egomem.codec.mimi import SHIPPED_TINY_CODEC, MimiWeightsError, build_mimi, codec_weights
from egomem.codec.train import CodecTrainConfig, CodecTrainer, SpeechCrops, codebooks, save_codec, speech_files
from egomem.config import MimiConfig
from egomem.trigger.codec import encode

DATA = Path(__file__).parent / "data" / "identity"  # LibriSpeech utterances (ATTRIBUTION.md there)
CFG = CodecTrainConfig(seed=0, steps=6, warmup_steps=2, batch=2, crop_frames=8, kmeans_frames=600,
                       quantized_tail=0.34)


@pytest.fixture(scope="module")
def crops() -> SpeechCrops:
    return SpeechCrops(speech_files([DATA]), progress=False)


def speech(crops: SpeechCrops) -> np.ndarray:
    return crops.audio[0][: 1920 * 30] * 0.5


def run(trainer: CodecTrainer, n: int) -> None:
    for _ in range(n):
        trainer.train_step()


def test_training_is_seeded_and_resumes_bit_exactly(crops, tmp_path):
    straight = CodecTrainer(CFG, crops, tmp_path / "a")
    run(straight, 6)
    first = CodecTrainer(CFG, crops, tmp_path / "b")
    run(first, 3)  # past the warm-up: the k-means codebooks are in the saved state
    first.save()
    resumed = CodecTrainer(CFG, crops, tmp_path / "b")
    assert resumed.resume() and resumed.step == 3
    run(resumed, 3)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history]
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_with_other_settings_is_refused(crops, tmp_path):
    t = CodecTrainer(CFG, crops, tmp_path)
    run(t, 1)
    t.save()
    other = CodecTrainer(CodecTrainConfig(**{**CFG.key(), "lr": 5e-4}), crops, tmp_path)
    with pytest.raises(SystemExit, match="other settings"):
        other.resume()


@torch.no_grad()
def first_layer_error(model: torch.nn.Module, x: np.ndarray) -> float:
    """Mean squared quantisation error of the first residual codebook on the latents of `x`."""
    model.eval()
    emb = model._encode_to_unquantized_latent(torch.from_numpy(x)[None, None])
    rvq, layers = codebooks(model)[1]
    residual = rvq.input_proj(emb)
    err = residual - layers[0].decode(layers[0].encode(residual))
    model.train()
    return float((err**2).mean() / (residual**2).mean())


def test_codebooks_are_fitted_to_speech_latents_after_the_warm_up(crops, tmp_path):
    t = CodecTrainer(CFG, crops, tmp_path)
    run(t, CFG.warmup_steps)  # warm-up done; the codebooks are still the random-init ones
    before = first_layer_error(t.model, speech(crops))
    run(t, 1)  # this step k-means-initialises every codebook on speech latents
    after = first_layer_error(t.model, speech(crops))
    assert after < 0.8 * before, (before, after)


def test_a_saved_codec_is_what_build_mimi_loads(crops, tmp_path):
    t = CodecTrainer(CFG, crops, tmp_path)
    run(t, 4)
    path = tmp_path / "codec.safetensors"
    save_codec(t.model, path, {"trained": "egomem train-codec", "steps": 4})
    loaded = build_mimi(MimiConfig(weights=path))
    x = speech(crops)
    np.testing.assert_array_equal(encode(loaded, x), encode(t.model.eval(), x))


def test_a_checkpoint_of_the_wrong_shape_is_an_error_naming_the_file(tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(str(SHIPPED_TINY_CODEC))
    key = next(k for k in state if k.endswith("embedding_sum"))
    state[key] = torch.zeros(16, state[key].shape[1])  # a codebook of another size
    bad = tmp_path / "wrong_shape.safetensors"
    save_file(state, str(bad))
    with pytest.raises(MimiWeightsError, match="wrong_shape.safetensors") as e:
        build_mimi(MimiConfig(weights=bad))
    assert key in str(e.value)


def test_no_speech_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no speech files"):
        speech_files([tmp_path])


def test_the_default_codec_is_the_shipped_trained_one(crops):
    from safetensors import safe_open

    assert codec_weights(MimiConfig()) == SHIPPED_TINY_CODEC
    assert codec_weights(MimiConfig(random_init=True)) is None
    assert SHIPPED_TINY_CODEC.stat().st_size < 30 * 2**20
    with safe_open(str(SHIPPED_TINY_CODEC), framework="pt") as f:
        meta = f.metadata()
    assert meta["trained"] == "egomem train-codec"
    assert "--data" in meta["train_command"] and "--seed" in meta["train_command"]
    x = speech(crops)
    trained, random = encode(build_mimi(MimiConfig()), x), encode(build_mimi(MimiConfig(random_init=True)), x)
    assert (trained != random).mean() > 0.5
