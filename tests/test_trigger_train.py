"""Trigger training: a short run lowers the loss; an interrupted run resumes to the same weights;
the synthetic streams' gold labels decode back to their sessions."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from egomem.config import TriggerConfig
from egomem.trigger.decode import decode_sessions
from egomem.trigger.synth import TEXT_PAD, CodeCache, StreamSpec, synth_stream
from egomem.trigger.train import FINE_CODEBOOKS, augment_codes, fit, main, make_model, pool_batch

CACHE = Path(__file__).parent / "data" / "trigger" / "heldout_codes.npz"
TINY = TriggerConfig(dim=32, num_layers=1, num_heads=2, emb_rank=4, text_buckets=64, conv_kernel=5)


@pytest.fixture(scope="module")
def cache() -> CodeCache:
    return CodeCache.load(CACHE)


def test_synthetic_streams_are_consistent(cache):
    rng = np.random.default_rng(0)
    n_sessions = 0
    for noised in (False, True):
        for _ in range(10):
            tokens, labels, gold = synth_stream(cache, rng, StreamSpec(steps=1024), noised=noised)
            assert tokens.shape == (1024, 17) and labels.shape == (1024,)
            assert tokens[:, 1:].min() >= 0 and tokens[:, 1:].max() < 2048
            assert decode_sessions(labels) == gold
            n_sessions += len(gold)
            for a, b in gold:  # somebody speaks at both ends of every session
                assert labels[a] == 1 and labels[b] == 3
    assert n_sessions >= 20


def test_a_noised_stream_names_its_background_and_draws_what_it_drew_before(cache):
    """`SynthStream.background` is the kind of the noise clip under the listen row (bench_trigger reports
    the trigger per kind); recording it leaves the draws, and so every benchmark's streams, unchanged."""
    from egomem.trigger.noise import KINDS
    from egomem.trigger.synth import _fill, noise_clip_kind, synth_recorded

    kinds = set()
    for seed in range(12):
        s = synth_recorded(cache, np.random.default_rng(seed), StreamSpec(steps=256), noised=True)
        kinds.add(s.background)
        rng = np.random.default_rng(seed)  # the clip the stream drew: the first draw, then its tiling
        clip = int(rng.integers(len(cache.noise)))
        assert s.background == noise_clip_kind(clip) and s.background in KINDS
        background = _fill(rng, cache.noise[clip], 256)
        quiet = s.speaker < 0  # no user speech there: the listen row is the background (or an echo)
        assert (s.tokens[quiet, 9:] == background[quiet]).mean() > 0.5
    assert len(kinds) >= 3
    clean = synth_recorded(cache, np.random.default_rng(0), StreamSpec(steps=256), noised=False)
    assert clean.background is None


def test_short_training_run_lowers_the_loss(cache):
    torch.set_num_threads(1)
    model = make_model(TINY, seed=0)
    losses = fit(model, cache, steps=60, batch=2, stream_steps=256, lr=3e-3, seed=0, progress=False)
    assert len(losses) == 60
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:3]), (losses[:3], losses[-10:])


def test_interrupted_run_resumes_to_the_same_weights(cache, tmp_path):
    torch.set_num_threads(1)
    kw = dict(steps=6, batch=2, stream_steps=128, lr=3e-3, seed=1, progress=False)
    straight = make_model(TINY, seed=1)
    fit(straight, cache, **kw)
    ckpt = tmp_path / "ckpt" / "last.pt"
    first = make_model(TINY, seed=1)
    fit(first, cache, ckpt=ckpt, ckpt_every=2, stop_after=3, **kw)  # "killed" after 3 steps
    assert torch.load(ckpt, weights_only=False)["step"] == 3
    resumed = make_model(TINY, seed=1)  # a new process: fresh weights, state comes from the file
    losses = fit(resumed, cache, ckpt=ckpt, **kw)
    assert len(losses) == 6
    for k, v in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v)


