"""Triton replicas: the tritonservers (`server.triton_urls`) this orchestrator spreads its streams over.

A stream's model state (its Mimi streaming state, its KV cache) lives in one server's model processes,
so a stream is pinned to the replica it opened on for its whole life. Each replica has its own client,
model gateway and grid clock: a cohort (one request per model call for all the grid's streams) never
mixes replicas, and a replica that stalls or dies delays only its own streams' ticks.

Placement: a new stream goes to the ready replica with the fewest streams. Health: every
`server.replica_probe_s` each replica is asked whether the dialog models are ready, and a call that
finds a server gone marks it down at once. Its streams fail with 1011 as a single server's do (their
memory is flushed as always); the other replicas' streams do not notice. A replica that answers ready
again rejoins: new streams go to it. With no replica ready, a new stream goes to the least loaded one
anyway, so it fails with that server's own reason, or works if the server came back between two probes.

Stateless calls (the face, speaker and text encoders) go to any ready replica, round-robin (`client()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from dataclasses import dataclass, field

from egomem.config import Config
from egomem.serving.client import AsyncTritonClient
from egomem.serving.wire import DIALOG_LM, MIMI_CODEC

from .cohort import encode_cohort, step_cohort
from .gateway import ModelGateway, new_sequence_ids
from .grid import GridClock
from .metrics import Metrics

log = logging.getLogger(__name__)
STREAM_MODELS = (MIMI_CODEC, DIALOG_LM)  # a replica is ready when both answer ready


@dataclass(eq=False)
class Replica:
    index: int  # its place in server.triton_urls
    triton: AsyncTritonClient
    gateway: ModelGateway
    clock: GridClock  # ticks this replica's global-clock streams in lockstep
    ready: bool = False  # set by the probe (the first one runs at start)
    streams: int = 0  # streams pinned to it now
    models: dict[str, bool] = field(default_factory=dict)  # the last probe's answer per model

    @property
    def url(self) -> str:
        return self.triton.url


class Replicas:
    def __init__(self, cfg: Config, metrics: Metrics):
        oc = cfg.orchestrator
        self.metrics = metrics
        self.probe_s = cfg.server.replica_probe_s
        self.probe_timeout_s = min(oc.triton_timeout_s, 2.0)  # a blackholed host must not hold the probe long
        sequence_ids = new_sequence_ids()  # one counter: a stream's id is unique whichever replica it is on
        self.replicas: list[Replica] = []
        for i, url in enumerate(cfg.server.grpc_urls()):
            triton = AsyncTritonClient(url, timeout_s=oc.triton_timeout_s)
            gateway = ModelGateway(triton, metrics, oc.triton_timeout_s, sequence_ids)
            clock = GridClock(metrics, oc.max_tick_lag_s, functools.partial(encode_cohort, gateway=gateway),
                              functools.partial(step_cohort, gateway=gateway), oc.overlap_ticks)
            replica = Replica(i, triton, gateway, clock)
            gateway.on_unavailable = functools.partial(self.mark_down, replica)
            self.replicas.append(replica)
        self._round_robin = itertools.cycle(self.replicas)
        self._probing: asyncio.Task | None = None
        metrics.set("egomem_triton_replicas", len(self.replicas))
        self._publish()

    # -- placement -----------------------------------------------------------------------------
    def pin(self) -> Replica:
        """The replica a new stream runs on (the caller `unpin`s it when the stream has ended)."""
        pool = [r for r in self.replicas if r.ready] or self.replicas
        replica = min(pool, key=lambda r: (r.streams, r.index))
        replica.streams += 1
        return replica

    def unpin(self, replica: Replica) -> None:
        replica.streams -= 1

    def client(self) -> AsyncTritonClient:
        """A client for a stateless call: the next ready replica, or the first when none is."""
        for _ in self.replicas:
            replica = next(self._round_robin)
            if replica.ready:
                return replica.triton
        return self.replicas[0].triton

    @property
    def open_streams(self) -> int:
        return sum(r.streams for r in self.replicas)

    # -- health --------------------------------------------------------------------------------
    def mark_down(self, replica: Replica) -> None:
        """A call found `replica`'s server gone: no new stream goes there until a probe finds it ready."""
        if replica.ready:
            others = [r.url for r in self.replicas if r.ready and r is not replica]
            log.warning("Triton replica %s stopped answering: its %d streams close (1011); new streams go to %s",
                        replica.url, replica.streams, others or "none (no replica is ready)")
        replica.ready = False
        self._publish()

    async def probe(self) -> list[Replica]:
        """Ask every replica now whether its stream models are ready; update and return them."""
        await asyncio.gather(*(self._probe(r) for r in self.replicas))
        self._publish()
        return self.replicas

    async def _probe(self, replica: Replica) -> None:
        async def ask(model: str) -> bool:
            try:
                return await asyncio.wait_for(replica.triton.is_ready(model), self.probe_timeout_s)
            except TimeoutError:
                return False

        answers = await asyncio.gather(*(ask(m) for m in STREAM_MODELS))
        replica.models = dict(zip(STREAM_MODELS, answers))
        ready = all(answers)
        if ready and not replica.ready:
            log.info("Triton replica %s is ready: new streams may go to it", replica.url)
        elif not ready and replica.ready:
            log.warning("Triton replica %s is not ready (%s): new streams go elsewhere", replica.url,
                        ", ".join(m for m, ok in replica.models.items() if not ok))
        replica.ready = ready

    def _publish(self) -> None:
        self.metrics.set("egomem_triton_replicas_ready", sum(r.ready for r in self.replicas))

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_s)
            try:
                await self.probe()
            except Exception:  # a bug here must not end the probing silently
                log.exception("probing the Triton replicas failed")

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> Replicas:
        await self.probe()
        self._probing = asyncio.create_task(self._probe_forever())
        return self

    async def close(self) -> None:
        if self._probing is not None:
            self._probing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probing
        for r in self.replicas:
            await r.triton.close()
