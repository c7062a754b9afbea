"""One MemChunk layout in training and serving (issue #13 point 1, paper §4.1).

The serving engine (`DialogEngine`, one tick at a time over its KV cache) and the training forward
(`egomem.training.forward.forward`, one teacher-forced pass over `[L1 ; L2 ; dialog]`) must see the same
context: per-step text logits equal, and the depformer's argmax under teacher forcing equals the codes the
engine chose greedily. Checked for an L1-only sample (L2 empty: pads), an L1+L2 sample and a sample with
both chunks empty, with the streams stepped together in batched ticks at different ages, and once at the
paper's chunk sizes (512 / 256). A stream whose L1 is refreshed mid-dialog is not expected to match: its
ring keeps K/V computed with the old chunk (docs/kv-cache.md#refresh).
"""

from __future__ import annotations

import pytest
import torch
from moshi.utils.compile import no_compile

from egomem.dialog import DialogEngine
from egomem.dialog.checkpoint import build_lm
from egomem.dialog.engine import memchunk_inputs
from egomem.training.forward import forward

# tests/test_dialog_engine.py's TINY, with a context that holds the chunks and the dialog in one forward
TINY = dict(dim=64, num_heads=2, num_layers=2, card=32, text_card=40, context=64, depformer_dim=32,
            depformer_dim_feedforward=64, depformer_num_heads=2, depformer_num_layers=1)
