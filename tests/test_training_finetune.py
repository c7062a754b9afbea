"""`egomem finetune` (issue #13 point 6): batches, masks, the loop, resume, checkpoints, LoRA.

A tiny LMModel (dim 64, 2 layers; byte-level text vocabulary) on hand-made samples held in memory:
each stream has a reply of text bytes and speak codes under its masks; L1 holds the person's name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest
import torch
from moshi.utils.compile import no_compile
from safetensors.torch import load_file, save_file

from egomem.dialog import DialogEngine
from egomem.dialog.checkpoint import CheckpointError, build_lm
from egomem.dialog.engine import memchunk_inputs
from egomem.dialog.tokenizer import ByteTokenizer
from egomem.training.batch import SampleError, SampleOrder, make_batch
from egomem.training.finetune import (
    TrainConfig,
    add_finetune_args,
    finetune,
    lr_factor,
    pick_eval_samples,
    run_finetune,
    sample_pool,
    train,
)
from egomem.training.forward import forward, masked_loss, turn_heads
from egomem.training.types import Sample, Span

TINY = dict(dim=64, num_heads=2, num_layers=2, card=32, text_card=260, context=64, depformer_dim=32,
            depformer_dim_feedforward=64, depformer_num_heads=2, depformer_num_layers=1)
N1, N2 = 16, 8  # MemChunk steps; the dialog window is context - N1 - N2 = 40
WINDOW = TINY["context"] - N1 - N2
TOK = ByteTokenizer()
NAMES = ["Ada", "Bob", "Cy", "Dee"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class MemData:
    """The `DataSource` protocol in memory (what egomem.training.dataset.Dataset reads from disk)."""

    def __init__(self, samples: list[Sample], streams: dict[str, np.ndarray]):
        self.manifest = {"format": "egomem-memchunk-v1", "n1": N1, "n2": N2, "tokenizer": "byte", "codec": "test",
                         "seed": 0}
        self.samples, self.streams = samples, streams

    def tokens(self, stream_id: str) -> np.ndarray:
        return self.streams[stream_id].astype(np.int64)


def _stream(seed: int, T: int, at: int, reply: str) -> np.ndarray:
    """Aligned [17, T]: text pad except the reply's bytes from frame `at`; random speak/listen codes."""
    g = np.random.default_rng(seed)
    s = np.empty((17, T), dtype=np.int64)
    s[0] = TOK.pad_id
    ids = TOK.encode(reply)
    s[0, at:at + len(ids)] = ids
    s[1:] = g.integers(0, TINY["card"], (16, T))
    return s


def _sample(i: int, name: str, T: int = 30, at: int = 8, **kw) -> tuple[Sample, np.ndarray]:
    reply = f"hi {name}!"
    n = len(TOK.encode(reply))
    s = Sample(stream=f"s{i}", kind="l1_response", l1_text=f"name: {name}", l2_text=kw.pop("l2", ""),
               text=kw.pop("text", (Span(at - 2, at + n + 1),)), speak=kw.pop("speak", (Span(at, at + n),)),
               dialog=0, turn=0, generator="test")
    return s, _stream(100 + i, T, at, reply)


def _data(n: int = 4) -> MemData:
    pairs = [_sample(i, NAMES[i % len(NAMES)], T=24 + 3 * i) for i in range(n)]
    return MemData([p[0] for p in pairs], {p[0].stream: p[1] for p in pairs})


def _cfg(tmp_path, name: str, **kw) -> TrainConfig:
    base = dict(data=None, out=tmp_path / name, model_overrides=TINY, steps=8, batch_size=2, lr=3e-3, min_lr=3e-4,
                warmup=2, seed=0, ckpt_every=3, eval_samples=4, device="cpu", dtype="float32")
    return TrainConfig(**(base | kw))


@pytest.fixture(scope="module")
def lm():
    return build_lm("tiny", seed=0, **TINY)


def _loss(model, data: MemData) -> float:
    batch = make_batch(model, TOK, [(s, data.tokens(s.stream)) for s in data.samples], N1, N2)
    with torch.no_grad(), no_compile():
        out = forward(model, batch.chunks, batch.stream)
    return float(masked_loss(out, batch.text_mask, batch.speak_mask, 3, 0.5, 100.0)[0])


# ---------------------------------------------------------------- batches and masks


