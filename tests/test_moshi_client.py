"""Moshi's own terminal client (`moshi.client`, unchanged) talks to the orchestrator.

`moshi.client` records and plays through `sounddevice`, which needs PortAudio and a sound card; CI
machines have neither. The test gives it a virtual sound card: `sounddevice.InputStream` /
`OutputStream` stand-ins that call moshi's own callbacks every 80 ms from a thread, feeding a tone in
and keeping what moshi plays out. Everything between the two — the WebSocket to `/api/chat`, the
binary protocol, Opus both ways, moshi's jitter queue — is moshi's code against our server.
Moshi's client sends no token, so the orchestrator runs with `anonymous_chat` (stream scope only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import sys
import threading
import time
import types

import numpy as np
import pytest

from tests.orchestrator_harness import served_orchestrator, tone


class _VirtualStream:
    """A sounddevice stream whose 'hardware' is a thread ticking every blocksize / samplerate seconds."""

    def __init__(self, *, samplerate, channels, blocksize, callback, source: np.ndarray | None, sink: list):
        self.period = blocksize / samplerate
        self.shape = (blocksize, channels)
        self.callback, self.source, self.sink = callback, source, sink
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._pos = 0

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            buf = np.zeros(self.shape, np.float32)
            if self.source is not None:  # microphone: the next block of the source, then silence
                block = self.source[self._pos:self._pos + self.shape[0]]
                buf[:len(block), 0] = block
                self._pos += self.shape[0]
                self.callback(buf, self.shape[0], None, None)
            else:  # speaker: moshi fills the buffer, the 'card' keeps it
                self.callback(buf, self.shape[0], None, None)
                self.sink.append(buf[:, 0].copy())
            next_t += self.period
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def __enter__(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        """Unplug: no more callbacks (the thread ends at its next tick)."""
        self._stop.set()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def virtual_sound_card(mic: np.ndarray, played: list) -> types.ModuleType:
    """A `sounddevice` module whose streams are _VirtualStreams; `mod.streams` lists those it made."""
    mod = types.ModuleType("sounddevice")
    mod.streams = []

    def make(source: np.ndarray | None, **kw) -> _VirtualStream:
        mod.streams.append(_VirtualStream(source=source, sink=played, **kw))
        return mod.streams[-1]

    mod.InputStream = lambda **kw: make(mic, **kw)
    mod.OutputStream = lambda **kw: make(None, **kw)
    return mod


@pytest.fixture()
def orch(triton, tmp_path):
    with served_orchestrator(triton, tmp_path, identify_models=False, retrieval=False, max_streams=2,
                             anonymous_chat=True) as o:
        yield o


def test_moshi_client_unchanged_hears_the_model_and_is_heard(orch, monkeypatch, capsys):
    played: list[np.ndarray] = []
    card = virtual_sound_card(tone(30.0), played)
    monkeypatch.setitem(sys.modules, "sounddevice", card)
    monkeypatch.delitem(sys.modules, "moshi.client", raising=False)
    from moshi import client as moshi_client
    from moshi.client_utils import RawPrinter

    m = orch.services.metrics
    late0, ticks0 = m.get("egomem_late_frames_total"), m.get("egomem_tick_seconds")
    out, err = io.StringIO(), io.StringIO()
    args = argparse.Namespace(host="127.0.0.1", port=orch.cfg.orchestrator.port, https=False, url=None)

    async def talk(seconds: float) -> None:
        """moshi's client talks until interrupted: after `seconds` the card is unplugged first, so that no
        microphone send is still in flight when the client is cancelled and closes its socket (that send
        would fail with 'Cannot write to closing transport' and print 'Lost connection': the test's own
        teardown, not the server)."""
        client = asyncio.ensure_future(moshi_client.run(RawPrinter(out, err), args))
        done, _ = await asyncio.wait({client}, timeout=seconds)
        if client in done:  # it ended by itself (a lost connection is in `err`)
            client.result()
            return
        for stream in card.streams:
            stream.stop()
        await asyncio.sleep(0.5)  # the sends already scheduled run while the socket is open
        client.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await client

    asyncio.run(talk(8.0))
    ticks = m.get("egomem_tick_seconds") - ticks0
    late = m.get("egomem_late_frames_total") - late0
    voiced = [f for f in played if np.abs(f).max() > 1e-4]
    # moshi's client prints the exception that lost it the connection on stdout: show it on failure
    assert "Lost connection" not in err.getvalue(), (err.getvalue(), capsys.readouterr().out[-2000:])
    assert ticks >= 20  # the server ran a dialog for moshi's client
    assert late <= ticks // 2  # ... on the microphone audio moshi's client streamed, not on silence
    assert len(voiced) >= 10  # moshi decoded the model's voice (Opus) and played it
    assert all(f.shape == (1920,) and np.isfinite(f).all() for f in played)
