"""The shared resources of one orchestrator process (opened and closed by app.py's cleanup_ctx)."""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from egomem.config import Config
from egomem.memory import MemoryStore
from egomem.serving.client import AsyncTritonClient

from .grid import GridClock
from .metrics import Metrics

if TYPE_CHECKING:
    from .perception import Perception
    from .stream import Stream


def _sequence_ids():
    """Triton correlation ids: unique across orchestrator restarts (time-seeded), never 0."""
    base = (int(time.time() * 1000) % (1 << 40)) << 16 | (os.getpid() & 0xFFFF)
    return itertools.count(base + 1)


@dataclass
class Services:
    cfg: Config
    triton: AsyncTritonClient
    store: MemoryStore
    metrics: Metrics
    perception: "Perception | None"  # None: identification/retrieval models are off
    clock: GridClock  # ticks the global-clock streams in lockstep
    streams: dict[str, "Stream"] = field(default_factory=dict)
    sequence_ids: "itertools.count[int]" = field(default_factory=_sequence_ids)

    @property
    def free_slots(self) -> int:
        return self.cfg.orchestrator.max_streams - len(self.streams)