def test_voice_change_targets_mark_each_speech_run_against_the_one_before():
    from egomem.trigger.synth import voice_change_targets

    speaker = np.array([-1, 4, 4, -1, 4, -1, -1, 7, 7, 7, -1, 4, 2])
    np.testing.assert_array_equal(voice_change_targets(speaker),
                                  [-1, -1, -1, -1, 0, -1, -1, 1, 1, 1, -1, 1, 1])
    assert (voice_change_targets(np.full(5, -1)) == -1).all()


@pytest.mark.parametrize("weight, head, flag", [("voice_change_weight", "voice_head", "voice-change-weight"),
                                                ("activity_weight", "activity_head", "activity-weight")])
def test_an_auxiliary_loss_trains_and_resumes_to_the_same_weights(cache, tmp_path, weight, head, flag):
    """Each auxiliary head (voice change: is this another user than before?; activity: is a user speaking on the
    listen row?): it adds to the loss on the same first batch, an interrupted run resumes (head included) to the
    losses and weights of an uninterrupted one, and a resume with another weight is refused."""
    torch.set_num_threads(1)
    kw = dict(steps=6, batch=2, stream_steps=512, lr=3e-3, seed=1, progress=False, **{weight: 0.5})
    straight = make_model(TINY, seed=1)
    losses = fit(straight, cache, **kw)
    plain_losses = fit(make_model(TINY, seed=1), cache, **(kw | {weight: 0.0}))
    assert losses[0] > plain_losses[0]  # the first step's loss adds the head's own (same weights, same batch)
    ckpt = tmp_path / "ckpt" / "last.pt"
    fit(make_model(TINY, seed=1), cache, ckpt=ckpt, ckpt_every=2, stop_after=3, **kw)
    assert torch.load(ckpt, weights_only=False)[head] is not None
    resumed = make_model(TINY, seed=1)
    assert fit(resumed, cache, ckpt=ckpt, **kw) == losses
    for k, v in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v)
    with pytest.raises(SystemExit, match=flag):
        fit(make_model(TINY, seed=1), cache, ckpt=ckpt, **(kw | {weight: 1.0}))


def test_a_trigger_reading_the_voice_track_trains_with_dropout_and_resumes_to_the_same_weights(cache, tmp_path):
    """voice_dim > 0 (the default): the polls enter training, withheld per stream and per poll with rng
    draws that a resumed run repeats; the track changes the loss; another dropout refuses the resume."""
    assert TINY.voice_dim == 256
    torch.set_num_threads(1)
    kw = dict(steps=6, batch=2, stream_steps=512, lr=3e-3, seed=2, progress=False, drop_track_p=0.5, drop_poll_p=0.3)
    straight = make_model(TINY, seed=1)
    losses = fit(straight, cache, **kw)
    codes_only = make_model(TINY, seed=1)
    assert fit(codes_only, cache, **(kw | {"drop_track_p": 1.0}))[0] != losses[0]  # the track reaches the loss
    ckpt = tmp_path / "ckpt" / "last.pt"
    fit(make_model(TINY, seed=1), cache, ckpt=ckpt, ckpt_every=2, stop_after=3, **kw)
    resumed = make_model(TINY, seed=1)
    assert fit(resumed, cache, ckpt=ckpt, **kw) == losses
    for k, v in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v)
    with pytest.raises(SystemExit, match="voice dropout"):
        fit(make_model(TINY, seed=1), cache, ckpt=ckpt, **(kw | {"drop_poll_p": 0.0}))


