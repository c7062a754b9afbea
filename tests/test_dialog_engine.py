"""DialogEngine proofs: parity with moshi's LMGen, MemChunk layout and semantics, long streams, slot isolation.

With no MemChunk region (l1_steps = l2_steps = 0) the engine is moshi's `LMGen`; with one, every stream
attends a full L1 and L2 (text pad when empty) before its dialog, as a full-sequence forward over
`[L1 ; L2 ; dialog]` does (tests/test_training_parity.py: the same against the training forward)."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from moshi.models.lm import LMGen
from moshi.utils.compile import no_compile

from egomem.dialog import DialogEngine, NoFreeSlotError
from egomem.dialog.checkpoint import build_lm
from egomem.dialog.engine import sample_text, stream_uniform
from egomem.dialog.kv_cache import KVCacheTooLarge, check_fits

TINY = dict(dim=64, num_heads=2, num_layers=2, card=32, text_card=40, context=32, depformer_dim=32,
            depformer_dim_feedforward=64, depformer_num_heads=2, depformer_num_layers=1)
N_LISTEN = 8


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def lm():
    return build_lm("tiny", seed=0, **TINY)


def _codes(seed: int, steps: int) -> torch.Tensor:
    return torch.randint(0, TINY["card"], (steps, N_LISTEN), generator=torch.Generator().manual_seed(seed))


def _lmgen_outputs(lm, codes: torch.Tensor) -> torch.Tensor:
    """Moshi's own greedy streaming generation for one stream: aligned [text, speak...] per step."""
    gen = LMGen(lm, use_sampling=False)
    outs = []
    with no_compile(), gen.streaming(1):
        for t in range(codes.shape[0]):
            out = gen.step(codes[t][None, :, None])
            if out is not None:
                outs.append(out[0, :, 0])
    return torch.stack(outs)  # [steps - max_delay, 1 + dep_q]


def test_greedy_parity_with_lmgen(lm):
    steps, starts = 48, [0, 3, 7]  # 48 > ring (32): the ring wraps too
    codes = [_codes(10 + i, steps) for i in range(3)]
    want = [_lmgen_outputs(lm, c) for c in codes]
    eng = DialogEngine(lm, max_streams=4, l1_steps=0, l2_steps=0, ring_steps=TINY["context"])  # no chunk: LMGen
    slots: list[int | None] = [None] * 3
    got: list[list[torch.Tensor]] = [[], [], []]
    done = [0, 0, 0]
    for tick in range(steps + max(starts)):
        live = [i for i in range(3) if starts[i] <= tick and done[i] < steps]
        for i in live:
            if slots[i] is None:
                slots[i] = eng.open()
        text, speak = eng.step([slots[i] for i in live], torch.stack([codes[i][done[i]] for i in live]))
        for row, i in enumerate(live):
            if done[i] >= eng.max_delay:
                got[i].append(torch.cat([text[row:row + 1], speak[row]]))
            else:
                assert text[row] == lm.ungenerated_token_id
            done[i] += 1
    for i in range(3):
        assert torch.equal(torch.stack(got[i]), want[i]), f"stream {i} diverged from LMGen"


