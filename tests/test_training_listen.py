"""Listening drills (egomem/training/listen.py) and `egomem train-backbone --task listen`.

Rows are built from real speech (eSpeak NG + the shipped tiny Mimi) in one or two voices; every question the
row asks must be heard on the listen rows right before its answer, and every answer's value must be in the
row's MemChunk text. The loop trains a small LMModel from a copying run's weights and resumes bit-exactly;
whether the tiny preset learns to hear is the benchmark's (docs/training.md), not a unit test's.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from egomem.config import MimiConfig
from egomem.dialog.checkpoint import build_lm
from egomem.dialog.engine import memchunk_inputs
from egomem.dialog.tokenizer import ByteTokenizer
from egomem.training.backbone import BackboneConfig, main, train_backbone
from egomem.training.forward import dialog_inputs
from egomem.training.listen import ClipBank, ListenRows, code_vectors, collate, held_scores, init_listen_embeddings
from egomem.training.listen import loss as listen_loss
from egomem.training.streams import silence_code
from egomem.training.tts import HELDOUT_VOICES, TRAIN_VOICES, TTSCache
from egomem.trigger.codec import build_codec

# the backbone tests' small model, with Mimi's 2048 codes (the rows carry real speech codes)
SMALL = dict(dim=64, num_heads=2, num_layers=2, context=1024, depformer_dim=32, depformer_dim_feedforward=64,
             depformer_num_heads=2, depformer_num_layers=1)
QUESTIONS = ("Where do I live again?", "What do I do for work?", "What is my name?", "What pet do I have?",
             "What did we talk about last time?")
TOK = ByteTokenizer()

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def codec():
    return build_codec(MimiConfig())


@pytest.fixture(scope="module")
def bank(codec):
    return ClipBank(codec, TRAIN_VOICES[:2], QUESTIONS, seed=3, progress=False)


def test_a_row_asks_spoken_questions_and_answers_them_from_its_profile(codec, bank):
    silence = silence_code(codec).astype(np.int64)
    rows = ListenRows(bank, "train", silence, questions=(1, 3), greeting_p=0.5, noised_p=0.5)
    r = random.Random(0)
    asked = greeted = noised = 0
    try:
        for _ in range(24):
            row = rows.row(r)
            l1 = TOK.decode(row.chunk)
            text, speak, listen = row.stream[0], row.stream[1:9], row.stream[9:]
            assert l1.startswith("name: ") and "people:" not in l1  # the person without their relations
            assert (speak == silence[:, None]).all()  # the model's voice is silent: text only
            said = np.zeros(len(text), bool)
            previous_end = 0
            for a in row.answers:
                reply = TOK.decode(text[a.start:a.end].tolist())
                value = TOK.decode(text[a.value_start:a.value_end].tolist())
                assert value and value in reply and value in l1, (reply, value, l1)  # the value is read from L1
                said[a.start:a.end] = True
                if a.greeting:
                    greeted += 1
                    assert reply.split()[0] in ("Hi", "Hello", "Hey", "Good") and a is row.answers[0]
                    assert l1.startswith(f"name: {value} ")  # greets the person by their first name
                else:
                    asked += 1
                    heard = listen[:, previous_end:a.start].T  # the question is spoken between the last reply and it
                    clips = [c for (q, v), c in bank.clean.items()] + [c for k, c in bank.noised.items()]
                    spoken = [c[:bank.speech_frames(c)] for c in clips]  # its tail runs on under the reply
                    assert any(len(c) <= len(heard) and any((heard[i:i + len(c)] == c).all()
                                                            for i in range(len(heard) - len(c) + 1)) for c in spoken)
                previous_end = a.end
            assert (text[~said] == TOK.pad_id).all()
            assert len(row.spoken) == sum(not a.greeting for a in row.answers)  # what was said, where, by whom
            for at, q in row.spoken:
                clip = bank.clean[(q, row.voice)] if row.noise_copy is None else bank.noised[(q, row.voice, row.noise_copy)]
                n = bank.speech_frames(clip)
                assert (listen[:, at:at + n].T == clip[:n]).all()
            if not (listen[:, :row.answers[0].start] == silence[:, None]).all():
                noised += 1  # a noised row's background is noise, not the codec's silence
        assert asked >= 24 and greeted >= 4 and 4 <= noised <= 20
    finally:
        rows.close()


def test_held_out_rows_are_held_out_people_in_held_out_voices(codec):
    held_bank = ClipBank(codec, HELDOUT_VOICES[:1], QUESTIONS, seed=3, progress=False)
    rows = ListenRows(held_bank, "heldout", silence_code(codec), questions=(1, 1), greeting_p=0.0, noised_p=0.0)
    try:
        row = rows.row(random.Random(1))
        assert held_bank.voices == HELDOUT_VOICES[:1] and not set(held_bank.voices) & set(TRAIN_VOICES)
        assert rows._homes and all(h.split == "heldout" for h in rows._homes.values())
    finally:
        rows.close()
    assert row.answers and not row.answers[0].greeting


def test_the_clip_bank_is_cached_and_rebuilt_when_its_inputs_change(codec, bank, tmp_path):
    path = tmp_path / "clips.npz"
    first = ClipBank(codec, TRAIN_VOICES[:2], QUESTIONS, seed=3, progress=False, cache=path)
    assert path.is_file() and first.fingerprint == bank.fingerprint
    assert all(np.array_equal(first.clean[k], bank.clean[k]) for k in bank.clean)  # seeded: the same bank
    assert all(np.array_equal(first.noised[k], bank.noised[k]) for k in bank.noised)
    stamp = path.stat().st_mtime_ns
    again = ClipBank(codec, TRAIN_VOICES[:2], QUESTIONS, seed=3, progress=False, cache=path)
    assert path.stat().st_mtime_ns == stamp and again.background.keys() == bank.background.keys()  # loaded
    assert all(np.array_equal(again.background[k], bank.background[k]) for k in bank.background)
    other = ClipBank(codec, TRAIN_VOICES[:2], QUESTIONS, seed=4, progress=False, cache=path)
    assert other.fingerprint != bank.fingerprint and path.stat().st_mtime_ns != stamp  # rebuilt and rewritten
    assert not all(np.array_equal(other.background[k], bank.background[k]) for k in bank.background)
    for (q, v, _b), codes in bank.noised.items():  # every noised clip is the clean one under noise
        assert codes.shape == bank.clean[(q, v)].shape and not np.array_equal(codes, bank.clean[(q, v)])


def test_a_killed_clip_bank_build_goes_on_from_its_saved_voices(codec, bank, tmp_path):
    """Each voice is saved under <cache>.parts/ once built; a build finding a voice there loads it instead of
    speaking it again, and the parts go once the whole bank is saved."""
    path = tmp_path / "clips.npz"
    parts = tmp_path / "clips.npz.parts"
    v0, v1 = TRAIN_VOICES[:2]
    q = QUESTIONS[0]
    marked = ClipBank(codec, TRAIN_VOICES[:2], QUESTIONS, seed=3, progress=False, cache=path)
    assert path.is_file() and not parts.exists()  # a finished build leaves no parts behind
    marked.clean[(q, v0)] = marked.clean[(q, v0)] + 1  # what a voice built before the kill holds, marked
    parts.mkdir()
    marked._save(parts / f"{marked.fingerprint}-0.npz", voices=(v0,))
    path.unlink()  # killed before the whole bank was saved
    resumed = ClipBank(codec, TRAIN_VOICES[:2], QUESTIONS, seed=3, progress=False, cache=path)
    assert np.array_equal(resumed.clean[(q, v0)], bank.clean[(q, v0)] + 1)  # voice 0 loaded, not spoken again
    assert all(np.array_equal(resumed.clean[(x, v1)], bank.clean[(x, v1)]) for x in QUESTIONS)  # voice 1 built
    assert resumed.noised.keys() == bank.noised.keys() and resumed.background.keys() == bank.background.keys()
    assert path.is_file() and not parts.exists()


def test_a_clip_is_encoded_as_a_one_pass_microphone_hears_it(codec, bank):
    """A question's codes are those of one pass over [silence | question | silence], not of the question alone."""
    from egomem.trigger.codec import FRAME_SAMPLES, encode

    q, v = QUESTIONS[1], TRAIN_VOICES[0]
    w = TTSCache()(q, v)
    n = -(-len(w) // FRAME_SAMPLES)
    lead, tail = bank.lead, bank.tail
    mic = np.concatenate([np.zeros((lead + 7) * FRAME_SAMPLES), w, np.zeros((tail + 9) * FRAME_SAMPLES)])
    one_pass = encode(codec, mic)[lead + 7:lead + 7 + n + tail]  # the clip's frames in a longer recording
    clip = bank.clean[(q, v)]
    assert clip.shape == (n + tail, 8) and bank.speech_frames(clip) == n
    agree = (clip[:, 0] == one_pass[:, 0]).mean()  # the first codebook as the longer pass writes it ...
    alone = (encode(codec, w)[:, 0] == one_pass[:n, 0]).mean()  # ... far closer than the question encoded alone
    assert agree >= 0.85 and agree >= alone + 0.2, (agree, alone)
    for b in range(bank.copies):
        assert bank.noised[(q, v, b)].shape == clip.shape


def test_collate_packs_each_row_as_the_engine_feeds_it(codec, bank):
    lm = build_lm("tiny", **SMALL)
    rows = ListenRows(bank, "train", silence_code(codec), questions=(1, 2), greeting_p=0.5, noised_p=0.5)
    try:
        got = [rows.row(random.Random(s)) for s in range(3)]
    finally:
        rows.close()
    b = collate(lm, got)
    assert b.inputs.shape[2] == max(len(x.chunk) + x.stream.shape[1] for x in got)
    for i, x in enumerate(got):
        c, n = len(x.chunk), x.stream.shape[1]
        assert b.offsets[i] == c
        assert torch.equal(b.inputs[i, :, :c], memchunk_inputs(lm, x.chunk, c))  # the chunk as serving writes it
        assert torch.equal(b.inputs[i, :, c:c + n], dialog_inputs(lm, torch.from_numpy(x.stream)[None])[0])
        assert torch.equal(b.targets[i, c:c + n], torch.from_numpy(x.stream[0]))
        assert b.mask[i].sum() == n and b.mask[i, c:c + n].all()


def test_listen_embeddings_are_a_whitened_image_of_the_codec_latent(codec, bank):
    vec = code_vectors(codec)
    codes = torch.randint(0, 2048, (1, 8, 6), generator=torch.Generator().manual_seed(0))
    latent = codec.quantizer.decode(codes)[0].T  # [T, D]
    assert torch.allclose(vec[torch.arange(8)[:, None], codes[0]].sum(0), latent, atol=1e-4)  # linear in the codes

    lm = build_lm("tiny", **SMALL)
    before = [e.weight.detach().clone() for e in lm.emb]
    frames = np.concatenate(list(bank.clean.values()))
    rank = init_listen_embeddings(lm, codec, frames, seed=0, rms=0.5)
    idx = [torch.as_tensor(frames[:, k], dtype=torch.long) for k in range(8)]
    added = sum((lm.emb[8 + k].weight - before[8 + k])[idx[k]] for k in range(8)).detach()  # the codec's image
    assert 2 <= rank <= 64 and abs(float(added.pow(2).mean().sqrt()) - 0.5) < 1e-3  # at the asked RMS
    assert torch.allclose(added.mean(0), torch.zeros(added.shape[1]), atol=1e-3)  # centred on speech
    eig = torch.linalg.eigvalsh(torch.cov(added.T))
    assert float(eig[-rank:].max() / eig[-rank:].min()) < 1.01 and float(eig[:-rank].abs().max()) < 1e-4  # whitened
    assert all(torch.equal(lm.emb[k].weight, before[k]) for k in range(8))  # the model's own (speak) rows as they were
    assert all(torch.equal(lm.emb[8 + k].weight[2048], before[8 + k][2048]) for k in range(8))  # the chunk audio token


class _Scripted:
    """A stand-in model for `held_scores`: its text logits put all mass on the given tokens."""

    def __init__(self, tokens: torch.Tensor, vocab: int = 260):
        self.logits = torch.nn.functional.one_hot(tokens, vocab).float()[:, None]

    def forward_text(self, inputs: torch.Tensor):
        return None, self.logits

    def eval(self):
        return self

    def train(self):
        return self


def test_held_scores_count_whole_replies_their_form_and_their_value(codec, bank):
    lm = build_lm("tiny", **SMALL)
    rows = ListenRows(bank, "train", silence_code(codec), questions=(2, 2), greeting_p=1.0, noised_p=0.0)
    try:
        b = collate(lm, [rows.row(random.Random(5))])
    finally:
        rows.close()
    greet, first, second = b.answers[0]
    c = b.offsets[0]
    assert held_scores(_Scripted(b.targets), [b]) == {"answer": 1.0, "form": 1.0, "form_after_start": 1.0,
                                                      "value": 1.0, "greeting": 1.0}
    wrong = b.targets.clone()
    wrong[0, c + first.value_start] += 1  # a wrong byte in the first answer's value
    wrong[0, c + second.start] += 1  # and in the second answer's words
    wrong[0, c + greet.value_start] += 1  # and in the greeted name
    assert held_scores(_Scripted(wrong), [b]) == {"answer": 0.0, "form": 0.5, "form_after_start": 1.0,  # first byte
                                                  "value": 0.5, "greeting": 0.0}
    wrong[0, c + second.start + 1] += 1  # a wrong byte after the first of the second answer's words
    assert held_scores(_Scripted(wrong), [b])["form_after_start"] == 0.5


def test_head_weight_weights_the_first_ten_bytes_of_every_reply(codec, bank):
    lm = build_lm("tiny", **SMALL)
    rows = ListenRows(bank, "train", silence_code(codec), questions=(2, 3), greeting_p=1.0, noised_p=0.0)
    try:
        b = collate(lm, [rows.row(random.Random(s)) for s in (1, 2)])
    finally:
        rows.close()
    with torch.no_grad():
        logits = lm.forward_text(b.inputs)[1][:, 0]
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), b.targets, reduction="none")
        w = torch.where(b.targets == lm.text_padding_token_id, 0.5, 1.0) * b.mask
        for i, (c, answers) in enumerate(zip(b.offsets, b.answers, strict=True)):
            for a in answers:  # the heads, from the rows' own reply positions
                w[i, c + a.start:c + min(a.start + 10, a.end)] *= 3.0
        want = (ce * w).sum() / w.sum()
        assert torch.allclose(listen_loss(lm, b, head_weight=3.0), want, rtol=1e-5)
        assert not torch.allclose(listen_loss(lm, b), want, rtol=1e-3)