def test_batch_layout_crop_and_padding(lm):
    short = _sample(0, "Ada", T=30, at=8)  # reply "hi Ada!" (7 bytes): text frames 6..15, speak 8..14
    long_ = _sample(1, "Bob", T=90, at=70)  # text 68..77, speak 70..76: past the window, cropped from the left
    b = make_batch(lm, TOK, [short, long_], N1, N2)
    assert b.chunks.shape == (2, 17, N1 + N2)
    assert torch.equal(b.chunks[0], torch.cat([memchunk_inputs(lm, TOK.encode("name: Ada"), N1), memchunk_inputs(lm, [], N2)], 1))
    # row 0 ends at the last supervised tick: text frame 15, speak frame 14 generated at tick 14 + delay 1
    assert b.lengths[0] == 16 and b.crop_start[0] == 0
    assert torch.equal(b.stream[0, :, :16], torch.as_tensor(short[1][:, :16]))
    # row 1 ends at tick 77; only the last WINDOW frames are kept, its spans shifted by the crop
    start = 78 - WINDOW
    assert b.lengths[1] == WINDOW and b.crop_start[1] == start
    assert torch.equal(b.stream[1], torch.as_tensor(long_[1][:, start:78]))
    assert b.text_mask[1].nonzero().flatten().tolist() == list(range(68 - start, 78 - start))
    assert b.speak_mask[1].nonzero().flatten().tolist() == list(range(70 - start, 77 - start))
    # padding of row 0: text pad, moshi's zero token, masked out
    assert b.stream.shape[2] == WINDOW
    assert (b.stream[0, 0, 16:] == lm.text_padding_token_id).all() and (b.stream[0, 1:, 16:] == -1).all()
    assert not b.text_mask[0, 16:].any() and not b.speak_mask[0, 16:].any()


def test_loss_reads_only_masked_frames_and_padding_is_invisible(lm):
    a, b_ = _sample(0, "Ada", T=30, at=8), _sample(1, "Bob", T=60, at=30)
    batch = make_batch(lm, TOK, [a, b_], N1, N2)
    with no_compile():
        out = forward(lm, batch.chunks, batch.stream)
        out.text_logits.retain_grad()
        out.audio_logits.retain_grad()
        loss, _ = masked_loss(out, batch.text_mask, batch.speak_mask, 3, 0.5, 100.0)
        loss.backward()
    text_grad = out.text_logits.grad.abs().sum(-1)  # [B, T]
    assert torch.equal(text_grad > 0, batch.text_mask)
    for k, d in enumerate(lm.delays[1:9]):  # codebook k's tick t predicts frame t - d
        ticks = torch.zeros_like(batch.speak_mask)
        ticks[:, d:] = batch.speak_mask[:, :ticks.shape[1] - d]
        assert torch.equal(out.audio_logits.grad[:, k].abs().sum(-1) > 0, ticks), k
    # the padded row's real frames see exactly what they see alone (causal model, right padding)
    alone = make_batch(lm, TOK, [a], N1, N2)
    with torch.no_grad(), no_compile():
        ref = forward(lm, alone.chunks, alone.stream)
    L = alone.lengths[0]
    torch.testing.assert_close(out.text_logits[0, :L].detach(), ref.text_logits[0], atol=1e-5, rtol=1e-5)


def test_turn_head_weight_scales_the_first_tokens_of_each_utterance(lm):
    row = torch.tensor([[3, 3, 10, 11, 12, 13, 3, 3, 20, 21, 3, 30]])
    assert turn_heads(row, 3, 2).int().tolist() == [[0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 1]]
    a = _sample(0, "Ada", T=30, at=8)  # "hi Ada!" at text frames 8..14, supervised 6..15 (pads around it)
    batch = make_batch(lm, TOK, [a], N1, N2)

    def text_grad(weight: float) -> torch.Tensor:
        with no_compile():
            out = forward(lm, batch.chunks, batch.stream)
        out.text_logits.retain_grad()
        masked_loss(out, batch.text_mask, batch.speak_mask, TOK.pad_id, 0.5, 100.0, weight, 3)[0].backward()
        lm.zero_grad()
        return out.text_logits.grad[0].abs().sum(-1)

    plain, heads = text_grad(1.0), text_grad(4.0)
    ratio = heads[batch.text_mask[0]] / plain[batch.text_mask[0]]
    frames = batch.text_mask[0].nonzero().flatten().tolist()
    boosted = [f for f, r in zip(frames, ratio.tolist()) if r > 1.5]
    assert boosted == [8, 9, 10]  # "hi " only: the first 3 bytes of the reply
    torch.testing.assert_close(ratio[[frames.index(f) for f in boosted]] / ratio[0], torch.full((3,), 4.0))


def test_bad_samples_name_themselves(lm):
    nothing = _sample(0, "Ada", text=(Span(5, 5),), speak=())
    with pytest.raises(SampleError, match=r"s0/l1_response/dialog0/turn0 supervises nothing"):
        make_batch(lm, TOK, [nothing], N1, N2)
    s, toks = _sample(1, "Bob")
    long_l1 = (dataclasses.replace(s, l1_text="name: " + "Bob" * 10), toks)
    with pytest.raises(SampleError, match=r"s1/.*Level-1 MemChunk text is 36 tokens.*holds 16"):
        make_batch(lm, TOK, [long_l1], N1, N2)
    s, toks = _sample(2, "Cy")  # text span 6..14
    with pytest.raises(SampleError, match=r"s2/.*reach frame 15 but stream s2 has 12 frames"):
        make_batch(lm, TOK, [(s, toks[:, :12])], N1, N2)
    s, toks = _sample(3, "Dee")
    toks[5, 3] = TINY["card"]  # a code from a bigger codec
    with pytest.raises(SampleError, match=r"s3/.*outside the model's codebooks \[0, 32\)"):
        make_batch(lm, TOK, [(s, toks)], N1, N2)


