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


# ---------------------------------------------------------------- a denoising codec (session 58)


def test_each_crop_comes_with_itself_without_its_noise(crops):
    rng = np.random.default_rng(3)
    x, _, clean = crops.batch(rng, 12, 8, noise_p=0.5, stream_noise=True)
    noised = [not torch.equal(a, b) for a, b in zip(x, clean)]
    assert 0 < sum(noised) < 12  # about half the crops carry noise, the others are their clean copy
    for a, b, n in zip(x, clean, noised):
        if n:
            snr = 10 * torch.log10(b.pow(2).mean() / (a - b).pow(2).mean())
            assert -1.0 < snr < 21.0, snr  # 0-20 dB to the crop's own speech (clipping moves it a little)
    x, _, clean = crops.batch(np.random.default_rng(3), 4, 8, noise_p=0.0)
    assert torch.equal(x, clean)


def test_a_denoising_fine_tune_starts_from_the_given_codec_and_keeps_its_codebooks(crops, tmp_path):
    cfg = CodecTrainConfig(**{**CFG.key(), "warmup_steps": 0, "steps": 2, "noise_p": 1.0, "denoise": 1,
                              "consistency_weight": 1.0, "stream_noise": 1, "init_weights": str(SHIPPED_TINY_CODEC)})
    t = CodecTrainer(cfg, crops, tmp_path)
    x = speech(crops)
    np.testing.assert_array_equal(encode(t.model.eval(), x), encode(build_mimi(MimiConfig()), x))
    t.model.train()
    before = [layer._codebook.embedding.clone() for _, layers in codebooks(t.model) for layer in layers]
    run(t, 1)
    after = [layer._codebook.embedding for _, layers in codebooks(t.model) for layer in layers]
    drift = max(float((a - b).norm() / b.norm()) for a, b in zip(after, before))
    assert drift < 0.05, drift  # EMA updates only: k-means at step 0 would have replaced every codebook
    assert t.history[0]["consistency"] > 0  # a noised crop's first-codebook input differs from the clean one's


def test_the_denoising_targets_are_the_clean_crops(crops, tmp_path):
    base = {**CFG.key(), "warmup_steps": 0, "steps": 1, "init_weights": str(SHIPPED_TINY_CODEC)}
    mel = {}
    for noise_p, denoise in ((1.0, 0), (1.0, 1), (0.0, 0), (0.0, 1)):
        t = CodecTrainer(CodecTrainConfig(**{**base, "noise_p": noise_p, "denoise": denoise}), crops,
                         tmp_path / f"{noise_p}-{denoise}")
        run(t, 1)
        mel[noise_p, denoise] = t.history[0]["mel"]
        assert t.history[0]["consistency"] == 0.0  # off unless weighted
    assert mel[1.0, 0] != mel[1.0, 1]  # noised crops: reconstructing the clean crop is another loss
    assert mel[0.0, 0] == mel[0.0, 1]  # clean crops: the same target either way
