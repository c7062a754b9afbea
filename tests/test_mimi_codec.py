"""The streaming Mimi codec: in-process pool semantics, then the same through a real tritonserver."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from egomem.codec.mimi import (
    CARDINALITY,
    FRAME_SAMPLES,
    CodecRequest,
    MimiStreamPool,
    StreamError,
    build_mimi,
    serve_codec_batch,
)
from egomem.config import MimiConfig

STEPS = 6


SPEECH = sorted((Path(__file__).parent / "data" / "identity").glob("*.flac"))  # LibriSpeech (ATTRIBUTION.md)


@functools.cache
def _speech(i: int) -> np.ndarray:
    from egomem.trigger.synth import load_24k

    return load_24k(SPEECH[i % len(SPEECH)])


def frames(seed: int, n: int = STEPS) -> np.ndarray:
    """n frames [n, 1920] of real speech: a seeded utterance and offset (the codec is trained on speech)."""
    rng = np.random.default_rng(seed)
    x = _speech(seed)
    a = int(rng.integers(0, len(x) - n * FRAME_SAMPLES))
    return (x[a:a + n * FRAME_SAMPLES] * 0.5).reshape(n, FRAME_SAMPLES).astype(np.float32)


@pytest.fixture(scope="module")
def pool() -> MimiStreamPool:
    return MimiStreamPool(build_mimi(MimiConfig()), max_streams=4)


def run_alone(pool: MimiStreamPool, stream: int, x: np.ndarray) -> np.ndarray:
    pool.open(stream)
    out = np.stack([pool.encode([stream], f[None])[0] for f in x])
    pool.close(stream)
    return out


def test_random_init_is_seeded_and_codes_vary(pool):
    a = run_alone(pool, 1, frames(0))
    other = MimiStreamPool(build_mimi(MimiConfig()), max_streams=2)
    b = run_alone(other, 1, frames(0))
    np.testing.assert_array_equal(a, b)  # every process builds the same codec
    assert a.shape == (STEPS, 8) and a.dtype == np.int64
    assert len({tuple(r) for r in a}) > 1, "codes should change with the input"
    assert a.min() >= 0 and a.max() < CARDINALITY


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Share of equal codes. Rows run in batches of different sizes round differently (BLAS picks its
    kernel by shape), and a latent on the edge between two centroids then flips its code; a state or
    input mix-up instead makes the codes unrelated (agreement ~ 1/2048)."""
    return float((np.asarray(a) == np.asarray(b)).mean())


def test_streams_are_isolated_in_process(pool):
    """A stream's codes do not depend on its neighbours' audio or on them opening mid-way (exactly:
    both runs of each stream run at the same row count, with the neighbour's row masked out)."""
    x0, x1 = frames(1), frames(2)
    alone0 = run_alone(pool, 10, x0)  # slot 0
    pool.open(12)  # an idle stream holds slot 0, so stream 11 runs alone at slot 1
    alone1 = run_alone(pool, 11, x1)
    pool.close(12)
    pool.open(10)
    inter0 = [pool.encode([10], x0[0:1])[0]]
    pool.open(11)  # opening a stream mid-way must not disturb stream 10
    inter1 = []
    for i in range(STEPS):
        if i > 0:
            inter0.append(pool.encode([10], x0[i:i + 1])[0])
        inter1.append(pool.encode([11], x1[i:i + 1])[0])
    pool.close(11)
    np.testing.assert_array_equal(np.stack(inter0), alone0)
    np.testing.assert_array_equal(np.stack(inter1), alone1)
    pool.close(10)


def test_batched_call_is_isolated_and_matches_single_calls(pool):
    x0, x1, other = frames(3), frames(4), frames(5)

    def batched(x_neighbour: np.ndarray) -> np.ndarray:
        pool.open(20), pool.open(21)
        out = np.stack([pool.encode([21, 20], np.stack([x_neighbour[i], x0[i]])) for i in range(STEPS)])  # [T, 2, 8]
        pool.close(20), pool.close(21)
        return out

    both, both_other = batched(x1), batched(other)
    np.testing.assert_array_equal(both[:, 1], both_other[:, 1])  # stream 20 never hears its neighbour
    assert agreement(both[:, 0], both_other[:, 0]) < 0.2  # ... while the neighbour's codes did change
    assert agreement(both[:, 1], run_alone(pool, 20, x0)) >= 0.9  # a batch row is the single call's function
    assert agreement(both[:, 0], run_alone(pool, 21, x1)) >= 0.9


