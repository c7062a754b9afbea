"""What every sequence-batched model (mimi_codec, dialog_lm) shares about its streams."""

from __future__ import annotations

from typing import Protocol


class StreamError(ValueError):
    """A request the pool cannot serve (unknown stream, full pool, bad data); only that request fails."""


class StreamPool(Protocol):
    def open(self, stream: int) -> int: ...

    def is_open(self, stream: int) -> bool: ...


def admit(pool: StreamPool, stream: int, start: bool) -> None:
    """A sequence's START (re)opens its stream; any later request needs the stream still open."""
    if start:
        pool.open(stream)
    elif not pool.is_open(stream):
        raise StreamError(f"unknown stream {stream}: open it with a sequence START (or it idled out)")