def test_sample_order_is_seeded_epochwise_and_resumable():
    a = SampleOrder(5, seed=3)
    first = a.take(3) + a.take(3) + a.take(4)  # two epochs
    assert sorted(first[:5]) == list(range(5)) and sorted(first[5:]) == list(range(5))
    b = SampleOrder(5, seed=3)
    b.take(4)
    c = SampleOrder(5, seed=3)
    c.load_state_dict(b.state_dict())
    assert c.take(6) == first[4:] == b.take(6)
    assert SampleOrder(5, seed=4).take(5) != first[:5]


def test_same_person_repeat_draws_the_greetings_after_a_silence_more_often():
    """sample_pool: a Level-1 sample of a dialog whose stream's dialog before is the same person's (its
    conversation start is the one before's) comes K times an epoch; the first person's, a new person's and
    the Level-2 samples once; K = 1 is the plain order."""

    class Laid:
        samples = [dataclasses.replace(_sample(0, "Ada")[0], stream=st, dialog=n, kind=kind)
                   for st, n, kind in (("a", 0, "l1_response"), ("a", 1, "l1_response"), ("a", 2, "l1_response"),
                                       ("a", 2, "l2_query"), ("b", 1, "l1_response"), ("b-noised", 1, "l1_response"))]

        def conversation_starts(self, stream_id: str) -> list[int]:  # a: first, new at 40, same; b: same
            return {"a": [0, 40, 40], "b": [0, 0], "b-noised": [0, 0]}[stream_id]

    assert sample_pool(Laid(), 1) == [0, 1, 2, 3, 4, 5]
    assert sample_pool(Laid(), 3) == [0, 1, 2, 3, 4, 5, 2, 2, 4, 4, 5, 5]


def test_same_person_repeat_is_checked(tmp_path):
    with pytest.raises(ValueError, match="same_person_repeat must be >= 1"):
        finetune(_cfg(tmp_path, "bad", same_person_repeat=0), _data(), progress=False)


def test_eval_samples_are_of_the_trained_kinds_seeded():
    pairs = [_sample(i, NAMES[i % len(NAMES)]) for i in range(6)]
    samples = [dataclasses.replace(s, kind="l2_query") if i % 2 else s for i, (s, _) in enumerate(pairs)]
    held = MemData(samples, {s.stream: t for s, t in pairs})
    picked = pick_eval_samples(held, {"l1_response"}, 2, seed=0)
    assert len(picked) == 2 and {s.kind for s in picked} == {"l1_response"}
    assert picked == pick_eval_samples(held, {"l1_response"}, 2, seed=0)  # the same subset at every evaluation
    assert len(pick_eval_samples(held, {"l1_response", "l2_query"}, 9, seed=0)) == 6
    with pytest.raises(SampleError, match=r"no samples of the kinds.*\['l2_response'\].*same --levels"):
        pick_eval_samples(held, {"l2_response"}, 2, seed=0)


def test_lr_schedule_warmup_then_cosine_to_floor():
    f = [lr_factor(s, 100, 10, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in zip(f[10:], f[11:]))
    assert lr_factor(100, 100, 10, 0.1) == pytest.approx(0.1)


# ---------------------------------------------------------------- the loop


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cfg = _cfg(tmp_path_factory.mktemp("ft"), "run", steps=30, eval_every=10)
    return cfg, train(cfg, _data(), progress=False)


def test_short_run_lowers_masked_loss(trained, lm):
    cfg, res = trained
    data = _data()
    before, after = _loss(lm, data), _loss(res.lm, data)
    assert after < 0.5 * before, (before, after)
    out = cfg.out
    records = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 31))
    assert [r["step"] for r in records if r["kind"] == "eval"] == [10, 20, 30]
    card = json.loads((out / "model_card.json").read_text())
    assert card["steps"] == 30 and card["final_loss"] == pytest.approx(np.mean(res.losses[-10:]))
    assert len(card["data"]["fingerprint_sha256"]) == 64 and card["data"]["samples"] == 4
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_checkpoint_loads_into_dialog_engine(trained):
    cfg, res = trained
    loaded = build_lm("tiny", weights=res.path, **TINY)
    want = res.lm.state_dict()
    assert set(loaded.state_dict()) == set(want)
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    # the engine, stepping the loaded checkpoint greedily, gives the trained model's teacher-forced logits
    eng = DialogEngine(loaded, max_streams=1, l1_steps=N1, l2_steps=N2)
    slot = eng.open()
    l1 = TOK.encode("name: Ada")
    eng.write_memchunk(slot, 1, l1)
    T = 20
    listen = torch.randint(0, TINY["card"], (T + 1, 8), generator=torch.Generator().manual_seed(5))
    stream = torch.zeros(1, 17, T, dtype=torch.long)
    logits = torch.zeros(1, T, TINY["text_card"])
    for tick in range(T + 1):
        text, speak, lg = eng.step([slot], listen[tick:tick + 1], return_logits=True)
        if tick < T:
            logits[0, tick], stream[0, 9:, tick] = lg[0], listen[tick]
        if tick >= 1:
            stream[0, 0, tick - 1], stream[0, 1:9, tick - 1] = text[0], speak[0]
    chunks = torch.cat([memchunk_inputs(res.lm, l1, N1), memchunk_inputs(res.lm, [], N2)], 1)[None]
    with torch.no_grad(), no_compile():
        out = forward(res.lm, chunks, stream)
    torch.testing.assert_close(out.text_logits, logits, atol=1e-4, rtol=1e-4)