def test_rows_run_follow_the_open_streams(pool):
    """On CPU a call runs rows 0..max(slot) only, and slots go out lowest first (cost follows load)."""
    seen: list[int] = []
    real = pool.model.encode
    pool.model.encode = lambda x: (seen.append(x.shape[0]), real(x))[1]
    try:
        pool.open(60), pool.open(61), pool.open(62)  # slots 0, 1, 2
        pool.encode([60], frames(0, 1))
        pool.encode([62], frames(0, 1))
        pool.close(61)  # stream 62 moves down into slot 1
        pool.encode([62], frames(0, 1))
        pool.open(63)  # takes the lowest free slot, 2
        pool.encode([63], frames(0, 1))
    finally:
        pool.model.encode = real
        for s in (60, 62, 63):
            pool.close(s)
    assert seen == [1, 3, 2, 3]


def test_a_stream_moved_down_on_a_close_carries_on_where_it_was(pool):
    x = frames(11, 16)
    alone = run_alone(pool, 70, x)  # slot 0 throughout
    pool.open(71), pool.open(72), pool.open(73)  # slots 0, 1, 2
    before = [pool.encode([73], x[i:i + 1])[0] for i in range(8)]  # stream 73 at slot 2
    pool.close(71)  # 73 moves to slot 0 with its streaming state
    after = [pool.encode([73], x[i:i + 1])[0] for i in range(8, 16)]
    pool.close(72), pool.close(73)
    assert agreement(np.stack(before), alone[:8]) >= 0.9
    assert agreement(np.stack(after), alone[8:]) >= 0.9  # a lost state would restart the codec mid-stream


def test_decode_shape_and_pool_limits(pool):
    pool.open(30)
    pcm = pool.decode([30], np.array([[1, 2, 3, 4, 5, 6, 7, 8]]))
    assert pcm.shape == (1, FRAME_SAMPLES) and np.isfinite(pcm).all()
    with pytest.raises(StreamError, match=r"codes must lie in \[0, 2048\)"):
        pool.decode([30], np.full((1, 8), 5000))
    with pytest.raises(StreamError, match="NaN"):
        pool.encode([30], np.full((1, FRAME_SAMPLES), np.nan, np.float32))
    with pytest.raises(StreamError, match="unknown stream 99"):
        pool.encode([99], frames(0, 1))
    for s in (31, 32, 33):
        pool.open(s)
    with pytest.raises(StreamError, match="no free stream slot"):
        pool.open(34)
    for s in (30, 31, 32, 33):
        pool.close(s)


def test_one_bad_request_does_not_fail_the_batch(pool):
    good = CodecRequest(40, start=True, pcm=frames(5, 1)[0])
    nan = CodecRequest(41, start=True, pcm=np.full(FRAME_SAMPLES, np.nan, np.float32))
    unknown = CodecRequest(42, pcm=frames(5, 1)[0])
    res = serve_codec_batch(pool, [good, nan, unknown])
    assert res[0].codes.shape == (8,)
    assert isinstance(res[1], StreamError) and "NaN" in str(res[1])
    assert isinstance(res[2], StreamError) and "unknown stream 42" in str(res[2])
    pool.close(40), pool.close(41)


# -- through the real tritonserver --------------------------------------------------------------


def encode(client, stream: int, frame: np.ndarray, start=False, end=False) -> np.ndarray:
    inp = grpcclient.InferInput("PCM", [1, FRAME_SAMPLES], "FP32")
    inp.set_data_from_numpy(frame[None].astype(np.float32))
    r = client.infer("mimi_codec", [inp], outputs=[grpcclient.InferRequestedOutput("CODES")],
                     sequence_id=stream, sequence_start=start, sequence_end=end)
    return r.as_numpy("CODES")[0]


