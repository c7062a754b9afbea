"""text_encoder through the real tritonserver: same embeddings as in-process, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from egomem.config import RetrievalConfig
from egomem.retrieval.encoder import build_text_encoder


def embed(client, texts: list) -> np.ndarray:
    arr = np.array(texts, dtype=np.object_)
    inp = grpcclient.InferInput("TEXT", [len(texts)], "BYTES")
    inp.set_data_from_numpy(arr)
    return client.infer("text_encoder", [inp]).as_numpy("EMBEDDINGS")


@pytest.fixture(scope="module")
def client(triton):
    triton.load("text_encoder")
    return triton.client()


def test_served_embeddings_match_in_process(client) -> None:
    texts = ["Alice (sister): plays tennis every Sunday", "tennis", "grows tomatoes", "网球"]
    served = embed(client, [t.encode() for t in texts])
    want = build_text_encoder(RetrievalConfig()).encode(texts)
    assert served.shape == (4, 384) and served.dtype == np.float32
    np.testing.assert_allclose(served, want, atol=1e-4)


def test_served_bad_inputs(client) -> None:
    with pytest.raises(InferenceServerException, match="UTF-8"):
        embed(client, [b"\xff\xfe"])
    inp = grpcclient.InferInput("TEXT", [2], "FP32")
    inp.set_data_from_numpy(np.zeros(2, np.float32))
    with pytest.raises(InferenceServerException, match="(?i)data-type"):
        client.infer("text_encoder", [inp])
    assert embed(client, [b"still serving"]).shape == (1, 384)