def listen_config(out, weights, **kw) -> BackboneConfig:
    base = dict(task="listen", weights=weights, model_overrides=SMALL, steps=6, batch_size=2, lr=2e-3, warmup=2,
                questions=(1, 2), voices=1, eval_every=3, ckpt_every=3)
    return BackboneConfig(out, **(base | kw))


def test_the_listen_stage_trains_from_weights_and_resumes_bit_exactly(tmp_path):
    start = tmp_path / "start.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in build_lm("tiny", seed=9, **SMALL).state_dict().items()}, str(start))
    whole = train_backbone(listen_config(tmp_path / "whole", start), progress=False)
    assert whole.complete and set(whole.held) == {"held_answer", "held_form", "held_form_after_start",
                                                  "held_value", "held_greeting"}
    records = [json.loads(x) for x in (tmp_path / "whole" / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7)) and "held_form" in records[2]
    card = json.loads((tmp_path / "whole" / "model_card.json").read_text())
    assert card["task"] == "listen" and card["started_from"] == str(start) and "held_answer" in card
    assert (tmp_path / "whole" / "listen_clips_train.npz").is_file()

    part = train_backbone(listen_config(tmp_path / "split", start, stop_after=4), progress=False)
    assert not part.complete and part.step == 4
    done = train_backbone(listen_config(tmp_path / "split", start, resume=True), progress=False)
    a, b = load_file(str(whole.path)), load_file(str(done.path))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    s = load_file(str(start))
    assert not torch.equal(a["text_emb.weight"], s["text_emb.weight"])  # trained, from the start weights


def test_bad_listen_settings_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"questions \(0, 2\)"):
        train_backbone(listen_config(tmp_path / "a", None, questions=(0, 2)), progress=False)
    with pytest.raises(ValueError, match="noised_p must lie in"):
        train_backbone(listen_config(tmp_path / "a", None, noised_p=1.5), progress=False)
    with pytest.raises(ValueError, match="task 'read'"):
        train_backbone(listen_config(tmp_path / "a", None, task="read"), progress=False)
    assert main(["--out", str(tmp_path / "b"), "--task", "listen", "--weights", str(tmp_path / "missing.safetensors"),
                 "--no-progress"]) == 2
    assert "missing.safetensors does not exist" in capsys.readouterr().err
