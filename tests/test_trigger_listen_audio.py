"""The listen row encoded whole from audio (egomem.trigger.listen_audio): a stream keeps its layout and
gets the codec's one-pass codes of its laid-out audio; levels, echo and noise as documented; the
training pool is deterministic per shard, resumes, and trains and resumes a trigger bit-exactly."""

from pathlib import Path

import numpy as np
import pytest
import torch

from egomem.config import MimiConfig, TriggerConfig
from egomem.trigger.codec import build_codec, encode, probe_signal
from egomem.trigger.listen_audio import (
    FLOOR,
    FRAME,
    PoolSpec,
    SourceAudio,
    encode_listen,
    listen_waveform,
    load_or_build_pool,
    shifted_voice,
)
from egomem.trigger.synth import CodeCache, StreamSpec, synth_recorded

CACHE = Path(__file__).parent / "data" / "trigger" / "heldout_codes.npz"


@pytest.fixture(scope="module")
def cache() -> CodeCache:
    return CodeCache.load(CACHE)


@pytest.fixture(scope="module")
def codec():
    torch.set_num_threads(1)
    return build_codec(MimiConfig())


@pytest.fixture(scope="module")
def audio(cache) -> SourceAudio:
    """Speech-like audio as long as each cached utterance (the tests need no LibriSpeech)."""
    def clip(i: int, n_steps: int) -> np.ndarray:
        return probe_signal(seed=1000 + i, seconds=n_steps * 0.08).astype(np.float32)

    return SourceAudio([clip(i, len(u["vad"])) for i, u in enumerate(cache.users)],
                       [clip(500 + i, len(a["vad"])) for i, a in enumerate(cache.assistant)])


def _layout(cache, seed: int, steps: int = 256):
    return synth_recorded(cache, np.random.default_rng(seed), StreamSpec(steps=steps), noised=False)


def test_the_row_is_the_codecs_one_pass_code_of_the_laid_out_audio_and_the_layout_is_kept(cache, codec, audio):
    layout = _layout(cache, 0)
    for noised in (False, True):
        s = encode_listen(layout, audio, codec, np.random.default_rng(5), noised)
        wave, kind, snr = listen_waveform(layout, audio, np.random.default_rng(5), noised)
        assert (s.tokens[:, 9:] == encode(codec, wave)[:256]).all()
        assert (s.tokens[:, :9] == layout.tokens[:, :9]).all()  # text and speak rows untouched
        assert (s.labels == layout.labels).all() and s.sessions == layout.sessions
        assert (s.speaker == layout.speaker).all() and s.noised == noised and s.background == kind
        assert s.snr_db == snr and (kind is None) == (snr is None) == (not noised)
    assert (s.tokens[:, 9:] != layout.tokens[:, 9:]).mean() > 0.3  # not the spliced codes


def test_each_user_speaks_at_one_level_per_stream_and_echo_and_noise_are_added(cache, audio):
    assert sum(bool(_layout(cache, seed, 512).echoes) for seed in range(6)) >= 2  # the echo is in the layouts
    for seed in range(6):
        layout = _layout(cache, seed, 512)
        x, _, _ = listen_waveform(layout, audio, np.random.default_rng(seed), noised=False)
        echo = np.zeros(512, bool)
        for _, _, at, n in layout.echoes:
            echo[at:at + n] = True
        gains: dict[int, list[float]] = {}
        for t in np.flatnonzero((layout.speaker >= 0) & ~echo):
            u, p = int(layout.speaker[t]), int(layout.speaker_pos[t])
            src = audio.users[u][p * FRAME:(p + 1) * FRAME]
            if np.abs(src).max() < 0.05:
                continue
            g = float(np.dot(x[t * FRAME:(t + 1) * FRAME], src) / np.dot(src, src))
            gains.setdefault(u, []).append(g)
            np.testing.assert_allclose(x[t * FRAME:(t + 1) * FRAME], g * src, atol=6 * FLOOR)
        for u, g in gains.items():
            peak_db = 20 * np.log10(np.median(g) * np.abs(audio.users[u]).max())
            assert np.ptp(g) < 1e-2 * np.median(g) and -20.01 <= peak_db <= -5.99
        quiet = (layout.speaker < 0) & ~echo
        assert np.sqrt(np.mean(x[np.repeat(quiet, FRAME)] ** 2)) < 2 * FLOOR  # only the floor between turns
        if layout.echoes:
            k, lo, at, n = layout.echoes[0]
            assert np.abs(x[at * FRAME:(at + n) * FRAME]).max() > 10 * FLOOR
        noisy, kind, drawn_snr = listen_waveform(layout, audio, np.random.default_rng(seed), noised=True)
        speech = x[np.repeat(layout.speaker >= 0, FRAME)]
        snr = 10 * np.log10(np.mean(speech**2) / np.mean((noisy - x) ** 2))  # same draws up to the noise
        assert -0.01 <= snr <= 20.01, (kind, snr)
        assert abs(snr - drawn_snr) < 0.5, (kind, snr, drawn_snr)  # the SNR it reports is the one it mixed at