def test_code_augmentation_replaces_only_fine_codes_at_its_rate():
    """augment_codes: text, both first codebooks and "no input" (-1) are kept; about p of the fine codes
    change; p = 0 leaves the tokens as they were."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2048, (2, 400, 17))
    tokens[:, :50, 9:] = -1  # no listen input yet
    out = augment_codes(tokens, np.random.default_rng(1), 0.25)
    kept = np.setdiff1d(np.arange(17), FINE_CODEBOOKS)
    assert sorted(kept.tolist()) == [0, 1, 9]
    np.testing.assert_array_equal(out[..., kept], tokens[..., kept])
    assert (out[:, :50, 9:] == -1).all()
    changed = (out != tokens)[:, 50:, FINE_CODEBOOKS].mean()
    assert 0.2 < changed < 0.26  # a replacement may draw the same code (1 in 2,048)
    assert out.min() >= -1 and out.max() < 2048
    np.testing.assert_array_equal(augment_codes(tokens, np.random.default_rng(1), 0.0), tokens)


def test_dropout_and_code_augmentation_train_resume_to_the_same_weights_and_leave_labelling_alone(cache, tmp_path):
    """--dropout / --code-aug-p: both change the training loss, a resumed run draws the same masks and
    codes (bit-exact weights) and the caller's torch generator is left as it was, another --code-aug-p
    refuses the resume, and in eval mode dropout is off (two passes give the same logits)."""
    torch.set_num_threads(1)
    kw = dict(steps=6, batch=2, stream_steps=256, lr=3e-3, seed=3, progress=False, code_aug_p=0.2)
    plain_first = fit(make_model(TINY, seed=1), cache, **(kw | {"code_aug_p": 0.0}))[0]
    straight = make_model(TINY, seed=1, dropout=0.2)
    rng_before = torch.get_rng_state()
    losses = fit(straight, cache, **kw)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the masks come from their own seeds, not the caller's
    assert fit(make_model(TINY, seed=1), cache, **kw)[0] != losses[0]  # dropout reaches the loss
    assert fit(make_model(TINY, seed=1, dropout=0.2), cache, **(kw | {"code_aug_p": 0.0}))[0] != losses[0]
    assert plain_first != losses[0]
    ckpt = tmp_path / "ckpt" / "last.pt"
    fit(make_model(TINY, seed=1, dropout=0.2), cache, ckpt=ckpt, ckpt_every=2, stop_after=3, **kw)
    torch.manual_seed(123)  # the global generator's state must not matter to a resumed run
    resumed = make_model(TINY, seed=1, dropout=0.2)
    assert fit(resumed, cache, ckpt=ckpt, **kw) == losses
    for k, v in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=0, atol=0)
    with pytest.raises(SystemExit, match="code-aug-p"):
        fit(make_model(TINY, seed=1, dropout=0.2), cache, ckpt=ckpt, **(kw | {"code_aug_p": 0.1}))
    tokens = torch.from_numpy(synth_stream(cache, np.random.default_rng(0), StreamSpec(steps=200), False)[0])[None]
    assert not straight.training
    with torch.no_grad():
        torch.testing.assert_close(straight(tokens), straight(tokens), rtol=0, atol=0)


def test_cli_needs_data_to_build_a_missing_cache(tmp_path):
    with pytest.raises(SystemExit, match="--data"):
        main(["--cache-dir", str(tmp_path), "--out", str(tmp_path / "t.safetensors"), "--steps", "1"])


def test_no_steps_or_an_out_of_range_option_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--cache-dir", str(tmp_path), "--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err
    for flag, value, says in (("--noised-share", "1.5", "[0, 1]"), ("--voice-shift", "-2", "0 or more")):
        with pytest.raises(SystemExit):
            main(["--cache-dir", str(tmp_path), flag, value])
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):  # heard tracks embed each pool stream's audio: no pool, nothing to hear
        main(["--cache-dir", str(tmp_path), "--heard-voices", "--listen-pool", "0"])
    assert "it needs --listen-pool" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before a cache or pool was built


def test_the_text_channel_is_a_real_monologue_inside_sessions(cache):
    """Text tokens are the split's corpus lines (byte-tokenised), written only inside gold sessions."""
    from egomem.trigger.synth import monologue_lines

    lines = [bytes(int(i) - 4 for i in ids).decode() for q, r in monologue_lines(cache.split)
             for ids in ((r,) if q is None else (q, r))]
    rng = np.random.default_rng(1)
    runs = in_line = 0
    for _ in range(8):
        tokens, _, gold = synth_stream(cache, rng, StreamSpec(steps=2048), noised=False)
        text = tokens[:, 0]
        inside = np.zeros(len(text), bool)
        for a, b in gold:
            inside[a:b + 1] = True
        assert not (text[~inside] != TEXT_PAD).any(), "monologue outside a session"
        edges = np.flatnonzero(np.diff(np.r_[0, (text != TEXT_PAD).astype(int), 0]))
        for a, b in zip(edges[::2], edges[1::2]):
            run = bytes(int(i) - 4 for i in text[a:b]).decode(errors="replace")
            runs += 1
            in_line += any(run in line for line in lines)
    assert runs >= 20 and in_line / runs >= 0.8, (runs, in_line)


