"""Mimi, the neural audio codec of Moshi: 24 kHz PCM <-> 8 codebooks at 12.5 Hz (1920 samples/step).

Built from `moshi`'s own classes (`moshi.models.loaders.get_mimi`). Two presets of the same
architecture:
  - `full`: the released Mimi shape (79 M parameters); real weights load from a local safetensors.
  - `tiny`: the same classes with fewer channels and layers, so many streams run in real time on a
    2-core CPU (docs/departures.md#d04-tiny-mimi-preset-on-cpu-trained-here: full size streams 4 CPU streams at ~91 ms per 80 ms frame).
With no weights configured the `tiny` preset loads the shipped trained codec
(`egomem/data/mimi_tiny.safetensors`, made by `egomem train-codec`, egomem/codec/train.py); with
`mimi.random_init` (or the `full` preset without weights) the model is random-initialised from a
fixed seed, so every process that builds it (the Triton model, the trigger's data builder, tests)
produces the same codes.

`MimiStreamPool` holds many concurrent streams in one batched streaming state: each stream owns a
row (slot); a call executes only the rows it names (moshi's per-row `exec_mask`), so streams never
see each other's state, and opening/closing a stream resets only its own row. On CPU a call runs
the model on the first `max(slot) + 1` rows only (views of the full state, `_row_prefix`); slots are handed
out lowest first and a close moves the highest stream into the freed row, so the open streams sit
in rows 0..n-1 and a step costs what they need, not `max_streams`.
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from egomem.config import MimiConfig
from egomem.serving.streams import SlotTable, StreamError, admit
from egomem.serving.wire import RowError

log = logging.getLogger(__name__)

SAMPLE_RATE = 24_000
FRAME_RATE = 12.5
FRAME_SAMPLES = 1920  # one 80 ms step at 24 kHz
CARDINALITY = 2048  # codebook size; the dialog LM's audio vocabulary depends on it
SHIPPED_TINY_CODEC = Path(__file__).resolve().parents[1] / "data" / "mimi_tiny.safetensors"


def mimi_config(preset: str) -> dict:
    """moshi's Mimi config dict for a preset (the `full` one is moshi's own `_mimi_config`)."""
    from moshi.models import loaders

    cfg = copy.deepcopy(loaders._mimi_config)
    if preset == "full":
        return cfg
    if preset != "tiny":
        raise ValueError(f"unknown Mimi preset {preset!r}; allowed: 'tiny', 'full'")
    dim = 128  # latent width (full: 512); keeps the 8-6-5-4 ratios, so 1920 samples/step is unchanged
    cfg["seanet"].update(dimension=dim, n_filters=8)
    cfg["quantizer"].update(dimension=64, n_q=8, input_dimension=dim, output_dimension=dim)
    cfg["transformer"].update(
        d_model=dim, num_heads=4, num_layers=2, dim_feedforward=256,
        input_dimension=dim, output_dimensions=[dim],
    )
    return cfg


class MimiWeightsError(RuntimeError):
    """The configured Mimi weights are missing or do not fit the configured architecture."""


def build_mimi(cfg: MimiConfig, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Build Mimi per config: `codec_weights(cfg)` if any (checked strictly), else seeded random init (said so)."""
    from moshi.models import loaders

    conf = mimi_config(cfg.preset)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = loaders.get_mimi(None, conf, device="cpu", num_codebooks=cfg.num_codebooks)
    weights = codec_weights(cfg)
    if weights is None:
        log.warning(
            "Mimi: using a RANDOM-INITIALISED %s Mimi (seed %d)%s. Codes are deterministic but carry little "
            "speech meaning. Set mimi.weights to a Moshi Mimi safetensors file for real audio.",
            cfg.preset, cfg.seed, " (mimi.random_init)" if cfg.random_init else " (no mimi.weights)",
        )
        _init_random_codebooks(model)  # its own seeded generator: the same codes in every process
    else:
        load_mimi_weights(model, weights)
    model.set_num_codebooks(cfg.num_codebooks)
    return model.to(device).eval()


