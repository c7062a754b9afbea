"""Request-level entry points for the `face_encoder` and `speaker_encoder` Triton models.

The adapters in model_repository/ only move tensors; these functions check a request's arrays, run
the encoder and name the output tensors, so the same path runs (and is tested) in-process.
"""

from __future__ import annotations

import numpy as np

from egomem.identity.errors import InputError
from egomem.identity.face import FaceEncoder
from egomem.identity.voice import STREAM_RATE, SpeakerEncoder

FACE_INPUTS = {"IMAGE": "TYPE_UINT8"}
FACE_OUTPUTS = {"BOXES": "TYPE_FP32", "SCORES": "TYPE_FP32", "EMBEDDINGS": "TYPE_FP32", "SPEAKER": "TYPE_INT32",
                "MODEL_ID": "TYPE_STRING"}
VOICE_INPUTS = {"PCM": "TYPE_FP32", "SAMPLE_RATE": "TYPE_INT32"}
VOICE_OUTPUTS = {"EMBEDDING": "TYPE_FP32", "VOICED": "TYPE_BOOL", "VOICED_RATIO": "TYPE_FP32", "VOICED_S": "TYPE_FP32",
                 "MODEL_ID": "TYPE_STRING"}


def face_request(encoder: FaceEncoder, image: np.ndarray) -> dict[str, np.ndarray]:
    """IMAGE uint8 [H, W, 3] -> BOXES [F, 4], SCORES [F], EMBEDDINGS [F, D], SPEAKER [1] (-1: no face), MODEL_ID [1]."""
    res = encoder.encode(image)
    return {
        "BOXES": res.boxes.astype(np.float32).reshape(-1, 4),
        "SCORES": res.scores.astype(np.float32),
        "EMBEDDINGS": res.embeddings.astype(np.float32).reshape(-1, encoder.dim),
        "SPEAKER": np.array([res.speaker], np.int32),
        "MODEL_ID": np.array([encoder.model_id.encode()], dtype=np.object_),
    }


def voice_request(encoder: SpeakerEncoder, pcm: np.ndarray, sample_rate: np.ndarray | None) -> dict[str, np.ndarray]:
    """PCM float32 [T] (+ SAMPLE_RATE [1], default 24 kHz) -> EMBEDDING [D] (or [0] when not voiced),
    VOICED [1], VOICED_RATIO [1], VOICED_S [1], MODEL_ID [1]."""
    sr = STREAM_RATE
    if sample_rate is not None:
        if np.size(sample_rate) != 1:
            raise InputError(f"SAMPLE_RATE must hold one value, got shape {list(np.shape(sample_rate))}")
        sr = int(np.asarray(sample_rate).reshape(-1)[0])
    res = encoder.encode(pcm, sr)
    emb = res.embedding if res.embedding is not None else np.zeros(0, np.float32)
    return {
        "EMBEDDING": emb.astype(np.float32),
        "VOICED": np.array([res.voiced], np.bool_),
        "VOICED_RATIO": np.array([res.voiced_ratio], np.float32),
        "VOICED_S": np.array([res.voiced_s], np.float32),
        "MODEL_ID": np.array([encoder.model_id.encode()], dtype=np.object_),
    }