def test_noise_kinds_are_unit_level_and_differ():
    from egomem.trigger.noise import KINDS, background

    rng = np.random.default_rng(0)
    speech = [np.sin(np.arange(48_000) * f).astype(np.float32) * rng.random(48_000).astype(np.float32)
              for f in (0.05, 0.08, 0.11)]
    flatness = {}
    for kind in KINDS:
        x = background(rng, 48_000, speech, kind=kind)
        assert x.shape == (48_000,) and np.isfinite(x).all()
        assert abs(np.sqrt(np.mean(x**2)) - 1) < 1e-3, kind
        spec = np.abs(np.fft.rfft(x)) ** 2 + 1e-12
        flatness[kind] = float(np.exp(np.mean(np.log(spec))) / np.mean(spec))
    assert flatness["white"] > 0.3 and flatness["music"] < 0.1 * flatness["white"], flatness
    with pytest.raises(ValueError, match="babble"):
        background(rng, 100, None, kind="babble")
    with pytest.raises(ValueError, match="unknown noise kind"):
        background(rng, 100, speech, kind="jazz")


def test_audio_embeddings_can_follow_the_codec_codebooks(cache, tmp_path):
    """`--codebook-emb`: each code's embedding starts as its centroid's principal components (neighbouring
    centroids, neighbouring embeddings), the same table for speak and listen; `frozen` keeps it through
    training, `init` (the shipped trigger's recipe) trains on from it, and a resume with another choice is
    refused."""
    from egomem.codec.mimi import build_mimi
    from egomem.config import MimiConfig
    from egomem.trigger.codec import codebook_vectors
    from egomem.trigger.train import init_audio_emb_from_codebooks

    torch.set_num_threads(1)
    vectors = codebook_vectors(build_mimi(MimiConfig()))
    assert vectors.shape == (8, 2048, 64)
    model = make_model(TriggerConfig(**{**TINY.__dict__, "emb_rank": 48}), seed=0)
    init_audio_emb_from_codebooks(model, vectors, freeze=True)
    emb = model.audio_emb.detach()
    torch.testing.assert_close(emb[0, :2048], emb[8, :2048])  # speak codebook 0 = listen codebook 0
    rows = torch.arange(0, 2048, 16)
    for k in (0, 3):  # pairwise distances of the embeddings follow those of the centroids
        d_emb = torch.cdist(emb[k, rows], emb[k, rows]).flatten()
        d_cb = torch.cdist(vectors[k, rows], vectors[k, rows]).flatten()
        assert torch.corrcoef(torch.stack([d_emb, d_cb]))[0, 1] > 0.9
    assert not model.audio_emb.requires_grad
    kw = dict(steps=3, batch=2, stream_steps=128, lr=3e-3, seed=1, progress=False)
    ckpt, proj = tmp_path / "last.pt", model.audio_proj.detach().clone()
    fit(model, cache, ckpt=ckpt, codebook_emb="frozen", **kw)
    torch.testing.assert_close(model.audio_emb.detach(), emb)  # frozen: no optimiser step moved it
    assert not torch.equal(model.audio_proj.detach(), proj)  # while its projections trained
    with pytest.raises(SystemExit, match="codebook-emb"):
        fit(make_model(TriggerConfig(**{**TINY.__dict__, "emb_rank": 48}), seed=0), cache, ckpt=ckpt,
            codebook_emb="init", **{**kw, "steps": 3})
    started = make_model(TriggerConfig(**{**TINY.__dict__, "emb_rank": 48}), seed=0)
    init_audio_emb_from_codebooks(started, vectors, freeze=False)  # `init` (the shipped recipe): a start only
    torch.testing.assert_close(started.audio_emb.detach(), emb)
    assert started.audio_emb.requires_grad
    fit(started, cache, ckpt=tmp_path / "init.pt", codebook_emb="init", **kw)
    assert not torch.equal(started.audio_emb.detach(), emb)  # the table trained on
    with pytest.raises(ValueError, match="do not fit"):
        init_audio_emb_from_codebooks(model, vectors[:4], freeze=False)


