"""The orchestrator's one way to the sequence-batched models (mimi_codec, dialog_lm): the Triton client,
the sequence ids, the call timeout and the error metric, handed to the cohort phases and the grid.

A cohort call (egomem.serving.wire) answers per row: a row the model refused fails its own stream with
a close code chosen from the row's error code (a full pool: try later), never from its message's text;
a call that fails as a whole (server down, request refused) fails every stream in it.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from egomem.protocol import CLOSE_INTERNAL, CLOSE_TRY_LATER
from egomem.serving.client import AsyncTritonClient, TritonRequestError, TritonUnavailable
from egomem.serving.wire import RowError

from .metrics import Metrics

TRITON_ERRORS = "egomem_triton_errors_total"


class StreamFailed(RuntimeError):
    """A model call failed under this stream; `close_code` tells the client why."""

    def __init__(self, message: str, close_code: int):
        super().__init__(message)
        self.close_code = close_code


def row_failure(model: str, code: RowError, message: str) -> StreamFailed:
    """The failure of a stream whose row `model` refused with `code`."""
    if code is RowError.NO_FREE_SLOT:
        return StreamFailed(f"no free stream slot in {model}", CLOSE_TRY_LATER)
    return StreamFailed(f"{model} refused the stream: {message}", CLOSE_INTERNAL)


def new_sequence_ids() -> itertools.count[int]:
    """Triton correlation ids: unique across orchestrator restarts (time-seeded), never 0."""
    base = (int(time.time() * 1000) % (1 << 40)) << 16 | (os.getpid() & 0xFFFF)
    return itertools.count(base + 1)


class ModelGateway:
    def __init__(self, triton: AsyncTritonClient, metrics: Metrics, timeout_s: float, sequence_ids: Iterator[int],
                 on_unavailable: Callable[[], None] | None = None):
        """`sequence_ids`: Triton correlation ids, unique and > 0 (the streams' and the cohort calls' own);
        `on_unavailable` is told when a call finds the server gone (orchestrator/replicas.py marks it down)."""
        self.triton = triton
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.sequence_ids = sequence_ids
        self.on_unavailable = on_unavailable

    def new_sequence_id(self) -> int:
        return next(self.sequence_ids)

    async def cohort(self, model: str, sequence_ids: list[int], flags: list[int], inputs: Mapping[str, np.ndarray],
                     outputs: list[str]) -> tuple[dict[str, np.ndarray], list[StreamFailed | None]]:
        """One cohort request, row r for the stream `sequence_ids[r]` with START/END bits `flags[r]`:
        (outputs [rows, ...], per row its failure or None)."""
        try:
            out, errors = await self.triton.infer_cohort(model, self.new_sequence_id(), sequence_ids, flags, inputs,
                                                         outputs, timeout_s=self.timeout_s)
        except TritonUnavailable as e:
            self.metrics.inc(TRITON_ERRORS, len(sequence_ids))
            if self.on_unavailable is not None:
                self.on_unavailable()
            return {}, [StreamFailed(f"model server unavailable: {e}", CLOSE_INTERNAL) for _ in sequence_ids]
        except TritonRequestError as e:
            self.metrics.inc(TRITON_ERRORS, len(sequence_ids))
            return {}, [StreamFailed(f"{model} refused the request: {e}", CLOSE_INTERNAL) for _ in sequence_ids]
        failures = [row_failure(model, *err) if err else None for err in errors]
        self.metrics.inc(TRITON_ERRORS, sum(f is not None for f in failures))
        return out, failures
