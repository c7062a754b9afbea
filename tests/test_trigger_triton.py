"""episodic_trigger through a real tritonserver: same labels as in-process; bad requests fail alone."""

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from egomem.trigger import TriggerLabeler


def _infer(client, tokens: np.ndarray):
    inp = grpcclient.InferInput("TOKENS", list(tokens.shape), "INT64")
    inp.set_data_from_numpy(tokens)
    return client.infer("episodic_trigger", inputs=[inp], outputs=[grpcclient.InferRequestedOutput("LABELS")])


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


def test_bad_request_gets_a_clear_error_and_the_model_stays_up(client):
    with pytest.raises(InferenceServerException, match="out of range"):
        _infer(client, np.full((10, 17), 9999, np.int64))
    ok = _infer(client, np.zeros((20, 17), np.int64))
    assert ok.as_numpy("LABELS").shape == (20,)
