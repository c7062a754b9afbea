"""What every sequence-batched model (mimi_codec, dialog_lm) shares about its streams: the error a
request gets, the stream -> slot table with its idle timeout, and the START rule."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from .wire import RowError

log = logging.getLogger(__name__)


class StreamError(ValueError):
    """A request the pool cannot serve (unknown stream, full pool, bad data); only that request fails.
    `code` says why (egomem.serving.wire.RowError); the message says it to a person."""

    def __init__(self, message: str, code: RowError = RowError.BAD_INPUT):
        super().__init__(message)
        self.code = code


class SlotTable:
    """Stream ids -> slots, each with the time it was last used. Triton forgets idle sequences silently,
    so a pool reclaims the streams idle longer than its TTL (`reclaim_idle`) before opening another.
    Not locked: the pool that owns it holds its own lock."""

    def __init__(self, name: str):
        self.name = name  # for the log line of a reclaimed stream
        self._slots: dict[int, int] = {}
        self._last_used: dict[int, float] = {}

    def __contains__(self, stream: int) -> bool:
        return stream in self._slots

    def __getitem__(self, stream: int) -> int:
        return self._slots[stream]

    def __len__(self) -> int:
        return len(self._slots)

    def items(self) -> Iterator[tuple[int, int]]:
        """(stream, slot) pairs."""
        return iter(list(self._slots.items()))

    def put(self, stream: int, slot: int) -> None:
        """Give `stream` its slot (used now)."""
        self._slots[stream] = slot
        self.touch(stream)

    def move(self, stream: int, slot: int) -> None:
        """`stream` now lives in `slot` (its last use unchanged)."""
        self._slots[stream] = slot

    def touch(self, stream: int) -> None:
        self._last_used[stream] = time.monotonic()

    def pop(self, stream: int) -> int | None:
        """Forget `stream`; its slot, or None when it was not open."""
        self._last_used.pop(stream, None)
        return self._slots.pop(stream, None)

    def reclaim_idle(self, ttl_s: float, release: Callable[[int], None]) -> None:
        """`release(stream)` every stream idle for longer than `ttl_s`."""
        now = time.monotonic()
        for stream, last in list(self._last_used.items()):
            if now - last > ttl_s:
                log.info("%s: closing stream %d idle for %.0f s", self.name, stream, now - last)
                release(stream)


class StreamPool(Protocol):
    def open(self, stream: int) -> int: ...

    def is_open(self, stream: int) -> bool: ...


def admit(pool: StreamPool, stream: int, start: bool) -> None:
    """A sequence's START (re)opens its stream; any later request needs the stream still open."""
    if start:
        pool.open(stream)
    elif not pool.is_open(stream):
        raise StreamError(f"unknown stream {stream}: open it with a sequence START (or it idled out)",
                          RowError.UNKNOWN_STREAM)
