"""A trigger that reads the recorded voice track: the per-step features, the model's input, the
labeler's windows, and the memory manager handing the track only to a labeler that reads it."""

import numpy as np
import pytest
import torch

from egomem.config import TriggerConfig
from egomem.memory.segment import label_stream
from egomem.trigger.labeler import TriggerLabeler, windows
from egomem.trigger.model import TriggerModel, TriggerModelConfig, save_trigger
from egomem.trigger.voice_track import CHANGE_FEATURES, track_from_rows, voice_features

D = 4
VOICED = TriggerModelConfig(dim=32, num_layers=2, num_heads=2, emb_rank=4, text_buckets=64, conv_kernel=3,
                            voice_dim=D, voice_window_steps=5)


def _unit(*xs):
    v = np.asarray(xs, np.float32)
    return v / np.linalg.norm(v)


def test_features_cover_each_polls_window_and_say_how_much_it_changed():
    a, b = _unit(1, 0, 0, 0), _unit(1, 1, 0, 0)
    track = [(9, b * 3.0), (4, a)]  # out of order and not unit: both are fixed
    f = voice_features(track, 12, D, window_steps=5)
    assert f.shape == (12, D + CHANGE_FEATURES) and f.dtype == np.float32
    np.testing.assert_allclose(f[0:5, :D], np.tile(a, (5, 1)), atol=1e-6)  # poll 4 covers steps 0..4
    np.testing.assert_allclose(f[5:10, :D], np.tile(b, (5, 1)), atol=1e-6)  # poll 9 covers 5..9
    assert not f[10:].any()  # no poll covers 10, 11
    change = 1.0 - float(a @ b)
    np.testing.assert_allclose(f[0:5, D], 0.0)  # the first poll has no previous one
    np.testing.assert_allclose(f[0:5, D + 1], change, atol=1e-6)
    np.testing.assert_allclose(f[5:10, D], change, atol=1e-6)
    np.testing.assert_allclose(f[5:10, D + 1], 0.0)


def test_overlapping_windows_keep_the_first_poll_and_polls_outside_still_cover_their_steps():
    a, b = _unit(1, 0, 0, 0), _unit(0, 1, 0, 0)
    f = voice_features([(3, a), (5, b)], 8, D, window_steps=5)  # windows 0..3 and 1..5 overlap on 1..3
    np.testing.assert_allclose(f[0:4, :D], np.tile(a, (4, 1)))
    np.testing.assert_allclose(f[4:6, :D], np.tile(b, (2, 1)))
    g = voice_features([(-2, a), (12, b)], 8, D, window_steps=5)  # before the chunk / after it
    assert not g[:, :D].any()  # -2 covers nothing inside; 12 covers 8..12, all past the chunk's end
    h = voice_features([(9, b)], 8, D, window_steps=5)
    np.testing.assert_allclose(h[5:8, :D], np.tile(b, (3, 1)))
    assert not h[:5].any()


def test_another_encoders_vectors_and_bad_rows_are_refused():
    with pytest.raises(ValueError, match="8 dims, the trigger reads 4"):
        voice_features([(3, np.ones(8, np.float32))], 10, D, 5)
    assert track_from_rows(None) == []
    got = track_from_rows(np.array([[7, 1, 2, 3, 4]], np.float32))
    assert got[0][0] == 7 and got[0][1].tolist() == [1, 2, 3, 4]
    for bad in (np.zeros((2,), np.float32), np.zeros((2, 1), np.float32), np.array([[1, np.nan]], np.float32)):
        with pytest.raises(ValueError, match="VOICES"):
            track_from_rows(bad)


def _random_tokens(rng, T):
    tok = rng.integers(0, 2049, size=(T, 17))
    tok[:, 0] = rng.integers(0, 5000, size=T)
    return tok


def _track(rng, T, every=25):
    return [(t, rng.random(D).astype(np.float32)) for t in range(24, T, every)]


def test_the_track_changes_the_labels_only_of_a_model_that_reads_it():
    rng = np.random.default_rng(0)
    tok = torch.from_numpy(_random_tokens(rng, 200))[None]
    feats = torch.from_numpy(voice_features(_track(rng, 200), 200, D, 5))[None]
    torch.manual_seed(0)
    voiced = TriggerModel(VOICED).eval()
    plain = TriggerModel(TriggerModelConfig(dim=32, num_layers=2, num_heads=2, emb_rank=4, text_buckets=64,
                                            conv_kernel=3)).eval()
    with torch.no_grad():
        assert not torch.allclose(voiced(tok, feats), voiced(tok))
        torch.testing.assert_close(voiced(tok, torch.zeros_like(feats)), voiced(tok))  # no poll = codes only
        torch.testing.assert_close(plain(tok, feats), plain(tok))  # a codes-only checkpoint ignores the track
        with pytest.raises(ValueError, match="voices must be"):
            voiced(tok, feats[:, :100])


@pytest.fixture()
def voiced_labeler(tmp_path):
    torch.manual_seed(1)
    path = tmp_path / "v.safetensors"
    save_trigger(TriggerModel(VOICED), path, {"codec_fingerprint": "test"})
    return TriggerLabeler(TriggerConfig(checkpoint=path, device="cpu", window_steps=400, window_overlap_steps=100))


def test_windows_read_the_features_of_the_whole_chunk(voiced_labeler):
    lab = voiced_labeler
    assert lab.reads_voices
    rng = np.random.default_rng(2)
    tok, track = _random_tokens(rng, 1000), _track(rng, 1000)
    feats = torch.from_numpy(voice_features(track, 1000, D, 5))
    s, e, ks, ke = windows(1000, 400, 100)[1]
    with torch.no_grad():
        ref = torch.log_softmax(lab.model(torch.from_numpy(tok[s:e])[None], feats[None, s:e])[0], -1).numpy()
    np.testing.assert_allclose(lab.log_probs(tok, track)[ks:ke], ref[ks - s:ke - s], atol=1e-5)
    assert not np.allclose(lab.log_probs(tok, track), lab.log_probs(tok))
    # vectors of another speaker encoder: labelled from the codes, as with no track
    other = [(t, np.ones(8, np.float32)) for t, _ in track]
    np.testing.assert_array_equal(lab.label(tok, other), lab.label(tok))


def test_label_stream_hands_the_track_rebased_to_a_labeler_that_reads_it(voiced_labeler):
    class Plain:  # an older labeler: label(tokens) only
        def label(self, tokens):
            return np.zeros(len(tokens), np.int64)

    class Recording:
        reads_voices = True

        def __init__(self):
            self.calls = []

        def label(self, tokens, voices=None):
            self.calls.append((len(tokens), voices))
            return np.zeros(len(tokens), np.int64)

    tokens = np.zeros((25, 17), np.int64)
    v = np.ones(D, np.float32)
    assert label_stream(Plain(), tokens, 10, [(3, v)]).shape == (25,)
    rec = Recording()
    label_stream(rec, tokens, 10, [(3, v), (14, v)])
    assert [n for n, _ in rec.calls] == [10, 10, 5]
    assert [[t for t, _ in vs] for _, vs in rec.calls] == [[3, 14], [-7, 4], [-17, -6]]
    # the real labeler over 2 windows of label_stream = its own labels of each window with the re-based track
    rng = np.random.default_rng(3)
    tok, track = _random_tokens(rng, 600), _track(rng, 600)
    got = label_stream(voiced_labeler, tok, 300, track)
    want = np.concatenate([voiced_labeler.label(tok[:300], track),
                           voiced_labeler.label(tok[300:], [(t - 300, x) for t, x in track])])
    np.testing.assert_array_equal(got, want)