def test_the_pool_is_seeded_per_shard_resumes_and_refuses_another_codec(cache, codec, audio, tmp_path, monkeypatch):
    import egomem.trigger.listen_audio as la

    monkeypatch.setattr(la, "POOL_SHARD", 2)
    monkeypatch.setattr(la.SourceAudio, "load", classmethod(lambda cls, root, split: audio))
    spec = PoolSpec(layouts=3, steps=128, long_p=0.5, max_steps=1100, seed=3)
    whole = load_or_build_pool(tmp_path / "a", cache, codec, spec, tmp_path, progress=False)
    assert len(whole) == 6 and [s.noised for s in whole] == [False, True] * 3
    assert {s.tokens.shape[0] for s in whole} - {128} and 128 in {s.tokens.shape[0] for s in whole}
    part = load_or_build_pool(tmp_path / "b", cache, codec, spec, tmp_path, shards=range(1, 2), progress=False)
    assert all((p.tokens == w.tokens).all() for p, w in zip(part, whole[4:]))  # shard 1 alone = the same streams
    first = sorted((tmp_path / "a").glob("*_0000.npz"))[0]
    stamp = first.stat().st_mtime_ns
    again = load_or_build_pool(tmp_path / "a", cache, codec, spec, None, progress=False)  # no data: all on disk
    assert first.stat().st_mtime_ns == stamp and all((a.tokens == w.tokens).all() for a, w in zip(again, whole))
    assert again[1].sessions == whole[1].sessions and again[1].background == whole[1].background
    other = CodeCache(fingerprint="0" * 16, split="train")
    with pytest.raises(ValueError, match="another codec"):
        load_or_build_pool(tmp_path / "a", other, codec, spec, tmp_path, progress=False)
    with pytest.raises(SystemExit, match="--data"):
        load_or_build_pool(tmp_path / "c", cache, codec, spec, None, progress=False)


def test_a_voice_shift_moves_each_users_pitch_and_nothing_else_and_names_its_own_pool(cache, audio):
    """`--voice-shift`: a tone lands at the shifted pitch at the same duration; a stream's user speech moves
    while its gaps stay the floor; a pool without it keeps the shard names pools had before the option."""
    import hashlib

    tone = np.sin(2 * np.pi * 200 * np.arange(24_000) / 24_000).astype(np.float32)
    up = shifted_voice(tone, 3.0)
    freqs = np.fft.rfftfreq(len(tone), 1 / 24_000)
    assert len(up) == len(tone) and abs(freqs[np.abs(np.fft.rfft(up)).argmax()] - 200 * 2 ** 0.25) < 2
    layout = _layout(cache, 3, 512)
    plain, _, _ = listen_waveform(layout, audio, np.random.default_rng(3), noised=False)
    moved, _, _ = listen_waveform(layout, audio, np.random.default_rng(3), noised=False, voice_shift=3.0)
    speech = np.repeat(layout.speaker >= 0, FRAME)
    assert len(moved) == len(plain) and np.abs(moved[speech] - plain[speech]).max() > 0.01
    echo = np.zeros(512, bool)
    for _, _, at, n in layout.echoes:
        echo[at:at + n] = True
    quiet = np.repeat((layout.speaker < 0) & ~echo, FRAME)
    assert np.sqrt(np.mean(moved[quiet] ** 2)) < 2 * FLOOR
    old = hashlib.sha256(b"1-fp-768-0.05-8192-0").hexdigest()[:10]
    assert PoolSpec(seed=0).key("fp") == old != PoolSpec(seed=0, voice_shift=3.0).key("fp")


