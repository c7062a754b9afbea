"""Face pipeline: an RGB frame -> detected faces (box, detection score) -> one unit embedding per face.

Backends (`IdentityConfig.face_backend`):
  - "dlib" (offline default): dlib's HOG frontal-face detector, 5-point landmarks and its ResNet
    face embedder (128-d; 99.38% on LFW). The `.dat` files come from the `face-recognition-models`
    wheel, located with `importlib.util.find_spec` because that package's `__init__` imports the
    removed `pkg_resources`.
  - "deepface" (the paper's): Facenet512 + RetinaFace through DeepFace, weights from a local
    DEEPFACE_HOME folder (`paper` extra). Never downloads: missing files raise `ModelFilesMissing`.

Every face in the frame is reported; `speaker` indexes the speaker candidate, the face with the
largest area weighted by how central it is (a person talking to a robot/kiosk faces it, close up).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from egomem.config import IdentityConfig
from egomem.identity.errors import InputError, ModelFilesMissing

MIN_SIDE = 16  # a frame smaller than this cannot hold a detectable face


@dataclass(frozen=True)
class FaceResult:
    """All faces found in one frame, in detector order; `speaker` is -1 when there is no face."""

    boxes: np.ndarray  # [F, 4] float32 (x0, y0, x1, y1) in pixels of the input frame
    scores: np.ndarray  # [F] float32 detection scores (backend-specific scale)
    embeddings: np.ndarray  # [F, D] float32, unit L2 norm
    speaker: int = -1

    def __len__(self) -> int:
        return int(self.boxes.shape[0])


class FaceEncoder(Protocol):
    model_id: str  # names the embedding space in the user-key index, e.g. "dlib_resnet_v1"
    dim: int
    threshold: float  # accept a match when cosine distance < threshold

    def encode(self, image: np.ndarray) -> FaceResult: ...


def validate_image(image: object, max_pixels: int) -> np.ndarray:
    """Return `image` as a C-contiguous uint8 [H, W, 3] array, or raise `InputError` saying why not."""
    if not isinstance(image, np.ndarray):
        raise InputError(f"image must be a numpy uint8 array [H, W, 3], got {type(image).__name__}")
    if image.dtype != np.uint8:
        raise InputError(f"image dtype must be uint8 RGB, got {image.dtype}; convert with .astype(np.uint8)")
    if image.ndim != 3 or image.shape[2] != 3:
        raise InputError(f"image must have shape [H, W, 3] (RGB), got {list(image.shape)}")
    h, w = int(image.shape[0]), int(image.shape[1])
    if h * w == 0:
        raise InputError("image is empty (0 pixels)")
    if h * w > max_pixels:
        raise InputError(
            f"image has {h * w / 1e6:.1f} MP ({w}x{h}); the limit is {max_pixels / 1e6:.1f} MP "
            "(identity.max_image_pixels): downscale the frame before sending it"
        )
    if min(h, w) < MIN_SIDE:
        raise InputError(f"image is {w}x{h}; both sides must be at least {MIN_SIDE} pixels")
    return np.ascontiguousarray(image)


def speaker_candidate(boxes: np.ndarray, height: int, width: int) -> int:
    """Index of the face most likely talking to us: area x (1 - 0.5 * distance of its centre from the
    frame centre, as a fraction of the half-diagonal). -1 when there are no boxes."""
    if len(boxes) == 0:
        return -1
    b = boxes.astype(np.float64)
    area = np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)
    cx, cy = (b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2
    off = np.hypot(cx - width / 2, cy - height / 2) / max(np.hypot(width / 2, height / 2), 1e-9)
    return int(np.argmax(area * (1.0 - 0.5 * np.clip(off, 0, 1))))


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32).reshape(len(x), -1)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def dlib_model_dir() -> Path:
    """The `models/` folder of the installed `face-recognition-models` wheel (not imported: see module doc)."""
    spec = importlib.util.find_spec("face_recognition_models")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFilesMissing(
            "package face-recognition-models is not installed; `pip install face-recognition-models==0.3.0` "
            "(it ships dlib's .dat model files)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "models"


class DlibFaceEncoder:
    """dlib HOG detector + 5-point alignment + ResNet embedder (128-d)."""

    model_id = "dlib_resnet_v1"
    dim = 128

    def __init__(self, threshold: float, min_score: float = 0.0, detect_max_side: int = 1024,
                 max_pixels: int = 40_000_000, model_dir: Path | None = None) -> None:
        try:
            import dlib  # dlib-bin wheel
        except ImportError as e:
            raise ModelFilesMissing("dlib is not installed; `pip install dlib-bin`") from e
        d = Path(model_dir) if model_dir else dlib_model_dir()
        files = {n: d / n for n in ("shape_predictor_5_face_landmarks.dat", "dlib_face_recognition_resnet_model_v1.dat")}
        for f in files.values():
            if not f.is_file():
                raise ModelFilesMissing(f"dlib model file {f} is missing; reinstall face-recognition-models")
        self._dlib = dlib
        self._detector = dlib.get_frontal_face_detector()
        self._shapes = dlib.shape_predictor(str(files["shape_predictor_5_face_landmarks.dat"]))
        self._embedder = dlib.face_recognition_model_v1(str(files["dlib_face_recognition_resnet_model_v1.dat"]))
        self.threshold = float(threshold)
        self.min_score = float(min_score)
        self.detect_max_side = int(detect_max_side)
        self.max_pixels = int(max_pixels)

    def encode(self, image: np.ndarray) -> FaceResult:
        img = validate_image(image, self.max_pixels)
        h, w = img.shape[:2]
        scale = min(1.0, self.detect_max_side / max(h, w))  # detect on a smaller copy, embed at full res
        small = img if scale == 1.0 else _resize(img, scale)
        upsample = 1 if max(small.shape[:2]) < 640 else 0  # HOG finds faces >= 80 px; upsampling halves that
        rects, scores, _ = self._detector.run(small, upsample, self.min_score)
        boxes = np.array([[r.left(), r.top(), r.right(), r.bottom()] for r in rects], dtype=np.float32).reshape(-1, 4)
        boxes /= scale  # back to input-frame pixels
        if len(boxes) == 0:
            return FaceResult(boxes, np.zeros(0, np.float32), np.zeros((0, self.dim), np.float32), -1)
        shapes = self._dlib.full_object_detections()
        for x0, y0, x1, y1 in boxes:
            rect = self._dlib.rectangle(int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1)))
            shapes.append(self._shapes(img, rect))
        emb = _unit(np.array(self._embedder.compute_face_descriptor(img, shapes)))  # [F, 128]
        boxes[:, [0, 2]] = boxes[:, [0, 2]].clip(0, w)
        boxes[:, [1, 3]] = boxes[:, [1, 3]].clip(0, h)
        return FaceResult(boxes, np.asarray(scores, np.float32), emb, speaker_candidate(boxes, h, w))


def _resize(img: np.ndarray, scale: float) -> np.ndarray:
    from PIL import Image

    h, w = img.shape[:2]
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return np.asarray(Image.fromarray(img).resize(size, Image.BILINEAR))


DEEPFACE_WEIGHTS = ("facenet512_weights.h5", "retinaface.h5")


class DeepFaceEncoder:
    """The paper's backend: RetinaFace detection + Facenet512 (512-d) via DeepFace, local weights only."""

    model_id = "facenet512"
    dim = 512

    def __init__(self, deepface_home: Path | None, threshold: float, max_pixels: int = 40_000_000) -> None:
        if deepface_home is None:
            raise ModelFilesMissing(
                "identity.face_backend = 'deepface' needs identity.deepface_home: a folder holding "
                f".deepface/weights/{{{', '.join(DEEPFACE_WEIGHTS)}}}"
            )
        weights = Path(deepface_home) / ".deepface" / "weights"
        missing = [str(weights / f) for f in DEEPFACE_WEIGHTS if not (weights / f).is_file()]
        if missing:
            raise ModelFilesMissing(
                f"DeepFace weights missing: {', '.join(missing)}; copy them there (we never download at run time)"
            )
        os.environ["DEEPFACE_HOME"] = str(deepface_home)  # DeepFace reads it at import time
        try:
            from deepface import DeepFace
        except ImportError as e:
            raise ModelFilesMissing("the deepface package is not installed; `pip install 'egomem[paper]'`") from e
        self._deepface = DeepFace
        self.threshold = float(threshold)
        self.max_pixels = int(max_pixels)

    def encode(self, image: np.ndarray) -> FaceResult:
        img = validate_image(image, self.max_pixels)
        h, w = img.shape[:2]
        found = self._deepface.represent(
            img_path=img[:, :, ::-1].copy(),  # DeepFace takes BGR arrays
            model_name="Facenet512", detector_backend="retinaface", enforce_detection=False, align=True,
        )
        found = [f for f in found if f.get("face_confidence", 0) > 0]  # enforce_detection=False returns the frame
        if not found:
            return FaceResult(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros((0, self.dim), np.float32))
        a = [f["facial_area"] for f in found]
        boxes = np.array([[r["x"], r["y"], r["x"] + r["w"], r["y"] + r["h"]] for r in a], dtype=np.float32)
        scores = np.array([f["face_confidence"] for f in found], dtype=np.float32)
        emb = _unit(np.array([f["embedding"] for f in found]))
        return FaceResult(boxes, scores, emb, speaker_candidate(boxes, h, w))


def build_face_encoder(cfg: IdentityConfig) -> FaceEncoder:
    """The configured face backend, with its own threshold from config."""
    if cfg.face_backend == "dlib":
        return DlibFaceEncoder(cfg.face_threshold_dlib, cfg.face_min_score, cfg.face_detect_max_side, cfg.max_image_pixels)
    return DeepFaceEncoder(cfg.deepface_home, cfg.face_threshold_deepface, cfg.max_image_pixels)


__all__ = ["DeepFaceEncoder", "DlibFaceEncoder", "FaceEncoder", "FaceResult", "build_face_encoder",
           "speaker_candidate", "validate_image"]
