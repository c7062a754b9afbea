"""The two production paths of each kernel (Triton, interpreted on CPU, and PyTorch) against each other
and against the naive references beside the kernels (`egomem.kernels.reference`).

TRITON_INTERPRET must be set before triton's first import, so it is set at import of this module
(egomem.kernels imports its triton modules lazily for this reason).
"""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels below

import pytest
import torch

from egomem.kernels.reference import decode_attention_reference, memchunk_write_reference
from egomem.kernels.rope import rope_rotate

da_mod = importlib.import_module("egomem.kernels.decode_attention")
mw_mod = importlib.import_module("egomem.kernels.memchunk_write")


def _interpreted(mod, kernel_name: str):
    """The kernel module, checked to run under the interpreter (triton must not be imported earlier)."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(getattr(mod, kernel_name), InterpretedFunction):
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; run this module alone "
                           "or keep triton imports lazy (egomem.kernels imports kernel modules on first use)")
    return mod


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy noise inside the interpreter

da = _interpreted(da_mod, "_decode_attention_kernel")
mw = _interpreted(mw_mod, "_memchunk_write_kernel")

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def _inputs(B, S, H, Hkv, D, n1, n2, W, dtype, chunk: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    k = torch.randn(S, Hkv, n1 + n2 + W, D, generator=g).to(dtype)
    v = torch.randn(S, Hkv, n1 + n2 + W, D, generator=g).to(dtype)
    slots = torch.randperm(S, generator=g)[:B]
    if chunk == "empty":
        l1 = torch.zeros(B, dtype=torch.int32)
        l2 = torch.zeros(B, dtype=torch.int32)
    elif chunk == "full":
        l1 = torch.full((B,), n1, dtype=torch.int32)
        l2 = torch.full((B,), n2, dtype=torch.int32)
    else:  # ragged: each row its own lengths, one row with L1 only
        l1 = torch.randint(0, n1 + 1, (B,), generator=g, dtype=torch.int32)
        l2 = torch.randint(0, n2 + 1, (B,), generator=g, dtype=torch.int32)
        l2[0] = 0
        l1[-1] = n1
    ring = torch.randint(1, W + 1, (B,), generator=g, dtype=torch.int32)
    ring[0] = W
    pos0 = torch.randint(-n1 - n2, 5000, (B,), generator=g, dtype=torch.int64)
    return q, k, v, slots, l1, l2, ring, pos0


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("chunk", ["empty", "ragged"])
def test_torch_path_matches_naive_reference(chunk, interleave):
    n1, n2, W = 12, 8, 10
    args = _inputs(3, 4, 4, 2, 32, n1, n2, W, torch.float32, chunk, seed=7)
    got = da.decode_attention(*args, n1=n1, n2=n2, interleave=interleave, impl="torch")
    want = decode_attention_reference(*args, n1=n1, n2=n2, max_period=10_000.0, interleave=interleave)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_torch_path_reads_only_what_some_row_can_see():
    """Young streams (every ring shorter than W, no L2, L1 shorter than N1): positions no row can see are
    never read. They hold NaN here, which any read would carry into the output (0 * NaN = NaN)."""
    n1, n2, W = 12, 8, 10
    q, k, v, slots, l1, _, _, pos0 = _inputs(3, 4, 4, 2, 32, n1, n2, W, torch.float32, "empty", seed=11)
    l1 = torch.tensor([0, 7, 4], dtype=torch.int32)
    l2 = torch.zeros(3, dtype=torch.int32)
    ring = torch.tensor([3, 1, 5], dtype=torch.int32)
    want = decode_attention_reference(q, k, v, slots, l1, l2, ring, pos0, n1=n1, n2=n2, max_period=10_000.0, interleave=True)
    for cache in (k, v):
        cache[:, :, 7:n1 + n2] = float("nan")  # beyond the longest L1, and all of L2
        cache[:, :, n1 + n2 + 5:] = float("nan")  # beyond the longest ring
    got = da.decode_attention(q, k, v, slots, l1, l2, ring, pos0, n1=n1, n2=n2, impl="torch")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_torch_path_reads_runs_of_slots_as_views():
    """Rows whose slots are consecutive (2, 3 then 0) are read per run; the result must not depend on it."""
    n1, n2, W = 8, 4, 6
    q, k, v, _, l1, l2, ring, pos0 = _inputs(3, 4, 2, 1, 32, n1, n2, W, torch.float32, "ragged", seed=9)
    slots = torch.tensor([2, 3, 0])
    got = da.decode_attention(q, k, v, slots, l1, l2, ring, pos0, n1=n1, n2=n2, impl="torch")
    want = decode_attention_reference(q, k, v, slots, l1, l2, ring, pos0, n1=n1, n2=n2, max_period=10_000.0, interleave=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("chunk", ["empty", "full", "ragged"])
def test_decode_attention_triton_matches_torch_path(chunk, gqa, dtype):
    Hkv, D, n1, n2, W = 2, 32, 40, 24, 48
    args = _inputs(3, 5, Hkv * gqa, Hkv, D, n1, n2, W, dtype, chunk, seed=11 + gqa)
    want = da.decode_attention(*args, n1=n1, n2=n2, impl="torch")
    got = da.decode_attention(*args, n1=n1, n2=n2, impl="triton", input_precision="ieee")
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_decode_attention_triton_concat_rope_and_group_of_three():
    """Non-interleaved RoPE halves and a GQA group (3) that is not a power of two."""
    Hkv, D, n1, n2, W = 1, 64, 16, 16, 20
    args = _inputs(2, 2, 3, Hkv, D, n1, n2, W, torch.float32, "ragged", seed=3)
    want = da.decode_attention(*args, n1=n1, n2=n2, interleave=False, max_period=500.0, impl="torch")
    got = da.decode_attention(*args, n1=n1, n2=n2, interleave=False, max_period=500.0, impl="triton")
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_chunk_is_rotated_on_read():
    """Moving the chunk's virtual position changes the output; moving it with the query does not."""
    n1, n2, W = 8, 8, 8
    q, k, v, slots, l1, l2, ring, pos0 = _inputs(2, 2, 2, 2, 32, n1, n2, W, torch.float32, "full", seed=5)
    ring = torch.zeros_like(ring) + 1
    base = da.decode_attention(q, k, v, slots, l1, l2, ring, pos0, n1=n1, n2=n2, impl="torch")
    moved = da.decode_attention(q, k, v, slots, l1, l2, ring, pos0 + 3, n1=n1, n2=n2, impl="torch")
    assert (base - moved).abs().max() > 1e-3
    # rotating q by +3 too keeps query-to-chunk distances: only the ring key (never shifted) breaks it,
    # so compare on a cache whose single ring key is zero (it then only adds a constant-logit value 0)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, n1 + n2:] = 0
    v2[:, :, n1 + n2:] = 0
    q3 = rope_rotate(q[:, :, None], torch.full((2, 1, 1), 3), 10_000.0, True)[:, :, 0]
    a = da.decode_attention(q, k2, v2, slots, l1, l2, ring, pos0, n1=n1, n2=n2, impl="torch")
    b = da.decode_attention(q3, k2, v2, slots, l1, l2, ring, pos0 + 3, n1=n1, n2=n2, impl="torch")
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.float16])
def test_memchunk_write_triton_matches_torch_path(dst_dtype):
    L, S, Hkv, T, D, N = 3, 4, 2, 90, 32, 70  # N > BLOCK_N: two blocks, the second ragged
    g = torch.Generator().manual_seed(1)
    src_k, src_v = torch.randn(2, L, Hkv, N, D, generator=g).unbind(0)
    dst = torch.randn(2, L, S, Hkv, T, D, generator=g).to(dst_dtype)
    want_k, want_v = dst[0].clone(), dst[1].clone()
    got_k, got_v = dst[0].clone(), dst[1].clone()
    mw.memchunk_write(src_k, src_v, want_k, want_v, slot=2, start=12, impl="torch")
    mw.memchunk_write(src_k, src_v, got_k, got_v, slot=2, start=12, impl="triton")
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert torch.equal(got_k[:, :2], dst[0][:, :2]) and torch.equal(got_k[:, 2, :, :12], dst[0][:, 2, :, :12])
    torch.testing.assert_close(got_k[:, 2, :, 12:82].float(), src_k, **TOL[dst_dtype])


