"""The wire schema of the sequence-batched models (`mimi_codec`, `dialog_lm`): one module for the
adapters (model_repository/*/1/model.py), the client (egomem.serving.client) and the orchestrator.

Tensor names and Triton dtypes of each model (config.pbtxt stays the truth for Triton; the adapters
check it at load and tests/test_serving_wire.py checks it against this module), the START/END flag bits,
and the per-row error codes a cohort answer carries in COHORT_ERRORS: "" for a served row, else
"<code>: <message>". A reader acts on the code (`parse_row_error`), never on the message's text.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np

SEQUENCE_START = 1  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
SEQUENCE_END = 2  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_END

MIMI_CODEC = "mimi_codec"
DIALOG_LM = "dialog_lm"

# -- cohort requests (egomem.serving.adapter): one request, one row per stream ---------------------------
COHORT_PREFIX = "COHORT_"
COHORT_STREAMS = "COHORT_STREAMS"  # INT64 [1, R]: each row's stream id (> 0)
COHORT_FLAGS = "COHORT_FLAGS"  # INT32 [1, R]: each row's SEQUENCE_START / SEQUENCE_END bits
COHORT_ERRORS = "COHORT_ERRORS"  # STRING [1, R]: "" = row served, else format_row_error(code, message)
COHORT_INPUTS = {COHORT_STREAMS: "TYPE_INT64", COHORT_FLAGS: "TYPE_INT32"}
COHORT_OUTPUTS = {COHORT_ERRORS: "TYPE_STRING"}


def cohort(name: str) -> str:
    """The cohort tensor of a per-stream tensor: PCM -> COHORT_PCM."""
    return COHORT_PREFIX + name


# per-stream tensors; each also travels as its cohort(...) twin (MEMCHUNK_TOKENS excepted)
MIMI_INPUTS = {"PCM": "TYPE_FP32", "CODES_IN": "TYPE_INT64"}
MIMI_OUTPUTS = {"CODES": "TYPE_INT64", "AUDIO": "TYPE_FP32"}
DIALOG_INPUTS = {"LISTEN_CODES": "TYPE_INT64", "MEMCHUNK_LEVEL": "TYPE_INT32", "MEMCHUNK_TOKENS": "TYPE_INT64",
                 "MEMCHUNK_TEXT": "TYPE_STRING"}
DIALOG_OUTPUTS = {"TEXT_TOKEN": "TYPE_INT64", "SPEAK_CODES": "TYPE_INT64", "TEXT_PIECE": "TYPE_STRING",
                  "STEP": "TYPE_INT64"}
PLAIN_ONLY = {"MEMCHUNK_TOKENS"}  # a cohort row refreshes its MemChunk with text only

NUMPY_DTYPES = {"TYPE_INT64": np.int64, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_STRING": np.object_}


def with_cohort(plain: dict[str, str], inputs: bool) -> dict[str, str]:
    """A model's full tensor table: the per-stream tensors, their cohort twins, and the cohort's own."""
    out = dict(plain)
    out.update({cohort(n): t for n, t in plain.items() if n not in PLAIN_ONLY})
    out.update(COHORT_INPUTS if inputs else COHORT_OUTPUTS)
    return out


TENSORS = {  # model -> (inputs, outputs), name -> Triton dtype
    MIMI_CODEC: (with_cohort(MIMI_INPUTS, True), with_cohort(MIMI_OUTPUTS, False)),
    DIALOG_LM: (with_cohort(DIALOG_INPUTS, True), with_cohort(DIALOG_OUTPUTS, False)),
}


def numpy_dtype(model: str, name: str) -> type:
    """The numpy dtype a tensor of `model` (or a cohort's own tensor, for any model) travels as."""
    inputs, outputs = TENSORS.get(model, ({}, {}))
    return NUMPY_DTYPES[{**COHORT_INPUTS, **COHORT_OUTPUTS, **inputs, **outputs}[name]]


# -- per-row errors ---------------------------------------------------------------------------------------
class RowError(StrEnum):
    """Why a row (or a plain request) was not served."""

    NO_FREE_SLOT = "no_free_slot"  # the model's stream pool is full: try again later
    UNKNOWN_STREAM = "unknown_stream"  # not opened with START, or idled out
    BAD_INPUT = "bad_input"  # the row's data is malformed
    DUPLICATE_ROW = "duplicate_row"  # a second row on one stream's state in one model step
    INTERNAL = "internal"  # anything else


def format_row_error(code: RowError, message: str) -> str:
    return f"{code.value}: {message}"


def parse_row_error(text: str) -> tuple[RowError, str] | None:
    """(code, message) of a COHORT_ERRORS entry; None for a served row. An entry without a known code
    (a model built before codes) reads as INTERNAL with the whole text as its message."""
    if not text:
        return None
    code, sep, message = text.partition(": ")
    try:
        return RowError(code), message if sep else ""
    except ValueError:
        return RowError.INTERNAL, text
