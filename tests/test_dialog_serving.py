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
    assert pool.engine.cache.l1_len[slot] == 16 and not pool.is_open(2)
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
