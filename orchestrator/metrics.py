"""Prometheus metrics in the text exposition format (version 0.0.4), without a client library.

Counters, gauges and histograms with fixed buckets; `render()` is what `/metrics` returns. All
updates happen on the event loop, so no locks are needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, v: float) -> None:
        self.total += v
        self.n += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1


# name -> (type, help)
DEFINITIONS = {
    "egomem_tick_seconds": ("histogram", "Time of one dialog tick (codec + dialog model round trips)."),
    "egomem_tick_deadline_misses_total": ("counter", "Ticks that ended after their 80 ms deadline, or were skipped."),
    "egomem_late_frames_total": ("counter", "Ticks with no client audio ready (silence was fed instead)."),
    "egomem_dropped_input_seconds_total": ("counter", "Client audio dropped because it ran too far ahead."),
    "egomem_dropped_output_messages_total": ("counter", "Outbound messages dropped for a slow client."),
    "egomem_open_streams": ("gauge", "Open /api/chat streams."),
    "egomem_streams_total": ("counter", "Streams opened since start."),
    "egomem_streams_rejected_total": ("counter", "Streams refused (no free slot, auth, limits)."),
    "egomem_stream_failures_total": ("counter", "Streams closed because a model call failed."),
    "egomem_malformed_messages_total": ("counter", "Client messages refused as malformed or over a limit."),
    "egomem_refresh_seconds": ("histogram", "MemChunk refresh latency, from decision to the model's answer."),
    "egomem_identification_seconds": ("histogram", "Identification latency (encoders + identify)."),
    "egomem_retrieval_seconds": ("histogram", "Level-2 retrieval latency (store + BM25 + re-rank)."),
    "egomem_memory_jobs_total": ("counter", "Memory jobs enqueued."),
    "egomem_memory_queue_depth": ("gauge", "Memory jobs queued or running (read from the store)."),
    "egomem_memory_dead_letters": ("gauge", "Unresolved dead letters (failed LLM calls and jobs)."),
    "egomem_changes_applied_total": ("counter", "Store changes (forget, merge, profile) applied from the change feed."),
    "egomem_change_propagation_seconds": ("histogram", "From a store change's commit (any process) to applied here."),
    "egomem_triton_errors_total": ("counter", "Failed Triton calls."),
    "egomem_triton_replicas": ("gauge", "Triton replicas configured (server.triton_urls)."),
    "egomem_triton_replicas_ready": ("gauge", "Triton replicas whose stream models answered ready at the last probe."),
    "egomem_http_requests_total": ("counter", "REST requests handled."),
}


class Metrics:
    def __init__(self) -> None:
        self.values: dict[str, float | Histogram] = {}
        for name, (kind, _) in DEFINITIONS.items():
            self.values[name] = Histogram() if kind == "histogram" else 0.0

    def inc(self, name: str, by: float = 1.0) -> None:
        self.values[name] += by

    def set(self, name: str, value: float) -> None:
        self.values[name] = float(value)

    def observe(self, name: str, seconds: float) -> None:
        h = self.values[name]
        assert isinstance(h, Histogram)
        h.observe(seconds)

    def get(self, name: str) -> float:
        v = self.values[name]
        return float(v.n) if isinstance(v, Histogram) else float(v)

    def render(self) -> str:
        out: list[str] = []
        for name, (kind, help_) in DEFINITIONS.items():
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            v = self.values[name]
            if isinstance(v, Histogram):
                for b, c in zip(v.buckets, v.counts):
                    out.append(f'{name}_bucket{{le="{_num(b)}"}} {c}')
                out.append(f'{name}_bucket{{le="+Inf"}} {v.n}')
                out.append(f"{name}_sum {_num(v.total)}")
                out.append(f"{name}_count {v.n}")
            else:
                out.append(f"{name} {_num(v)}")
        return "\n".join(out) + "\n"


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))
