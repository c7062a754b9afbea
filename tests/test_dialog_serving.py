"""dialog_lm: the stream pool in-process, then the same model through a real tritonserver."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from egomem.config import DialogConfig
from egomem.dialog import DialogEngine
from egomem.dialog.checkpoint import build_lm
from egomem.dialog.serving import DialogRequest, DialogResult, DialogStreamPool, StreamError, build_engine
from egomem.dialog.tokenizer import ByteTokenizer

TINY = dict(dim=64, num_heads=2, num_layers=2, card=32, text_card=260, context=32, depformer_dim=32,
            depformer_dim_feedforward=64, depformer_num_heads=2, depformer_num_layers=1)


@pytest.fixture()
def pool():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors on a shared 2-core box
    lm = build_lm("tiny", seed=0, **TINY)
    yield DialogStreamPool(DialogEngine(lm, 2, l1_steps=16, l2_steps=8, ring_steps=16), ByteTokenizer(), ttl_s=600)
    torch.set_num_threads(before)


def listen(seed: int, card: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, card, 8).astype(np.int64)


def test_pool_serves_refreshes_and_frees(pool):
    res = pool.serve([DialogRequest(1, start=True, listen=listen(0)), DialogRequest(2, start=True, listen=listen(1))])
    assert all(isinstance(r, DialogResult) and r.step == 1 and r.text_token == -2 for r in res)
    res = pool.serve([DialogRequest(3, start=True, listen=listen(2))])
    assert isinstance(res[0], StreamError) and "no free stream slot" in str(res[0])
    slot = pool._slots[1]
    res = pool.serve([DialogRequest(1, listen=listen(3), memchunk_level=1, memchunk_text="Ada likes tea"),
                      DialogRequest(2, listen=listen(4), end=True)])
    assert all(isinstance(r, DialogResult) for r in res) and res[0].speak_codes.shape == (8,)
    empty_k = pool.engine.empty_chunks[0]  # [L, Hkv, 16 + 8, D]: what open() put in the slot
    assert not torch.equal(pool.engine.cache.k[:, slot, :, :16], empty_k[:, :, :16])  # the refresh wrote L1
    assert not pool.is_open(2)
    res = pool.serve([DialogRequest(3, start=True, listen=listen(5))])  # END freed a slot
    assert isinstance(res[0], DialogResult) and res[0].step == 1


def test_pool_refuses_bad_requests_and_serves_the_rest(pool):
    pool.serve([DialogRequest(1, start=True, listen=listen(0))])
    bad = [
        DialogRequest(9, listen=listen(1)),  # never started
        DialogRequest(1, listen=np.zeros(5, np.int64)),  # wrong shape
    ]
    res = pool.serve(bad)
    assert "START" in str(res[0]) and "8 codes" in str(res[1])
    res = pool.serve([DialogRequest(1, listen=listen(2), memchunk_level=2, memchunk_text="x" * 9)])
    assert isinstance(res[0], StreamError) and "holds 8 steps" in str(res[0])
    res = pool.serve([DialogRequest(1, listen=listen(3), memchunk_level=3, memchunk_tokens=np.array([5]))])
    assert isinstance(res[0], StreamError) and "level must be 1" in str(res[0])
    res = pool.serve([DialogRequest(1, listen=listen(4), memchunk_tokens=np.array([5]))])
    assert isinstance(res[0], StreamError) and "MEMCHUNK_LEVEL" in str(res[0])
    res = pool.serve([DialogRequest(1, listen=np.full(8, 99, np.int64)),
                      DialogRequest(1, listen=listen(5))])  # a bad row beside a good one
    assert isinstance(res[0], StreamError) and isinstance(res[1], DialogResult) and res[1].step == 2


def test_pool_ttl_reclaims_idle_streams(pool):
    pool.ttl_s = 0.05
    pool.serve([DialogRequest(1, start=True, listen=listen(0)), DialogRequest(2, start=True, listen=listen(1))])
    threading.Event().wait(0.1)
    res = pool.serve([DialogRequest(3, start=True, listen=listen(2))])  # both idle ones reclaimed first
    assert isinstance(res[0], DialogResult) and pool.open_streams == 1


def test_build_engine_from_config_checks_tokenizer(tmp_path):
    cfg = DialogConfig(max_streams=1, l1_steps=4, l2_steps=4, ring_steps=8, tokenizer=tmp_path / "nope.model")
    with pytest.raises(FileNotFoundError, match="nope.model"):
        build_engine(cfg, "cpu")


# -- through the real tritonserver --------------------------------------------------------------

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402


@pytest.fixture(scope="module")
def dialog(triton):
    triton.load("dialog_lm")
    return triton.client()


def tick(client, stream, codes, start=False, end=False, level=None, text=None, tokens=None):
    inputs = [grpcclient.InferInput("LISTEN_CODES", [1, len(codes)], "INT64")]
    inputs[0].set_data_from_numpy(np.asarray(codes, np.int64)[None])
    if level is not None:
        inputs.append(grpcclient.InferInput("MEMCHUNK_LEVEL", [1, 1], "INT32"))
        inputs[-1].set_data_from_numpy(np.array([[level]], np.int32))
    if text is not None:
        inputs.append(grpcclient.InferInput("MEMCHUNK_TEXT", [1, 1], "BYTES"))
        inputs[-1].set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
    if tokens is not None:
        inputs.append(grpcclient.InferInput("MEMCHUNK_TOKENS", [1, len(tokens)], "INT64"))
        inputs[-1].set_data_from_numpy(np.asarray(tokens, np.int64)[None])
    r = client.infer("dialog_lm", inputs, sequence_id=stream, sequence_start=start, sequence_end=end)
    return int(r.as_numpy("TEXT_TOKEN")[0, 0]), r.as_numpy("SPEAK_CODES")[0], int(r.as_numpy("STEP")[0, 0])


def test_served_streams_refresh_end_and_bad_inputs(dialog):
    card = 2048  # the tiny preset's Mimi codebook size
    steps = 6
    a = [listen(10 + t, card) for t in range(steps)]
    b = [listen(20 + t, card) for t in range(steps)]
    out_a, out_b = [], []
    pool = ThreadPoolExecutor(2)
    for t in range(steps):  # two concurrent sequences, a refresh mid-stream on one of them
        fa = pool.submit(tick, dialog, 901, a[t], start=t == 0, level=1 if t == 3 else None,
                         text="Ada, 34, likes green tea" if t == 3 else None)
        fb = pool.submit(tick, dialog, 902, b[t], start=t == 0)
        out_a.append(fa.result()), out_b.append(fb.result())
        if t == 4:
            with pytest.raises(InferenceServerException, match="holds 256 steps"):
                tick(dialog, 902, b[t], level=2, tokens=[5] * 300)
            with pytest.raises(InferenceServerException, match="LISTEN_CODES must be in"):
                tick(dialog, 902, np.full(8, card, np.int64))
    assert [s for _, _, s in out_a] == list(range(1, steps + 1))
    assert [s for _, _, s in out_b] == list(range(1, steps + 1))  # refused requests did not step b
    assert out_a[0][0] == -2 and 0 <= out_a[-1][0] < 260 and ((out_a[-1][1] >= 0) & (out_a[-1][1] < card)).all()
    tick(dialog, 901, a[0], end=True)
    with pytest.raises(InferenceServerException, match="START"):
        tick(dialog, 901, a[0])  # END freed it
    # a fresh sequence replays b's inputs and gets b's outputs: the pool and its neighbours left no trace
    replay = [tick(dialog, 903, b[t], start=t == 0, end=t == steps - 1) for t in range(steps)]
    for (t1, s1, _), (t2, s2, _) in zip(out_b, replay):
        assert t1 == t2 and np.array_equal(s1, s2)
    tick(dialog, 902, b[0], end=True)
    pool.shutdown()


def cohort_tick(client, cohort_id: int, streams: list[int], flags: list[int], codes: list[np.ndarray],
                refresh: dict[int, tuple[int, str]] | None = None):
    """One cohort request: row r is streams[r]; `refresh` maps a row to its (MemChunk level, text).
    Returns per row (text token, speak codes, step) or the row's error."""
    arrays = {"COHORT_STREAMS": np.asarray(streams, np.int64), "COHORT_FLAGS": np.asarray(flags, np.int32),
              "COHORT_LISTEN_CODES": np.stack(codes).astype(np.int64)}
    if refresh:
        arrays["COHORT_MEMCHUNK_LEVEL"] = np.array([refresh.get(r, (0, ""))[0] for r in range(len(streams))], np.int32)
        arrays["COHORT_MEMCHUNK_TEXT"] = np.array([refresh.get(r, (0, ""))[1].encode() for r in range(len(streams))],
                                                  dtype=np.object_)
    inputs = []
    for name, a in arrays.items():
        dtype = {np.int64: "INT64", np.int32: "INT32", np.object_: "BYTES"}[a.dtype.type]
        inputs.append(grpcclient.InferInput(name, [1, *a.shape], dtype))
        inputs[-1].set_data_from_numpy(a[None])
    r = client.infer("dialog_lm", inputs, sequence_id=cohort_id, sequence_start=True, sequence_end=True)
    token, speak, step = (r.as_numpy(n)[0] for n in ("COHORT_TEXT_TOKEN", "COHORT_SPEAK_CODES", "COHORT_STEP"))
    errors = [e.decode() for e in r.as_numpy("COHORT_ERRORS")[0]]
    return [errors[i] or (int(token[i]), speak[i], int(step[i])) for i in range(len(streams))]


