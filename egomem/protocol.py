"""The `/api/chat` WebSocket protocol: Moshi's binary message kinds plus EgoMem's own.

Every message is one binary WebSocket frame: one kind byte, then the payload. Kinds 0x00-0x02 are
Moshi's (moshi/server.py, moshi/client.py), so Moshi's own clients work unchanged; 0x05 is the
error kind of Moshi's Rust server. EgoMem's kinds start at 0x10 so they never collide with Moshi's.

  0x00 handshake   server -> client   empty payload: the stream is open, send audio now
  0x01 audio       both ways          Ogg/Opus pages (sphn.OpusStreamWriter/Reader, 24 kHz mono)
  0x02 text        server -> client   UTF-8 piece of the model's text channel
  0x05 error       server -> client   UTF-8 message; the stream closes after it when fatal
  0x10 video       client -> server   one JPEG (or PNG) frame of the camera (checked by its signature)
  0x11 transcript  client -> server   UTF-8 words the user said (from the client's ASR or a script)
  0x12 event       server -> client   UTF-8 JSON object {"type": ..., ...} (see EVENT_TYPES)
  0x13 control     client -> server   UTF-8 JSON object {"type": "model_text", "text": ...} (when allowed)

This module is shared by the orchestrator and `egomem.client`; it holds no I/O.
"""

from __future__ import annotations

import json
from typing import Any

HANDSHAKE = 0x00
AUDIO = 0x01
TEXT = 0x02
ERROR = 0x05
VIDEO = 0x10
TRANSCRIPT = 0x11
EVENT = 0x12
CONTROL = 0x13

CLIENT_KINDS = {AUDIO: "audio", VIDEO: "video", TRANSCRIPT: "transcript", CONTROL: "control"}
SERVER_KINDS = {HANDSHAKE: "handshake", AUDIO: "audio", TEXT: "text", ERROR: "error", EVENT: "event"}

EVENT_TYPES = (
    "stream_open",  # {stream_id, sequence_id}
    "user_recognised",  # {user_id, name, decided_by, previous_user_id, latency_ms}
    "memchunk_refreshed",  # {level: 1|2, user_id, text, latency_ms}
    "retrieval",  # {query: {relations, keywords}, results: [text], latency_ms}
    "memory_written",  # {chunk_index, steps, job_id}
    "warning",  # {message} (a frame dropped, input malformed...)
    "stream_closed",  # {reason}
)

SAMPLE_RATE = 24000
FRAME_SAMPLES = 1920  # 80 ms at 24 kHz: one dialog tick
TICK_S = 0.08

# WebSocket close codes (RFC 6455 + the registered 1013 "try again later")
CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008  # limits broken (rate, size)
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL = 1011  # Triton failed under the stream
CLOSE_TRY_LATER = 1013  # no free stream slot


class ProtocolError(ValueError):
    """A message that breaks the protocol; the text says what was wrong."""


def pack(kind: int, payload: bytes = b"") -> bytes:
    return bytes([kind]) + payload


def pack_event(type_: str, **fields: Any) -> bytes:
    return pack(EVENT, json.dumps({"type": type_, **fields}, default=_jsonable).encode())


def unpack(message: bytes) -> tuple[int, bytes]:
    if not message:
        raise ProtocolError("empty message: every message starts with a kind byte")
    return message[0], message[1:]


def parse_json(payload: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"payload is not UTF-8 JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError('payload must be a JSON object with a string "type"')
    return obj


def parse_text(payload: bytes, max_chars: int = 10_000) -> str:
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"text payload is not UTF-8: {e}") from None
    if len(text) > max_chars:
        raise ProtocolError(f"text payload has {len(text)} characters; at most {max_chars}")
    return text


JPEG_SIGNATURE = b"\xff\xd8\xff"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_video_frame(payload: bytes) -> None:
    """A 0x10 payload must be one JPEG or PNG image; checked by its signature (the polling loop decodes it)."""
    if not payload:
        raise ProtocolError("empty video frame")
    if not (payload.startswith(JPEG_SIGNATURE) or payload.startswith(PNG_SIGNATURE)):
        raise ProtocolError(f"video frame is not a JPEG or PNG image: its {len(payload)} bytes start with "
                            "neither the JPEG nor the PNG signature")


def _jsonable(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    return str(o)
