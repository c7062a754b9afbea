"""Helpers shared by the thin `model_repository/*/1/model.py` adapters.

They run inside the Triton Python-backend stub; `triton_python_backend_utils` is imported lazily so
this module also imports (and is tested) outside Triton.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Hashable, Iterable

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
            responses.append(error_response(str(e)))
    return responses


def error_response(message: str) -> Any:
    """A response that fails one request with `message`; the rest of the batch is served."""
    import triton_python_backend_utils as pb_utils

    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


# -- cohort requests: one request, one row per stream ---------------------------------------------------
# The sequence batcher takes one row per request (batch size 1), so N streams cost N requests: N gRPC
# calls in the orchestrator, N queue entries in tritonserver, N request objects in the stub, and a batch
# split whenever the N requests take longer to send than the batcher's queue window. A cohort request
# carries the rows of many streams in one request: COHORT_STREAMS [R] names each row's stream (the
# correlation id it would use alone), COHORT_FLAGS [R] its START/END bits, and the COHORT_* data inputs
# hold R rows. The request itself is a one-request sequence (START|END, a correlation id of its own),
# so Triton keeps no state for it; its rows join the plain requests of the same execute() in ONE model
# step. Outputs come back as R rows plus COHORT_ERRORS [R] ("" = row served), so one bad row fails
# only its own stream.


def cohort_members(request: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """(stream ids [R], START/END flags [R]) of a cohort request; None for a plain per-stream request."""
    streams = optional_input(request, "COHORT_STREAMS", batch_of_one=True)
    if streams is None:
        return None
    streams = streams.reshape(-1).astype(np.int64)
    flags = optional_input(request, "COHORT_FLAGS", batch_of_one=True)
    flags = np.zeros(streams.shape, np.int64) if flags is None else flags.reshape(-1).astype(np.int64)
    if flags.shape != streams.shape:
        raise ValueError(f"COHORT_FLAGS holds {flags.size} flags for {streams.size} COHORT_STREAMS")
    if streams.size and streams.min() <= 0:
        raise ValueError("COHORT_STREAMS: stream ids must be > 0")
    return streams, flags


def cohort_input(request: Any, name: str, rows: int, row_shape: tuple[int, ...]) -> np.ndarray | None:
    """A cohort data input as [rows, *row_shape] (None when absent); refuses any other shape."""
    a = optional_input(request, name, batch_of_one=True)
    if a is None:
        return None
    if a.shape != (rows, *row_shape):
        raise ValueError(f"input {name}: expected shape [{rows}, {', '.join(map(str, row_shape))}] "
                         f"(one row per COHORT_STREAMS entry), got {list(a.shape)}")
    return a


class StepBatch:
    """The per-stream items of one execute(): each plain request, and each row of each cohort request.

    `add(request, item, keys)` files a row's item under request index `request`; `fail(request, message)`
    fails a whole request (a malformed cohort). The pool serves `items` in one step. `keys` name the
    stream state a row touches (the stream id; for the codec, its encoder and/or decoder): a key met twice
    in one step keeps its first row, and a later one fails unserved (two rows on one state in one model
    step would corrupt it)."""

    def __init__(self) -> None:
        self.items: list[Any] = []  # what the pool serves, in order
        self.rows: dict[int, list[tuple[int, str] | str]] = {}  # request -> per row: (item position, parse error) or unserved error
        self.request_errors: dict[int, str] = {}
        self._seen: set[Hashable] = set()

    def add(self, request: int, item: Any, keys: Iterable[Hashable], error: str = "") -> None:
        """`error`: the row did not parse; its item (carrying no data) still goes to the pool, so its
        START/END still open/free the stream, and the row reports `error`."""
        rows = self.rows.setdefault(request, [])
        keys = set(keys)
        if keys & self._seen:
            dup = sorted(keys & self._seen, key=str)[0]
            what = f"stream {dup[0]}'s {dup[1]}" if isinstance(dup, tuple) else f"stream {dup}"
            rows.append(f"{what} has two rows in one model step: send one per tick")
            return
        self._seen |= keys
        rows.append((len(self.items), error))
        self.items.append(item)

    def fail(self, request: int, message: str) -> None:
        self.request_errors[request] = message

    def results_of(self, request: int, results: list[Any]) -> list[tuple[Any, str]]:
        """(result or None, error message or "") of each row of `request`, in row order; a pool result
        that is an exception counts as that row's error."""
        out = []
        for row in self.rows.get(request, []):
            if isinstance(row, str):
                out.append((None, row))
                continue
            pos, error = row
            res = results[pos]
            if error or isinstance(res, Exception):
                out.append((None, error or str(res)))
            else:
                out.append((res, ""))
        return out


def cohort_errors(rows: list[tuple[Any, str]]) -> np.ndarray:
    """The COHORT_ERRORS output [1, R] of `StepBatch.results_of` rows ("" = row served)."""
    return np.array([[err.encode("utf-8") for _, err in rows]], dtype=np.object_)
