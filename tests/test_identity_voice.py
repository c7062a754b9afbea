"""Voice pipeline: real GE2E (Resemblyzer weights) + silero-vad on a few LibriSpeech utterances."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from egomem.config import IdentityConfig
from egomem.identity.errors import InputError, ModelFilesMissing
from egomem.identity.voice import ResemblyzerEncoder, VoiceActivity, WavLMEncoder, build_speaker_encoder, to_16k

DATA = Path(__file__).parent / "data" / "identity"
SPEAKERS = {"1998": ["1998-15444-0007", "1998-15444-0008"], "2033": ["2033-164914-0004", "2033-164914-0005"],
            "2414": ["2414-128291-0003", "2414-128291-0009"]}


def load(name: str) -> np.ndarray:
    pcm, sr = sf.read(DATA / f"{name}.flac", dtype="float32")
    assert sr == 16000
    return pcm


@pytest.fixture(scope="module")
def encoder() -> ResemblyzerEncoder:
    return build_speaker_encoder(IdentityConfig())


@pytest.fixture(scope="module")
def embeddings(encoder: ResemblyzerEncoder) -> dict[str, np.ndarray]:
    out = {}
    for names in SPEAKERS.values():
        for n in names:
            res = encoder.encode(load(n), 16000)
            assert res.voiced, f"{n}: no speech found"
            out[n] = res.embedding
    return out


def test_same_speaker_scores_above_different_speakers(embeddings: dict[str, np.ndarray]) -> None:
    same = [float(embeddings[a] @ embeddings[b]) for a, b in SPEAKERS.values()]
    spk = list(SPEAKERS)
    diff = [float(embeddings[x] @ embeddings[y]) for i, a in enumerate(spk) for b in spk[i + 1:]
            for x in SPEAKERS[a] for y in SPEAKERS[b]]
    assert min(same) > max(diff), (same, diff)
    for e in embeddings.values():
        assert e.shape == (256,) and e.dtype == np.float32 and abs(np.linalg.norm(e) - 1) < 1e-4


def test_24k_stream_audio_is_resampled_to_the_same_voice(encoder: ResemblyzerEncoder, embeddings: dict[str, np.ndarray]) -> None:
    from scipy.signal import resample_poly

    pcm24 = resample_poly(load("2033-164914-0004"), 3, 2).astype(np.float32)
    res = encoder.encode(pcm24, 24000)
    assert res.voiced and float(res.embedding @ embeddings["2033-164914-0004"]) > 0.95
    assert to_16k(pcm24, 24000).shape[0] == pytest.approx(load("2033-164914-0004").shape[0], abs=2)


def test_silence_and_noise_are_not_voiced(encoder: ResemblyzerEncoder) -> None:
    silence = np.zeros(16000 * 3, np.float32)
    noise = np.random.default_rng(0).normal(0, 0.05, 16000 * 3).astype(np.float32)
    for pcm in (silence, noise):
        res = encoder.encode(pcm, 16000)
        assert not res.voiced and res.embedding is None and res.voiced_ratio < 0.2


def test_speech_padded_with_silence_keeps_its_embedding(encoder: ResemblyzerEncoder, embeddings: dict[str, np.ndarray]) -> None:
    pcm = load("1998-15444-0007")
    padded = np.concatenate([np.zeros(16000 * 4, np.float32), pcm, np.zeros(16000 * 4, np.float32)])
    res = encoder.encode(padded, 16000)
    assert res.voiced and res.voiced_ratio < 0.5  # most of the clip is silence, and the VAD says so
    assert float(res.embedding @ embeddings["1998-15444-0007"]) > 0.95  # gating removed it before embedding


@pytest.mark.parametrize(
    "pcm, sr, message",
    [
        (np.zeros(3, np.float32), 16000, "3 samples"),
        (np.full(16000, np.nan, np.float32), 16000, "NaN"),
        (np.zeros(16000, np.float64), 16000, "float32"),
        (np.zeros((2, 16000), np.float32), 16000, "mono"),
        (np.zeros(16000, np.float32), 44100, "sample rate"),
        (np.zeros(16000 * 61, np.float32), 16000, "limit"),
        ("not audio", 16000, "numpy"),
    ],
)
def test_bad_audio_gets_clear_errors(encoder: ResemblyzerEncoder, pcm: object, sr: int, message: str) -> None:
    with pytest.raises(InputError, match=message):
        encoder.encode(pcm, sr)


def test_paper_backend_without_checkpoint_names_what_is_missing(tmp_path: Path) -> None:
    vad = VoiceActivity()
    with pytest.raises(ModelFilesMissing, match="wavlm_checkpoint"):
        build_speaker_encoder(IdentityConfig(voice_backend="wavlm"), vad)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFilesMissing, match="preprocessor_config.json"):
        WavLMEncoder(tmp_path, 2.0, vad)


def test_cohort_build_one_unit_row_per_speaker(encoder: ResemblyzerEncoder, embeddings: dict[str, np.ndarray], tmp_path: Path) -> None:
    from egomem.identity.cohort_build import build_cohort, main

    files = [DATA / f"{n}.flac" for n in ["1998-15444-0007", "1998-15444-0008", "2033-164914-0004"]]
    rows, speakers = build_cohort(files, encoder)
    assert speakers == ["1998", "2033"] and rows.shape == (2, 256)
    mean = embeddings["1998-15444-0007"] + embeddings["1998-15444-0008"]
    np.testing.assert_allclose(rows[0], mean / np.linalg.norm(mean), atol=1e-5)
    audio = tmp_path / "audio"
    audio.mkdir()
    for f in files[1:]:
        (audio / f.name).write_bytes(f.read_bytes())
    assert main(["--audio-dir", str(audio), "--out", str(tmp_path / "c.npy")]) == 0
    assert np.load(tmp_path / "c.npy").shape == (2, 256)
