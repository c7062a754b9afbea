"""Video files as chat input: camera frames as JPEG at a fixed rate, and the audio track as speech.

`egomem chat --video FILE` sends what a phone recording of the user holds: frames at the chat's
frame rate (1 per second by default; the orchestrator only looks at the newest frame at each 2 s
identification poll), scaled down to fit the server's limits, and the recording's sound
(24 kHz mono, the stream's rate) when no other audio is given. Decoding is PyAV (FFmpeg inside
the wheel), so any container/codec FFmpeg reads works: mp4, webm, mkv, avi, mov ...
The display rotation phones store (portrait recordings) is applied, so faces stand upright.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_RATE = 24000  # the stream's audio rate (egomem.protocol.SAMPLE_RATE)
DEFAULT_MAX_SIDE = 1280  # longest side of a sent frame: faces stay far above dlib's ~80 px, a JPEG ~100-200 KB
JPEG_QUALITY = 85  # Pillow's scale; lowered step by step only when a frame is over the message limit


class VideoError(ValueError):
    """The file is missing, not a video, or FFmpeg cannot decode it; the message names the file."""


@dataclass(frozen=True)
class VideoInfo:
    path: Path
    width: int
    height: int
    duration_s: float | None  # None when the container does not say
    has_audio: bool


def _open(path: Path):
    import av

    if not path.is_file():
        raise VideoError(f"video file {path} does not exist")
    try:
        return av.open(str(path))
    except (av.FFmpegError, OSError, ValueError) as e:
        raise VideoError(f"{path} is not a video file FFmpeg can read: {e}") from None


def probe(path: str | Path) -> VideoInfo:
    """Check that `path` holds a decodable video stream (its first frame decodes); VideoError if not."""
    import av

    path = Path(path)
    with _open(path) as c:
        if not c.streams.video:
            raise VideoError(f"{path} has no video stream (an audio-only file? pass it as --audio)")
        v = c.streams.video[0]
        try:
            first = next(c.decode(v), None)
        except (av.FFmpegError, ValueError) as e:
            raise VideoError(f"{path}: its video stream cannot be decoded: {e}") from None
        if first is None:
            raise VideoError(f"{path}: its video stream holds no frames")
        duration = float(c.duration) / av.time_base if c.duration else None
        return VideoInfo(path, first.width, first.height, duration, bool(c.streams.audio))


def to_jpeg(image, max_side: int, max_pixels: int, max_bytes: int) -> bytes:
    """A PIL image scaled to fit `max_side` x `max_side` and `max_pixels`, as a JPEG under `max_bytes`."""
    from PIL import Image

    w, h = image.size
    scale = min(1.0, max_side / max(w, h), math.sqrt(max_pixels / (w * h)))
    quality = JPEG_QUALITY
    while True:
        size = (max(1, int(w * scale)), max(1, int(h * scale)))
        img = image if size == (w, h) else image.resize(size, Image.BILINEAR)
        buf = io.BytesIO()
        img.convert("RGB").save(buf, format="JPEG", quality=quality)
        if buf.tell() <= max_bytes:
            return buf.getvalue()
        if quality > 50:
            quality -= 15
        else:
            scale /= 2


def frames(path: str | Path, fps: float = 1.0, max_side: int = DEFAULT_MAX_SIDE, max_pixels: int = 40_000_000,
           max_bytes: int = 2_000_000, seconds: float | None = None) -> Iterator[tuple[float, bytes]]:
    """(time in s from the first frame, JPEG bytes) for one frame every 1/fps s of the video's own
    clock; a video slower than `fps` gives each of its frames once."""
    import av

    if fps <= 0:
        raise VideoError(f"frame rate {fps} must be > 0")
    path = Path(path)
    with _open(path) as c:
        v = c.streams.video[0]
        v.thread_type = "AUTO"
        start, due, index = None, 0.0, 0
        try:
            for frame in c.decode(v):
                t = frame.time if frame.time is not None else index / float(v.average_rate or 25)
                index += 1
                start = t if start is None else start
                t -= start
                if seconds is not None and t >= seconds:
                    return
                if t + 1e-6 < due:
                    continue
                due = (math.floor(t * fps + 1e-6) + 1) / fps  # the next frame slot after this one
                img = frame.to_image()  # RGB PIL image
                rotation = getattr(frame, "rotation", 0)  # PyAV >= 14
                if rotation:  # phones store portrait video sideways plus a display rotation
                    img = img.rotate(rotation, expand=True)  # PIL turns counter-clockwise, as the angle is given
                yield t, to_jpeg(img, max_side, max_pixels, max_bytes)
        except (av.FFmpegError, ValueError) as e:
            raise VideoError(f"{path}: decoding failed at frame {index}: {e}") from None


def audio(path: str | Path, seconds: float | None = None) -> np.ndarray | None:
    """The first audio track as float32 mono at 24 kHz ([T]); None when the file has none."""
    import av

    path = Path(path)
    with _open(path) as c:
        if not c.streams.audio:
            return None
        resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
        parts: list[np.ndarray] = []
        try:
            for frame in c.decode(c.streams.audio[0]):
                parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]  # packed mono: [1, n] -> [n]
            parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]  # flush
        except (av.FFmpegError, ValueError) as e:
            raise VideoError(f"{path}: its audio track cannot be decoded: {e}") from None
    pcm = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
    return pcm[: int(seconds * SAMPLE_RATE)] if seconds else pcm