def test_memchunk_write_torch_path_matches_naive_reference():
    L, S, Hkv, T, D, N = 2, 3, 2, 20, 8, 6
    g = torch.Generator().manual_seed(2)
    src_k, src_v = torch.randn(2, L, Hkv, N, D, generator=g).unbind(0)
    dst_k, dst_v = torch.randn(2, L, S, Hkv, T, D, generator=g).to(torch.float16).unbind(0)
    want_k, want_v = memchunk_write_reference(src_k, src_v, dst_k, dst_v, slot=1, start=5)
    got_k, got_v = dst_k.clone(), dst_v.clone()
    mw.memchunk_write(src_k, src_v, got_k, got_v, slot=1, start=5, impl="torch")
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_memchunk_write_refuses_overflow():
    src = torch.zeros(1, 1, 10, 32)
    dst = torch.zeros(1, 2, 1, 16, 32)
    with pytest.raises(IndexError, match="does not fit"):
        mw.memchunk_write(src, src, dst, dst.clone(), slot=0, start=8, impl="torch")
    with pytest.raises(IndexError, match="slot 5"):
        mw.memchunk_write(src, src, dst, dst.clone(), slot=5, start=0, impl="torch")


def test_engine_runs_the_triton_kernels():
    """The same engine code with kernels='triton' (interpreted here) gives the PyTorch path's logits."""
    from egomem.dialog import DialogEngine
    from egomem.dialog.checkpoint import build_lm

    lm = build_lm("tiny", seed=0, dim=64, num_heads=2, num_layers=2, card=32, text_card=40, context=32,
                  depformer_dim=32, depformer_dim_feedforward=64, depformer_num_heads=2, depformer_num_layers=1)
    codes = torch.randint(0, 32, (6, 2, 8), generator=torch.Generator().manual_seed(0))
    runs = []
    for impl in ("torch", "triton"):
        eng = DialogEngine(lm, max_streams=3, l1_steps=8, l2_steps=4, ring_steps=4, kernels=impl)
        a, b = eng.open(), eng.open()
        eng.write_memchunk(b, 1, [5, 6])
        eng.write_memchunk(b, 2, [7])
        runs.append(torch.stack([eng.step([a, b], codes[t], return_logits=True)[2] for t in range(6)]))
    torch.testing.assert_close(runs[1], runs[0], atol=1e-4, rtol=1e-4)


