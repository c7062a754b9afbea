"""Client audio in (0x01): each Ogg/Opus message checked, bounded, then decoded off the event loop, in order.

Why the bounds come before the decoder: sphn's `OpusStreamReader.append_bytes` holds the GIL while it
works, and its cost grows with the message (a 2.4 MB message of Ogg-wrapped silence held every thread
of the process for 1.6 s on a 2-core box), so a worker thread alone would not keep one client from
stalling every other stream's ticks. So each message's Ogg pages are walked here first (page headers
and the first byte of each Opus packet only: cheap, and at most `max_audio_pages_per_message` of them),
its audio duration is read from the Opus TOC bytes (RFC 6716 §3.1), and the message is refused, never
decoded, when it
  - is not a run of whole Ogg pages (garbage, a truncated page): malformed;
  - holds more than `max_audio_pages_per_message` pages or `max_audio_message_s` seconds: malformed;
  - would take the stream over `max_audio_speed` x real time (a token bucket of audio seconds that
    refills at that speed and holds at most `max_audio_burst_s`): refused as over the rate.
Every refusal is a 0x05 error and counts toward the stream's malformed-message close (1008), so a
client that keeps pushing is closed rather than served. What passes is decoded by the stream's own
one-thread executor: one decoder per stream (sphn's reader is stateful), messages in arrival order.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import sphn

from egomem.config import OrchestratorConfig
from egomem.protocol import SAMPLE_RATE, ProtocolError

OPUS_RATE = 48000  # Opus TOC durations are counted at 48 kHz whatever the decoded rate
MAX_PACKET_SAMPLES = 5760  # 120 ms: the longest an Opus packet may be (RFC 6716 §3.2.5)
_SILK_HYBRID_CELT = ((480, 960, 1920, 2880), (480, 960), (120, 240, 480, 960))  # 10-60 ms, 10-20 ms, 2.5-20 ms
NOT_OGG = "audio payload is not an Ogg/Opus stream (each message holds whole Ogg pages)"


class AudioRateExceeded(ProtocolError):
    """Audio pushed faster than `max_audio_speed` x real time (counted like a malformed message)."""


def opus_packet_samples(packet_head: bytes) -> int:
    """Samples (at 48 kHz) one Opus packet decodes to, from its TOC byte (and frame-count byte for
    code 3); 120 ms, the most any packet may hold, when the packet is empty or its count byte is missing."""
    if not packet_head:
        return MAX_PACKET_SAMPLES  # an empty packet asks for concealment of up to a whole packet
    toc = packet_head[0]
    config = toc >> 3
    if config < 12:
        frame = _SILK_HYBRID_CELT[0][config & 3]
    elif config < 16:
        frame = _SILK_HYBRID_CELT[1][config & 1]
    else:
        frame = _SILK_HYBRID_CELT[2][config & 3]
    code = toc & 3
    if code == 0:
        frames = 1
    elif code in (1, 2):
        frames = 2
    else:
        frames = packet_head[1] & 0x3F if len(packet_head) > 1 else 48
    return min(frames * frame, MAX_PACKET_SAMPLES)


def scan_ogg_opus(data: bytes, max_pages: int, max_seconds: float) -> float:
    """Seconds of audio in `data`, which must be whole Ogg pages; ProtocolError when it is not, or
    when it holds more than `max_pages` pages or `max_seconds` seconds (the walk stops there)."""
    n, pos, pages, samples = len(data), 0, 0, 0
    limit = int(max_seconds * OPUS_RATE)
    while pos < n:
        if data[pos:pos + 4] != b"OggS":
            raise ProtocolError(f"{NOT_OGG}: no Ogg page starts at byte {pos}")
        if pos + 27 > n:
            raise ProtocolError(f"audio message ends inside an Ogg page header at byte {pos}; send whole pages")
        if data[pos + 4] != 0:
            raise ProtocolError(f"{NOT_OGG}: Ogg page version {data[pos + 4]} at byte {pos} (only 0 exists)")
        pages += 1
        if pages > max_pages:
            raise ProtocolError(f"audio message holds more than {max_pages} Ogg pages "
                                f"(orchestrator.max_audio_pages_per_message); send audio as it is recorded")
        continued = data[pos + 5] & 1  # the page starts inside a packet begun on an earlier page
        nseg = data[pos + 26]
        lacing = data[pos + 27:pos + 27 + nseg]
        body = pos + 27 + nseg
        end = body + sum(lacing)
        if len(lacing) < nseg or end > n:
            raise ProtocolError(f"audio message ends inside an Ogg page (page {pages} needs {end - pos} bytes, "
                                f"{n - pos} left); send whole pages")
        at, in_packet = body, bool(continued)
        for seg in lacing:
            if not in_packet:  # this segment starts a packet: its first bytes say how long it plays
                head = data[at:at + min(seg, 8)]
                if not (head.startswith(b"OpusHead") or head.startswith(b"OpusTags")):
                    samples += opus_packet_samples(head)
            in_packet = seg == 255
            at += seg
        if samples > limit:
            raise ProtocolError(f"audio message holds over {max_seconds:g} s of audio "
                                f"(orchestrator.max_audio_message_s); send audio as it is recorded")
        pos = end
    return samples / OPUS_RATE


class AudioBudget:
    """Token bucket in seconds of audio: refills at `speed` seconds per second of wall time, holds at
    most `burst_s` (what a client may catch up after a network stall)."""

    def __init__(self, speed: float, burst_s: float):
        self.speed, self.burst_s = speed, burst_s
        self.tokens = burst_s
        self.last = time.monotonic()

    def take(self, seconds: float) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst_s, self.tokens + (now - self.last) * self.speed)
        self.last = now
        if seconds > self.tokens:
            raise AudioRateExceeded(f"audio over {self.speed:g}x real time: this message's {seconds:.2f} s "
                                    f"were refused (orchestrator.max_audio_speed, max_audio_burst_s)")
        self.tokens -= seconds


class AudioInput:
    """One stream's audio decoder: checks and bounds each message on the loop (cheap), decodes on the
    stream's own worker thread. Call `decode` for one message at a time (the reader awaits each)."""

    def __init__(self, oc: OrchestratorConfig, name: str):
        self.max_pages = oc.max_audio_pages_per_message
        self.max_s = oc.max_audio_message_s
        self.budget = AudioBudget(oc.max_audio_speed, oc.max_audio_burst_s)
        self._reader = sphn.OpusStreamReader(SAMPLE_RATE)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"opus-in-{name}")

    async def decode(self, payload: bytes) -> np.ndarray:
        """24 kHz float32 PCM of one 0x01 payload; ProtocolError (AudioRateExceeded) when refused."""
        if not payload.startswith(b"OggS"):
            raise ProtocolError(NOT_OGG)
        seconds = scan_ogg_opus(payload, self.max_pages, self.max_s)
        self.budget.take(seconds)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._decode, payload)

    def _decode(self, payload: bytes) -> np.ndarray:
        try:
            return self._reader.append_bytes(payload)
        except Exception as e:  # noqa: BLE001 - sphn raises plain exceptions on bad Ogg/Opus data
            self._reader = sphn.OpusStreamReader(SAMPLE_RATE)  # a clean decoder for what follows
            raise ProtocolError(f"{NOT_OGG}: {e}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