def codec_weights(cfg: MimiConfig) -> Path | None:
    """The weights file `build_mimi` loads: `mimi.weights`, else the shipped trained tiny codec for the tiny
    preset, else None (random init: `mimi.random_init`, or the full preset without weights)."""
    if cfg.weights is not None:
        return Path(cfg.weights)
    if cfg.random_init or cfg.preset != "tiny":
        return None
    return SHIPPED_TINY_CODEC


def _init_random_codebooks(model: torch.nn.Module, seconds: float = 24.0) -> None:
    """Seed the codebooks of a random-initialised Mimi from its own latents.

    moshi leaves untrained codebooks at zero (k-means fills them during training), which would map
    every frame to code 0. We run a seeded calibration signal (noise bursts and chirps) through the
    encoder and draw each residual codebook's centroids from the residual's own distribution,
    layer after layer (as k-means initialisation would place them near the data). Codes then vary with the input, deterministically.
    """
    g = torch.Generator().manual_seed(0)
    n = int(seconds * SAMPLE_RATE) // FRAME_SAMPLES * FRAME_SAMPLES
    t = torch.arange(n) / SAMPLE_RATE
    env = torch.rand(n // FRAME_SAMPLES, generator=g).repeat_interleave(FRAME_SAMPLES)  # per-step loudness
    freq = 100 + 3000 * torch.rand(n // FRAME_SAMPLES, generator=g).repeat_interleave(FRAME_SAMPLES)
    wav = env * (0.3 * torch.sin(2 * torch.pi * freq * t) + 0.2 * torch.randn(n, generator=g))
    with torch.no_grad():
        emb = model._encode_to_unquantized_latent(wav.view(1, 1, n))  # [1, D, T]
        q = model.quantizer
        for rvq in (q.rvq_first, q.rvq_rest):
            residual = rvq.input_proj(emb)  # [1, d, T]
            for layer in rvq.vq.layers:
                x = layer.project_in(residual.transpose(1, 2))[0]  # [T, d]
                cb = layer._codebook
                # Gaussian centroids matched to the residual's per-dimension mean/std: spread about as
                # far apart as the data, so float noise between batch shapes rarely flips a code.
                centroids = x.mean(0) + x.std(0) * torch.randn(cb.codebook_size, x.shape[1], generator=g)
                cb.embedding_sum.data.copy_(centroids)
                cb.cluster_usage.data.fill_(1.0)
                cb._initialized.data.fill_(1.0)
                cb.register_buffer("_embedding", None, persistent=False)
                residual = residual - layer.decode(layer.encode(residual))


def load_mimi_weights(model: torch.nn.Module, path: Path) -> None:
    """Load a Mimi safetensors file strictly; name the file and the first mismatched keys on failure."""
    if not path.is_file():
        if path == SHIPPED_TINY_CODEC:
            raise MimiWeightsError(
                f"the shipped tiny codec {path} is missing (a partial checkout?): restore it from git, retrain it "
                f"with `egomem train-codec --data <LibriSpeech root>`, or set mimi.random_init = true")
        raise MimiWeightsError(
            f"Mimi weights file {path} not found (mimi.weights). Put the Moshi Mimi safetensors "
            f"(e.g. tokenizer-e351c8d8-checkpoint125.safetensors) there, or unset mimi.weights for "
            f"the shipped trained tiny codec."
        )
    from safetensors.torch import load_file

    state = load_file(str(path))
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or wrong:
        raise MimiWeightsError(
            f"Mimi weights {path} do not match the '{model.__class__.__name__}' architecture "
            f"(is mimi.preset right?): missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"wrong shape {wrong[:5]}"
        )
    model.load_state_dict(state, strict=True)
    from moshi.quantization.core_vq import EuclideanCodebook

    for m in model.modules():  # each codebook caches embedding_sum / usage: recompute it from the loaded values
        if isinstance(m, EuclideanCodebook):
            m.register_buffer("_embedding", None, persistent=False)
            m._cached_initialized = False


class MimiStreamPool:
    """Many concurrent streaming Mimi encoders/decoders in one batched streaming state.

    Thread-safe: Triton may call `execute` from several threads for one instance.
    """

    def __init__(self, model: torch.nn.Module, max_streams: int, ttl_s: float = 600.0):
        self.model = model
        self.max_streams = max_streams
        self.ttl_s = ttl_s
        self.device = next(model.parameters()).device
        self.num_codebooks = model.num_codebooks
        self._streams = SlotTable("Mimi")
        self._free = list(range(max_streams))  # a min-heap: the lowest free slot goes out first
        self._lock = threading.Lock()
        with torch.inference_mode():  # state tensors are inference tensors: create and update them in it
            model.streaming_forever(max_streams)
        self._full_states = _streaming_states(model)
        # CUDA graphs are captured for the full batch, and a GPU step costs about the same at any
        # batch size: there every call runs all rows. On CPU cost grows with the rows run.
        self._narrow = self.device.type == "cpu"
        self._prefix_states: dict[int, list[tuple[object, Bound]]] = {}  # rows -> narrowed states, made once

    # -- stream lifecycle -------------------------------------------------------------------------
    def open(self, stream_id: int) -> int:
        """Open (or re-open from scratch) a stream; returns its slot."""
        with self._lock:
            self._streams.reclaim_idle(self.ttl_s, self._release)
            if stream_id in self._streams:
                slot = self._streams[stream_id]
            else:
                if not self._free:
                    raise StreamError(
                        f"no free stream slot: all {self.max_streams} Mimi streams are open "
                        f"(raise mimi.max_streams or close idle streams)", RowError.NO_FREE_SLOT
                    )
                slot = heapq.heappop(self._free)
            self._streams.put(stream_id, slot)
            self._reset_rows([slot])
            return slot

    def close(self, stream_id: int) -> None:
        with self._lock:
            self._release(stream_id)

    def _release(self, stream_id: int) -> None:
        """Free a stream's slot. On CPU the stream in the highest slot moves into the freed one (its
        state rows are copied), so the rows a call runs stay packed at 0..open streams - 1."""
        freed = self._streams.pop(stream_id)
        if freed is None:
            return
        if self._narrow and len(self._streams):
            top, top_slot = max(self._streams.items(), key=lambda o: o[1])
            if top_slot > freed:
                self._move_row(top_slot, freed)
                self._streams.move(top, freed)
                freed = top_slot
        heapq.heappush(self._free, freed)

    @torch.inference_mode()
    def _move_row(self, src: int, dst: int) -> None:
        """Copy every streaming-state row `src` to row `dst`."""
        for _, state in self._full_states:
            for _, _, tensor, dim in _per_row(state):
                tensor.select(dim, dst).copy_(tensor.select(dim, src))

    def is_open(self, stream_id: int) -> bool:
        return stream_id in self._streams

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @torch.inference_mode()
    def _reset_rows(self, slots: list[int]) -> None:
        mask = torch.zeros(self.max_streams, dtype=torch.bool, device=self.device)
        mask[slots] = True
        self.model.reset_streaming(mask)

    def _slots(self, stream_ids: list[int]) -> list[int]:
        if len(set(stream_ids)) != len(stream_ids):
            raise StreamError("a stream appears twice in one call", RowError.DUPLICATE_ROW)
        out = []
        for sid in stream_ids:
            if sid not in self._streams:
                raise StreamError(f"unknown stream {sid}: open it first (sequence START)",
                                  RowError.UNKNOWN_STREAM)
            self._streams.touch(sid)
            out.append(self._streams[sid])
        return out

    # -- one step ---------------------------------------------------------------------------------
    def check_pcm(self, pcm: np.ndarray, n: int) -> np.ndarray:
        """Refuse anything but float32 [n, 1920] finite PCM (before any stream state is touched)."""
        pcm = np.asarray(pcm)
        if pcm.shape != (n, FRAME_SAMPLES):
            raise StreamError(f"expected PCM of shape [{n}, {FRAME_SAMPLES}], got {list(pcm.shape)}")
        if pcm.dtype != np.float32:
            raise StreamError(f"expected float32 PCM in [-1, 1], got {pcm.dtype}")
        if not np.isfinite(pcm).all():
            raise StreamError("PCM contains NaN or Inf")
        return pcm

    def check_codes(self, codes: np.ndarray, n: int) -> np.ndarray:
        """Refuse anything but integer [n, num_codebooks] codes inside the codebook."""
        codes = np.asarray(codes)
        if codes.shape != (n, self.num_codebooks):
            raise StreamError(f"expected codes of shape [{n}, {self.num_codebooks}], got {list(codes.shape)}")
        if not np.issubdtype(codes.dtype, np.integer):
            raise StreamError(f"expected integer codes, got {codes.dtype}")
        if codes.size and (codes.min() < 0 or codes.max() >= CARDINALITY):
            raise StreamError(f"codes must lie in [0, {CARDINALITY}), got [{codes.min()}, {codes.max()}]")
        return codes

    @torch.inference_mode()
    def encode(self, stream_ids: list[int], pcm: np.ndarray) -> np.ndarray:
        """pcm float32 [N, 1920] (one 80 ms frame per stream) -> codes int64 [N, num_codebooks]."""
        pcm = self.check_pcm(pcm, len(stream_ids))
        with self._lock:
            slots = self._slots(stream_ids)
            with self._row_prefix(slots) as rows:
                x = torch.zeros(rows, 1, FRAME_SAMPLES, device=self.device)  # [rows, C=1, T]
                x[slots, 0] = torch.from_numpy(pcm).to(self.device)
                codes = self.model.encode(x)  # [rows, K, 1]
            return codes[slots, :, 0].to(torch.int64).cpu().numpy()

    @torch.inference_mode()
    def decode(self, stream_ids: list[int], codes: np.ndarray) -> np.ndarray:
        """codes int64 [N, num_codebooks] -> pcm float32 [N, 1920]."""
        codes = self.check_codes(codes, len(stream_ids))
        with self._lock:
            slots = self._slots(stream_ids)
            with self._row_prefix(slots) as rows:
                c = torch.zeros(rows, self.num_codebooks, 1, dtype=torch.long, device=self.device)
                c[slots, :, 0] = torch.from_numpy(codes.astype(np.int64)).to(self.device)
                pcm = self.model.decode(c)  # [rows, 1, 1920]
            return pcm[slots, 0].float().cpu().numpy()

    @contextlib.contextmanager
    def _row_prefix(self, slots: list[int]) -> Iterator[int]:
        """Run the model on rows [0, max(slots)] only (CPU) with exactly `slots` executing; yields
        the number of rows. The narrowed states are views, so every update lands in the full state."""
        rows = max(slots) + 1 if self._narrow else self.max_streams
        if rows < self.max_streams:
            views = self._prefix_states.get(rows)
            if views is None:
                views = self._prefix_states[rows] = [_narrow_state(st, rows) for _, st in self._full_states]
            for (module, _), (view, _bound) in zip(self._full_states, views):
                module._streaming_state = view
        try:
            mask = torch.zeros(rows, dtype=torch.bool, device=self.device)
            mask[slots] = True
            self.model.set_exec_mask(mask)
            yield rows
        finally:
            if rows < self.max_streams:
                for (module, full), (_view, bound) in zip(self._full_states, views):
                    _write_back(bound)
                    module._streaming_state = full


def _streaming_states(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """(module, its streaming state) for every moshi StreamingModule in `model` that holds one."""
    from moshi.modules.streaming import StreamingModule

    return [(m, m._streaming_state) for m in model.modules()
            if isinstance(m, StreamingModule) and m._streaming_state is not None]


Bound = list[tuple[object, str, torch.Tensor]]  # (holder, field, the row view it must keep pointing at)


def _per_row(state: object) -> Iterator[tuple[str, str | None, torch.Tensor, int]]:
    """(field, sub-field of a KV cache or None, tensor, its row dim) for every per-row tensor of a moshi
    streaming `State`: dim 0 everywhere except RingKVCache's cache [2, B, H, T, D]."""
    from moshi.modules.transformer import RingKVCache

    rows = state.batch_size
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
            yield name, None, value, 0
        elif isinstance(value, RingKVCache):
            yield name, "cache", value.cache, 1
            if value.end_offset.shape[0] == rows:
                yield name, "end_offset", value.end_offset, 0


def _narrow_state(state: object, rows: int) -> tuple[object, Bound]:
    """A shallow copy of a moshi streaming `State` whose per-row tensors (`_per_row`) are views of the
    first `rows` rows. moshi updates most state tensors in place (`t[:] = ...`, `scatter_`), so those
    writes reach the full state; a field it reassigns instead (a replicate-padded conv's `first`) is
    copied back by `_write_back`."""
    view = copy.copy(state)
    caches: dict[str, object] = {}  # field -> the view's own copy of that KV cache object
    bound: Bound = []
    for name, sub, tensor, dim in _per_row(state):
        holder = view
        if sub is not None:
            if name not in caches:
                caches[name] = copy.copy(getattr(state, name))
                setattr(view, name, caches[name])
            holder, name = caches[name], sub
        rows_view = tensor.narrow(dim, 0, rows)
        setattr(holder, name, rows_view)
        bound.append((holder, name, rows_view))
    view.batch_size = rows
    view._set_exec_mask_graphed = None  # CPU only: never a CUDA graph
    return view, bound


def _write_back(bound: Bound) -> None:
    """Copy fields the step reassigned (instead of updating in place) into the full state's rows."""
    for holder, name, tensor in bound:
        current = getattr(holder, name)
        if current is not tensor:
            tensor.copy_(current)
            setattr(holder, name, tensor)


@dataclass
class CodecRequest:
    """One request to the served codec: a frame to encode and/or codes to decode, for one stream."""

    stream: int
    start: bool = False  # open (reset) the stream before this frame
    end: bool = False  # close the stream after this frame
    pcm: np.ndarray | None = None  # float32 [1920]
    codes: np.ndarray | None = None  # int64 [num_codebooks]


@dataclass
class CodecResult:
    codes: np.ndarray | None = None  # int64 [num_codebooks]
    pcm: np.ndarray | None = None  # float32 [1920]


def serve_codec_batch(pool: MimiStreamPool, requests: list[CodecRequest]) -> list[CodecResult | StreamError]:
    """Run one Triton batch: validate each request on its own, then ONE batched encode and ONE batched
    decode over the valid ones. A bad request gets its own error; the others are served."""
    results: list[CodecResult | StreamError] = []
    for r in requests:
        try:
            admit(pool, r.stream, r.start)
            if r.pcm is None and r.codes is None:
                raise StreamError("request carries neither PCM nor CODES_IN")
            if r.pcm is not None:
                pool.check_pcm(r.pcm[None], 1)
            if r.codes is not None:
                pool.check_codes(r.codes[None], 1)
            results.append(CodecResult())
        except StreamError as e:
            results.append(e)
    ok = [i for i, res in enumerate(results) if isinstance(res, CodecResult)]
    enc = [i for i in ok if requests[i].pcm is not None]
    if enc:
        codes = pool.encode([requests[i].stream for i in enc], np.stack([requests[i].pcm for i in enc]))
        for j, i in enumerate(enc):
            results[i].codes = codes[j]
    dec = [i for i in ok if requests[i].codes is not None]
    if dec:
        pcm = pool.decode([requests[i].stream for i in dec], np.stack([requests[i].codes for i in dec]))
        for j, i in enumerate(dec):
            results[i].pcm = pcm[j]
    for r in requests:
        if r.end:
            pool.close(r.stream)
    return results
