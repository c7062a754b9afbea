"""The orchestrator's pure pieces, in-process: protocol framing, the outbox's drop policy, the rate
limit, MemChunk fitting, recording into StreamChunks, Prometheus rendering, the grid clock."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import numpy as np
import pytest

from egomem import protocol as P
from egomem.dialog.memchunk_text import fit as _fit
from egomem.orchestrator.grid import GridClock
from egomem.orchestrator.metrics import Metrics
from egomem.orchestrator.recording import Recorder
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
    assert rec.steps_since_poll == 3  # never looked at: the stream's last look must (IdentityPoller.finish)
    rec.face(np.ones(4, np.float32))
    assert rec.steps_since_poll == 0
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
    """What the grid clock looks at: `closed`; `ticks` counts the ticks it finished."""

    def __init__(self, name: str):
        self.name = name
        self.closed = asyncio.Event()
        self.ticks = 0


@dataclass
class _Row:
    stream: _FakeStream


class _FakePhases:
    """The grid's `encode(cohort)` and `step(rows)`: log (event, names, time), take `encode_s` / `step_s`;
    stream `fail` fails in the step of its tick number `fail_at`."""

    def __init__(self, encode_s: float = 0.0, step_s: float = 0.0, fail: str | None = None, fail_at: int = 0):
        self.log: list = []
        self.encode_s, self.step_s, self.fail, self.fail_at = encode_s, step_s, fail, fail_at

    def _note(self, event: str, streams: list) -> None:
        self.log.append((event, sorted(s.name for s in streams), asyncio.get_running_loop().time()))

    async def encode(self, cohort: list):
        self._note("encode", cohort)
        await asyncio.sleep(self.encode_s)
        self._note("encoded", cohort)
        return [_Row(s) for s in cohort], {}

    async def step(self, rows: list):
        streams = [r.stream for r in rows]
        self._note("step", streams)
        await asyncio.sleep(self.step_s)
        failed = {}
        for s in streams:
            if s.name == self.fail and s.ticks == self.fail_at:
                failed[s] = RuntimeError(f"{s.name}: model server unavailable")
            else:
                s.ticks += 1
        self._note("stepped", streams)
        return failed

    def times(self, event: str) -> list[float]:
        return [t for e, _, t in self.log if e == event]


def _run_grid(phases: _FakePhases, names: list[str], seconds: float, overlap: bool = True):
    async def run():
        metrics = Metrics()
        clock = GridClock(metrics, max_lag_s=0.4, encode=phases.encode, step=phases.step, overlap=overlap)
        streams = [_FakeStream(n) for n in names]
        runs = [asyncio.create_task(clock.run(s)) for s in streams]
        await asyncio.sleep(seconds)
        for s in streams:
            s.closed.set()
        await asyncio.gather(*runs)
        return streams, metrics

    return asyncio.run(run())


def test_grid_clock_ticks_streams_together_on_the_80ms_grid():
    phases = _FakePhases(encode_s=0.01, step_s=0.02)
    (a, b), metrics = _run_grid(phases, ["a", "b"], 0.6)
    assert a.ticks >= 5 and abs(a.ticks - b.ticks) <= 1  # 80 ms grid, both every tick
    cohorts = [names for e, names, _ in phases.log if e == "encode"]
    assert sum(c == ["a", "b"] for c in cohorts) >= len(cohorts) - 2  # one cohort per tick (edges aside)
    gaps = np.diff(phases.times("encode"))
    assert 0.06 < float(np.median(gaps)) < 0.1  # the grid's 80 ms, not as fast as possible
    assert "egomem_tick_seconds_count" in metrics.render()


def test_grid_clock_overlaps_a_late_step_with_the_next_encode_in_order():
    # encode + step = 100 ms > 80 ms, but each phase alone fits: overlapped, the grid keeps its 80 ms pace
    for overlap, lo, hi in ((True, 0.065, 0.093), (False, 0.097, 0.14)):
        phases = _FakePhases(encode_s=0.04, step_s=0.06)
        (s,), _ = _run_grid(phases, ["s"], 1.2, overlap=overlap)
        period = float(np.median(np.diff(phases.times("stepped"))))
        assert lo < period < hi, (overlap, period)
        order = [(e, t) for e, _, t in phases.log]
        encodes = [t for e, t in order if e in ("encode", "encoded")]
        steps = [t for e, t in order if e in ("step", "stepped")]
        assert encodes == sorted(encodes) and steps == sorted(steps)  # encodes never overlap; steps never overlap
        for k, t_step in enumerate(phases.times("step")):  # a tick's step follows its own encode
            assert t_step >= phases.times("encoded")[k]
        if overlap:  # some encode ran while a step was in flight
            assert any(a < e < b for e in phases.times("encode")
                       for a, b in zip(phases.times("step"), phases.times("stepped")))


def test_grid_clock_a_failing_stream_leaves_alone():
    async def run():
        phases = _FakePhases(fail="bad", fail_at=2)
        clock = GridClock(Metrics(), max_lag_s=0.4, encode=phases.encode, step=phases.step)
        good, bad = _FakeStream("good"), _FakeStream("bad")
        good_run = asyncio.create_task(clock.run(good))
        with pytest.raises(RuntimeError, match="bad: model server unavailable"):
            await clock.run(bad)
        ticks_when_bad_failed = good.ticks
        await asyncio.sleep(0.3)
        assert not good_run.done() and clock.size == 1
        phases.step_s = 0.05
        while phases.log[-1][0] != "step":  # close it mid-tick, while its model calls are in flight
            await asyncio.sleep(0.005)
        good.closed.set()
        await good_run  # a closed stream's run returns without error ...
        return ticks_when_bad_failed, good.ticks, phases.log[-1]  # ... and only after its tick is over

    at_failure, later, last = asyncio.run(run())
    assert later >= at_failure + 2  # the good stream kept ticking after the other one failed
    assert last[:2] == ("stepped", ["good"])  # its tick in flight finished before run returned
