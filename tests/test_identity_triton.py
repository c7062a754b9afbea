"""face_encoder and speaker_encoder through the real tritonserver: same answers as in-process, clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import tritonclient.grpc as grpcclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from egomem.config import IdentityConfig
from egomem.identity.face import build_face_encoder
from egomem.identity.voice import build_speaker_encoder

DATA = Path(__file__).parent / "data" / "identity"


def infer(client, model: str, **inputs: np.ndarray):
    dtypes = {np.uint8: "UINT8", np.float32: "FP32", np.int32: "INT32", np.float64: "FP64"}
    ins = []
    for name, value in inputs.items():
        inp = grpcclient.InferInput(name, list(value.shape), dtypes[value.dtype.type])
        inp.set_data_from_numpy(value)
        ins.append(inp)
    return client.infer(model, ins)


@pytest.fixture(scope="module")
def client(triton):
    triton.load("face_encoder")
    triton.load("speaker_encoder")
    return triton.client()


def test_served_faces_match_in_process(client) -> None:
    image = np.asarray(Image.open(DATA / "img2.jpg").convert("RGB"))
    r = infer(client, "face_encoder", IMAGE=image)
    want = build_face_encoder(IdentityConfig()).encode(image)
    np.testing.assert_allclose(r.as_numpy("EMBEDDINGS"), want.embeddings, atol=1e-5)
    np.testing.assert_allclose(r.as_numpy("BOXES"), want.boxes, atol=1e-3)
    assert r.as_numpy("SCORES").shape == (len(want),) and int(r.as_numpy("SPEAKER")[0]) == want.speaker
    assert r.as_numpy("MODEL_ID")[0] == b"dlib_resnet_v1"
    blank = infer(client, "face_encoder", IMAGE=np.zeros((120, 160, 3), np.uint8))
    assert blank.as_numpy("EMBEDDINGS").shape[0] == 0 and int(blank.as_numpy("SPEAKER")[0]) == -1


def test_served_voice_matches_in_process_and_resamples_24k(client) -> None:
    from scipy.signal import resample_poly

    pcm, _ = sf.read(DATA / "2033-164914-0004.flac", dtype="float32")
    want = build_speaker_encoder(IdentityConfig()).encode(pcm, 16000)
    r = infer(client, "speaker_encoder", PCM=pcm, SAMPLE_RATE=np.array([16000], np.int32))
    np.testing.assert_allclose(r.as_numpy("EMBEDDING"), want.embedding, atol=1e-4)
    assert bool(r.as_numpy("VOICED")[0]) and r.as_numpy("MODEL_ID")[0] == b"resemblyzer_ge2e"
    r24 = infer(client, "speaker_encoder", PCM=resample_poly(pcm, 3, 2).astype(np.float32))  # default 24 kHz
    assert float(r24.as_numpy("EMBEDDING") @ want.embedding) > 0.95
    quiet = infer(client, "speaker_encoder", PCM=np.zeros(24000 * 2, np.float32))
    assert not bool(quiet.as_numpy("VOICED")[0]) and quiet.as_numpy("EMBEDDING").shape == (0,)


@pytest.mark.parametrize(
    "model, inputs, expect",
    [
        ("face_encoder", {"IMAGE": np.zeros((0, 0, 3), np.uint8)}, "empty"),
        ("face_encoder", {"IMAGE": np.zeros((64, 64, 3), np.float32)}, "data-type"),
        ("speaker_encoder", {"PCM": np.zeros(3, np.float32)}, "3 samples"),
        ("speaker_encoder", {"PCM": np.full(24000, np.nan, np.float32)}, "NaN"),
        ("speaker_encoder", {"PCM": np.zeros(24000, np.float64)}, "data-type"),
        ("speaker_encoder", {"PCM": np.zeros(24000, np.float32), "SAMPLE_RATE": np.array([8000], np.int32)}, "sample rate"),
    ],
)
def test_served_bad_inputs_get_clear_errors(client, model: str, inputs: dict, expect: str) -> None:
    with pytest.raises(InferenceServerException) as err:
        infer(client, model, **inputs)
    assert expect.lower() in str(err.value).lower()
    ok = infer(client, "face_encoder", IMAGE=np.zeros((32, 32, 3), np.uint8))  # still serving
    assert int(ok.as_numpy("SPEAKER")[0]) == -1