class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any op that hands a tensor's value to the host (`.item()`, `int(t)`, `.tolist()`) or whose
    output shape depends on values (`nonzero`, boolean-mask indexing): what a CUDA graph cannot capture."""

    SYNCING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default, torch.ops.aten.equal.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCING:
            raise AssertionError(f"host sync in the step: {func}")
        return func(*args, **(kwargs or {}))


def test_the_fixed_shape_engine_step_never_syncs_with_the_host():
    """`step_all` with the Triton kernels (what runs on CUDA; interpreted here) reads no tensor value on
    the host, so its tick can be captured in a CUDA graph. The narrow `step` path does sync (its checks
    and the CPU attention's spans), which the mode must catch, or it would prove nothing."""
    from egomem.dialog import DialogEngine
    from egomem.dialog.checkpoint import build_lm

    lm = build_lm("tiny", seed=0, dim=64, num_heads=2, num_layers=2, card=32, text_card=40, context=32,
                  depformer_dim=32, depformer_dim_feedforward=64, depformer_num_heads=2, depformer_num_layers=1)
    eng = DialogEngine(lm, max_streams=3, l1_steps=8, l2_steps=4, ring_steps=4, kernels="triton")
    a, b = eng.open(), eng.open()
    eng.write_memchunk(b, 1, [5, 6])
    codes = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([True, True, False])
    with _NoHostSync():
        for _ in range(6):
            eng._step_all(codes, mask)
    assert eng.cache.steps.tolist() == [6, 6, 0]
    with pytest.raises(AssertionError, match="host sync"), _NoHostSync():
        eng.step([a, b], codes[:2])


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("chunk", ["empty", "ragged"])
def test_split_kv_decode_attention_matches_one_program(chunk, splits):
    """Flash-decoding: each (row, kv head) read by several programs whose partial softmax states are merged
    gives the single-program result -- with shares that are empty, partial or past a region's end."""
    Hkv, D, n1, n2, W = 2, 32, 40, 24, 100
    args = _inputs(3, 5, Hkv * 2, Hkv, D, n1, n2, W, torch.float32, chunk, seed=21 + splits)
    want = da.decode_attention(*args, n1=n1, n2=n2, impl="triton", input_precision="ieee", num_splits=1)
    got = da.decode_attention(*args, n1=n1, n2=n2, impl="triton", input_precision="ieee", num_splits=splits)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    ref = decode_attention_reference(*args, n1=n1, n2=n2, max_period=10_000.0, interleave=True)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


def test_default_splits_fill_the_gpu_only_when_rows_do_not():
    sms = 132  # an H100 SXM
    assert da.default_splits(1 * 32, 3000, sms) == 9  # one 7B stream: 32 kv heads x 9 splits >= 2 x 132
    assert da.default_splits(4 * 8, 3000, sms) == 9
    assert da.default_splits(2 * 8, 3000, sms) == 11  # capped by one split per 256 cache steps
    assert da.default_splits(64 * 32, 3000, sms) == 1  # a full batch fills the GPU by itself
    assert da.default_splits(1, 100, sms) == 1  # a short cache is never split


def test_fp8_caches_are_read_by_both_paths_as_their_upcast_values():
    """An fp8 KV cache (a storage format): the Triton kernel and the PyTorch path attend exactly what the
    reference attends over the upcast values; memchunk_write casts into an fp8 cache."""
    Hkv, D, n1, n2, W = 2, 32, 16, 8, 40
    q, k, v, slots, l1, l2, ring, pos0 = _inputs(3, 4, 4, Hkv, D, n1, n2, W, torch.float32, "ragged", seed=5)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    want = decode_attention_reference(q, k8.float(), v8.float(), slots, l1, l2, ring, pos0, n1=n1, n2=n2)
    for impl, splits in (("torch", None), ("triton", 1), ("triton", 3)):
        got = da.decode_attention(q, k8, v8, slots, l1, l2, ring, pos0, n1=n1, n2=n2, impl=impl, num_splits=splits)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    src = torch.randn(2, Hkv, n1, D)
    for impl in ("torch", "triton"):
        dk = torch.zeros(2, 4, Hkv, n1 + n2 + W, D, dtype=torch.float8_e4m3fn)
        dv = torch.zeros_like(dk)
        mw.memchunk_write(src, src, dk, dv, 1, 0, impl=impl)
        assert torch.equal(dk[:, 1, :, :n1].view(torch.uint8), src.to(torch.float8_e4m3fn).view(torch.uint8))


def test_an_fp8_cache_is_upcast_to_the_queries_half_dtype_not_to_fp32():
    """With half-precision queries (a bf16 model on the GPU) the kernel upcasts fp8 K/V to the queries'
    dtype, so its dots stay on tensor cores (upcast to fp32, "ieee" dots ran 12x slower on an H200): it
    answers exactly what it answers over a half cache holding the same values. fp16 stands in for bf16
    here: the Triton interpreter miscomputes bf16 dots (a bf16 cache is off by ~1e8 under it; on the
    H200 the compiled bf16 kernel is within 0.004 of the reference, bench/results/gpu/kernels.json)."""
    Hkv, D, n1, n2, W = 2, 32, 16, 8, 40
    q, k, v, slots, l1, l2, ring, pos0 = _inputs(3, 4, 4, Hkv, D, n1, n2, W, torch.float32, "ragged", seed=6)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    want = decode_attention_reference(q.half().float(), k8.float(), v8.float(), slots, l1, l2, ring, pos0,
                                      n1=n1, n2=n2)
    for splits in (1, 3):
        got = da.decode_attention(q.half(), k8, v8, slots, l1, l2, ring, pos0, n1=n1, n2=n2, impl="triton",
                                  num_splits=splits)
        over_half = da.decode_attention(q.half(), k8.half(), v8.half(), slots, l1, l2, ring, pos0, n1=n1, n2=n2,
                                        impl="triton", num_splits=splits)
        assert got.dtype == torch.float16 and torch.equal(got, over_half)
        torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)
