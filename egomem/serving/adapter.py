"""Helpers shared by the thin `model_repository/*/1/model.py` adapters, and `SequenceBatchedModel`, the
base of the sequence-batched ones (mimi_codec, dialog_lm). Tensor names, flags and error codes:
egomem.serving.wire.

They run inside the Triton Python-backend stub; `triton_python_backend_utils` is imported lazily so
this module also imports (and is tested) outside Triton.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

from .streams import StreamError
from .wire import (
    COHORT_ERRORS,
    COHORT_FLAGS,
    COHORT_STREAMS,
    SEQUENCE_END,
    SEQUENCE_START,
    RowError,
    cohort,
    format_row_error,
)

__all__ = ["SEQUENCE_END", "SEQUENCE_START", "SequenceBatchedModel", "StepBatch", "check_model_config",
           "cohort_errors", "cohort_input", "cohort_members", "error_response", "optional_input", "respond_each",
           "sequence_flags", "text_of"]


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
    streams = optional_input(request, COHORT_STREAMS, batch_of_one=True)
    if streams is None:
        return None
    streams = streams.reshape(-1).astype(np.int64)
    flags = optional_input(request, COHORT_FLAGS, batch_of_one=True)
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


def text_of(raw: Any) -> str:
    """A STRING tensor element as text."""
    return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)


RowFailure = tuple[RowError, str]  # (code, message) of a row that was not served


class StepBatch:
    """The per-stream items of one execute(): each plain request, and each row of each cohort request.

    `add(request, item, keys)` files a row's item under request index `request`; `fail(request, message)`
    fails a whole request (a malformed cohort). The pool serves `items` in one step. `keys` name the
    stream state a row touches (the stream id; for the codec, its encoder and/or decoder): a key met twice
    in one step keeps its first row, and a later one fails unserved (two rows on one state in one model
    step would corrupt it)."""

    def __init__(self) -> None:
        self.items: list[Any] = []  # what the pool serves, in order
        # request -> per row: (item position, parse error or None) or the failure of a row left unserved
        self.rows: dict[int, list[tuple[int, RowFailure | None] | RowFailure]] = {}
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
            rows.append((RowError.DUPLICATE_ROW, f"{what} has two rows in one model step: send one per tick"))
            return
        self._seen |= keys
        rows.append((len(self.items), (RowError.BAD_INPUT, error) if error else None))
        self.items.append(item)

    def fail(self, request: int, message: str) -> None:
        self.request_errors[request] = message

    def results_of(self, request: int, results: list[Any]) -> list[tuple[Any, RowFailure | None]]:
        """(result or None, failure or None) of each row of `request`, in row order; a pool result that
        is an exception counts as that row's failure (its code: a StreamError's own, else INTERNAL)."""
        out: list[tuple[Any, RowFailure | None]] = []
        for row in self.rows.get(request, []):
            if isinstance(row[0], RowError):
                out.append((None, row))
                continue
            pos, failure = row
            res = results[pos]
            if failure is None and isinstance(res, Exception):
                failure = (res.code if isinstance(res, StreamError) else RowError.INTERNAL, str(res))
            out.append((None, failure) if failure else (res, None))
        return out


def cohort_errors(rows: list[tuple[Any, RowFailure | None]]) -> np.ndarray:
    """The COHORT_ERRORS output [1, R] of `StepBatch.results_of` rows ("" = row served)."""
    return np.array([[format_row_error(*f).encode("utf-8") if f else b"" for _, f in rows]], dtype=np.object_)


class SequenceBatchedModel:
    """The Triton model of a sequence-batched pool: every row of every request of one execute() (each
    plain request, each row of each cohort request) is served in ONE pool step; a bad row fails alone.

    A subclass names its tensors (`INPUTS`, `OUTPUTS`: egomem.serving.wire tables) and says what is
    model-specific: `load(device)` builds `self.pool`; `parse(request, stream, start, end)` reads a plain
    request into the pool's item (an `ITEM`; `ITEM(stream, start, end)` stands for a request that did not
    parse, so its START/END still count), `parse_cohort(request, streams, flags)` reads a cohort's rows; `serve(items)`
    steps the pool; `blank(n)` gives each output (per-stream name) as n rows of fill values and `values(result)`
    a served row's values (None: not produced). `keys(item)`: the stream state a row touches."""

    INPUTS: dict[str, str] = {}
    OUTPUTS: dict[str, str] = {}
    ITEM: Callable[[int, bool, bool], Any]  # the pool's item type: ITEM(stream, start, end)
    pool: Any = None

    def initialize(self, args: dict[str, Any]) -> None:
        check_model_config(args, inputs=self.INPUTS, outputs=self.OUTPUTS)
        self.load("cuda" if args.get("model_instance_kind") == "GPU" else "cpu")

    def finalize(self) -> None:
        self.pool = None

    # -- what a model says ----------------------------------------------------------------------------
    def load(self, device: str) -> None:
        raise NotImplementedError

    def parse(self, request: Any, stream: int, start: bool, end: bool) -> Any:
        raise NotImplementedError

    def parse_cohort(self, request: Any, streams: np.ndarray, flags: np.ndarray) -> list[Any]:
        raise NotImplementedError

    def blank(self, n: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def values(self, result: Any) -> dict[str, Any]:
        raise NotImplementedError

    def keys(self, item: Any) -> list[Hashable]:
        return [item.stream]

    def serve(self, items: list[Any]) -> list[Any]:
        return self.pool.serve(items)

    # -- the plumbing ---------------------------------------------------------------------------------
    @staticmethod
    def rows(streams: np.ndarray, flags: np.ndarray) -> Iterable[tuple[int, int, bool, bool]]:
        """(row, stream, START, END) of each cohort row."""
        for r, (stream, flag) in enumerate(zip(streams.tolist(), flags.tolist())):
            yield r, stream, bool(flag & SEQUENCE_START), bool(flag & SEQUENCE_END)

    def execute(self, requests: list[Any]) -> list[Any]:
        batch, cohorts = StepBatch(), set()
        for i, request in enumerate(requests):
            try:
                members = cohort_members(request)
                if members is not None:
                    cohorts.add(i)
                    for item in self.parse_cohort(request, *members):
                        batch.add(i, item, self.keys(item))
                    continue
            except ValueError as e:  # UnicodeDecodeError included
                batch.fail(i, str(e))
                continue
            stream, start, end = sequence_flags(request)
            try:
                item = self.parse(request, stream, start, end)
                batch.add(i, item, self.keys(item))
            except ValueError as e:
                item = self.ITEM(stream, start, end)
                batch.add(i, item, self.keys(item), error=str(e))  # END still frees the stream
        results = self.serve(batch.items)
        return [self._respond(batch, i, request, results, i in cohorts) for i, request in enumerate(requests)]

    def _respond(self, batch: StepBatch, i: int, request: Any, results: list[Any], is_cohort: bool) -> Any:
        import triton_python_backend_utils as pb_utils

        if i in batch.request_errors:
            return error_response(batch.request_errors[i])
        rows = batch.results_of(i, results)
        wanted = set(request.requested_output_names())
        arrays = self.blank(len(rows))
        produced: set[str] = set()
        for r, (res, _) in enumerate(rows):
            if res is not None:
                for name, value in self.values(res).items():
                    if value is not None:
                        arrays[name][r] = value
                        produced.add(name)
        if is_cohort:
            out = {cohort(n): a[None] for n, a in arrays.items() if not wanted or cohort(n) in wanted}
            out[COHORT_ERRORS] = cohort_errors(rows)
        else:
            (_, failure), = rows
            if failure:
                return error_response(failure[1])
            out = {n: a.reshape(1, -1) for n, a in arrays.items() if n in produced and (not wanted or n in wanted)}
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, a) for n, a in out.items()])
