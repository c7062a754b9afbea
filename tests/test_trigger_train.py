"""Trigger training: a short run lowers the loss; an interrupted run resumes to the same weights;
the synthetic streams' gold labels decode back to their sessions."""

from pathlib import Path

import numpy as np
import pytest
import torch

from egomem.config import TriggerConfig
from egomem.trigger.decode import decode_sessions
from egomem.trigger.synth import CodeCache, StreamSpec, synth_stream
from egomem.trigger.train import fit, main, make_model

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


def test_cli_needs_data_to_build_a_missing_cache(tmp_path):
    with pytest.raises(SystemExit, match="--data"):
        main(["--cache-dir", str(tmp_path), "--out", str(tmp_path / "t.safetensors"), "--steps", "1"])
