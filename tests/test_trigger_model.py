"""The trigger network and TriggerLabeler: shapes, full attention, windowing, checkpoint files."""

import numpy as np
import pytest
import torch

from egomem.config import TriggerConfig
from egomem.trigger.decode import configured_decode, viterbi_labels
from egomem.trigger.labeler import TriggerLabeler, windows
from egomem.trigger.model import TriggerCheckpointError, TriggerModel, TriggerModelConfig, load_trigger, save_trigger

TINY = TriggerModelConfig(dim=32, num_layers=2, num_heads=2, emb_rank=4, text_buckets=64, conv_kernel=3)


def random_tokens(rng, T):
    tok = rng.integers(0, 2049, size=(T, 17))
    tok[:, 0] = rng.integers(0, 5000, size=T)
    return tok


def test_logits_shape_and_full_attention():
    torch.manual_seed(0)
    m = TriggerModel(TINY).eval()
    tok = torch.from_numpy(random_tokens(np.random.default_rng(0), 200))[None]
    with torch.no_grad():
        a = m(tok)
        tok2 = tok.clone()
        tok2[0, 150:, 9:] = (tok2[0, 150:, 9:] + 1) % 2048  # change only the FUTURE listen channel
        b = m(tok2)
    assert a.shape == (1, 200, 4)
    # non-causal: the first step's output depends on steps far beyond any conv receptive field
    assert not torch.allclose(a[0, 0], b[0, 0])


def test_zero_token_embeds_to_nothing():
    m = TriggerModel(TINY)
    tok = torch.full((1, 5, 17), -1)
    assert torch.count_nonzero(m.embed(tok)) == 0
    tok[0, :, 3] = 7
    assert torch.count_nonzero(m.embed(tok)) > 0


def test_windows_tile_the_stream():
    for T in (1, 100, 8192, 8193, 20000, 50001):
        ws = windows(T, 8192, 256)
        assert ws[0][2] == 0 and ws[-1][3] == T
        for (s, e, ks, ke), nxt in zip(ws, ws[1:] + [None]):
            assert 0 <= s <= ks < ke <= e <= T and e - s <= 8192
            assert ks - s >= 256 or s == 0
            assert e - ke >= 256 or e == T
            if nxt:
                assert nxt[2] == ke


def _labeler(tmp_path, **kw):
    torch.manual_seed(1)
    path = tmp_path / "t.safetensors"
    save_trigger(TriggerModel(TINY), path, {"codec_fingerprint": "test"})
    return TriggerLabeler(TriggerConfig(checkpoint=path, device="cpu", **kw))


def test_long_input_windowed_matches_centre_of_one_pass(tmp_path):
    lab = _labeler(tmp_path, window_steps=400, window_overlap_steps=100)
    tok = random_tokens(np.random.default_rng(2), 1000)
    out = lab.label(tok)
    assert out.shape == (1000,) and out.dtype == np.int64 and set(np.unique(out)) <= {0, 1, 2, 3}
    with torch.no_grad():  # the second window covers [300, 700) and keeps [300 + 0 .. ] per `windows`
        ws = windows(1000, 400, 100)
        s, e, ks, ke = ws[1]
        ref = torch.log_softmax(lab.model(torch.from_numpy(tok[s:e])[None])[0], -1).numpy()
    np.testing.assert_allclose(lab.log_probs(tok)[ks:ke], ref[ks - s:ke - s], atol=1e-5)
    lp = lab.log_probs(tok)
    np.testing.assert_array_equal(out, configured_decode(lp, lab.cfg))
    np.testing.assert_array_equal(configured_decode(lp, lab.cfg, boundary_window=0),
                                  viterbi_labels(lp, lab.cfg.min_gap_steps, lab.cfg.min_session_steps,
                                                 lab.cfg.short_gap_cost))
    # a short input is one pass
    short = tok[:300]
    with torch.no_grad():
        one = torch.log_softmax(lab.model(torch.from_numpy(short)[None])[0], -1).numpy()
    np.testing.assert_allclose(lab.log_probs(short), one, atol=1e-5)


def test_labeler_rejects_bad_tokens(tmp_path):
    lab = _labeler(tmp_path)
    with pytest.raises(ValueError, match=r"\[T, 17\]"):
        lab.label(np.zeros((10, 16), np.int64))
    with pytest.raises(ValueError, match="integers"):
        lab.label(np.zeros((10, 17), np.float32))
    with pytest.raises(ValueError, match="out of range"):
        lab.label(np.full((10, 17), 5000, np.int64))
    assert lab.label(np.zeros((0, 17), np.int64)).shape == (0,)


def test_checkpoint_round_trip_and_clear_errors(tmp_path):
    torch.manual_seed(3)
    m = TriggerModel(TINY)
    p = tmp_path / "x.safetensors"
    save_trigger(m, p, {"codec_fingerprint": "abc"})
    m2, meta = load_trigger(p)
    assert meta["codec_fingerprint"] == "abc" and m2.cfg == TINY
    for k, v in m.state_dict().items():  # fp16 storage: equal to half precision
        torch.testing.assert_close(m2.state_dict()[k], v.half().float())
    with pytest.raises(TriggerCheckpointError, match="not found"):
        load_trigger(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    bad = tmp_path / "bad.safetensors"
    save_file({"head.weight": torch.zeros(4, 32)}, str(bad), metadata={"config": '{"dim": 32}'})
    with pytest.raises(TriggerCheckpointError, match="missing"):
        load_trigger(bad)
