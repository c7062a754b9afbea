"""DialogEngine proofs: parity with moshi's LMGen, MemChunk semantics, long streams, slot isolation."""

from __future__ import annotations

import gc

import pytest
import torch
from moshi.models.lm import LMGen
from moshi.utils.compile import no_compile

from egomem.dialog import DialogEngine, NoFreeSlotError
from egomem.dialog.checkpoint import build_lm

TINY = dict(dim=64, num_heads=2, num_layers=2, card=32, text_card=40, context=32, depformer_dim=32,
            depformer_dim_feedforward=64, depformer_num_heads=2, depformer_num_layers=1)
N_LISTEN = 8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread avoids spin-wait contention on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    eng = DialogEngine(lm, max_streams=4, l1_steps=8, l2_steps=4, ring_steps=TINY["context"])
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


@pytest.mark.parametrize("levels", ["l1", "l1+l2", "l2"])
def test_memchunk_logits_equal_full_sequence_forward(lm, levels):
    n1, n2, steps = 12, 6, 14
    eng = DialogEngine(lm, max_streams=3, l1_steps=n1, l2_steps=n2, ring_steps=TINY["context"])
    neighbour, slot = eng.open(), eng.open()
    l1, l2 = [5, 6, 7, 8, 9], [11, 12, 13]
    prefix = []
    if "l1" in levels:
        eng.write_memchunk(slot, 1, l1)
        prefix.append(_chunk_inputs(lm, l1, n1))
    if "l2" in levels:
        eng.write_memchunk(slot, 2, l2)
        prefix.append(_chunk_inputs(lm, l2, n2))
    eng.write_memchunk(neighbour, 1, [1, 2, 3])
    codes = _codes(3, steps)
    fed, logits = [], []
    for t in range(steps):
        _, _, lg = eng.step([neighbour, slot], torch.stack([codes[(t + 5) % steps], codes[t]]), return_logits=True)
        fed.append(eng.last_inputs[1])  # [K, 1]
        logits.append(lg[1])
    seq = torch.cat(prefix + fed, dim=1)[None]  # [1, K, chunk + steps]: [L1 ; L2 ; dialog]
    with torch.no_grad(), no_compile():
        _, ref = lm.forward_text(seq)  # plain full-sequence forward, teacher-forced
    c = seq.shape[2] - steps
    torch.testing.assert_close(torch.stack(logits), ref[0, 0, c:], atol=2e-5, rtol=2e-5)


def test_memchunk_changes_output_and_l1_clears_l2(lm):
    eng = DialogEngine(lm, max_streams=2, l1_steps=8, l2_steps=4, ring_steps=16)
    a, b = eng.open(), eng.open()
    eng.write_memchunk(b, 1, [20, 21, 22])
    eng.write_memchunk(b, 2, [30])
    assert (eng.cache.l1_len[b], eng.cache.l2_len[b]) == (8, 4)  # full length: tokens then text-pad
    _, _, lg = eng.step([a, b], _codes(1, 1).expand(2, -1), return_logits=True)
    assert (lg[0] - lg[1]).abs().max() > 1e-3  # the chunk is attended
    eng.write_memchunk(b, 1, [23])
    assert (eng.cache.l1_len[b], eng.cache.l2_len[b]) == (8, 0)


def test_memchunk_refuses_bad_tokens(lm):
    eng = DialogEngine(lm, max_streams=1, l1_steps=8, l2_steps=4, ring_steps=16)
    s = eng.open()
    with pytest.raises(ValueError, match="holds 4 steps"):
        eng.write_memchunk(s, 2, list(range(5)))
    with pytest.raises(ValueError, match="level must be 1"):
        eng.write_memchunk(s, 3, [1])
    with pytest.raises(ValueError, match=r"\[0, 40\)"):
        eng.write_memchunk(s, 1, [40])
    assert eng.cache.l2_len[s] == 0 and eng.cache.l1_len[s] == 0


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
    eng = DialogEngine(lm, max_streams=1, l1_steps=4, l2_steps=4, ring_steps=TINY["context"])
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
