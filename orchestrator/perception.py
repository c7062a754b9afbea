"""Who is there, and what they know: the orchestrator's seams to identification and retrieval.

- `Perception.faces(jpeg)` / `.voice(pcm)`: the `face_encoder` / `speaker_encoder` models on Triton (any ready
  replica: these calls keep no state).
- `Perception.identify(...)`: `egomem.identity.StoreBackedIdentifier` (the memory worker uses the same), its index
  synced when `store.keys_generation()` changes (enrolment: keys added; merge, forget: rebuilt).
- `Perception.retrieve(user_id, query)`: Level-2 retrieval (`egomem.retrieval`) over the user's
  relation-graph neighbours, re-ranked with the `text_encoder` model on Triton.
Store and retrieval calls are synchronous; callers run them with `asyncio.to_thread`.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from egomem.config import Config
from egomem.identity import Identification, StoreBackedIdentifier
from egomem.memory import MemoryStore
from egomem.retrieval import Hit, Level2Retriever, Neighbour, RetrievalQuery
from egomem.serving.client import AsyncTritonClient, channel_args


@dataclass
class FaceResult:
    embeddings: np.ndarray  # [F, D] float32 (F = 0: no face)
    speaker: int  # row of the speaker-candidate face, -1 when none
    model_id: str


def decode_image(data: bytes, max_pixels: int) -> np.ndarray:
    """JPEG/PNG bytes -> uint8 [H, W, 3]; ValueError for anything else or an oversized frame."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > max_pixels:
            raise ValueError(f"video frame {img.width}x{img.height} is over identity.max_image_pixels")
        return np.asarray(img.convert("RGB"), dtype=np.uint8)  # [H, W, 3]
    except UnidentifiedImageError:  # its text names the BytesIO object (a memory address), not the problem
        raise ValueError(f"video frame is not a JPEG/PNG image: Pillow cannot identify its {len(data)} bytes") from None
    except OSError as e:  # e.g. "image file is truncated"
        raise ValueError(f"video frame is not a decodable JPEG/PNG image: {e}") from None


class _TritonTextEncoder:
    """`TextEncoder` over the `text_encoder` model with blocking gRPC clients (used from worker threads),
    one per Triton replica, each call on the replica `url()` names."""

    def __init__(self, url: Callable[[], str], timeout_s: float):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self._url = url
        self._clients: dict[str, grpcclient.InferenceServerClient] = {}
        self._lock = threading.Lock()
        self.timeout_s = timeout_s

    def _client(self):
        url = self._url()
        with self._lock:
            if url not in self._clients:  # reconnects fast (channel_args)
                self._clients[url] = self._grpc.InferenceServerClient(url, channel_args=channel_args())
            return self._clients[url]

    def encode(self, texts) -> np.ndarray:
        arr = np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
        inp = self._grpc.InferInput("TEXT", [len(texts)], "BYTES")
        inp.set_data_from_numpy(arr)
        res = self._client().infer("text_encoder", [inp], outputs=[self._grpc.InferRequestedOutput("EMBEDDINGS")],
                                   client_timeout=self.timeout_s)
        return res.as_numpy("EMBEDDINGS").astype(np.float32)  # [N, D]

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()


class Perception:
    def __init__(self, cfg: Config, triton: Callable[[], AsyncTritonClient], store: MemoryStore,
                 use_text_encoder: bool = True):
        """`triton()`: the client of a ready Triton replica for each stateless encoder call."""
        self.cfg = cfg
        self.triton = triton
        self.store = store
        # Locks (issue #11: a forget must never wait behind a retrieval's text-encoder call):
        # `_retrieving` serialises retrievals (the retriever's caches are not thread-safe) and is held
        # across the encoder call, so nothing but another retrieval ever takes it. `_state` is held
        # only for a few assignments and a cache clear; forget takes only that one.
        self._retrieving = threading.Lock()
        self._state = threading.Lock()
        self.forgets = 0  # bumped by every forget; a retrieval that spans one is redone
        self._busy = False  # a retrieval is using the retriever's caches (under `_state`)
        self.identifier = StoreBackedIdentifier(store, cfg.identity)  # the memory worker's identifier too
        self._text = _TritonTextEncoder(lambda: triton().url, cfg.orchestrator.triton_timeout_s) if use_text_encoder else None
        self.retriever = Level2Retriever.from_config(cfg.retrieval, self._text, cfg.dialog.l2_steps)

    def close(self) -> None:
        if self._text is not None:
            self._text.close()

    # -- encoders on Triton ---------------------------------------------------------------------
    async def faces(self, image: np.ndarray) -> FaceResult:
        r = await self.triton().infer("face_encoder", {"IMAGE": image}, ["EMBEDDINGS", "SPEAKER", "MODEL_ID"],
                                    timeout_s=self.cfg.orchestrator.triton_timeout_s * 4)
        mid = r["MODEL_ID"].reshape(-1)[0]
        return FaceResult(r["EMBEDDINGS"].astype(np.float32), int(r["SPEAKER"].reshape(-1)[0]),
                          mid.decode() if isinstance(mid, bytes) else str(mid))

    async def voice(self, pcm: np.ndarray) -> np.ndarray | None:
        """[T] float32 24 kHz -> [D] embedding, or None when too little of it is speech."""
        r = await self.triton().infer("speaker_encoder", {"PCM": pcm.astype(np.float32)}, ["EMBEDDING", "VOICED"],
                                    timeout_s=self.cfg.orchestrator.triton_timeout_s * 4)
        return r["EMBEDDING"].astype(np.float32) if bool(r["VOICED"].reshape(-1)[0]) else None

    # -- identification (blocking: store reads + faiss) -----------------------------------------
    def identify(self, face_vecs: np.ndarray | None, speaker: int, voice_vec: np.ndarray | None) -> Identification:
        return self.identifier.identify(face_vecs, voice_vec, speaker=speaker)

    def forget(self) -> None:
        """A user was forgotten: rebuild the key index at the next identification (even if the store's
        generation were unchanged) and drop the retrieval caches, which hold memory texts."""
        self.identifier.invalidate()
        with self._state:
            self.forgets += 1
            if not self._busy:  # else the running retrieval sees `forgets` move and clears as it ends
                self.retriever.clear()

    def user_name(self, user_id: str) -> str | None:
        """The user's name; None when no such user lives (forgotten, or merged away)."""
        u = self.store.resolve_user(user_id)
        return u.name if u else None

    def profile_text(self, user_id: str, max_chars: int) -> str:
        return self.store.render_profile(user_id, max_chars=max_chars)

    # -- Level-2 retrieval (blocking) -------------------------------------------------------------
    def retrieve(self, user_id: str | None, query: RetrievalQuery, attempts: int = 3) -> list[Hit]:
        """Hits from the store as it is after any forget that ran meanwhile: a retrieval that a forget
        overlapped drops the caches it filled (they may hold the forgotten person's memories) and is
        redone from the store; `[]` after `attempts` overlapped tries."""
        if user_id is None:
            return []
        for _ in range(attempts):
            seen = self.forgets
            neighbours = [Neighbour(n.name, n.relation, tuple(n.items)) for n in self.store.neighbour_memories(user_id)]
            with self._retrieving:
                with self._state:
                    self._busy = True
                try:
                    hits = self.retriever.retrieve(query, neighbours)  # the text-encoder call: no `_state` held
                finally:
                    with self._state:
                        self._busy = False
                        stale = self.forgets != seen
                        if stale:
                            self.retriever.clear()
            if not stale:
                return hits
        return []
