"""Who is there, and what they know: the orchestrator's seams to identification and retrieval.

- `Perception.faces(jpeg)` / `.voice(pcm)`: the `face_encoder` / `speaker_encoder` models on Triton.
- `Perception.identify(...)`: `egomem.identity.Identifier` over the store's biometric keys, the index
  rebuilt whenever `store.keys_generation()` changes (enrolment, merge, forget).
- `Perception.retrieve(user_id, query)`: Level-2 retrieval (`egomem.retrieval`) over the user's
  relation-graph neighbours, re-ranked with the `text_encoder` model on Triton.
Store and retrieval calls are synchronous; callers run them with `asyncio.to_thread`.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass

import numpy as np

from egomem.config import Config
from egomem.identity import Identification, Identifier, KeyRecord, UserKeyIndex
from egomem.memory import MemoryStore
from egomem.retrieval import Hit, Level2Retriever, Neighbour, RetrievalQuery
from egomem.serving.client import AsyncTritonClient


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
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"video frame is not a JPEG/PNG image: {e}") from None


class _TritonTextEncoder:
    """`TextEncoder` over the `text_encoder` model with a blocking gRPC client (used from worker threads)."""

    def __init__(self, url: str, timeout_s: float):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self._client = grpcclient.InferenceServerClient(url)
        self.timeout_s = timeout_s

    def encode(self, texts) -> np.ndarray:
        arr = np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
        inp = self._grpc.InferInput("TEXT", [len(texts)], "BYTES")
        inp.set_data_from_numpy(arr)
        res = self._client.infer("text_encoder", [inp], outputs=[self._grpc.InferRequestedOutput("EMBEDDINGS")],
                                 client_timeout=self.timeout_s)
        return res.as_numpy("EMBEDDINGS").astype(np.float32)  # [N, D]

    def close(self) -> None:
        self._client.close()


class Perception:
    def __init__(self, cfg: Config, triton: AsyncTritonClient, store: MemoryStore, use_text_encoder: bool = True):
        self.cfg = cfg
        self.triton = triton
        self.store = store
        self._lock = threading.Lock()
        self._generation: int | None = None
        self.identifier = Identifier.from_config(cfg.identity)
        self._text = _TritonTextEncoder(triton.url, cfg.orchestrator.triton_timeout_s) if use_text_encoder else None
        self.retriever = Level2Retriever.from_config(cfg.retrieval, self._text)
        self.retriever.memchunk_steps = min(self.retriever.memchunk_steps, cfg.dialog.l2_steps)

    def close(self) -> None:
        if self._text is not None:
            self._text.close()

    # -- encoders on Triton ---------------------------------------------------------------------
    async def faces(self, image: np.ndarray) -> FaceResult:
        r = await self.triton.infer("face_encoder", {"IMAGE": image}, ["EMBEDDINGS", "SPEAKER", "MODEL_ID"],
                                    timeout_s=self.cfg.orchestrator.triton_timeout_s * 4)
        mid = r["MODEL_ID"].reshape(-1)[0]
        return FaceResult(r["EMBEDDINGS"].astype(np.float32), int(r["SPEAKER"].reshape(-1)[0]),
                          mid.decode() if isinstance(mid, bytes) else str(mid))

    async def voice(self, pcm: np.ndarray) -> np.ndarray | None:
        """[T] float32 24 kHz -> [D] embedding, or None when too little of it is speech."""
        r = await self.triton.infer("speaker_encoder", {"PCM": pcm.astype(np.float32)}, ["EMBEDDING", "VOICED"],
                                    timeout_s=self.cfg.orchestrator.triton_timeout_s * 4)
        return r["EMBEDDING"].astype(np.float32) if bool(r["VOICED"].reshape(-1)[0]) else None

    # -- identification (blocking: store reads + faiss) -----------------------------------------
    def _sync_index(self) -> None:
        gen = self.store.keys_generation()
        if gen == self._generation:
            return
        keys = self.store.list_keys()
        self.identifier.index = UserKeyIndex.rebuild(
            KeyRecord(k.user_id, k.modality, k.model_id, np.asarray(k.vector, np.float32)) for k in keys)
        self._generation = gen

    def identify(self, face_vecs: np.ndarray | None, speaker: int, voice_vec: np.ndarray | None) -> Identification:
        with self._lock:
            self._sync_index()
            return self.identifier.identify(face_vecs, voice_vec, speaker=max(speaker, 0))

    def forget(self) -> None:
        """A user was forgotten: rebuild the key index at the next identification (even if the store's
        generation were unchanged) and drop the retrieval caches, which hold memory texts."""
        with self._lock:
            self._generation = None
            self.retriever.clear()

    def user_name(self, user_id: str) -> str:
        u = self.store.resolve_user(user_id)
        return u.name if u else "?"

    def profile_text(self, user_id: str, max_chars: int) -> str:
        return self.store.render_profile(user_id, max_chars=max_chars)

    # -- Level-2 retrieval (blocking) -------------------------------------------------------------
    def retrieve(self, user_id: str | None, query: RetrievalQuery) -> list[Hit]:
        if user_id is None:
            return []
        neighbours = [Neighbour(n.name, n.relation, tuple(n.items)) for n in self.store.neighbour_memories(user_id)]
        with self._lock:  # the retriever's embedding cache is not thread-safe
            return self.retriever.retrieve(query, neighbours)