N_LISTEN = 8
SAMPLES = {  # name: (L1 tokens, L2 tokens)
    "l1_only": ([5, 6, 7, 8, 9], []),
    "l1_l2": ([5, 6, 7, 8, 9], [11, 12, 13]),
    "empty": ([], []),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _listen(seed: int, frames: int, card: int) -> torch.Tensor:
    return torch.randint(0, card, (frames, N_LISTEN), generator=torch.Generator().manual_seed(seed))


def _serve(eng: DialogEngine, chunks: list[tuple[list[int], list[int]]], listen: list[torch.Tensor],
           starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run each stream i from tick `starts[i]` for T + 1 of its own ticks, live streams batched per tick.

    Returns the aligned streams `[N, 17, T]` the engine produced (its text and speak codes, the user's
    listen codes) and its text logits `[N, T, text_card]`. Aligned frame f comes back at the stream's
    tick f + 1; listen frame f is given at tick f (the extra last tick gets frame T - 1 again).
    """
    N, T = len(listen), listen[0].shape[0]
    slots = [eng.open() for _ in range(N)]
    for s, (l1, l2) in zip(slots, chunks):
        if l1:
            eng.write_memchunk(s, 1, l1)
        if l2:
            eng.write_memchunk(s, 2, l2)
    stream = torch.zeros(N, eng.lm.num_codebooks, T, dtype=torch.long)
    logits = torch.zeros(N, T, eng.lm.text_card)
    for tick in range(max(starts) + T + 1):
        live = [i for i in range(N) if 0 <= tick - starts[i] <= T]
        ages = [tick - starts[i] for i in live]
        if not live:
            continue
        codes = torch.stack([listen[i][min(a, T - 1)] for i, a in zip(live, ages)])  # [B, 8]
        text, speak, lg = eng.step([slots[i] for i in live], codes, return_logits=True)
        for row, (i, a) in enumerate(zip(live, ages)):
            if a < T:
                logits[i, a] = lg[row]
                stream[i, 9:, a] = listen[i][a]
            if a >= 1:  # aligned frame a - 1
                stream[i, 0, a - 1] = text[row]
                stream[i, 1:9, a - 1] = speak[row]
    for s in slots:
        eng.close(s)
    return stream, logits


def _check_parity(lm, n1: int, n2: int, chunks: list[tuple[list[int], list[int]]], starts: list[int], T: int,
                  engine_audio_token: int | None = None, training_audio_token: int | None = None) -> None:
    eng = DialogEngine(lm, max_streams=len(chunks) + 1, l1_steps=n1, l2_steps=n2,
                       chunk_audio_token=engine_audio_token)
    listen = [_listen(10 + i, T, lm.card) for i in range(len(chunks))]
    stream, eng_logits = _serve(eng, chunks, listen, starts)
    assert (stream >= 0).all(), "the engine left a frame ungenerated"
    rows = torch.stack([torch.cat([memchunk_inputs(lm, l1, n1, training_audio_token),
                                   memchunk_inputs(lm, l2, n2, training_audio_token)], dim=1) for l1, l2 in chunks])
    with torch.no_grad(), no_compile():
        out = forward(lm, rows, stream)  # [N, K, n1 + n2] chunks, [N, K, T] dialog, one batched pass
    torch.testing.assert_close(out.text_logits, eng_logits, atol=2e-5, rtol=2e-5)
    # what the engine chose greedily is what the teacher-forced heads rank first
    assert torch.equal(out.text_logits.argmax(-1), out.targets[:, 0])
    audio_argmax = out.audio_logits.argmax(-1)  # [N, 8, T]
    valid = out.valid[:, 1:]
    assert valid.sum() > 0.8 * valid.numel()
    assert torch.equal(audio_argmax[valid], out.targets[:, 1:][valid])


@pytest.fixture(scope="module")
def lm():
    return build_lm("tiny", seed=0, **TINY)


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_engine_equals_training_forward(lm, sample):
    _check_parity(lm, 12, 6, [SAMPLES[sample]], [0], T=20)


def test_batched_streams_of_different_ages_equal_training_forward(lm):
    """Three streams (one per sample) share ticks, joining at ticks 0, 3 and 7: rows of one batched
    step at different positions, each equal to its own training forward."""
    chunks = [SAMPLES["l1_l2"], SAMPLES["empty"], SAMPLES["l1_only"]]
    _check_parity(lm, 12, 6, chunks, [0, 3, 7], T=20)


def test_paper_chunk_sizes():
    """n1 = 512, n2 = 256: the dialog starts at 768 in both (tiny model, context 768 + 32)."""
    lm = build_lm("tiny", seed=1, **(TINY | dict(context=800)))
    g = torch.Generator().manual_seed(1)
    l1 = torch.randint(4, TINY["text_card"], (300,), generator=g).tolist()
    l2 = torch.randint(4, TINY["text_card"], (100,), generator=g).tolist()
    _check_parity(lm, 512, 256, [(l1, l2), (l1, [])], [0, 2], T=12)


def test_parity_with_the_final_norm_kept():
    """The tiny preset drops moshi's final norm (presets.py); 7B keeps it. Both layouts match the training
    forward, and the norm is really used: the same weights without it give other logits."""
    normed = build_lm("tiny", seed=0, **(TINY | dict(out_norm=True)))
    assert normed.out_norm is not None and build_lm("tiny", seed=0, **TINY).out_norm is None
    _check_parity(normed, 12, 6, [SAMPLES["l1_l2"], SAMPLES["empty"]], [0, 3], T=12)
    with torch.no_grad(), no_compile():
        x = torch.randint(0, 32, (1, normed.num_codebooks, 8))
        with_norm = normed.forward_text(x)[1]
        normed.out_norm = None
        assert not torch.allclose(with_norm, normed.forward_text(x)[1])


def test_chunk_audio_token_is_part_of_the_layout(lm):
    """Both sides take the chunk audio token (docs/departures.md#d17-memchunk-layout-and-its-audio-token):
    the same override on both still matches; a different token on one side does not."""
    _check_parity(lm, 12, 6, [SAMPLES["l1_only"]], [0], T=8, engine_audio_token=0, training_audio_token=0)
    with pytest.raises(AssertionError, match="not close"):
        _check_parity(lm, 12, 6, [SAMPLES["l1_only"]], [0], T=8, engine_audio_token=0)