def test_a_trigger_trains_on_the_pool_and_resumes_to_the_same_weights(cache, codec, audio, tmp_path, monkeypatch):
    import egomem.trigger.listen_audio as la
    from egomem.trigger.train import fit, make_model

    monkeypatch.setattr(la.SourceAudio, "load", classmethod(lambda cls, root, split: audio))
    pool = load_or_build_pool(tmp_path, cache, codec, PoolSpec(layouts=4, steps=128, long_p=0.0), tmp_path,
                              progress=False)
    tiny = TriggerConfig(dim=32, num_layers=1, num_heads=2, emb_rank=4, text_buckets=64, conv_kernel=5)
    kw = dict(steps=6, batch=2, stream_steps=128, lr=3e-3, seed=0, progress=False, pool=pool)
    straight = make_model(tiny, seed=1)
    losses = fit(straight, cache, **kw)
    ckpt = tmp_path / "ckpt" / "last.pt"
    fit(make_model(tiny, seed=1), cache, ckpt=ckpt, ckpt_every=2, stop_after=3, **kw)
    resumed = make_model(tiny, seed=1)
    assert fit(resumed, cache, ckpt=ckpt, **kw) == losses
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()))
    assert fit(make_model(tiny, seed=1), cache, **(kw | {"pool": None}))[0] != losses[0]  # the pool is what it read
    with pytest.raises(SystemExit, match="--listen-pool"):
        fit(make_model(tiny, seed=1), cache, ckpt=ckpt, **(kw | {"pool": None}))
    with pytest.raises(ValueError, match="no stream of 64 steps"):
        fit(make_model(tiny, seed=1), cache, **(kw | {"stream_steps": 64}))


def test_the_one_pass_codes_are_what_the_served_codec_writes_frame_by_frame(cache, codec, audio):
    """The premise: serving's streaming `mimi_codec` pool, fed the row 80 ms at a time, writes the codes
    `encode_listen` trains on (the silence after speech included), up to BLAS rounding at a centroid edge."""
    from egomem.codec.mimi import FRAME_SAMPLES, MimiStreamPool

    layout = _layout(cache, 1, 160)
    wave, _, _ = listen_waveform(layout, audio, np.random.default_rng(2), noised=False)
    whole = encode(codec, wave)[:160]
    served = MimiStreamPool(codec, max_streams=1)
    served.open(0)
    frames = [served.encode([0], wave[t * FRAME_SAMPLES:(t + 1) * FRAME_SAMPLES][None])[0] for t in range(160)]
    served.close(0)
    assert float((np.stack(frames) == whole).mean()) >= 0.9
    spliced = layout.tokens[:, 9:]
    assert float((spliced == whole).mean()) < 0.5  # the splice (of other audio levels) is not what serving writes


def test_the_heard_voice_track_polls_the_speaker_encoder_on_the_last_window_of_the_audio():
    """`heard_voices`: every 25 steps from step 24, the configured speaker encoder over the last 38 steps of the
    microphone's audio, as the polling loop records it; a poll its VAD gate refuses (silence) records nothing,
    and a poll over one speaker's speech is that speaker's voice."""
    import soundfile as sf
    from scipy.signal import resample_poly

    from egomem.config import IdentityConfig
    from egomem.identity.voice import build_speaker_encoder
    from egomem.trigger.listen_audio import heard_voices

    asr = Path(__file__).parent / "data" / "asr"  # LibriSpeech, two speakers (ATTRIBUTION.md there)
    a, _ = sf.read(asr / "1688-142285-0000.flac", dtype="float32")  # 15 s of speaker 1688
    b, _ = sf.read(asr / "2414-128291-0008.flac", dtype="float32")  # 3 s of speaker 2414
    a24, b24 = (resample_poly(x, 3, 2).astype(np.float32) for x in (a[:16000 * 6], b))
    silence = np.zeros(FRAME * 60, np.float32)  # 4.8 s from step 75: a whole window of nothing inside it
    wave = np.concatenate([a24, silence, b24, silence[:FRAME * 15]])
    wave = np.pad(wave, (0, (-len(wave)) % FRAME))
    encoder = build_speaker_encoder(IdentityConfig())
    track = heard_voices(wave, encoder)
    T = len(wave) // FRAME
    steps = [t for t, _ in track]
    assert set(steps) <= set(range(24, T, 25)) and steps == sorted(steps)
    quiet = [t for t in range(24, T, 25) if t - 37 >= 75 and t < 135]  # a window inside the silence
    assert quiet and not set(quiet) & set(steps)
    for t, v in track:
        expect = encoder.encode(wave[max(0, t - 37) * FRAME:(t + 1) * FRAME], 24000).embedding
        np.testing.assert_allclose(v, expect, atol=1e-5)
    ref_a = encoder.encode(resample_poly(a[16000 * 6:], 3, 2).astype(np.float32), 24000).embedding  # unheard audio
    first, last = track[0][1], track[-1][1]  # speaker 1688 at step 24; speaker 2414 at the end
    assert steps[0] == 24 and steps[-1] >= 135 + 37
    assert float(first @ ref_a) > float(last @ ref_a) + 0.1


