"""DialogEngine: many full-duplex dialog streams over one Moshi `LMModel`, one batched step per tick.

The engine owns a pool of `max_streams` slots. Each tick, `step(slots, listen_codes)` runs the
temporal transformer for those slots only (rows gathered by slot index; other slots untouched) with
attention over the MemChunk KV cache `[L1 | L2 | ring]` (see kv_cache.py), then the depth transformer
for the 8 speak codebooks (moshi's depformer maths, without its per-tick streaming-state churn). Token
delays are handled exactly as `moshi.models.lm.LMGen` does, per slot. Weights are the LMModel's own
modules, never copied; greedy outputs equal LMGen's (tests/test_dialog_engine.py).

Every stream always attends a full L1 (N1 steps) and a full L2 (N2 steps) before its dialog, as the
paper trains (§4.1): an empty chunk is text pad and still attended. `open()` copies the empty chunks' K/V
(computed once) into the slot; `write_memchunk(slot, level, text_tokens)` refreshes one: one forward pass
for that slot (L1 together with L2 reset to pads; L2 attending the slot's L1). Chunk keys are kept at
their positions inside the chunk region and rotated on to the chunk's virtual positions at read time
(docs/kv-cache.md#positions-rotate-on-read, kv_cache.py).

With a query grammar (`query_grammar`, query_grammar.py) a slot's `<retr>` relation line is drawn among
the relations its Level-1 profile names (`set_query_relations`): the text logits are masked and the grammar's
state advanced inside the tick.

Two ways to tick. `step(slots, ...)` runs only the named slots (the CPU path: cost follows the open
streams). `step_all(listen_codes, exec_mask)` runs every slot with an exec mask, as moshi's LMGen does:
fixed shapes, per-slot step counts and positions on the device, no host sync, so on CUDA the whole tick
is captured once in a CUDA graph and replayed. Both share `_step`; rows not executed keep their cache,
tokens and step count (tests/test_dialog_engine.py).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from moshi.models.lm import LMModel
from moshi.modules.transformer import create_sin_embedding
from moshi.utils.compile import CUDAGraphed, no_compile
from moshi.utils.sampling import sample_token

from egomem.kernels import Impl, rope_rotate

from .kv_cache import MemChunkKVCache
from .query_grammar import GrammarTokens, QueryGrammar


def memchunk_inputs(lm: LMModel, tokens: list[int] | torch.Tensor, steps: int, audio_token: int | None = None
                    ) -> torch.Tensor:
    """One MemChunk as model input `[K, steps]`: text row = the tokens then text pad; all audio rows =
    `audio_token` (default Moshi's audio initial token). Serving writes chunks from it and training
    (`egomem.training.forward`) builds its samples' chunk steps from it: one layout in both."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
    if tokens.numel() > steps:
        raise ValueError(f"a {steps}-step MemChunk cannot hold {tokens.numel()} tokens")
    rows = torch.full((lm.num_codebooks, steps), lm.initial_token_id if audio_token is None else audio_token,
                      dtype=torch.long)
    rows[0] = lm.text_padding_token_id
    rows[0, :tokens.numel()] = tokens
    return rows


class NoFreeSlotError(RuntimeError):
    """Every stream slot is in use."""


def draw_token(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """A token from `logits` [..., card]: the argmax at temperature 0, else top-k sampling at `temperature`."""
    return torch.argmax(logits, dim=-1) if temperature <= 0 else sample_token(logits.float(), True, temperature, top_k)


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons) on the low 32 bits of int64 `x`: products wrap mod 2**64, so the low 32 bits
    are exact on CPU and CUDA alike."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def stream_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A uniform in [0, 1) per (stream seed, step) `[B]` int64 -> `[B]` float32: a counter-based draw, so a
    stream's draws depend on its seed and its own steps only, never on which streams share the tick or on the
    process's generator (a served stream replays exactly; CUDA-graph safe: no generator state)."""
    return (_hash32(_hash32(seeds) + steps) >> 8).float() / float(1 << 24)


def sample_text(logits: torch.Tensor, pad: int, temperature: float, top_k: int,
                start_temperature: float | None = None, silent: torch.Tensor | None = None,
                uniform: torch.Tensor | None = None, start_floor: float = 0.0) -> torch.Tensor:
    """The text token from `logits` [..., card]: greedy at temperature 0, else top-k sampling at `temperature`.

    With `start_temperature`, a silent channel (`silent` [...]: its last token the pad; None: every row) draws
    in two steps: wait (the pad) or start speaking, a Bernoulli on the model's pad probability at
    `start_temperature` (1: the model's own odds; 0: the likelier of the two), then which word, among the
    words only. One temperature over every token squares an uncertain turn start away (at T = 0.5 a 10 %
    chance to start becomes about 1 %; greedy never opens a turn whose moment is uncertain), while the words
    want a low one; a channel mid-reply keeps the one draw, so the replies are not broken by pads
    (docs/training.md#when-to-speak). `uniform` (shaped like `logits` without its last dim): the wait
    draw's uniforms (`stream_uniform`); None: the process's generator. `start_floor`: a start whose chance is
    below it is not taken (epsilon sampling on the turn start): over a long silence the model's small odds of
    opening add up to a turn opened at a moment the model itself did not pick, whose first word is whatever
    byte ranks first there, e.g. the middle of a MemChunk line it then reads out (docs/training.md#when-to-speak)."""
    if start_temperature is None:
        return draw_token(logits, temperature, top_k)
    logp = torch.log_softmax(logits.float(), dim=-1)
    log_wait = logp[..., pad]
    log_start = torch.log1p(-log_wait.exp().clamp(max=1 - 1e-6))  # log P(any word)
    if start_temperature <= 0:
        wait = log_wait >= log_start
    else:
        u = torch.rand_like(log_wait) if uniform is None else uniform.to(log_wait.dtype)
        wait = u < torch.sigmoid((log_wait - log_start) / start_temperature)
    if start_floor > 0:
        wait = wait | (log_start < math.log(start_floor))
    words = logits.clone()
    words[..., pad] = float("-inf")
    two_step = torch.where(wait, pad, draw_token(words, temperature, top_k))
    return two_step if silent is None else torch.where(silent, two_step, draw_token(logits, temperature, top_k))


class DialogEngine:
    """A pool of dialog stream slots stepped together over one `LMModel` (see module docstring)."""

    def __init__(self, lm: LMModel, max_streams: int, l1_steps: int = 512, l2_steps: int = 256,
                 ring_steps: int | None = None, temperature: float = 0.0, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, kernels: Impl = "auto", top_k_text: int = 25,
                 top_k_audio: int = 250, chunk_audio_token: int | None = None, cuda_graphs: bool = True,
                 fixed_shape_tick: bool | None = None, kv_dtype: torch.dtype | None = None,
                 start_temperature: float | None = None, start_floor: float = 0.0,
                 query_grammar: GrammarTokens | None = None):
        tr = lm.transformer
        if tr.positional_embedding not in ("rope", "rope_concat"):
            raise ValueError(f"DialogEngine needs a RoPE LMModel; this one uses {tr.positional_embedding!r}")
        if lm.fuser is not None or lm.condition_provider is not None:
            raise ValueError("conditioned LMModels (fuser / condition_provider) are not supported")
        if lm.depformer is None:
            raise ValueError("DialogEngine needs an LMModel with a depformer (dep_q > 0)")
        attn0 = tr.layers[0].self_attn
        if attn0.weights_per_step or tr.layers[0].cross_attention is not None:
            raise ValueError("the temporal transformer must not use weights_per_step or cross-attention")
        self.lm = lm.eval()
        self.device = lm.device
        if dtype is not None and dtype != lm.dtype:
            raise ValueError(f"engine dtype {dtype} differs from the model's {lm.dtype}: load the model in {dtype}")
        if device is not None and torch.device(device).type != lm.device.type:
            raise ValueError(f"engine device {device} differs from the model's {lm.device}: move the model first")
        self.dtype = lm.dtype
        self.max_streams = max_streams
        self.temperature = float(temperature)
        if start_temperature is not None and not start_temperature >= 0:
            raise ValueError(f"start_temperature must be >= 0 or None, got {start_temperature}")
        self.start_temperature = start_temperature
        if not 0.0 <= start_floor < 1.0:
            raise ValueError(f"start_floor must be in [0, 1), got {start_floor}")
        self.start_floor = float(start_floor)
        self.top_k_text, self.top_k_audio = top_k_text, top_k_audio
        # training layout: ring + chunk = the model's trained context, when it has one
        if ring_steps is None:
            ring_steps = (lm.context - l1_steps - l2_steps) if lm.context else 2048
        if ring_steps <= 0:
            raise ValueError(f"ring_steps must be positive; the chunks ({l1_steps} + {l2_steps}) leave none of "
                             f"the model's {lm.context}-step context")
        if lm.context is not None and ring_steps > lm.context:
            raise ValueError(f"ring_steps {ring_steps} exceeds the model's trained context {lm.context}")
        self.num_heads = attn0.num_heads
        self.kv_repeat = attn0.kv_repeat
        self.head_dim = lm.dim // self.num_heads
        self.max_period = float(tr.rope.max_period)
        self.interleave = bool(tr.rope.interleave)
        # the KV cache holds the model's dtype, or float8_e4m3fn (half the bytes a decode step reads; H100+)
        self.cache = MemChunkKVCache(len(tr.layers), max_streams, self.num_heads // self.kv_repeat, self.head_dim,
                                     l1_steps, l2_steps, ring_steps, self.device, kv_dtype or self.dtype, impl=kernels)
        self.chunk_audio_token = lm.initial_token_id if chunk_audio_token is None else chunk_audio_token
        # Moshi's delayed token buffer per slot, as LMGen keeps it per batch row.
        self.delays = torch.tensor(lm.delays, device=self.device, dtype=torch.long)  # [K]
        self.max_delay = max(lm.delays)
        self.tokens = torch.full((max_streams, lm.num_codebooks, self.max_delay + 2), lm.ungenerated_token_id,
                                 device=self.device, dtype=torch.long)  # [S, K, CT]
        self.initial = lm._get_initial_token()  # [1, K, 1]
        self.free = list(range(max_streams))[::-1]
        self.active: set[int] = set()
        # each slot's stream seed: its turn-start draws are stream_uniform(seed, step) (open(seed=...))
        self.seeds = torch.zeros(max_streams, device=self.device, dtype=torch.long)
        self.all_slots = torch.arange(max_streams, device=self.device)  # step_all's rows: every slot, fixed shape
        # a query's relation line drawn among the relations the slot's L1 names (query_grammar.py); None: free
        self.grammar = QueryGrammar(query_grammar, max_streams, self.device) if query_grammar is not None else None
        # tick() runs step_all (fixed shape) or step (only the named slots); default: fixed on CUDA
        self.fixed_shape_tick = self.device.type == "cuda" if fixed_shape_tick is None else fixed_shape_tick
        # step_all on CUDA: captured once in a CUDA graph, replayed every tick (moshi's CUDAGraphed, as LMGen)
        self._step_all_graphed = CUDAGraphed(self._step_all, disable=self.device.type != "cuda" or not cuda_graphs)
        # K/V of an empty L1 followed by an empty L2 (all text pad): the same for every slot, so computed
        # once here and copied into each slot by open(). Assumes the model's weights no longer change.
        n_chunk = self.cache.n1 + self.cache.n2
        self.empty_chunks = self._chunk_kv(self._chunk_inputs(torch.zeros(0, dtype=torch.long), n_chunk), 0) \
            if n_chunk else None  # [L, Hkv, N1 + N2, D] K and V

    # ---------------------------------------------------------------- slots

    def open(self, seed: int | None = None) -> int:
        """Claim a free slot, reset to an empty stream whose L1 and L2 are empty (text pad, attended).
        `seed` fixes the stream's turn-start draws (`stream_uniform`); None draws one from torch's generator."""
        if not self.free:
            raise NoFreeSlotError(
                f"no free stream slot: all {self.max_streams} are in use; close one or raise max_streams")
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, ()))
        slot = self.free.pop()
        self.seeds[slot] = int(seed) & _MASK32
        self.cache.reset(slot)
        if self.empty_chunks is not None:
            self.cache.write_chunk(slot, 0, *self.empty_chunks)
        self.tokens[slot] = self.lm.ungenerated_token_id
        if self.grammar is not None:
            self.grammar.relations(slot, [])
        self.active.add(slot)
        return slot

    def set_query_relations(self, slot: int, relations: list[list[int]]) -> int:
        """The relations (text token ids each) a query's relation line may name on `slot`, with the query
        grammar on (`query_grammar`); returns how many fitted its table. The serving pool calls it with each
        Level-1 write (`query_grammar.profile_relations`)."""
        self._check_slot(slot)
        if self.grammar is None:
            raise ValueError("this engine has no query grammar: build it with query_grammar=GrammarTokens(...)")
        return self.grammar.relations(slot, relations)

    def close(self, slot: int) -> None:
        self._check_slot(slot)
        self.active.discard(slot)
        self.free.append(slot)

    def steps(self, slot: int) -> int:
        """Dialog steps this slot has taken (reads the device counter: not for the hot path)."""
        return int(self.cache.steps[slot])

    def _check_slot(self, slot: int) -> None:
        if slot not in self.active:
            raise KeyError(f"slot {slot} is not open (open slots: {sorted(self.active)})")

    # ---------------------------------------------------------------- layers

    def _qkv(self, layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed projections of x [B, T, C] -> q [B, H, T, D], k and v [B, Hkv, T, D]."""
        B, T, C = x.shape
        projected = layer.self_attn.in_projs[0](layer.norm1(x))  # [B, T, C + 2 * Hkv * D]
        Hkv = self.num_heads // self.kv_repeat
        q = projected[..., :C].view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        kv = projected[..., C:].view(B, T, 2, Hkv, self.head_dim)  # [B, T, 2, Hkv, D]
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # [B, Hkv, T, D] each
        return q, k, v

    def _finish_layer(self, layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection + residual, then the feed-forward block. attn: [B, T, C]."""
        update = layer.self_attn.out_projs[0](attn)
        x = x.to(update) + layer.layer_scale_1(update)
        return layer._ff_block(x)

    def _embed(self, inputs: torch.Tensor) -> torch.Tensor:
        """Summed text + audio embeddings of inputs [B, K, T] -> [B, T, C]."""
        lm = self.lm
        x = lm.emb[0](inputs[:, lm.audio_offset])
        for cb in range(1, lm.num_audio_codebooks):  # summed in moshi's order: audio, then text
            x = x + lm.emb[cb](inputs[:, cb + lm.audio_offset])
        return x + lm.text_emb(inputs[:, 0])

    # ---------------------------------------------------------------- memchunks

    def _chunk_inputs(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """MemChunk steps as model input `[1, K, steps]` (`memchunk_inputs`)."""
        return memchunk_inputs(self.lm, tokens, steps, self.chunk_audio_token).to(self.device)[None]

    @torch.no_grad()
    def _chunk_kv(self, inputs: torch.Tensor, start: int, slot: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V `[L, Hkv, n, D]` of chunk steps `inputs` `[1, K, n]` at chunk positions start .. start + n - 1,
        causal, attending to `slot`'s stored chunk steps 0 .. start - 1 as a prefix (an L2 refresh reads L1)."""
        assert start in (0, self.cache.n1) and (slot is not None or not start), (slot, start)
        n = inputs.shape[2]
        with no_compile():
            x = self._embed(inputs)  # [1, n, C]
            pos = torch.arange(start, start + n, device=self.device)  # positions inside the chunk region
            mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(start)  # [n, start + n]
            ks, vs = [], []
            for li, layer in enumerate(self.lm.transformer.layers):
                q, k, v = self._qkv(layer, x)  # [1, H|Hkv, n, D]
                q = rope_rotate(q, pos, self.max_period, self.interleave)
                k = rope_rotate(k, pos, self.max_period, self.interleave)
                ks.append(k[0]), vs.append(v[0])  # stored at chunk positions, see kv_cache.py
                if start:
                    pk, pv = self.cache.l1_kv(slot, li)  # [Hkv, n1, D]
                    k = torch.cat([pk[None].to(k), k], dim=2)  # [1, Hkv, n1 + n, D]
                    v = torch.cat([pv[None].to(v), v], dim=2)
                attn = self._sdpa(q, k, v, mask)  # [1, H, n, D]
                x = self._finish_layer(layer, x, attn.transpose(1, 2).reshape(1, n, -1))
        return torch.stack(ks), torch.stack(vs)  # [L, Hkv, n, D]

    @torch.no_grad()
    def write_memchunk(self, slot: int, level: Literal[1, 2], text_tokens: list[int] | torch.Tensor) -> None:
        """Refresh a slot's L1 (profile) or L2 (retrieved facts) MemChunk from text tokens.

        The chunk is always full length: the tokens, then text pad; its audio rows are `chunk_audio_token`.
        L1 is written with L2 reset to pads (a new person makes the old retrieval stale): one pass over
        N1 + N2 steps, L2 attending the new L1. L2 sits at N1 .. N1 + N2 - 1 and attends the slot's current
        L1 (pads or written). The dialog ring is kept. Bad input raises before anything is written.
        """
        self._check_slot(slot)
        if level not in (1, 2):
            raise ValueError(f"MemChunk level must be 1 (profile) or 2 (retrieved facts), got {level!r}")
        n1, n2 = self.cache.n1, self.cache.n2
        cap = n1 if level == 1 else n2
        tokens = torch.as_tensor(text_tokens, dtype=torch.long).flatten()
        if tokens.numel() > cap:
            raise ValueError(f"level-{level} MemChunk holds {cap} steps; got {tokens.numel()} tokens: "
                             f"truncate or summarise the memory text first")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.lm.text_card):
            raise ValueError(f"MemChunk text tokens must be in [0, {self.lm.text_card}), "
                             f"got {tokens.min()}..{tokens.max()}")
        start, steps = (0, n1 + n2) if level == 1 else (n1, n2)
        if steps == 0:
            return
        k, v = self._chunk_kv(self._chunk_inputs(tokens, steps), start, slot)
        self.cache.write_chunk(slot, start, k, v)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Full attention q [B, H, T, D] over k/v [B, Hkv, T', D] with a bool mask [T, T']."""
        if self.kv_repeat > 1:
            k = k.repeat_interleave(self.kv_repeat, dim=1)
            v = v.repeat_interleave(self.kv_repeat, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    # ---------------------------------------------------------------- tick

    @torch.no_grad()
    def step(self, slots: list[int], listen_codes: torch.Tensor, return_logits: bool = False) -> tuple[torch.Tensor, ...]:
        """One tick for `slots` (other slots untouched). listen_codes: [B, 8] (or [B, 8, 1]) user audio codes.

        Returns (text_tokens [B], speak_codes [B, dep_q]) aligned in time (Moshi's delays undone), so the
        first `max_delay` ticks of a stream return `lm.ungenerated_token_id` (-2) there. With
        `return_logits`, also the text logits [B, text_card] that produced this tick's text token.
        """
        lm = self.lm
        slots = [int(s) for s in slots]
        if len(set(slots)) != len(slots):
            raise ValueError(f"each slot may step once per tick; got {slots}")
        for s in slots:
            self._check_slot(s)
        n_listen = lm.num_codebooks - lm.dep_q - 1
        listen = torch.as_tensor(listen_codes, device=self.device, dtype=torch.long)
        if listen.dim() == 3:
            listen = listen[..., 0]
        if listen.shape != (len(slots), n_listen):
            raise ValueError(f"listen_codes must be [{len(slots)}, {n_listen}], got {tuple(listen.shape)}")
        if int(listen.min()) < 0 or int(listen.max()) >= lm.card:
            raise ValueError(f"listen codes must be in [0, {lm.card})")
        with no_compile():
            rows = torch.tensor(slots, device=self.device, dtype=torch.long)  # [B]
            return self._step(rows, listen, None, return_logits)

    @torch.no_grad()
    def tick(self, slots: list[int], listen_codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The serving entry: one tick for `slots` -> (text [B], speak codes [B, dep_q], steps taken [B]).

        On CUDA (`fixed_shape_tick`) it runs `step_all` (every slot, an exec mask, one CUDA graph replay); on
        the CPU `step` (only these slots: the cost follows the open streams). Codes are checked on the host first."""
        if not self.fixed_shape_tick:
            text, speak = self.step(slots, listen_codes)
            return text, speak, self.cache.steps[slots]
        for s in slots:
            self._check_slot(s)
        listen = torch.as_tensor(listen_codes, dtype=torch.long).cpu().reshape(len(slots), -1)  # checked on the host
        n_listen = self.lm.num_codebooks - self.lm.dep_q - 1
        if listen.shape[1] != n_listen or len(set(slots)) != len(slots):
            raise ValueError(f"listen_codes must be [{len(slots)}, {n_listen}] for distinct slots")
        if listen.numel() and (int(listen.min()) < 0 or int(listen.max()) >= self.lm.card):
            raise ValueError(f"listen codes must be in [0, {self.lm.card})")
        full = torch.zeros(self.max_streams, n_listen, dtype=torch.long)
        mask = torch.zeros(self.max_streams, dtype=torch.bool)
        full[slots], mask[slots] = listen, True
        text, speak = self.step_all(full.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True))
        rows = torch.tensor(slots, device=self.device)
        return text[rows], speak[rows], self.cache.steps[rows]

    @torch.no_grad()
    def step_all(self, listen_codes: torch.Tensor, exec_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One fixed-shape tick over EVERY slot: rows where `exec_mask` `[S]` (bool) is True step, the others
        are computed and discarded (moshi LMGen's exec-mask pattern). listen_codes: `[S, 8]` int64 on the
        engine's device. Everything stays on the device (no host sync), so on CUDA the call is captured
        once in a CUDA graph and replayed (`cuda_graphs`). The caller checks the codes and that only open
        slots execute (the served path does both on the host, before the tensors reach the device).

        Returns (text_tokens [S], speak_codes [S, dep_q]) as `step` does; rows not executed hold
        `lm.ungenerated_token_id`.
        """
        S = self.max_streams
        if listen_codes.shape != (S, self.lm.num_codebooks - self.lm.dep_q - 1) or exec_mask.shape != (S,):
            raise ValueError(f"step_all takes listen codes [{S}, 8] and an exec mask [{S}] for all slots")
        with no_compile():
            return self._step_all_graphed(listen_codes, exec_mask)

    def _step_all(self, listen: torch.Tensor, exec_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        text, audio = self._step(self.all_slots, listen, exec_mask, False)
        ungenerated = self.lm.ungenerated_token_id
        return torch.where(exec_mask, text, ungenerated), torch.where(exec_mask[:, None], audio, ungenerated)

    def _step(self, rows: torch.Tensor, listen: torch.Tensor, exec_mask: torch.Tensor | None, return_logits: bool):
        """The tick for `rows` `[B]` (device ops only; `exec_mask` `[B]` or None = all rows step)."""
        lm = self.lm
        B = rows.shape[0]
        CT = self.tokens.shape[2]
        offsets = self.cache.steps[rows]  # [B]
        before = self.tokens[rows]  # [B, K, CT] (a copy)
        tok = before.clone()  # updated below, written back for the rows that step
        # LMGen's delay handling: write user audio ahead by its delay, read this tick's inputs.
        listen_delays = self.delays[lm.dep_q + 1:]  # [8]
        write_pos = (offsets[:, None] + listen_delays[None]) % CT  # [B, 8]
        tok[:, lm.dep_q + 1:].scatter_(2, write_pos[..., None], listen[..., None])
        is_init = offsets[:, None] <= self.delays[None]  # [B, K]
        read_pos = (offsets % CT)[:, None, None].expand(B, lm.num_codebooks, 1)  # [B, K, 1]
        inputs = torch.where(is_init[..., None], self.initial, tok.gather(2, read_pos))  # [B, K, 1]
        self.last_inputs = inputs  # the tokens this tick fed the model (teacher-forcing checks)

        meta = self.cache.step_meta(rows)
        x = self._embed(inputs)  # [B, 1, C]
        for li, layer in enumerate(lm.transformer.layers):
            q, k, v = self._qkv(layer, x)  # [B, H|Hkv, 1, D]
            pos = meta["pos"][:, None, None]  # [B, 1, 1]
            q = rope_rotate(q, pos, self.max_period, self.interleave)[:, :, 0]  # [B, H, D]
            k = rope_rotate(k, pos, self.max_period, self.interleave)[:, :, 0]  # [B, Hkv, D]
            attn = self.cache.append_and_attend(li, meta, q, k, v[:, :, 0], self.max_period, self.interleave,
                                                exec_mask)
            x = self._finish_layer(layer, x, attn.reshape(B, 1, -1))  # attn [B, H, D] -> [B, 1, C]
        out = lm.out_norm(x) if lm.out_norm else x  # [B, 1, C]; the tiny preset has no final norm (presets.py)
        text_logits = lm.text_linear(out)[:, None]  # [B, 1, 1, text_card]
        if self.grammar is not None:
            text_logits = self.grammar.mask(text_logits, rows)  # returned masked: what was drawn from
        text = self._sample_text(text_logits, inputs[:, 0, 0], rows, offsets)[:, 0, 0]  # [B]
        if self.grammar is not None:
            self.grammar.advance(rows, text, lm.text_padding_token_id, exec_mask)
        audio = self._depformer(text, out)  # [B, dep_q]
        self.cache.advance(rows, exec_mask)

        offsets = offsets + 1
        new_pos = (offsets % CT)[:, None, None]  # [B, 1, 1]
        tok[:, :1].scatter_(2, new_pos, text[:, None, None])
        tok[:, 1:lm.dep_q + 1].scatter_(2, new_pos.expand(B, lm.dep_q, 1), audio[:, :, None])
        self.tokens[rows] = tok if exec_mask is None else torch.where(exec_mask[:, None, None], tok, before)
        gen_delays = self.delays[:lm.dep_q + 1]  # [1 + dep_q]
        index = (offsets[:, None, None] - self.max_delay + gen_delays[None, :, None]) % CT  # [B, 1 + dep_q, 1]
        aligned = tok[:, :lm.dep_q + 1].gather(2, index)[..., 0]  # [B, 1 + dep_q]
        aligned = torch.where((offsets <= self.max_delay)[:, None], lm.ungenerated_token_id, aligned)
        result = (aligned[:, 0], aligned[:, 1:])
        if return_logits:
            return result + (text_logits[:, 0, 0].float(),)
        return result

    def _sample_text(self, logits: torch.Tensor, last: torch.Tensor, rows: torch.Tensor,
                     offsets: torch.Tensor) -> torch.Tensor:
        """This tick's text token [B, 1, 1]; `last` [B]: the text token fed this tick (the one before);
        `rows`, `offsets` [B]: the slots and their steps (the turn-start draws' counters)."""
        if self.start_temperature is None:  # one draw: no silence to look for
            return self._sample(logits, self.top_k_text)
        silent = (last == self.lm.text_padding_token_id) | (last == self.lm.text_initial_token_id)
        uniform = stream_uniform(self.seeds[rows], offsets)[:, None, None]  # [B, 1, 1]
        return sample_text(logits, self.lm.text_padding_token_id, self.temperature, self.top_k_text,
                           self.start_temperature, silent[:, None, None], uniform, self.start_floor)

    def _sample(self, logits: torch.Tensor, top_k: int) -> torch.Tensor:
        return draw_token(logits, self.temperature, top_k)

    def _depformer(self, text: torch.Tensor, transformer_out: torch.Tensor) -> torch.Tensor:
        """The depth transformer over this tick's dep_q speak codebooks, on moshi's depformer weights.

        Same maths as `LMModel.forward_depformer` under `depformer.streaming(B)` (what LMGen runs), with
        the per-codebook K/V kept in plain lists instead of moshi's per-tick streaming states.
        """
        lm = self.lm
        dep = lm.depformer
        sched = lm.depformer_weights_per_step_schedule
        prev = text
        kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in dep.layers]
        codes = []
        for cb in range(lm.dep_q):
            w = sched[cb] if sched is not None else cb  # weight index of this codebook
            lin = lm.depformer_in[w if lm.depformer_multi_linear else 0]
            emb = lm.depformer_text_emb if cb == 0 else lm.depformer_emb[cb - 1]
            x = lin(transformer_out) + emb(prev[:, None])  # [B, 1, Cd]
            if dep.positional_embedding in ("sin", "sin_rope"):
                pos = torch.full((1, 1, 1), cb, device=x.device)
                x = x + dep.positional_scale * create_sin_embedding(pos, x.shape[-1], dep.max_period, x.dtype)
            for li, layer in enumerate(dep.layers):
                x = self._depformer_layer(layer, x, cb, w, kv[li])
            logits = lm.linears[cb](lm.depformer_norms[cb](x))  # [B, 1, card]
            prev = self._sample(logits, self.top_k_audio)[:, 0]  # [B]
            codes.append(prev)
        return torch.stack(codes, dim=1)  # [B, dep_q]

    def _depformer_layer(self, layer, x: torch.Tensor, cb: int, w: int,
                         kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One depformer layer for codebook `cb` (weights `w`), attending to the codebooks before it."""
        attn = layer.self_attn
        B, _, C = x.shape
        H = attn.num_heads
        Hkv, D = H // attn.kv_repeat, C // H
        proj = attn.in_projs[w if len(attn.in_projs) > 1 else 0](layer.norm1(x))  # [B, 1, C + 2 * Hkv * D]
        q = proj[..., :C].view(B, 1, H, D).transpose(1, 2)  # [B, H, 1, D]
        k, v = proj[..., C:].view(B, 1, 2, Hkv, D).permute(2, 0, 3, 1, 4).unbind(0)  # [B, Hkv, 1, D]
        if attn.rope is not None:
            pos = torch.full((1,), cb, device=x.device)
            q = rope_rotate(q, pos, attn.rope.max_period, attn.rope.interleave)
            k = rope_rotate(k, pos, attn.rope.max_period, attn.rope.interleave)
        kv.append((k, v))
        keys = torch.cat([kk for kk, _ in kv], dim=2)  # [B, Hkv, cb + 1, D]
        vals = torch.cat([vv for _, vv in kv], dim=2)
        if attn.context is not None and keys.shape[2] > attn.context:
            keys, vals = keys[:, :, -attn.context:], vals[:, :, -attn.context:]
        if attn.kv_repeat > 1:
            keys = keys.repeat_interleave(attn.kv_repeat, dim=1)
            vals = vals.repeat_interleave(attn.kv_repeat, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, vals)  # [B, H, 1, D]
        update = attn.out_projs[w if len(attn.out_projs) > 1 else 0](out.transpose(1, 2).reshape(B, 1, C))
        x = x.to(update) + layer.layer_scale_1(update)
        h = layer.norm2(x)
        if layer.gating is None:
            update = layer.linear2(layer.activation(layer.linear1(h)))
        elif isinstance(layer.gating, torch.nn.ModuleList):
            update = layer.gating[w](h)
        else:
            update = layer.gating(h)
        return x.to(update) + layer.layer_scale_2(update)
