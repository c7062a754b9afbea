"""The orchestrator's pure pieces, in-process: protocol framing, the outbox's drop policy, the rate
limit, MemChunk fitting, recording into StreamChunks, Prometheus rendering, the grid clock."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from egomem import protocol as P
from egomem.orchestrator.grid import GridClock
from egomem.orchestrator.metrics import Metrics
from egomem.orchestrator.recording import Recorder
from egomem.orchestrator.stream import _fit
from egomem.orchestrator.ws import Outbox, RateLimit


def test_protocol_round_trip_and_errors():
    kind, payload = P.unpack(P.pack_event("user_recognised", user_id="u1", score=np.float32(0.5)))
    assert kind == P.EVENT and json.loads(payload) == {"type": "user_recognised", "user_id": "u1", "score": 0.5}
    assert P.unpack(b"\x01abc") == (P.AUDIO, b"abc")
    with pytest.raises(P.ProtocolError, match="kind byte"):
        P.unpack(b"")
    with pytest.raises(P.ProtocolError, match="JSON object"):
        P.parse_json(b"[1, 2]")
    with pytest.raises(P.ProtocolError, match="at most 3"):
        P.parse_text(b"abcd", max_chars=3)
    assert len({P.VIDEO, P.TRANSCRIPT, P.EVENT, P.CONTROL} & {0, 1, 2, 3, 4, 5, 6}) == 0  # clear of Moshi's kinds


def test_outbox_drops_audio_first_and_keeps_events():
    dropped = []
    box = Outbox(3, lambda: dropped.append(1))
    for m in (b"\x01a", b"\x01b", b"\x12e1"):
        box.put(m)
    box.put(b"\x12e2")  # full: the oldest audio goes, the event stays
    assert list(box.q) == [b"\x01b", b"\x12e1", b"\x12e2"] and len(dropped) == 1
    box.put(b"\x01c")  # full again, new audio: the oldest audio makes room
    assert list(box.q) == [b"\x12e1", b"\x12e2", b"\x01c"]
    box.put(b"\x12e3")
    box.put(b"\x12e4")  # no audio left to drop: the oldest message goes
    assert list(box.q) == [b"\x12e2", b"\x12e3", b"\x12e4"] and len(dropped) == 4
    box.put(b"\x01d")  # all events: new audio is dropped
    assert b"\x01d" not in box.q and len(dropped) == 5


def test_outbox_gives_up_on_a_client_that_stops_reading(monkeypatch):
    import egomem.orchestrator.ws as ws_mod

    monkeypatch.setattr(ws_mod, "SEND_TIMEOUT_S", 0.05)

    class Stuck:
        closed = False

        async def send_bytes(self, data):
            await asyncio.sleep(10)

    async def go():
        box = Outbox(4, lambda: None)
        box.put(b"\x01x")
        await asyncio.wait_for(box.drain(Stuck()), 2)  # returns (the client is gone), never hangs

    asyncio.run(go())


def test_rate_limit_allows_bursts_up_to_one_second():
    r = RateLimit(10)
    assert sum(r.allow() for _ in range(15)) == 10


def test_fit_cuts_at_line_boundaries_in_utf8_bytes():
    text = "name: Zoë\nfact: likes tea\nfact: lives in Köln"
    assert _fit(text, 1000) == text
    assert _fit(text, 26) == "name: Zoë\nfact: likes tea"  # 10 bytes + 1 + 15
    assert _fit(text, 5) == ""


def test_recorder_cuts_chunks_with_aligned_audio_and_zero_tokens(tmp_path):
    rec = Recorder("s1", record_audio=True)
    for t in range(3):
        speak = np.full(8, -2 if t == 0 else 5, np.int64)  # the model's warm-up tick
        rec.tick(-2 if t == 0 else 65, speak, np.arange(8), np.full(1920, t, np.float32), "" if t == 0 else "a")
    rec.transcript_line("my name is Ada")
    rec.face(np.ones(4, np.float32))
    chunk = rec.cut()
    assert chunk.tokens.shape == (3, 17) and (chunk.tokens[0, :9] == -1).all() and chunk.tokens[1, 0] == 65
    assert chunk.listen_audio.shape == (3 * 1920,) and chunk.listen_audio[1920] == 1.0
    assert chunk.monologue == [(1, "aa")] and chunk.client_transcript == [(2, "my name is Ada")]
    assert chunk.faces[0][0] == 2 and chunk.chunk_index == 0
    assert rec.cut() is None  # nothing new recorded
    rec.tick(1, np.zeros(8, np.int64), np.zeros(8, np.int64), np.zeros(1920, np.float32), "")
    nxt = rec.cut()
    assert nxt.chunk_index == 1 and nxt.steps == 1


def test_metrics_render_prometheus_text():
    m = Metrics()
    m.observe("egomem_tick_seconds", 0.03)
    m.observe("egomem_tick_seconds", 0.2)
    m.inc("egomem_late_frames_total", 2)
    text = m.render()
    assert 'egomem_tick_seconds_bucket{le="0.04"} 1' in text and 'egomem_tick_seconds_bucket{le="+Inf"} 2' in text
    assert "egomem_tick_seconds_count 2" in text and "egomem_late_frames_total 2" in text
    assert "# TYPE egomem_open_streams gauge" in text



class _FakeStream:
    """What the grid clock drives: `closed`, `encode()`, `step(enc)`; logs (event, stream, time)."""

    def __init__(self, name: str, log: list, encode_s: float = 0.0, fail_at: int | None = None):
        self.name, self.log, self.encode_s, self.fail_at = name, log, encode_s, fail_at
        self.closed = asyncio.Event()
        self.ticks = 0

    async def encode(self):
        self.log.append(("encoding", self.name, asyncio.get_running_loop().time()))
        await asyncio.sleep(self.encode_s)
        if self.fail_at is not None and self.ticks == self.fail_at:
            raise RuntimeError(f"{self.name}: model server unavailable")
        self.log.append(("encoded", self.name, asyncio.get_running_loop().time()))
        return self.ticks

    async def step(self, enc):
        self.log.append(("step", self.name, asyncio.get_running_loop().time()))
        self.ticks += 1


def test_grid_clock_ticks_streams_in_lockstep_phases():
    async def run():
        log: list = []
        metrics = Metrics()
        clock = GridClock(metrics, max_lag_s=0.4)
        fast, slow = _FakeStream("fast", log), _FakeStream("slow", log, encode_s=0.03)
        runs = [asyncio.create_task(clock.run(s)) for s in (fast, slow)]
        await asyncio.sleep(0.5)
        fast.closed.set(), slow.closed.set()
        await asyncio.gather(*runs)
        return log, fast.ticks, slow.ticks, metrics

    log, fast_ticks, slow_ticks, metrics = asyncio.run(run())
    assert fast_ticks >= 5 and abs(fast_ticks - slow_ticks) <= 1  # 80 ms grid, both every tick
    steps = [t for e, _, t in log if e == "step"]
    encodes = {n: [t for e, m, t in log if e == "encoded" and m == n] for n in ("fast", "slow")}
    for k in range(min(fast_ticks, slow_ticks)):  # tick k: no dialog step before the slow stream's codes are in
        assert min(steps[2 * k:2 * k + 2]) >= encodes["slow"][k]
    gaps = np.diff(encodes["fast"])
    assert 0.06 < float(np.median(gaps)) < 0.1  # the grid's 80 ms, not as fast as possible
    assert "egomem_tick_seconds" in metrics.render()


def test_grid_clock_a_failing_stream_leaves_alone():
    async def run():
        log: list = []
        clock = GridClock(Metrics(), max_lag_s=0.4)
        good, bad = _FakeStream("good", log), _FakeStream("bad", log, fail_at=2)
        good_run = asyncio.create_task(clock.run(good))
        with pytest.raises(RuntimeError, match="bad: model server unavailable"):
            await clock.run(bad)
        ticks_when_bad_failed = good.ticks
        await asyncio.sleep(0.3)
        assert not good_run.done() and clock.size == 1
        good.encode_s = 0.05
        while log[-1][:2] != ("encoding", "good"):  # close it mid-tick, while its encode is in flight
            await asyncio.sleep(0.005)
        good.closed.set()
        await good_run  # a closed stream's run returns without error ...
        return ticks_when_bad_failed, good.ticks, log[-1]  # ... and only after its tick's step

    at_failure, later, last = asyncio.run(run())
    assert later >= at_failure + 2  # the good stream kept ticking after the other one failed
    assert last[:2] == ("step", "good")  # its tick in flight finished before run returned
