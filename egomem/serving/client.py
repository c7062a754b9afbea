"""Async client for the models on tritonserver (gRPC), used by the orchestrator and benchmarks.

Wraps `tritonclient.grpc.aio` with numpy in/out and two error kinds the caller can act on:
`TritonUnavailable` (server down or restarting: retry later, fail the streams cleanly) and
`TritonRequestError` (this request was refused: report it to the one stream that sent it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, InferInput, InferRequestedOutput, KeepAliveOptions
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from .wire import COHORT_ERRORS, COHORT_FLAGS, COHORT_STREAMS, RowError, numpy_dtype, parse_row_error


class TritonUnavailable(ConnectionError):
    """The server cannot be reached (down, restarting, model not loaded)."""


class TritonRequestError(ValueError):
    """The server refused this one request (bad shape, dtype, unknown stream...)."""


# gRPC waits up to 120 s between reconnect attempts to a server that went away, so a Triton restarted
# by `egomem serve` (same ports, ~30 s) would stay unreachable for minutes; cap the wait at 2 s.
RECONNECT_BACKOFF_MS = 2000


def channel_args() -> list[tuple[str, int]]:
    """tritonclient's own channel options (message size, keepalive) plus a short reconnect backoff."""
    ka = KeepAliveOptions()
    return [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", ka.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", ka.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", ka.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", ka.http2_max_pings_without_data),
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.min_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS)]


# Server down or restarting: the gRPC status says so, or (a connection lost mid-call, a model not loaded
# yet) only tritonserver's / gRPC's own message does. Our models' refusals carry codes (egomem.serving.wire).
_UNAVAILABLE_STATUS = {"StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED", "StatusCode.CANCELLED"}
_UNAVAILABLE_TEXT = ("failed to connect", "Socket closed", "is not ready", "unknown model")


def _unavailable(e: InferenceServerException) -> bool:
    return e.status() in _UNAVAILABLE_STATUS or any(k in str(e) for k in _UNAVAILABLE_TEXT)


class AsyncTritonClient:
    """One gRPC channel to tritonserver, safe to share between many asyncio tasks.

    The channel reconnects by itself when the server comes back (a restart on the same address):
    calls fail with TritonUnavailable meanwhile, and work again within RECONNECT_BACKOFF_MS of it.
    Readiness is asked of the server each time (`is_ready`), never cached."""

    def __init__(self, url: str, timeout_s: float = 10.0):
        self.url = url
        self.timeout_s = timeout_s
        self._client = grpcaio.InferenceServerClient(url, channel_args=channel_args())

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> AsyncTritonClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def is_ready(self, model: str | None = None) -> bool:
        try:
            if model is None:
                return bool(await self._client.is_server_ready())
            return bool(await self._client.is_model_ready(model))
        except InferenceServerException:
            return False

    async def wait_ready(self, models: list[str], timeout_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not all([await self.is_ready(m) for m in models]):
            if asyncio.get_running_loop().time() > deadline:
                raise TritonUnavailable(f"models {models} not ready at {self.url} after {timeout_s:.0f} s")
            await asyncio.sleep(0.25)

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        outputs: list[str],
        sequence_id: int = 0,
        start: bool = False,
        end: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, np.ndarray]:
        """One request; `sequence_id` > 0 makes it part of a stream (START/END flags)."""
        ins = []
        for name, arr in inputs.items():
            arr = np.ascontiguousarray(arr)
            t = InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
            t.set_data_from_numpy(arr)
            ins.append(t)
        outs = [InferRequestedOutput(o) for o in outputs]
        timeout = timeout_s or self.timeout_s
        try:
            res = await asyncio.wait_for(
                self._client.infer(model, ins, outputs=outs, sequence_id=sequence_id,
                                   sequence_start=start, sequence_end=end),
                timeout=timeout,
            )
        except TimeoutError as e:
            raise TritonUnavailable(f"{model}: no answer from {self.url} within {timeout:.1f} s") from e
        except InferenceServerException as e:
            if _unavailable(e):
                raise TritonUnavailable(f"{model}: {e}") from e
            raise TritonRequestError(f"{model}: {e}") from e
        return {o: res.as_numpy(o) for o in outputs}

    async def infer_cohort(
        self,
        model: str,
        cohort_id: int,
        streams: list[int],
        flags: list[int],
        inputs: Mapping[str, np.ndarray],
        outputs: list[str],
        timeout_s: float | None = None,
    ) -> tuple[dict[str, np.ndarray], list[tuple[RowError, str] | None]]:
        """One cohort request (egomem.serving.adapter, egomem.serving.wire): row r of every input and
        output belongs to `streams[r]`, whose START/END bits are `flags[r]`. `cohort_id` is the request's
        own one-request sequence (unique, > 0). Returns the outputs ([rows, ...]) and each row's failure,
        (code, message), or None where the row was served."""
        ins = {COHORT_STREAMS: np.asarray(streams, numpy_dtype(model, COHORT_STREAMS))[None],
               COHORT_FLAGS: np.asarray(flags, numpy_dtype(model, COHORT_FLAGS))[None]}
        ins.update({name: np.asarray(a)[None] for name, a in inputs.items()})
        out = await self.infer(model, ins, [*outputs, COHORT_ERRORS], cohort_id, start=True, end=True,
                               timeout_s=timeout_s)
        errors = [parse_row_error(e.decode("utf-8", "replace") if isinstance(e, bytes) else str(e))
                  for e in out.pop(COHORT_ERRORS)[0]]
        return {name: a[0] for name, a in out.items()}, errors