def _chunk_inputs(lm, tokens: list[int], n: int) -> torch.Tensor:
    chunk = torch.full((lm.num_codebooks, n), lm.initial_token_id)
    chunk[0] = lm.text_padding_token_id
    chunk[0, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return chunk  # [K, n]


def _slot_kv(eng, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of everything a slot holds: K and V over its chunk region and ring."""
    return eng.cache.k[:, slot].clone(), eng.cache.v[:, slot].clone()


@pytest.mark.parametrize("levels", ["none", "l1", "l1+l2", "l2"])
def test_memchunk_logits_equal_full_sequence_forward(lm, levels):
    """Both chunks are always attended at full length: an unwritten one is text pad, at its own positions."""
    n1, n2, steps = 12, 6, 14
    eng = DialogEngine(lm, max_streams=3, l1_steps=n1, l2_steps=n2, ring_steps=TINY["context"])
    neighbour, slot = eng.open(), eng.open()
    l1 = [5, 6, 7, 8, 9] if "l1" in levels else []
    l2 = [11, 12, 13] if "l2" in levels else []
    if l1:
        eng.write_memchunk(slot, 1, l1)
    if l2:
        eng.write_memchunk(slot, 2, l2)
    eng.write_memchunk(neighbour, 1, [1, 2, 3])
    codes = _codes(3, steps)
    fed, logits = [], []
    for t in range(steps):
        _, _, lg = eng.step([neighbour, slot], torch.stack([codes[(t + 5) % steps], codes[t]]), return_logits=True)
        fed.append(eng.last_inputs[1])  # [K, 1]
        logits.append(lg[1])
    seq = torch.cat([_chunk_inputs(lm, l1, n1), _chunk_inputs(lm, l2, n2)] + fed, dim=1)[None]  # [L1 ; L2 ; dialog]
    with torch.no_grad(), no_compile():
        _, ref = lm.forward_text(seq)  # plain full-sequence forward, teacher-forced
    torch.testing.assert_close(torch.stack(logits), ref[0, 0, n1 + n2:], atol=2e-5, rtol=2e-5)


def test_open_copies_the_empty_chunks(lm):
    """open() gives exactly the chunk K/V an explicit empty L1 write computes, for any slot, reused or not."""
    eng = DialogEngine(lm, max_streams=2, l1_steps=8, l2_steps=4, ring_steps=16)
    a, b = eng.open(), eng.open()
    eng.write_memchunk(a, 1, [20, 21])
    eng.write_memchunk(a, 2, [30])
    eng.close(a)
    a = eng.open()  # reused: the old chunks must be gone
    eng.write_memchunk(b, 1, [])
    c = 8 + 4
    assert torch.equal(eng.cache.k[:, a, :, :c], eng.cache.k[:, b, :, :c])
    assert torch.equal(eng.cache.v[:, a, :, :c], eng.cache.v[:, b, :, :c])
    assert eng.cache.k[:, a, :, :c].abs().sum() > 0  # pads are computed K/V, not zeros
    bare = DialogEngine(lm, max_streams=1, l1_steps=0, l2_steps=0, ring_steps=16)
    s = bare.open()
    _, _, lg_pads = eng.step([a], _codes(1, 1), return_logits=True)
    _, _, lg_bare = bare.step([s], _codes(1, 1), return_logits=True)
    assert (lg_pads - lg_bare).abs().max() > 1e-3  # the empty chunks are attended


def test_memchunk_changes_output_and_l1_resets_l2(lm):
    eng = DialogEngine(lm, max_streams=2, l1_steps=8, l2_steps=4, ring_steps=16)
    a, b = eng.open(), eng.open()
    eng.write_memchunk(b, 1, [20, 21, 22])
    l2_pads_after_l1 = _slot_kv(eng, b)
    eng.write_memchunk(b, 2, [30])
    l2_written = _slot_kv(eng, b)
    assert torch.equal(l2_written[0][:, :, :8], l2_pads_after_l1[0][:, :, :8])  # an L2 write leaves L1
    assert not torch.equal(l2_written[0][:, :, 8:12], l2_pads_after_l1[0][:, :, 8:12])
    _, _, lg = eng.step([a, b], _codes(1, 1).expand(2, -1), return_logits=True)
    assert (lg[0] - lg[1]).abs().max() > 1e-3  # the chunk is attended
    eng.write_memchunk(b, 1, [23])
    ref = DialogEngine(lm, max_streams=1, l1_steps=8, l2_steps=4, ring_steps=16)
    r = ref.open()
    ref.write_memchunk(r, 1, [23])
    for got, want in zip(_slot_kv(eng, b), _slot_kv(ref, r)):  # L2 is pads again, attending the new L1
        assert torch.equal(got[:, :, :12], want[:, :, :12])


def test_l2_without_l1_attends_the_empty_l1(lm):
    """An L2 written before any L1 sits at N1 .. N1 + N2 - 1 after the pad L1, as in training."""
    eng = DialogEngine(lm, max_streams=1, l1_steps=8, l2_steps=4, ring_steps=16)
    s = eng.open()
    empty = _slot_kv(eng, s)
    eng.write_memchunk(s, 2, [30, 31])
    got = _slot_kv(eng, s)
    assert torch.equal(got[0][:, :, :8], empty[0][:, :, :8])  # L1 stays the pad chunk
    ref = DialogEngine(lm, max_streams=1, l1_steps=8, l2_steps=4, ring_steps=16)
    seq = torch.cat([_chunk_inputs(lm, [], 8), _chunk_inputs(lm, [30, 31], 4)], dim=1)[None]  # [1, K, 12]
    k, _ = ref._chunk_kv(seq, 0)  # the 12 steps as one causal pass from position 0
    torch.testing.assert_close(got[0][:, :, 8:12], k[:, :, 8:12], atol=1e-5, rtol=1e-5)


def test_memchunk_refuses_bad_tokens(lm):
    eng = DialogEngine(lm, max_streams=1, l1_steps=8, l2_steps=4, ring_steps=16)
    s = eng.open()
    eng.write_memchunk(s, 1, [5, 6])
    before = _slot_kv(eng, s)
    with pytest.raises(ValueError, match="holds 4 steps"):
        eng.write_memchunk(s, 2, list(range(5)))
    with pytest.raises(ValueError, match="level must be 1"):
        eng.write_memchunk(s, 3, [1])
    with pytest.raises(ValueError, match=r"\[0, 40\)"):
        eng.write_memchunk(s, 1, [40])
    with pytest.raises(ValueError, match="holds 8 steps"):
        eng.write_memchunk(s, 1, list(range(9)))
    for got, want in zip(_slot_kv(eng, s), before):
        assert torch.equal(got, want)


def test_long_stream_keeps_chunk_at_virtual_positions(lm):
    W, n1, n2 = 16, 8, 4
    eng = DialogEngine(lm, max_streams=2, l1_steps=n1, l2_steps=n2, ring_steps=W)
    s, bare = eng.open(), eng.open()
    eng.write_memchunk(s, 1, [4, 5, 6])
    eng.write_memchunk(s, 2, [7])
    ptrs = (eng.cache.k.data_ptr(), eng.cache.v.data_ptr(), eng.tokens.data_ptr())
    codes = _codes(4, 3 * W + 5)
    live_tensors = None
    for t in range(3 * W + 5):
        meta = eng.cache.step_meta([s])
        oldest = max(0, t + 1 - W)
        assert int(meta["pos"][0]) == t
        assert int(meta["ring_len"][0]) == min(t + 1, W)
        assert int(meta["chunk_pos0"][0]) == oldest - (n1 + n2)  # chunk right before the oldest ring step
        if t >= W:  # past the ring: query-to-chunk distance is constant, inside the trained span
            assert t - int(meta["chunk_pos0"][0]) == W - 1 + n1 + n2
        _, _, lg = eng.step([s, bare], torch.stack([codes[t], codes[t]]), return_logits=True)
        assert torch.isfinite(lg).all()
        if t > W:
            assert (lg[0] - lg[1]).abs().max() > 1e-4  # the chunk is still attended
        if t == W + 1:
            gc.collect()
            live_tensors = sum(type(o) is torch.Tensor for o in gc.get_objects())
    gc.collect()
    assert sum(type(o) is torch.Tensor for o in gc.get_objects()) == live_tensors
    assert ptrs == (eng.cache.k.data_ptr(), eng.cache.v.data_ptr(), eng.tokens.data_ptr())
    assert eng.steps(s) == 3 * W + 5


def test_slot_isolation(lm):
    steps = 20
    codes = _codes(7, steps)

    def run(disturb: bool) -> tuple[torch.Tensor, torch.Tensor]:
        eng = DialogEngine(lm, max_streams=4, l1_steps=8, l2_steps=4, ring_steps=TINY["context"])
        others = [eng.open()] if disturb else []
        me = eng.open()
        eng.write_memchunk(me, 1, [9, 10])
        toks, logits = [], []
        for t in range(steps):
            if disturb and t == 3:
                others.append(eng.open())
                eng.write_memchunk(others[-1], 1, [1, 2, 3])
            if disturb and t == 6:
                eng.write_memchunk(others[0], 2, [4])
            if disturb and t == 9:
                eng.close(others.pop(0))
            if disturb and t == 12:
                others.append(eng.open())
            rows = ([me] + others) if t % 2 else (others + [me])
            i = rows.index(me)
            listen = _codes(100 + t, len(rows))
            listen[i] = codes[t]
            text, speak, lg = eng.step(rows, listen, return_logits=True)
            toks.append(torch.cat([text[i:i + 1], speak[i]]))
            logits.append(lg[i])
        return torch.stack(toks), torch.stack(logits)

    alone, alone_logits = run(False)
    crowded, crowded_logits = run(True)
    assert torch.equal(alone, crowded)
    torch.testing.assert_close(alone_logits, crowded_logits, atol=1e-5, rtol=1e-5)


def test_pool_open_close_and_input_checks(lm):
    eng = DialogEngine(lm, max_streams=2, l1_steps=8, l2_steps=4, ring_steps=16)
    a, b = eng.open(), eng.open()
    with pytest.raises(NoFreeSlotError, match="no free stream slot"):
        eng.open()
    eng.close(a)
    with pytest.raises(KeyError, match="not open"):
        eng.step([a], _codes(0, 1))
    c = eng.open()
    assert c == a and eng.steps(c) == 0
    with pytest.raises(ValueError, match="listen_codes must be"):
        eng.step([b], _codes(0, 2))
    with pytest.raises(ValueError, match="listen codes must be in"):
        eng.step([b], torch.full((1, N_LISTEN), TINY["card"]))
    with pytest.raises(ValueError, match="once per tick"):
        eng.step([b, b], _codes(0, 2))


def test_sampling_uses_temperature(lm):
    def run(seed: int, temperature: float) -> torch.Tensor:
        torch.manual_seed(seed)
        eng = DialogEngine(lm, max_streams=1, l1_steps=8, l2_steps=4, ring_steps=16, temperature=temperature)
        s = eng.open()
        codes = _codes(2, 12)
        return torch.stack([torch.cat([x[0:1], y[0]]) for x, y in (eng.step([s], codes[t:t + 1]) for t in range(12))])

    assert torch.equal(run(0, 0.0), run(1, 0.0))  # greedy ignores the RNG
    a, b = run(0, 1.0), run(1, 1.0)
    assert not torch.equal(a, b) and torch.equal(a, run(0, 1.0))
    assert int(a[1:, 1:].max()) < TINY["card"] and int(a[1:, 0].max()) < TINY["text_card"]


def _wait_or_word(p_pad: float, p_words: tuple[float, ...], n: int = 4000) -> tuple[torch.Tensor, int]:
    """`n` rows of text logits: the pad at `p_pad`, ids 10, 11, ... at `p_words`, the rest ~0."""
    logits = torch.full((n, 1, 1, TINY["text_card"]), -30.0)
    logits[..., 3] = torch.tensor(p_pad).log()
    for i, p in enumerate(p_words):
        logits[..., 10 + i] = torch.tensor(p).log()
    return logits, 3


def test_start_temperature_keeps_the_odds_of_starting_and_sharpens_the_word():
    """sample_text with start_temperature: on a silent channel, wait-or-start drawn at its own temperature (1: the
    model's odds), the word at `temperature` among the words; one temperature over all would all but never
    start. A channel mid-reply keeps the one draw."""
    logits, pad = _wait_or_word(0.8, (0.15, 0.05))
    torch.manual_seed(0)
    one = sample_text(logits, pad, 0.5, 25)[..., 0, 0]
    assert (one != pad).float().mean() < 0.06  # 0.2 to speak, squared: 0.025 / 0.665 = 3.8 %
    two = sample_text(logits, pad, 0.5, 25, start_temperature=1.0)[..., 0, 0]
    assert abs((two != pad).float().mean() - 0.2) < 0.03
    words = two[two != pad]
    assert set(words.tolist()) <= {10, 11} and abs((words == 10).float().mean() - 0.9) < 0.05  # 0.15² : 0.05²
    greedy_words = sample_text(logits, pad, 0.0, 25, start_temperature=1.0)[..., 0, 0]
    assert set(greedy_words[greedy_words != pad].tolist()) == {10} and (greedy_words != pad).any()
    silent = torch.arange(len(logits))[:, None, None] % 2 == 0  # odd rows are mid-reply: plain greedy (the pad)
    mixed = sample_text(logits, pad, 0.0, 25, start_temperature=1.0, silent=silent)[..., 0, 0]
    assert (mixed[1::2] == pad).all() and abs((mixed[0::2] != pad).float().mean() - 0.2) < 0.04
    # start_temperature 0: the likelier of waiting (0.4) and any word (0.6), though the pad is the top token
    logits, pad = _wait_or_word(0.4, (0.35, 0.25))
    assert (sample_text(logits, pad, 0.0, 25) == pad).all()
    assert (sample_text(logits, pad, 0.0, 25, start_temperature=0.0) == 10).all()


def test_start_floor_drops_the_unlikely_starts_and_keeps_the_likely_ones_odds():
    """start_floor: a silent channel whose chance to start is below the floor waits; above it, the draw at the
    start temperature is unchanged (the same uniforms start the same rows). A mid-reply channel is untouched."""
    u = stream_uniform(torch.full((4000,), 3), torch.arange(4000))[:, None, None]
    rare, pad = _wait_or_word(0.96, (0.04,), n=4000)  # 4 % a tick: over 50 silent ticks, 87 % open a turn
    assert abs((sample_text(rare, pad, 0.0, 25, 1.0, uniform=u) != pad).float().mean() - 0.04) < 0.01
    assert (sample_text(rare, pad, 0.0, 25, 1.0, uniform=u, start_floor=0.05) == pad).all()
    likely, pad = _wait_or_word(0.7, (0.3,), n=4000)
    plain = sample_text(likely, pad, 0.0, 25, 1.0, uniform=u)
    assert abs((plain != pad).float().mean() - 0.3) < 0.03
    assert (sample_text(likely, pad, 0.0, 25, 1.0, uniform=u, start_floor=0.05) == plain).all()
    mid_reply = torch.zeros(4000, 1, 1, dtype=torch.bool)  # no channel silent: the one greedy draw (the pad)
    rare_word, _ = _wait_or_word(0.4, (0.6,), n=4000)
    assert (sample_text(rare_word, pad, 0.0, 25, 1.0, mid_reply, u, start_floor=0.9) == 10).all()


def test_stream_uniform_draws_are_uniform_and_a_function_of_seed_and_step_only():
    steps = torch.arange(20000)
    u = stream_uniform(torch.full_like(steps, 7), steps)
    assert u.dtype == torch.float32 and 0 <= float(u.min()) and float(u.max()) < 1
    hist = torch.histc(u, bins=10, min=0, max=1) / len(u)
    assert (hist - 0.1).abs().max() < 0.01  # uniform
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.03  # next step's draw unrelated
    other = stream_uniform(torch.full_like(steps, 8), steps)
    assert (u == stream_uniform(torch.full_like(steps, 7), steps)).all() and (u != other).float().mean() > 0.99
    logits, pad = _wait_or_word(0.8, (0.15, 0.05))  # 0.2 to speak: the given uniforms decide, not torch's
    started = sample_text(logits, pad, 0.0, 25, start_temperature=1.0, uniform=u[:len(logits), None, None])
    assert ((started[..., 0, 0] != pad) == (u[:len(logits)] >= 0.8)).all()


def test_engine_draws_turn_starts_only_while_silent():
    """The engine's text head here gives the pad 0.45 and each of the 39 words 0.014 on every tick. Greedy, the
    channel never speaks. With start_temperature 0 a silent channel starts (any word: 0.55 > 0.45) and the tick
    after a word, mid-reply, keeps the plain greedy draw (the pad): word and pad alternate."""
    lm = build_lm("tiny", seed=0, **TINY)
    head = torch.nn.Linear(lm.dim, TINY["text_card"], bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[lm.text_padding_token_id] = math.log(0.45 * (TINY["text_card"] - 1) / 0.55)
    lm.text_linear = head

    def run(start: float | None) -> list[int]:
        eng = DialogEngine(lm, max_streams=1, l1_steps=8, l2_steps=4, ring_steps=16, start_temperature=start)
        s = eng.open()
        codes = _codes(2, 16)
        texts = [int(eng.step([s], codes[t:t + 1])[0][0]) for t in range(16)]
        return [t for t in texts if t != lm.ungenerated_token_id]

    pad = lm.text_padding_token_id
    assert set(run(None)) == {pad}
    started = run(0.0)
    assert len(started) >= 10 and all((t == pad) == (i % 2 == 1) for i, t in enumerate(started))
    with pytest.raises(ValueError, match="start_temperature"):
        DialogEngine(lm, max_streams=1, l1_steps=8, l2_steps=4, ring_steps=16, start_temperature=-1.0)
    # a floor above the 0.55 chance to start: the channel never opens; below it: the same alternation
    eng = DialogEngine(lm, max_streams=1, l1_steps=8, l2_steps=4, ring_steps=16, start_temperature=0.0,
                       start_floor=0.6)
    s, codes = eng.open(), _codes(2, 16)
    assert {int(eng.step([s], codes[t:t + 1])[0][0]) for t in range(16)} <= {pad, lm.ungenerated_token_id}
    with pytest.raises(ValueError, match="start_floor"):
        DialogEngine(lm, max_streams=1, l1_steps=8, l2_steps=4, ring_steps=16, start_floor=1.0)


def test_engine_refuses_non_rope_model():
    lm = build_lm("tiny", seed=0, **(TINY | {"positional_embedding": "sin"}))
    with pytest.raises(ValueError, match="RoPE"):
        DialogEngine(lm, max_streams=1, l1_steps=8, l2_steps=4, ring_steps=16)


@pytest.mark.parametrize("variant", [
    dict(depformer_pos_emb="sin", depformer_multi_linear=False),
    dict(depformer_pos_emb="rope", depformer_weights_per_step_schedule=[0, 0, 1, 1, 2, 2, 3, 3]),
    dict(kv_repeat=2),  # grouped KV heads in both transformers
])
def test_depformer_matches_moshi_depformer_step(variant):
    """The engine's depth transformer equals moshi's streaming one (what LMGen runs) on other layouts too."""
    lm = build_lm("tiny", seed=1, **(TINY | variant))
    eng = DialogEngine(lm, max_streams=1, l1_steps=4, l2_steps=4, ring_steps=16)
    gen = LMGen(lm, use_sampling=False)
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, TINY["text_card"], (3,), generator=g)
    out = torch.randn(3, 1, TINY["dim"], generator=g)
    with torch.no_grad(), no_compile():
        want = gen.depformer_step(text, out)
        got = eng._depformer(text, out)
    assert torch.equal(got, want)


def test_grouped_kv_heads_parity_with_lmgen():
    lm = build_lm("tiny", seed=2, **(TINY | dict(kv_repeat=2)))
    codes = _codes(5, 12)
    want = _lmgen_outputs(lm, codes)
    eng = DialogEngine(lm, max_streams=1, l1_steps=0, l2_steps=0, ring_steps=TINY["context"])
    s = eng.open()
    got = [torch.cat([t, a[0]]) for t, a in (eng.step([s], codes[i:i + 1]) for i in range(12))][eng.max_delay:]
    assert torch.equal(torch.stack(got), want)


def test_past_the_ring_chunk_sits_right_before_the_oldest_step():
    """One layer: ring K/V depend only on their own step, so past the ring the engine must equal a plain
    forward over [L1 ; L2 ; the last W dialog inputs] -- the chunk at the virtual positions just before
    the oldest ring step. (More layers would carry the forgotten history inside the ring's K/V.)"""
    lm = build_lm("tiny", seed=3, **(TINY | dict(num_layers=1)))
    W, n1, n2 = 12, 8, 4
    eng = DialogEngine(lm, max_streams=1, l1_steps=n1, l2_steps=n2, ring_steps=W)
    s = eng.open()
    eng.write_memchunk(s, 1, [4, 5, 6])
    eng.write_memchunk(s, 2, [7])
    chunk = torch.cat([_chunk_inputs(lm, [4, 5, 6], n1), _chunk_inputs(lm, [7], n2)], dim=1)  # [K, 12]
    codes = _codes(8, 3 * W)
    fed = []
    for t in range(3 * W):
        _, _, lg = eng.step([s], codes[t:t + 1], return_logits=True)
        fed.append(eng.last_inputs[0])
        if t in (W - 1, W + 3, 2 * W + 5, 3 * W - 1):
            seq = torch.cat([chunk] + fed[max(0, t + 1 - W):], dim=1)[None]  # [1, K, 12 + min(t + 1, W)]
            with torch.no_grad(), no_compile():
                _, ref = lm.forward_text(seq)
            torch.testing.assert_close(lg[0], ref[0, 0, -1], atol=2e-5, rtol=2e-5)


def test_step_all_with_an_exec_mask_equals_step_on_those_slots(lm):
    """The fixed-shape tick (every slot computed, an exec mask says which step) gives the executed slots
    exactly what `step` gives them, and leaves the other slots' cache, tokens and step count as they were."""
    codes = _codes(7, 10)  # [T, 8]
    engines = [DialogEngine(lm, max_streams=4, l1_steps=16, l2_steps=8, ring_steps=6) for _ in range(2)]
    for eng in engines:
        for _ in range(3):
            eng.open()
        eng.write_memchunk(2, 1, [7, 8, 9])
    narrow, fixed = engines
    mask = torch.tensor([True, False, True, False])
    for t in range(10):  # past the ring: wrap-around included
        text, audio = narrow.step([0, 2], torch.stack([codes[t], codes[(t + 3) % 10]]))
        full = torch.zeros(4, 8, dtype=torch.long)
        full[0], full[2] = codes[t], codes[(t + 3) % 10]
        text_all, audio_all = fixed.step_all(full, mask)
        assert torch.equal(text_all[[0, 2]], text) and torch.equal(audio_all[[0, 2]], audio)
        assert (text_all[[1, 3]] == lm.ungenerated_token_id).all() and (audio_all[[1, 3]] == lm.ungenerated_token_id).all()
    assert narrow.cache.steps.tolist() == fixed.cache.steps.tolist() == [10, 0, 10, 0]
    assert torch.equal(narrow.tokens, fixed.tokens)
    torch.testing.assert_close(fixed.cache.k, narrow.cache.k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fixed.cache.v, narrow.cache.v, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="all slots"):
        fixed.step_all(codes[:2], mask[:2])


def test_the_fixed_shape_tick_serves_what_the_narrow_tick_serves(lm):
    """`tick` on CUDA takes the fixed-shape path (`fixed_shape_tick`); forced on here, it answers the named
    slots exactly as the CPU path does, and checks its input on the host the same way."""
    narrow = DialogEngine(lm, max_streams=5, l1_steps=16, l2_steps=8, ring_steps=6, fixed_shape_tick=False)
    fixed = DialogEngine(lm, max_streams=5, l1_steps=16, l2_steps=8, ring_steps=6, fixed_shape_tick=True)
    for eng in (narrow, fixed):
        for _ in range(4):
            eng.open()
        eng.write_memchunk(3, 2, [1, 2, 3])
    codes = _codes(11, 8)
    for t in range(8):
        slots = [3, 1] if t % 2 else [0, 3, 1]
        listen = codes[[(t + j) % 8 for j in range(len(slots))]]
        for a, b in zip(narrow.tick(slots, listen), fixed.tick(slots, listen)):
            assert torch.equal(a, b)
    assert narrow.cache.steps.tolist() == fixed.cache.steps.tolist() == [4, 8, 0, 8, 0]
    with pytest.raises(ValueError, match="listen codes must be in"):
        fixed.tick([0], torch.full((1, 8), TINY["card"]))
    with pytest.raises(KeyError, match="not open"):
        fixed.tick([4], codes[:1])


def test_an_fp8_kv_cache_keeps_the_logits_close(lm):
    """`kv_dtype=float8_e4m3fn` stores K/V in half the bytes of bf16 (a quarter of fp32); the logits stay
    within 0.1 of their own standard deviation of the full-precision cache's (measured: 0.05-0.08 here)."""
    codes = _codes(5, 12)
    runs, inputs = [], []
    for kv_dtype in (None, torch.float8_e4m3fn):
        eng = DialogEngine(lm, max_streams=2, l1_steps=16, l2_steps=8, ring_steps=6, kv_dtype=kv_dtype)
        a, b = eng.open(), eng.open()
        eng.write_memchunk(b, 1, [3, 4, 5, 6])
        logits, fed = [], []
        for t in range(12):
            logits.append(eng.step([a, b], torch.stack([codes[t], codes[-t]]), return_logits=True)[2])
            fed.append(eng.last_inputs.clone())
        runs.append(torch.stack(logits))
        inputs.append(torch.stack(fed))
        assert eng.cache.k.dtype == (kv_dtype or torch.float32)
    full, fp8 = runs
    # the ticks before the two runs' own greedy tokens (fed back as input) part ways
    same = next((t for t in range(12) if not torch.equal(inputs[0][t], inputs[1][t])), 12)
    assert same >= 3, same
    rel = torch.stack([(fp8[t] - full[t]).abs().max() / full[t].std() for t in range(same)])
    assert (rel > 0).all() and (rel < 0.1).all(), rel  # fp8 differs (it is not silently fp32) but stays close


def test_a_kv_cache_too_large_for_its_device_says_what_to_change():
    """At Moshi-7B shape (32 layers, 32 KV heads, 3,000 steps, head dim 128) a bf16 slot holds 1.46 GiB of K
    and V: 128 slots need 188 GiB, more than an H200 holds; the error names the slots that fit and the knobs."""
    shape = (32, 128, 32, 3000, 128)
    check_fits(shape, torch.bfloat16, 200 * 2**30, "cuda:0")  # fits: no error
    with pytest.raises(KVCacheTooLarge) as e:
        check_fits(shape, torch.bfloat16, 120 * 2**30, "cuda:0")
    msg = str(e.value)
    assert "187.5 GiB" in msg and "1.46 GiB" in msg and "at most 81 fit" in msg
    assert "dialog.max_streams" in msg and 'kv_cache_dtype = "fp8"' in msg and "dialog.ring_steps" in msg
    check_fits(shape, torch.float8_e4m3fn, 120 * 2**30, "cuda:0")  # fp8: half the bytes, 94 GiB fit
