"""The shipped trigger checkpoint: small, documented, made for the default Mimi, and it reaches the
benchmark's bar on held-out synthetic streams (held-out users and assistant utterances).

Bar: `egomem.trigger.metrics.SHIPPED_BAR` (Jaccard and span_match F1@5 per condition), the same bar
bench/bench_trigger.py reports on 200 streams per condition; here 48 clean + 48 noised streams (24 left
F1@5 swinging by +-0.05 from one checkpoint to the next at equal 200-stream figures), their listen rows
encoded whole from audio by the default codec as serving encodes them, each with the voice track serving
records from that audio (`listen_audio.heard_voices`; tests/data/trigger/heldout_listen.npz).
"""

from pathlib import Path

import pytest

from egomem.trigger import SHIPPED_CHECKPOINT, TriggerLabeler, decode_sessions
from egomem.trigger.metrics import SHIPPED_BAR, evaluate
from egomem.trigger.synth import CodeCache, recorded_voices

CACHE = Path(__file__).parent / "data" / "trigger" / "heldout_codes.npz"
LISTEN = Path(__file__).parent / "data" / "trigger" / "heldout_listen.npz"


@pytest.fixture(scope="module")
def labeler() -> TriggerLabeler:
    return TriggerLabeler()


def test_shipped_checkpoint_is_small_and_documented(labeler):
    assert labeler.checkpoint == SHIPPED_CHECKPOINT
    assert SHIPPED_CHECKPOINT.stat().st_size <= 5 * 2**20
    cmd = labeler.meta["train_command"]
    assert "--seed" in cmd and "--data" in cmd
    assert labeler.meta["mimi_preset"] == "tiny" and labeler.meta["mimi_codec"] == "mimi_tiny.safetensors"


def test_checkpoint_matches_the_default_mimi(labeler):
    """A changed default Mimi makes the shipped trigger stale: retrain with the documented command."""
    from egomem.config import MimiConfig
    from egomem.trigger.codec import build_codec, codec_fingerprint

    cache = CodeCache.load(CACHE)
    assert labeler.meta["codec_fingerprint"] == cache.fingerprint
    assert codec_fingerprint(build_codec(MimiConfig())) == cache.fingerprint


@pytest.mark.parametrize("cond", ["clean", "noised"])
def test_shipped_checkpoint_reaches_the_bar(labeler, cond):
    from egomem.trigger.listen_audio import load_streams

    cache = CodeCache.load(CACHE)
    streams = [s for s in load_streams(LISTEN, cache.fingerprint) if s.noised == (cond == "noised")]
    assert len(streams) == 48 and all(s.tokens.shape == (1024, 17) and s.voices is not None for s in streams)
    preds, golds = [], []
    for s in streams:
        preds.append(decode_sessions(labeler.label(s.tokens, recorded_voices(cache, s))))  # the heard track, as the manager hands it
        golds.append(s.sessions)
    m = evaluate(preds, golds)
    assert m["gold_sessions"] >= 80
    assert m["jaccard"] >= SHIPPED_BAR[cond]["jaccard"], m
    assert m["span_match@5"]["f1"] >= SHIPPED_BAR[cond]["f1@5"], m