@pytest.fixture(scope="module")
def codec(triton):
    triton.load("mimi_codec")
    return triton.client()


def test_served_codes_shape_range_and_determinism(codec, pool):
    x = frames(7)
    served = np.stack([encode(codec, 501, f, start=(i == 0), end=(i == STEPS - 1)) for i, f in enumerate(x)])
    assert served.shape == (STEPS, 8) and served.dtype == np.int64
    assert served.min() >= 0 and served.max() < CARDINALITY
    assert agreement(served, run_alone(pool, 50, x)) >= 0.9  # same codec in and out of Triton


def test_served_streams_are_isolated(codec):
    x0, x1 = frames(8), frames(9)
    alone0 = np.stack([encode(codec, 601, f, start=(i == 0), end=(i == STEPS - 1)) for i, f in enumerate(x0)])
    alone1 = np.stack([encode(codec, 602, f, start=(i == 0), end=(i == STEPS - 1)) for i, f in enumerate(x1)])
    inter0, inter1 = [], []
    for i in range(STEPS):
        last = i == STEPS - 1
        inter0.append(encode(codec, 603, x0[i], start=(i == 0), end=last))
        inter1.append(encode(codec, 604, x1[i], start=(i == 0), end=last))
    # the server may batch the two streams' requests: rows differ from the lone runs, so rounding may
    # flip a code; a mix-up of the two streams' states would make them unrelated.
    assert agreement(np.stack(inter0), alone0) >= 0.9
    assert agreement(np.stack(inter1), alone1) >= 0.9
    assert agreement(np.stack(inter0), np.stack(inter1)) < 0.2


def test_served_decode_round_trip(codec):
    inp = grpcclient.InferInput("CODES_IN", [1, 8], "INT64")
    inp.set_data_from_numpy(np.arange(8, dtype=np.int64)[None] * 100)
    r = codec.infer("mimi_codec", [inp], outputs=[grpcclient.InferRequestedOutput("AUDIO")],
                    sequence_id=701, sequence_start=True, sequence_end=True)
    audio = r.as_numpy("AUDIO")
    assert audio.shape == (1, FRAME_SAMPLES) and audio.dtype == np.float32 and np.isfinite(audio).all()


@pytest.mark.parametrize("bad", ["wrong_samples", "wrong_dtype", "unknown_stream", "huge", "bad_code", "nothing"])
def test_served_bad_input_is_refused_and_server_keeps_serving(codec, bad):
    seq = 800 + ["wrong_samples", "wrong_dtype", "unknown_stream", "huge", "bad_code", "nothing"].index(bad)
    encode(codec, seq, frames(0, 1)[0], start=True)  # an open stream beside the bad request
    kwargs = dict(sequence_id=seq)
    if bad == "wrong_samples":
        inp = grpcclient.InferInput("PCM", [1, 100], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 100), np.float32))
        expect = "unexpected shape"
    elif bad == "wrong_dtype":
        inp = grpcclient.InferInput("PCM", [1, FRAME_SAMPLES], "INT32")
        inp.set_data_from_numpy(np.zeros((1, FRAME_SAMPLES), np.int32))
        expect = "data-type"
    elif bad == "unknown_stream":
        inp = grpcclient.InferInput("PCM", [1, FRAME_SAMPLES], "FP32")
        inp.set_data_from_numpy(np.zeros((1, FRAME_SAMPLES), np.float32))
        kwargs = dict(sequence_id=99_999)
        expect = "START"
    elif bad == "huge":
        n = 8_000_000  # 32 MB: a client that sends a whole file as one frame
        inp = grpcclient.InferInput("PCM", [1, n], "FP32")
        inp.set_data_from_numpy(np.zeros((1, n), np.float32))
        expect = "got [1,8000000]"  # refused by shape, before any model code runs
    elif bad == "bad_code":
        inp = grpcclient.InferInput("CODES_IN", [1, 8], "INT64")
        inp.set_data_from_numpy(np.full((1, 8), 9999, np.int64))
        expect = "codes must lie in"
    else:
        inp = None
        expect = "0 inputs"  # Triton itself refuses a request with no inputs
    with pytest.raises(InferenceServerException) as err:
        codec.infer("mimi_codec", [inp] if inp is not None else [], **kwargs)
    assert expect.lower() in str(err.value).lower()
    # The server and the open stream beside it keep working.
    codes = encode(codec, seq, frames(1, 1)[0], end=True)
    assert codes.shape == (8,)