def test_a_continuation_starts_from_a_trained_trigger_of_its_own_codec_and_draws_other_batches(cache, tmp_path):
    """`--init-weights`: the network starts as the checkpoint (same dims, trained on the configured codec's codes,
    else refused naming the file); `--draw-seed` draws other batches than `--seed` would, and a resume with
    another draw seed or start is refused."""
    from egomem.config import MimiConfig
    from egomem.trigger.codec import build_codec, codec_fingerprint
    from egomem.trigger.model import save_trigger
    from egomem.trigger.train import load_start

    torch.set_num_threads(1)
    trained = make_model(TINY, seed=3)
    fp = codec_fingerprint(build_codec(MimiConfig()))
    good, alien = tmp_path / "good.safetensors", tmp_path / "alien.safetensors"
    save_trigger(trained, good, {"codec_fingerprint": fp})
    save_trigger(trained, alien, {"codec_fingerprint": "0123456789"})
    fresh = make_model(TINY, seed=4)
    assert not torch.equal(fresh.head.weight, trained.head.weight)
    load_start(fresh, good, fp)
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value.half().float())  # saved in fp16
    with pytest.raises(SystemExit, match="alien.safetensors was trained on codec"):
        load_start(make_model(TINY, seed=4), alien, fp)
    with pytest.raises(SystemExit, match="good.safetensors: its dims differ"):
        load_start(make_model(TriggerConfig(**{**TINY.__dict__, "dim": 48}), seed=4), good, fp)

    kw = dict(steps=2, batch=2, stream_steps=128, lr=3e-3, seed=1, progress=False)
    runs = {}
    for draw in (None, 1, 2):
        model = make_model(TINY, seed=0)
        fit(model, cache, draw_seed=draw, ckpt=tmp_path / f"d{draw}" / "last.pt", **kw)
        runs[draw] = model.head.weight.detach().clone()
    torch.testing.assert_close(runs[None], runs[1])  # the default draws are --seed's
    assert not torch.equal(runs[1], runs[2])
    with pytest.raises(SystemExit, match="another --draw-seed; pass"):
        fit(make_model(TINY, seed=0), cache, draw_seed=5, ckpt=tmp_path / "d2" / "last.pt", **kw)
    with pytest.raises(SystemExit, match="another --init-weights; pass"):
        fit(make_model(TINY, seed=0), cache, draw_seed=2, init_weights=str(good), ckpt=tmp_path / "d2" / "last.pt", **kw)


def test_a_noised_share_weighs_the_pools_noised_copies_and_none_draws_as_before(cache):
    """`--noised-share`: each short stream noised with that probability; unset, the uniform draw of before."""
    from egomem.trigger.synth import synth_recorded

    base = synth_recorded(cache, np.random.default_rng(0), StreamSpec(steps=64), noised=False)
    pool = [dataclasses.replace(base, noised=bool(i % 2), snr_db=float(i)) for i in range(40)]  # clean, noised, ...
    for share, lo, hi in ((1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (0.9, 0.85, 0.95)):
        drawn = [s for k in range(200) for s in pool_batch(np.random.default_rng([0, k]), pool, 3, share)]
        assert lo <= np.mean([s.noised for s in drawn]) <= hi, share
        if share in (0.0, 1.0):
            assert len({s.snr_db for s in drawn}) == 20  # uniform among its kind: each of the 20 drawn
    rng, again = np.random.default_rng(5), np.random.default_rng(5)
    assert [s.snr_db for s in pool_batch(rng, pool, 3)] == [pool[int(i)].snr_db for i in again.integers(40, size=3)]
    with pytest.raises(ValueError, match="clean and noised"):
        fit(make_model(TINY, seed=0), cache, steps=1, batch=1, stream_steps=64, lr=1e-3, seed=0, progress=False, pool=pool[::2], noised_share=0.5)