def test_served_cohort_rows_match_their_streams_ticked_alone(dialog):
    card, steps = 2048, 6
    a = [listen(30 + t, card) for t in range(steps)]
    b = [listen(40 + t, card) for t in range(steps)]
    rows = []
    for t in range(steps):  # streams 911 and 912 in one cohort per tick; a profile lands in 911's L1 at t = 3
        flags = [(1 if t == 0 else 0) | (2 if t == steps - 1 else 0)] * 2
        refresh = {0: (1, "Ada, 34, likes green tea")} if t == 3 else None
        rows.append(cohort_tick(dialog, 6000 + t, [911, 912], flags, [a[t], b[t]], refresh))
    assert [r[0][2] for r in rows] == [r[1][2] for r in rows] == list(range(1, steps + 1))
    # the same inputs through plain per-stream requests give the same outputs, refresh included
    alone_a = [tick(dialog, 913, a[t], start=t == 0, end=t == steps - 1, level=1 if t == 3 else None,
                    text="Ada, 34, likes green tea" if t == 3 else None) for t in range(steps)]
    alone_b = [tick(dialog, 914, b[t], start=t == 0, end=t == steps - 1) for t in range(steps)]
    for r, (ta, sa, _), (tb, sb, _) in zip(rows, alone_a, alone_b):
        assert r[0][0] == ta and np.array_equal(r[0][1], sa)
        assert r[1][0] == tb and np.array_equal(r[1][1], sb)
    # bad rows fail alone: a stream never started, a code out of range; the good row steps
    out = cohort_tick(dialog, 6100, [915, 916, 917], [1, 0, 1], [a[0], a[0], np.full(8, card, np.int64)])
    assert out[0][2] == 1 and "START" in out[1] and "LISTEN_CODES must be in" in out[2]
    cohort_tick(dialog, 6101, [915], [2], [a[1]])
    with pytest.raises(InferenceServerException, match="COHORT_FLAGS holds 1 flags for 2 COHORT_STREAMS"):
        dialog.infer("dialog_lm", _cohort_inputs_with_flags_mismatch(), sequence_id=6102, sequence_start=True,
                     sequence_end=True)


def _cohort_inputs_with_flags_mismatch():
    streams = grpcclient.InferInput("COHORT_STREAMS", [1, 2], "INT64")
    streams.set_data_from_numpy(np.array([[918, 919]], np.int64))
    flags = grpcclient.InferInput("COHORT_FLAGS", [1, 1], "INT32")
    flags.set_data_from_numpy(np.array([[1]], np.int32))
    return [streams, flags]