def cohort(client, cohort_id: int, streams: list[int], flags: list[int], pcm=None, codes=None):
    """One cohort request (one row per stream); returns (COHORT_CODES, COHORT_AUDIO, per-row errors)."""
    arrays = {"COHORT_STREAMS": np.asarray(streams, np.int64), "COHORT_FLAGS": np.asarray(flags, np.int32)}
    if pcm is not None:
        arrays["COHORT_PCM"] = np.asarray(pcm, np.float32)
    if codes is not None:
        arrays["COHORT_CODES_IN"] = np.asarray(codes, np.int64)
    inputs = []
    for name, a in arrays.items():
        inputs.append(grpcclient.InferInput(name, [1, *a.shape], {np.int64: "INT64", np.int32: "INT32",
                                                                  np.float32: "FP32"}[a.dtype.type]))
        inputs[-1].set_data_from_numpy(a[None])
    outs = [grpcclient.InferRequestedOutput(n) for n in ("COHORT_CODES", "COHORT_AUDIO", "COHORT_ERRORS")]
    r = client.infer("mimi_codec", inputs, outputs=outs, sequence_id=cohort_id, sequence_start=True, sequence_end=True)
    return r.as_numpy("COHORT_CODES")[0], r.as_numpy("COHORT_AUDIO")[0], [e.decode() for e in r.as_numpy("COHORT_ERRORS")[0]]


START, END = 1, 2


def test_served_cohort_rows_are_their_own_streams(codec):
    x = [frames(20 + i) for i in range(3)]
    alone = [np.stack([encode(codec, 1001 + i, f, start=(t == 0), end=(t == STEPS - 1)) for t, f in enumerate(x[i])])
             for i in range(3)]
    streams, got = [1101, 1102, 1103], [[], [], []]
    for t in range(STEPS):
        flags = [(START if t == 0 else 0) | (END if t == STEPS - 1 else 0)] * 3
        codes, _, errors = cohort(codec, 5000 + t, streams, flags, pcm=np.stack([x[i][t] for i in range(3)]))
        assert errors == ["", "", ""]
        for i in range(3):
            got[i].append(codes[i])
    for i in range(3):  # a row is its own stream's encoder state, whatever rows share the step
        assert agreement(np.stack(got[i]), alone[i]) >= 0.9
        assert max(agreement(np.stack(got[i]), alone[j]) for j in range(3) if j != i) < 0.5  # not a neighbour's
    # a decode cohort: one frame of audio per row
    _, audio, errors = cohort(codec, 5100, [1104, 1105], [START | END] * 2, codes=np.arange(16).reshape(2, 8) * 50)
    assert errors == ["", ""] and audio.shape == (2, FRAME_SAMPLES) and np.isfinite(audio).all()


def test_served_cohort_bad_rows_fail_alone(codec):
    f = frames(3, 1)[0]
    # row 1 names a stream that was never started; row 2 repeats row 0's stream: both fail, row 0 is served
    codes, _, errors = cohort(codec, 5200, [1201, 1299, 1201], [START, 0, 0], pcm=np.stack([f, f, f]))
    assert errors[0] == "" and codes[0].min() >= 0
    assert "START" in errors[1] and "two rows in one model step" in errors[2]
    assert (codes[1] == -1).all() and (codes[2] == -1).all()
    # a malformed cohort fails as a whole, with what to fix
    with pytest.raises(InferenceServerException, match="one row per COHORT_STREAMS entry"):
        cohort(codec, 5201, [1201, 1202], [0, 0], pcm=np.stack([f]))
    # the stream is still open and served
    codes, _, errors = cohort(codec, 5202, [1201], [END], pcm=f[None])
    assert errors == [""] and codes.shape == (1, 8)