def test_resume_is_bit_exact(tmp_path):
    data = _data()
    whole = finetune(_cfg(tmp_path, "whole"), data, progress=False)
    part = _cfg(tmp_path, "part", stop_after=4)
    ckpt = finetune(part, data, progress=False)
    assert ckpt.name == "state.pt" and not (part.out / "lm.safetensors").exists()
    with pytest.raises(FileExistsError, match="--resume"):
        finetune(part, data, progress=False)
    with pytest.raises(ValueError, match=r"lr \(0.003 -> 0.001\)"):
        finetune(_cfg(tmp_path, "part", lr=1e-3, resume=True), data, progress=False)
    resumed = finetune(_cfg(tmp_path, "part", resume=True), data, progress=False)
    a, b = load_file(str(whole)), load_file(str(resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loss = [[json.loads(x)["loss"] for x in (p.parent / "loss.jsonl").read_text().splitlines()] for p in (whole, resumed)]
    assert loss[0] == loss[1] and len(loss[0]) == 8 + 1  # 8 steps + the final evaluation


def test_drills_change_the_rows_and_resume_bit_exactly(tmp_path):
    """With fresh names and reading drills the run trains on other rows (other weights), and a resumed run
    draws exactly the transforms an uninterrupted one did."""
    data, mix = _data(), dict(fresh_names=1.0, drills=0.5, drill_random_l1=0.5, drill_span=(4, 8))
    plain = load_file(str(finetune(_cfg(tmp_path, "plain", steps=4), data, progress=False)))
    whole = load_file(str(finetune(_cfg(tmp_path, "whole", steps=4, **mix), data, progress=False)))
    assert any(not torch.equal(plain[k], whole[k]) for k in plain)
    finetune(_cfg(tmp_path, "part", steps=4, stop_after=2, **mix), data, progress=False)
    resumed = load_file(str(finetune(_cfg(tmp_path, "part", steps=4, resume=True, **mix), data, progress=False)))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    with pytest.raises(ValueError, match=r"drills must be in \[0, 1\]"):
        finetune(_cfg(tmp_path, "bad", drills=2.0), data, progress=False)


class LaidOutData(MemData):
    """MemData whose streams hold an earlier dialog: each sample's is the second, from frame `start`."""

    def __init__(self, samples: list[Sample], streams: dict[str, np.ndarray], start: int):
        super().__init__(samples, streams)
        self.start = start

    def conversation_starts(self, stream_id: str) -> list[int]:
        return [0, self.start]


def test_dialog_context_trains_on_each_dialog_alone(tmp_path):
    """context='dialog': a row starts at its dialog's first frame (a stream restarted for a new person), so
    what came before in the stream cannot change the run; context='stream' does see it."""
    pairs = [_sample(i, NAMES[i], T=40, at=26) for i in range(4)]  # replies at 26.., the dialogs start at 20
    samples = [dataclasses.replace(s, dialog=1) for s, _ in pairs]
    data = LaidOutData(samples, {s.stream: t for s, t in pairs}, start=20)
    other = {k: v.copy() for k, v in data.streams.items()}
    for v in other.values():
        v[0, 2:12] = TOK.encode("an earlier")  # another conversation before the dialog
        v[9:, :20] = (v[9:, :20] + 1) % TINY["card"]
    moved = LaidOutData(data.samples, other, start=20)
    runs = {(ctx, name): load_file(str(finetune(_cfg(tmp_path, f"{ctx}-{name}", steps=3, context=ctx), d,
                                                progress=False)))
            for ctx in ("dialog", "stream") for name, d in (("a", data), ("b", moved))}
    a, b = runs["dialog", "a"], runs["dialog", "b"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    a, b = runs["stream", "a"], runs["stream", "b"]
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(runs["dialog", "a"][k], a[k]) for k in a)
    with pytest.raises(ValueError, match="layouts"):
        finetune(_cfg(tmp_path, "no-layouts", context="dialog"), _data(), progress=False)
    late = LaidOutData(data.samples, data.streams, start=30)  # the replies' spans begin before 30
    with pytest.raises(SampleError, match="before its dialog"):
        finetune(_cfg(tmp_path, "late", context="dialog"), late, progress=False)


def test_lora_trains_only_adapters_and_merges(tmp_path, lm):
    data = _data()
    res = train(_cfg(tmp_path, "lora", lora=True, lora_rank=4, lora_alpha=8.0, lr=1e-2, min_lr=1e-3, steps=6),
                data, progress=False)
    base = lm.state_dict()
    trained = res.lm.state_dict()
    lora_keys = [k for k in trained if ".lora_" in k]
    assert lora_keys and all(".transformer." in f".{k}" or k.startswith("depformer.") for k in lora_keys)
    for k, v in trained.items():
        plain = k.replace(".frozen_W.", ".")
        if ".lora_" not in k:
            assert torch.equal(v, base[plain]), f"{k} changed: only LoRA adapters may train"
    assert any(trained[k].abs().sum() > 0 for k in lora_keys if ".lora_B." in k)
    assert _loss(res.lm, data) < _loss(lm, data)
    merged = build_lm("tiny", weights=res.path, **TINY)  # a plain LMModel: strict key and shape check
    assert not any(".lora_" in k for k in merged.state_dict())
    assert not torch.equal(merged.state_dict()["transformer.layers.0.gating.linear_in.weight"],
                           base["transformer.layers.0.gating.linear_in.weight"])
    batch = make_batch(lm, TOK, [(s, data.tokens(s.stream)) for s in data.samples], N1, N2)
    with torch.no_grad(), no_compile():
        want, got = forward(res.lm, batch.chunks, batch.stream), forward(merged, batch.chunks, batch.stream)
    torch.testing.assert_close(got.text_logits, want.text_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.audio_logits, want.audio_logits, atol=1e-4, rtol=1e-4)


def test_bf16_lora_path_keeps_fp32_masters_and_resumes_exactly(tmp_path):
    """The 7B recipe's code path (bf16 weights, fp32 master weights and optimiser state, LoRA), at tiny size on CPU."""
    data = _data()
    kw = dict(dtype="bfloat16", lora=True, lora_rank=4, lora_alpha=8.0, lr=1e-2, min_lr=1e-3, steps=6)
    whole = train(_cfg(tmp_path, "whole", **kw), data, progress=False)
    assert np.mean(whole.losses[-2:]) < whole.losses[0]
    finetune(_cfg(tmp_path, "part", stop_after=3, **kw), data, progress=False)
    state = torch.load(tmp_path / "part" / "ckpt" / "state.pt", weights_only=False)
    assert state["trained"] and all(v.dtype == torch.float32 for v in state["trained"].values())
    resumed = finetune(_cfg(tmp_path, "part", resume=True, **kw), data, progress=False)
    a, b = load_file(str(whole.path)), load_file(str(resumed))
    assert all(v.dtype == torch.bfloat16 for v in a.values())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    build_lm("tiny", weights=resumed, dtype=torch.bfloat16, **TINY)


# ---------------------------------------------------------------- bad input


def test_bad_inputs_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="training data folder .*nowhere does not exist"):
        finetune(_cfg(tmp_path, "x", data=tmp_path / "nowhere"), progress=False)
    wrong = tmp_path / "wrong.safetensors"
    save_file(build_lm("tiny", seed=0, **(TINY | dict(dim=32))).state_dict(), str(wrong))
    with pytest.raises(CheckpointError, match="shape mismatches"):
        finetune(_cfg(tmp_path, "y", init_weights=wrong), _data(), progress=False)
    nothing = _sample(9, "Ada", text=(), speak=(Span(3, 3),))[0]
    data = _data()
    data.samples.append(nothing)
    with pytest.raises(SampleError, match="s9/.*supervises nothing"):
        finetune(_cfg(tmp_path, "z"), data, progress=False)
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint"):
        finetune(_cfg(tmp_path, "w", resume=True), _data(), progress=False)
    with pytest.raises(ValueError, match="turn_head_weight must be positive"):
        finetune(_cfg(tmp_path, "v", turn_head_weight=0.0), _data(), progress=False)


def test_cli_trains_the_tiny_preset_from_a_dataset_folder(tmp_path, monkeypatch, capsys):
    """`egomem finetune --data DIR`: the on-disk format (egomem.training.dataset) in, dialog.weights out."""
    from egomem.training.dataset import write_dataset

    monkeypatch.delenv("EGOMEM_CONFIG", raising=False)
    mem = _data()
    manifest = {k: mem.manifest[k] for k in ("n1", "n2", "tokenizer", "codec", "seed")}
    write_dataset(tmp_path / "ds", manifest, [], [], mem.streams, mem.samples)
    p = argparse.ArgumentParser()
    add_finetune_args(p)
    args = p.parse_args(["--data", str(tmp_path / "ds"), "--out", str(tmp_path / "run"), "--steps", "2",
                         "--batch-size", "2", "--threads", "1", "--no-progress"])
    args.config = None
    assert run_finetune(args) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["complete"] is True
    card = json.loads((tmp_path / "run" / "model_card.json").read_text())
    assert card["preset"] == "tiny" and card["data"]["n1"] == N1 and card["data"]["samples"] == 4
    build_lm("tiny", weights=tmp_path / "run" / "lm.safetensors")  # what [dialog] weights = ... loads


def test_cli_reports_bad_input(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_finetune_args(p)
    args = p.parse_args(["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"), "--no-progress"])
    args.config = None
    assert run_finetune(args) == 2
    assert "does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------- listening drills (--listen-drills)

LISTEN_N1 = 96  # an L1 long enough for a profile's name and first facts
LISTEN_MODEL = TINY | dict(card=2048, context=LISTEN_N1 + N2 + 200)  # Mimi's codes; a drill row's ~90-230 ticks
LISTEN_QUESTIONS = ("Where do I live again?", "What do I do for work?", "What pet do I have?")


@pytest.fixture(scope="module")
def listen_rows():
    from egomem.config import MimiConfig
    from egomem.training.listen import ClipBank, ListenRows
    from egomem.training.streams import silence_code
    from egomem.training.tts import TRAIN_VOICES
    from egomem.trigger.codec import build_codec

    codec = build_codec(MimiConfig())
    bank = ClipBank(codec, TRAIN_VOICES[:1], LISTEN_QUESTIONS, seed=0, progress=False)
    rows = ListenRows(bank, "train", silence_code(codec), (2, 3), greeting_p=0.3, noised_p=0.5, l1_bytes=LISTEN_N1)
    yield rows
    rows.close()


def _listen_data(seed: int) -> MemData:
    data = _data()
    data.manifest["n1"] = LISTEN_N1
    g = np.random.default_rng(seed)
    for v in data.streams.values():
        v[1:] = g.integers(0, 32, v[1:].shape)
    return data


def test_a_listening_drill_is_a_level1_sample_in_the_serving_layout(listen_rows):
    """A drill row enters the fine-tune as the serving engine would feed it: its profile in the L1 chunk, the L2
    chunk empty, the dialog (the user's spoken question on the listen rows) after both; the text channel is
    supervised over the whole dialog, the speak codebooks not at all. `listen.collate` in the serving layout
    (what bench/diag_drills_whole.py --layout serving scores) gives the fine-tune's own text logits."""
    import random

    from egomem.training.listen import collate, text_logits

    model = build_lm("tiny", seed=0, **LISTEN_MODEL)
    row = listen_rows.row(random.Random(5))
    sample, tokens = row.as_sample()
    assert sample.l1_text.startswith("name: ") and sample.l2_text == "" and sample.generator == "listen-drill"
    assert TOK.encode(sample.l1_text) == row.chunk and len(row.chunk) <= LISTEN_N1
    batch = make_batch(model, TOK, [(sample, tokens)], LISTEN_N1, N2)
    T = tokens.shape[1]
    l1 = memchunk_inputs(model, row.chunk, LISTEN_N1)
    assert torch.equal(batch.chunks[0, :, :LISTEN_N1], l1)
    assert torch.equal(batch.chunks[0, :, LISTEN_N1:], memchunk_inputs(model, [], N2))
    assert torch.equal(batch.stream[0, :, :T], torch.from_numpy(tokens))
    assert batch.text_mask[0, :T].all() and not batch.speak_mask.any()
    tick, question = row.spoken[0]
    assert question in LISTEN_QUESTIONS and not np.array_equal(tokens[9:, tick], tokens[9:, 0])
    with torch.no_grad(), no_compile():  # the listening stage's scorer, told the serving layout, sees the same
        out = forward(model, batch.chunks, batch.stream)
        packed = collate(model, [row], (LISTEN_N1, N2))
        assert packed.offsets == [LISTEN_N1 + N2]
        torch.testing.assert_close(text_logits(model, packed)[0, LISTEN_N1 + N2:], out.text_logits[0, :T])


def test_listen_drills_replace_rows_and_resume_bit_exactly(tmp_path, listen_rows):
    """--listen-drills 1: every row is a drill, so the corpus rows no longer matter (two datasets train the same
    weights); 0.5: a resumed run draws exactly the drills an uninterrupted one did."""
    a, b = _listen_data(1), _listen_data(2)
    cfg = dict(model_overrides=LISTEN_MODEL, steps=4)
    runs = {(p, name): load_file(str(finetune(_cfg(tmp_path, f"{p}-{name}", listen_drills=p, **cfg), d,
                                              progress=False, listen=listen_rows)))
            for p in (0.0, 1.0) for name, d in (("a", a), ("b", b))}
    same = runs[1.0, "a"], runs[1.0, "b"]
    assert all(torch.equal(same[0][k], same[1][k]) for k in same[0])
    plain = runs[0.0, "a"], runs[0.0, "b"]
    assert any(not torch.equal(plain[0][k], plain[1][k]) for k in plain[0])
    whole = load_file(str(finetune(_cfg(tmp_path, "half", listen_drills=0.5, **cfg), a, progress=False,
                                   listen=listen_rows)))
    assert any(not torch.equal(whole[k], runs[0.0, "a"][k]) for k in whole)
    finetune(_cfg(tmp_path, "part", listen_drills=0.5, stop_after=2, **cfg), a, progress=False, listen=listen_rows)
    resumed = load_file(str(finetune(_cfg(tmp_path, "part", listen_drills=0.5, resume=True, **cfg), a,
                                     progress=False, listen=listen_rows)))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    with pytest.raises(ValueError, match=r"listen_drills must be in \[0, 1\]"):
        finetune(_cfg(tmp_path, "bad", listen_drills=1.5), a, progress=False, listen=listen_rows)


@pytest.mark.parametrize("flag, bank, what", [("--listen-drills", "listen_clips_train.npz", "listening drills"),
                                              ("--query-drills", "query_clips_train.npz", "query drills")])
def test_drills_refuse_a_codec_the_dataset_was_not_made_with(tmp_path, capsys, monkeypatch, flag, bank, what):
    """The drills are spoken through the config's codec; a dataset encoded by another is refused by name."""
    from egomem.training.dataset import write_dataset

    monkeypatch.delenv("EGOMEM_CONFIG", raising=False)
    mem = _data()  # its manifest says codec "test"
    manifest = {k: mem.manifest[k] for k in ("n1", "n2", "tokenizer", "codec", "seed")}
    write_dataset(tmp_path / "ds", manifest, [], [], mem.streams, mem.samples)
    p = argparse.ArgumentParser()
    add_finetune_args(p)
    args = p.parse_args(["--data", str(tmp_path / "ds"), "--out", str(tmp_path / "run"), flag, "0.5",
                         "--no-progress"])
    args.config = None
    assert run_finetune(args) == 2
    err = capsys.readouterr().err
    assert "encoded by codec test" in err and "[mimi]" in err and f"the {what} would be" in err
    assert not (tmp_path / "run" / bank).exists()  # refused before any clip was spoken


# ---------------------------------------------------------------- query drills (--query-drills)


@pytest.fixture(scope="module")
def query_rows():
    from egomem.config import MimiConfig
    from egomem.training.listen import ClipBank
    from egomem.training.query_drill import QueryRows
    from egomem.training.streams import silence_code
    from egomem.training.tts import TRAIN_VOICES
    from egomem.training.types import Query
    from egomem.trigger.codec import build_codec

    codec = build_codec(MimiConfig())
    questions = {"Where does my aunt live?": ("aunt", Query(("aunt",), ("live", "city"))),
                 "What is my boss's name?": ("boss", Query(("boss",), ()))}
    bank = ClipBank(codec, TRAIN_VOICES[:1], sorted(questions), seed=0, progress=False, copies=1)
    rows = QueryRows(bank, questions, silence_code(codec), l1_bytes=LISTEN_N1)
    yield rows
    rows.close()


def test_query_drills_replace_rows_keep_listening_drills_and_resume_bit_exactly(tmp_path, query_rows, listen_rows):
    """--query-drills 1: every row is a query drill (two datasets train the same weights); with listening drills
    too, a row already a listening drill stays one (the run differs from query drills alone); 0.5 resumes
    bit-exactly; out-of-range shares and a missing source are refused."""
    a, b = _listen_data(1), _listen_data(2)
    cfg = dict(model_overrides=LISTEN_MODEL, steps=4)
    runs = {name: load_file(str(finetune(_cfg(tmp_path, name, query_drills=1.0, **cfg), d, progress=False,
                                         query=query_rows))) for name, d in (("a", a), ("b", b))}
    assert all(torch.equal(runs["a"][k], runs["b"][k]) for k in runs["a"])
    both = load_file(str(finetune(_cfg(tmp_path, "both", query_drills=1.0, listen_drills=0.5, **cfg), a,
                                  progress=False, query=query_rows, listen=listen_rows)))
    assert any(not torch.equal(both[k], runs["a"][k]) for k in both)
    whole = load_file(str(finetune(_cfg(tmp_path, "half", query_drills=0.5, **cfg), a, progress=False,
                                   query=query_rows)))
    finetune(_cfg(tmp_path, "part", query_drills=0.5, stop_after=2, **cfg), a, progress=False, query=query_rows)
    resumed = load_file(str(finetune(_cfg(tmp_path, "part", query_drills=0.5, resume=True, **cfg), a,
                                     progress=False, query=query_rows)))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    with pytest.raises(ValueError, match=r"query_drills must be in \[0, 1\]"):
        finetune(_cfg(tmp_path, "bad", query_drills=-0.1), a, progress=False, query=query_rows)
    with pytest.raises(ValueError, match=r"query_relations, query_voices and query_templates must be >= 1 "
                                         r"\(got 80, 0, 2\)"):
        finetune(_cfg(tmp_path, "bad", query_drills=0.5, query_relations=80, query_voices=0), a, progress=False,
                 query=query_rows)
    with pytest.raises(ValueError, match=r"query_voices_per_question must be in \[0, query_voices\] \(got 30\)"):
        finetune(_cfg(tmp_path, "bad", query_drills=0.5, query_voices_per_question=30), a, progress=False,
                 query=query_rows)


def test_speak_dropout_silences_the_speak_rows_and_their_loss(tmp_path):
    """--speak-dropout 1: every corpus row trains with the codec's silence on its speak rows and no speak loss,
    so two datasets that differ only in what the model said train the same weights (and differ at 0); 0.5
    resumes bit-exactly. Without a silence code the trainer refuses the setting."""
    from egomem.training.finetune import _Trainer

    a = _data()
    b = MemData(a.samples, {k: v.copy() for k, v in a.streams.items()})
    for v in b.streams.values():
        v[1:9] = (v[1:9] + 7) % TINY["card"]
    silence = np.arange(8, dtype=np.int64)
    runs = {(p, name): load_file(str(finetune(_cfg(tmp_path, f"{p}-{name}", steps=4, speak_dropout=p), d,
                                              progress=False, silence=silence)))
            for p in (0.0, 1.0) for name, d in (("a", a), ("b", b))}
    assert all(torch.equal(runs[1.0, "a"][k], runs[1.0, "b"][k]) for k in runs[1.0, "a"])
    assert any(not torch.equal(runs[0.0, "a"][k], runs[0.0, "b"][k]) for k in runs[0.0, "a"])
    t = _Trainer(_cfg(tmp_path, "rows", speak_dropout=1.0), a, torch.device("cpu"), torch.float32, silence=silence)
    sample, tokens = t._speak_dropout(0, a.samples[0], a.tokens(a.samples[0].stream))
    assert sample.speak == () and sample.text == a.samples[0].text
    assert (tokens[1:9] == silence[:, None]).all() and np.array_equal(tokens[[0, *range(9, 17)]],
                                                                     a.tokens(a.samples[0].stream)[[0, *range(9, 17)]])
    whole = load_file(str(finetune(_cfg(tmp_path, "half", steps=4, speak_dropout=0.5), a, progress=False,
                                   silence=silence)))
    finetune(_cfg(tmp_path, "part", steps=4, speak_dropout=0.5, stop_after=2), a, progress=False, silence=silence)
    resumed = load_file(str(finetune(_cfg(tmp_path, "part", steps=4, speak_dropout=0.5, resume=True), a,
                                     progress=False, silence=silence)))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    with pytest.raises(ValueError, match="silence code"):
        _Trainer(_cfg(tmp_path, "none", speak_dropout=0.5), a, torch.device("cpu"), torch.float32)


def test_query_seed_picks_the_drills_questions_apart_from_the_run_seed(tmp_path):
    """--query-seed: the query drills' questions (and so their bank) follow it, not --seed, so a fine-tune with
    another --seed reuses a query stage's bank; unset, they follow --seed. A real (one-clip) bank is spoken."""
    from egomem.training.finetune import query_source
    from egomem.training.query_drill import bank_questions

    small = dict(query_drills=0.5, query_relations=2, query_voices=1, query_templates=1)
    seeds = {s: set(bank_questions(2, 1, s)) for s in (0, 1, 2, 3)}
    a, b = next((a, b) for a in seeds for b in seeds if seeds[a] != seeds[b])  # two seeds that ask differently
    got = query_source(_cfg(tmp_path, "q", seed=b, query_seed=a, **small), {"n1": 256}, None, progress=False)
    assert set(got.questions) == seeds[a]
    plain = query_source(_cfg(tmp_path, "p", seed=b, **small), {"n1": 256}, None, progress=False)
    assert set(plain.questions) == seeds[b]


def test_listen_seed_reuses_another_seeds_listening_bank(tmp_path):
    """--listen-seed: the listening drills' bank follows it, not --seed, so a fine-tune with another --seed loads a
    bank built under the first seed from its cache instead of rebuilding (and overwriting) it."""
    from egomem.training.finetune import listen_source

    small = dict(listen_drills=0.5, listen_voices=1, listen_bank=tmp_path / "bank.npz")
    manifest = {"n1": 256}
    first = listen_source(_cfg(tmp_path, "a", seed=2, **small), manifest, None, progress=False)
    built = (tmp_path / "bank.npz").stat().st_mtime_ns
    again = listen_source(_cfg(tmp_path, "b", seed=5, listen_seed=2, **small), manifest, None, progress=False)
    assert again.bank.fingerprint == first.bank.fingerprint and (tmp_path / "bank.npz").stat().st_mtime_ns == built
    other = listen_source(_cfg(tmp_path, "c", seed=5, **small), manifest, None, progress=False)
    assert other.bank.fingerprint != first.bank.fingerprint
