"""Helpers shared by the thin `model_repository/*/1/model.py` adapters.

They run inside the Triton Python-backend stub; `triton_python_backend_utils` is imported lazily so
this module also imports (and is tested) outside Triton.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np

SEQUENCE_START = 1  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
SEQUENCE_END = 2  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


def check_model_config(args: dict[str, Any], inputs: dict[str, str], outputs: dict[str, str]) -> dict:
    """Fail at load, with a clear message, when config.pbtxt's tensor names/dtypes differ from the code's."""
    config = json.loads(args["model_config"])
    name = config.get("name", "?")
    have_in = {t["name"]: t["data_type"] for t in config.get("input", [])}
    have_out = {t["name"]: t["data_type"] for t in config.get("output", [])}
    for kind, want, have in (("input", inputs, have_in), ("output", outputs, have_out)):
        for tensor, dtype in want.items():
            if have.get(tensor) != dtype:
                raise ValueError(
                    f"model {name}: config.pbtxt {kind} {tensor!r} must be {dtype}, found {have.get(tensor)!r}; "
                    f"the adapter and config.pbtxt are out of sync"
                )
    return config


def sequence_flags(request: Any) -> tuple[int, bool, bool]:
    """(correlation id, START, END) of a sequence-batched request."""
    flags = int(request.flags())
    return int(request.correlation_id()), bool(flags & SEQUENCE_START), bool(flags & SEQUENCE_END)


def optional_input(request: Any, name: str, batch_of_one: bool = False) -> np.ndarray | None:
    """The named input as numpy (None when absent); with `batch_of_one`, strip a leading batch dim of 1."""
    import triton_python_backend_utils as pb_utils

    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    a = t.as_numpy()
    if batch_of_one:
        if a.ndim == 0 or a.shape[0] != 1:
            raise ValueError(f"input {name}: send one item per request (batch dimension 1), got shape {list(a.shape)}")
        a = a[0]
    return a


def respond_each(requests: list[Any], handle: Callable[[Any], dict[str, np.ndarray]]) -> list[Any]:
    """One response per request: `handle(request) -> {output name: array}`; an exception becomes that
    request's error response, so one bad request never fails the batch."""
    import triton_python_backend_utils as pb_utils

    responses = []
    for request in requests:
        try:
            out = handle(request)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, value) for name, value in out.items()]))
        except Exception as e:  # noqa: BLE001 - reported to the client that sent it
            responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))))
    return responses
