"""`egomem chat`: a terminal client for `/api/chat` that shows recognition and memory events.

Audio: a speech file (`--audio`, any format soundfile reads; resampled to 24 kHz) streamed in real
time, else the audio track of `--video`, else the microphone when `sounddevice` finds one
(PortAudio present). Camera: one or more image files (`--image`, JPEG/PNG) sent once a second in
turn, or a video file (`--video`, anything FFmpeg decodes) whose frames go out in real time at
`--fps` (egomem.video), scaled to the server's frame limits. A bad video file is reported before
the chat opens. A file's audio is followed by `--tail` seconds of silence (default 4), so the model has
time to answer what it heard last. The model's voice is written to `--save-audio` (WAV) when given;
every event is printed as it arrives, the model's text channel an utterance at a time.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from egomem import protocol as P
from egomem import video as vid
from egomem.client import ChatSession, EgoMemClient, stream_audio
from egomem.demo import TAIL_S, load_voice


def _microphone():
    """An InputStream at 24 kHz mono, or None when no microphone / no PortAudio."""
    try:
        import sounddevice as sd

        sd.query_devices(kind="input")
        return sd
    except Exception:  # noqa: BLE001 - OSError (no PortAudio), PortAudioError (no device), ImportError
        return None


def _describe(ev: dict) -> str:
    t = ev["type"]
    if t == "user_recognised":
        return f"recognised {ev['name']} ({ev['user_id'][:8]}, by {ev['decided_by']}, {ev['latency_ms']} ms)"
    if t == "memchunk_refreshed":
        first = (ev["text"] or "(empty)").splitlines()[0]
        return f"L{ev['level']} MemChunk refreshed in {ev['latency_ms']} ms: {first} ..."
    if t == "retrieval":
        return f"retrieval {ev['query']} -> {len(ev['results'])} results"
    if t == "memory_written":
        return f"memory job queued (chunk {ev['chunk_index']}, {ev['steps']} steps)"
    return json.dumps({k: v for k, v in ev.items() if k != "_t"})


UTTERANCE_GAP_S = 0.5  # the model's text is printed a whole utterance at a time: after this long without a new piece


async def _printer(chat: ChatSession, t0: float) -> None:
    """Events and errors as they come; the model's text (one piece per 80 ms tick) gathered into utterances,
    each printed with the time it began once the text channel goes quiet for `UTTERANCE_GAP_S`."""
    seen_ev, seen_text, seen_err = 0, 0, 0
    said, began, last = "", 0.0, 0.0

    def flush() -> None:
        nonlocal said
        if said.strip():
            print(f"[{began:6.1f}s] model: {said.strip()!r}", flush=True)
        said = ""

    try:
        while not chat.closed:
            await asyncio.sleep(0.1)
            now = time.monotonic() - t0
            for ev in chat.events[seen_ev:]:
                print(f"[{now:6.1f}s] * {_describe(ev)}", flush=True)
            seen_ev = len(chat.events)
            if len(chat.text) > seen_text:
                if not said:
                    began = now
                said, seen_text, last = said + chat.text[seen_text:], len(chat.text), now
            if said and now - last >= UTTERANCE_GAP_S:
                flush()
            for e in chat.errors[seen_err:]:
                print(f"[{now:6.1f}s] ! {e}", flush=True)
            seen_err = len(chat.errors)
    finally:
        said += chat.text[seen_text:]
        flush()


async def run_chat(url: str, token: str, audio: Path | None, images: list[Path], transcript: str | None,
                   seconds: float | None, save_audio: Path | None, video: Path | None = None, fps: float = 1.0,
                   max_side: int = vid.DEFAULT_MAX_SIDE, max_pixels: int = 40_000_000,
                   max_frame_bytes: int = 2_000_000, tail_s: float = TAIL_S) -> int:
    """Run one chat until the audio ends (or `seconds`, or Ctrl-C); 2 when the inputs are unusable. A file's
    audio is followed by `tail_s` of silence, so the model can answer what it heard last."""
    pcm = load_voice(audio, seconds) if audio is not None else None
    if video is not None:
        try:  # every check before the chat opens: a bad file must not cost a stream slot
            info = await asyncio.to_thread(vid.probe, video)
            if pcm is None and info.has_audio:
                pcm = await asyncio.to_thread(vid.audio, video, seconds)
        except vid.VideoError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        source = audio or (f"{video}'s audio track" if info.has_audio else "the microphone")
        print(f"video {video}: {info.width}x{info.height}, {info.duration_s or 0:.1f} s, sent at {fps:g} frames/s; "
              f"audio from {source}", flush=True)
    if pcm is not None and tail_s > 0:
        pcm = np.concatenate([pcm, np.zeros(int(tail_s * P.SAMPLE_RATE), np.float32)])
    sd = _microphone() if pcm is None else None
    if pcm is None and sd is None:
        print("no microphone found (sounddevice/PortAudio): pass --audio FILE.wav (or a --video with sound)",
              flush=True)
        return 2
    frames = []
    for p in images:  # checked before the chat opens, as the orchestrator would refuse them one by one
        try:
            data = p.read_bytes()
            P.check_video_frame(data)
        except (OSError, P.ProtocolError) as e:
            print(f"error: --image {p}: {e}", file=sys.stderr, flush=True)
            return 2
        frames.append(data)
    async with EgoMemClient(url, token) as client:
        chat = await client.open_chat()
        t0 = time.monotonic()
        print(f"connected to {url}/api/chat; Ctrl-C to stop", flush=True)
        printer = asyncio.create_task(_printer(chat, t0))
        if transcript:
            await chat.send_transcript(transcript)

        async def send_images():
            i = 0
            while frames and not chat.closed:
                await chat.send_video(frames[i % len(frames)])
                i += 1
                await asyncio.sleep(1.0)

        async def send_video_file():
            """Frames at their own time in the video, so they stay in step with its audio."""
            it = vid.frames(video, fps, max_side, max_pixels, max_frame_bytes, seconds)
            try:
                while not chat.closed:
                    item = await asyncio.to_thread(next, it, None)  # decoding runs off the event loop
                    if item is None:
                        return
                    t, jpeg = item
                    delay = t0 + t - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await chat.send_video(jpeg)
            except vid.VideoError as e:
                print(f"[{time.monotonic() - t0:6.1f}s] ! video stopped: {e}", flush=True)

        vtask = asyncio.create_task(send_video_file() if video is not None else send_images())
        try:
            if pcm is not None:
                await stream_audio(chat, pcm)
                await asyncio.sleep(1.0)
            else:
                await _from_microphone(sd, chat, seconds)
        except (KeyboardInterrupt, asyncio.CancelledError):
            pass
        finally:
            vtask.cancel()
            await chat.close()
            await asyncio.sleep(0.2)
            printer.cancel()
        if save_audio is not None and chat.pcm.size:
            import soundfile as sf

            sf.write(str(save_audio), chat.pcm, P.SAMPLE_RATE)
            print(f"model audio: {save_audio} ({chat.pcm.size / P.SAMPLE_RATE:.1f} s)")
    return 0


async def _from_microphone(sd, chat: ChatSession, seconds: float | None) -> None:
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[np.ndarray] = asyncio.Queue()

    def callback(indata, frames, t, status):  # audio thread -> event loop
        loop.call_soon_threadsafe(q.put_nowait, indata[:, 0].copy())

    deadline = time.monotonic() + seconds if seconds else float("inf")
    with sd.InputStream(samplerate=P.SAMPLE_RATE, channels=1, dtype="float32", blocksize=P.FRAME_SAMPLES,
                        callback=callback):
        while not chat.closed and time.monotonic() < deadline:
            await chat.send_pcm(await q.get())
