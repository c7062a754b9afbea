"""Face pipeline with the real dlib models on a few photos (tests/data/identity, see ATTRIBUTION.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from egomem.config import IdentityConfig
from egomem.identity.errors import InputError, ModelFilesMissing
from egomem.identity.face import DeepFaceEncoder, DlibFaceEncoder, build_face_encoder, speaker_candidate

DATA = Path(__file__).parent / "data" / "identity"
SAME = [("img1", "img2"), ("img1", "img5"), ("img2", "img5"), ("img3", "img12")]
DIFF = [("img1", "img3"), ("img2", "img12"), ("img5", "img8"), ("img3", "img8"), ("img12", "img8")]


def load(name: str) -> np.ndarray:
    return np.asarray(Image.open(DATA / f"{name}.jpg").convert("RGB"))


@pytest.fixture(scope="module")
def encoder() -> DlibFaceEncoder:
    return build_face_encoder(IdentityConfig())


@pytest.fixture(scope="module")
def embeddings(encoder: DlibFaceEncoder) -> dict[str, np.ndarray]:
    out = {}
    for n in ["img1", "img2", "img5", "img3", "img12", "img8"]:
        res = encoder.encode(load(n))
        assert len(res) >= 1, f"no face found in {n}"
        out[n] = res.embeddings[res.speaker]
    return out


def cos_dist(a: np.ndarray, b: np.ndarray) -> float:
    return 1.0 - float(a @ b)


def test_embeddings_are_unit_and_128d(embeddings: dict[str, np.ndarray]) -> None:
    for e in embeddings.values():
        assert e.shape == (128,) and e.dtype == np.float32
        assert abs(np.linalg.norm(e) - 1) < 1e-4


def test_same_person_closer_than_different_person(embeddings: dict[str, np.ndarray], encoder: DlibFaceEncoder) -> None:
    same = [cos_dist(embeddings[a], embeddings[b]) for a, b in SAME]
    diff = [cos_dist(embeddings[a], embeddings[b]) for a, b in DIFF]
    assert max(same) < min(diff), (same, diff)
    assert max(same) < encoder.threshold < min(diff)  # the configured threshold separates them


def test_all_faces_reported_and_largest_is_speaker(encoder: DlibFaceEncoder, embeddings: dict[str, np.ndarray]) -> None:
    small, big = load("img5"), load("img3")  # different people; img3's face is far larger
    canvas = np.zeros((max(small.shape[0], big.shape[0]), small.shape[1] + big.shape[1], 3), np.uint8)
    canvas[: small.shape[0], : small.shape[1]] = small
    canvas[: big.shape[0], small.shape[1]:] = big
    res = encoder.encode(canvas)
    assert len(res) == 2
    assert res.boxes.shape == (2, 4) and res.scores.shape == (2,) and res.embeddings.shape == (2, 128)
    spk = res.embeddings[res.speaker]
    assert cos_dist(spk, embeddings["img3"]) < encoder.threshold
    other = res.embeddings[1 - res.speaker]
    assert cos_dist(other, embeddings["img5"]) < encoder.threshold
    assert res.boxes[res.speaker, 0] >= small.shape[1]  # the speaker's box lies in the right-hand photo


def test_no_face_gives_empty_result(encoder: DlibFaceEncoder) -> None:
    res = encoder.encode(np.full((240, 320, 3), 127, np.uint8))
    assert len(res) == 0 and res.speaker == -1 and res.embeddings.shape == (0, 128)


def test_speaker_candidate_prefers_central_among_equal_sizes() -> None:
    boxes = np.array([[0, 0, 100, 100], [450, 350, 550, 450], [0, 700, 300, 1000]], np.float32)
    assert speaker_candidate(boxes[:2], 800, 1000) == 1  # same size: the central one
    assert speaker_candidate(boxes, 800, 1000) == 2  # 9x the area beats centrality
    assert speaker_candidate(np.zeros((0, 4), np.float32), 10, 10) == -1


@pytest.mark.parametrize(
    "image, message",
    [
        (np.zeros((0, 0, 3), np.uint8), "empty"),
        (np.zeros((64, 64, 3), np.float32), "uint8"),
        (np.zeros((64, 64), np.uint8), "[H, W, 3]"),
        (np.zeros((8, 64, 3), np.uint8), "at least"),
        (np.broadcast_to(np.zeros(3, np.uint8), (7100, 7100, 3)), "MP"),  # 50 MP without allocating it
        ([[1, 2, 3]], "numpy"),
    ],
)
def test_bad_images_get_clear_errors(encoder: DlibFaceEncoder, image: object, message: str) -> None:
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        encoder.encode(image)


def test_paper_backend_without_weights_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ModelFilesMissing, match="deepface_home"):
        build_face_encoder(IdentityConfig(face_backend="deepface"))
    with pytest.raises(ModelFilesMissing, match="facenet512_weights.h5"):
        DeepFaceEncoder(tmp_path, threshold=0.3)


def test_service_outputs_match_the_triton_config(encoder: DlibFaceEncoder) -> None:
    from egomem.identity.service import FACE_OUTPUTS, face_request

    out = face_request(encoder, load("img2"))
    assert set(out) == set(FACE_OUTPUTS)
    assert out["BOXES"].shape == (1, 4) and out["EMBEDDINGS"].shape == (1, 128) and out["SPEAKER"].tolist() == [0]
    assert out["EMBEDDINGS"].dtype == np.float32 and out["SPEAKER"].dtype == np.int32
    config = (Path(__file__).parent.parent / "model_repository" / "face_encoder" / "config.pbtxt").read_text()
    for name, dtype in FACE_OUTPUTS.items():
        assert f'name: "{name}", data_type: {dtype}' in config