def test_a_heard_voices_pool_stores_each_streams_heard_track_and_training_reads_it(cache, tmp_path, monkeypatch):
    """`PoolSpec.heard_voices` (`train-trigger --heard-voices`): each pool stream carries the track the polling
    loop would record from its laid-out audio (the same streams otherwise, their own shard names), the shard
    keeps it through save and load, and `track_features` reads it instead of the cached partials."""
    codec = build_codec(MimiConfig())  # its own: the module's codec may be left streaming by the test above
    import soundfile as sf
    from scipy.signal import resample_poly

    import egomem.trigger.listen_audio as la
    from egomem.trigger.listen_audio import heard_encoder, heard_voices
    from egomem.trigger.synth import poll_voices, track_features
    from egomem.trigger.voice_track import voice_features

    asr = Path(__file__).parent / "data" / "asr"  # real speech, so the encoder's VAD gate opens
    clips = [resample_poly(sf.read(f, dtype="float32")[0], 3, 2).astype(np.float32)
             for f in sorted(asr.glob("*.flac"))]

    def speech(i: int, n_steps: int) -> np.ndarray:
        c = clips[i % len(clips)]
        return np.tile(c, -(-n_steps * FRAME // len(c)))[:n_steps * FRAME]

    audio = SourceAudio([speech(i, len(u["vad"])) for i, u in enumerate(cache.users)],
                        [speech(i, len(a["vad"])) for i, a in enumerate(cache.assistant)])
    monkeypatch.setattr(la, "POOL_SHARD", 2)
    monkeypatch.setattr(la.SourceAudio, "load", classmethod(lambda cls, root, split: audio))
    spec = PoolSpec(layouts=2, steps=160, long_p=0.0, seed=5, heard_voices=True)
    plain = PoolSpec(layouts=2, steps=160, long_p=0.0, seed=5)
    assert spec.key("f") != plain.key("f")
    heard = load_or_build_pool(tmp_path, cache, codec, spec, tmp_path, progress=False)
    cached = load_or_build_pool(tmp_path, cache, codec, plain, tmp_path, progress=False)
    assert len(heard) == 4 and all(h.voices is not None and c.voices is None for h, c in zip(heard, cached))
    assert all((h.tokens == c.tokens).all() and h.sessions == c.sessions for h, c in zip(heard, cached))
    assert sum(len(h.voices) for h in heard) >= 4  # real speech: the gate opened on the polls that hear a user
    # the stored track is the one heard from the stream's audio (rebuilt here from the same draws)
    from egomem.trigger.synth import StreamSpec, synth_recorded

    rng = np.random.default_rng([5, 100, 1])  # layout 1 (layout 0 drew a stream with no one in it)
    assert rng.random() >= spec.long_p  # pool_layout's draw of the stream's length: a short one
    layout = synth_recorded(cache, rng, StreamSpec(steps=160), noised=False)
    wave, _, _ = la.listen_waveform(layout, audio, rng, False)
    again = heard_voices(wave, heard_encoder())
    assert [t for t, _ in again] == [t for t, _ in heard[2].voices] and again
    np.testing.assert_allclose(np.stack([v for _, v in again]), np.stack([v for _, v in heard[2].voices]),
                               atol=2e-3)  # stored in float16
    feats = track_features(cache, heard[2], 256, 38)
    np.testing.assert_array_equal(feats, voice_features(heard[2].voices, 160, 256, 38))
    assert not np.array_equal(feats, voice_features(poll_voices(cache, heard[2]), 160, 256, 38))
