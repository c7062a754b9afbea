"""episodic_trigger through a real tritonserver: same labels as in-process; bad requests fail alone."""

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from egomem.trigger import TriggerLabeler
from egomem.trigger.synth import CodeCache, StreamSpec, poll_voices, synth_recorded

CACHE = Path(__file__).parent / "data" / "trigger" / "heldout_codes.npz"


def _infer(client, tokens: np.ndarray, voices: np.ndarray | None = None):
    inp = grpcclient.InferInput("TOKENS", list(tokens.shape), "INT64")
    inp.set_data_from_numpy(tokens)
    inputs = [inp]
    if voices is not None:
        v = grpcclient.InferInput("VOICES", list(voices.shape), "FP32")
        v.set_data_from_numpy(voices)
        inputs.append(v)
    return client.infer("episodic_trigger", inputs=inputs, outputs=[grpcclient.InferRequestedOutput("LABELS")])


@pytest.fixture(scope="module")
def client(triton):
    triton.load("episodic_trigger")
    return triton.client()


def test_labels_match_in_process(client):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2048, size=(300, 17)).astype(np.int64)
    tokens[:, 0] = 3
    res = _infer(client, tokens)
    labels = res.as_numpy("LABELS")
    assert labels.dtype == np.int64 and labels.shape == (300,)
    np.testing.assert_array_equal(labels, TriggerLabeler().label(tokens))


def test_the_voice_track_travels_as_rows_and_labels_as_in_process(client):
    """VOICES rows [step, embedding...]: the labels equal the in-process labeler's with that track."""
    cache = CodeCache.load(CACHE)
    s = synth_recorded(cache, np.random.default_rng(5), StreamSpec(steps=600), noised=False)
    track = poll_voices(cache, s)
    assert len(track) >= 5
    rows = np.array([[t, *v] for t, v in track], np.float32)
    labels = _infer(client, s.tokens, rows).as_numpy("LABELS")
    np.testing.assert_array_equal(labels, TriggerLabeler().label(s.tokens, track))
    with pytest.raises(InferenceServerException, match="VOICES must be finite"):
        _infer(client, s.tokens, np.full((2, 3), np.nan, np.float32))


def test_bad_request_gets_a_clear_error_and_the_model_stays_up(client):
    with pytest.raises(InferenceServerException, match="out of range"):
        _infer(client, np.full((10, 17), 9999, np.int64))
    ok = _infer(client, np.zeros((20, 17), np.int64))
    assert ok.as_numpy("LABELS").shape == (20,)
