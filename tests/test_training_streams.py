"""Token streams of the training corpus (egomem/training/streams.py, tts.py) on hand-made dialogs.

Real parts throughout: eSpeak NG from the espeakng-loader wheel speaks every line, the project's tiny
Mimi encodes it. With fixed timing ranges every frame boundary is known in advance from the lengths
of the real utterances, so the tests check exact positions: the 2-frame text lead, the query words of
a Level-2 turn, interruptions cutting text and audio at the next user turn, truncation at the cap.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from egomem.config import MimiConfig
from egomem.dialog.tokenizer import ByteTokenizer
from egomem.training.streams import (
    FRAME_SAMPLES,
    MAX_DIALOG_STEPS,
    DialogLayout,
    StreamBuilder,
    StreamLayout,
    StreamSpec,
    TurnLayout,
    conversation_starts,
    dialog_persons,
    group_dialogs,
    noise_draw,
)
from egomem.training.tts import (
    HELDOUT_VOICES,
    MODEL_VOICE,
    SAMPLE_RATE,
    TRAIN_VOICES,
    TTSCache,
    TTSError,
    Voice,
    synthesize,
    voice_for,
)
from egomem.training.types import Dialog, Query, Turn
from egomem.trigger.codec import build_codec, encode

PAD = ByteTokenizer.pad_id
# fixed gaps: positions follow from the utterances' lengths alone
FIXED = StreamSpec(lead_in=(4, 4), reply_gap=(3, 3), query_gap=(2, 2), retrieval_wait=(1, 1), pause=(5, 5),
                   dialog_gap=(20, 20), interrupt_p=0.0, tail=4)

GREET = Dialog("ada", "ada", 1, (
    Turn("", "Hello Ada, nice to see you."),
    Turn("How did my match go?", "You won at tennis in Lisbon."),
), "hand:1")
ASK = Dialog("ada", "bob", 2, (
    Turn("Who is my sister?", "Your sister is Cleo.", 2, Query(("sister",), ("Cleo",))),
), "hand:1")
USER_LINES = ("What time is it?", "Tell me a joke.", "Thanks a lot.")
REPLY_LINES = ("It is three in the afternoon, time for tea.", "Why did the cat sit on the computer?",
               "You are welcome, any time.")


def chatty(n_turns: int, user: str = "ada", split: str = "train") -> Dialog:
    """A long dialog made of few distinct lines (each is spoken and encoded once)."""
    turns = tuple(Turn(USER_LINES[i % 3], REPLY_LINES[(i * 2) % 3]) for i in range(n_turns))
    return Dialog("ada", user, 1, turns, "hand:1", split)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def codec():
    return build_codec(MimiConfig())  # tiny preset, seeded random init: the offline default


@pytest.fixture(scope="module")
def tts():
    return TTSCache()


def builder(codec, tts, spec: StreamSpec = FIXED, seed: int = 0) -> StreamBuilder:
    return StreamBuilder(codec, spec=spec, seed=seed, tts=tts)


# -- TTS --------------------------------------------------------------------------------------------


def test_tts_speaks_24khz_float_per_voice():
    line = "Hello Ada, how was tennis in Lisbon?"
    a = synthesize(line, TRAIN_VOICES[0])
    b = synthesize(line, HELDOUT_VOICES[0])
    assert a.dtype == np.float32 and np.abs(a).max() <= 1.0
    assert 1.0 < len(a) / SAMPLE_RATE < 5.0  # a short sentence
    assert np.sqrt(np.mean(a ** 2)) > 0.01  # not silence
    assert len(a) != len(b) or not np.allclose(a, b)  # another voice sounds different
    assert len(synthesize("", MODEL_VOICE)) == 0


def test_tts_is_reproducible_in_any_order_and_process():
    """eSpeak keeps state across lines; every line runs in a freshly loaded library, so a dataset rebuilds
    bit-exactly."""
    line = "Your sister Cleo called about the picnic."
    first = synthesize(line, TRAIN_VOICES[3])
    for v in (HELDOUT_VOICES[2], MODEL_VOICE, TRAIN_VOICES[5]):
        synthesize("Something else entirely, with other words.", v)
    assert np.array_equal(first, synthesize(line, TRAIN_VOICES[3]))
    code = ("import hashlib; from egomem.training.tts import TRAIN_VOICES, synthesize; "
            f"print(hashlib.sha256(synthesize({line!r}, TRAIN_VOICES[3]).tobytes()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == hashlib.sha256(first.tobytes()).hexdigest()


def test_voice_splits_are_disjoint():
    def parts(vs):
        return {v.name.split("+")[0] for v in vs}, {v.name.split("+")[1] for v in vs}

    (ta, tv), (ha, hv) = parts(TRAIN_VOICES), parts(HELDOUT_VOICES)
    assert not ta & ha and not tv & hv  # neither accent nor variant of a held-out voice is heard in training
    assert MODEL_VOICE not in TRAIN_VOICES + HELDOUT_VOICES
    assert voice_for("ada", "train") in TRAIN_VOICES and voice_for("ada", "heldout") in HELDOUT_VOICES
    assert voice_for("ada", "train") == voice_for("ada", "train")
    assert len({voice_for(f"user{i}", "train") for i in range(200)}) > len(TRAIN_VOICES) // 2  # users spread out


def test_tts_missing_voice_says_what_to_do():
    with pytest.raises(TTSError, match="no voice 'en-gb'"):
        synthesize("hi", Voice("en-gb"))
    with pytest.raises(TTSError, match="no voice variant 'nope'"):  # eSpeak itself would ignore it silently
        synthesize("hi", Voice("en-us+nope"))
    with pytest.raises(TTSError, match="'f2' uses breath noise"):  # not reproducible
        synthesize("hi", Voice("en-us+f2"))


def test_tts_cache_speaks_each_line_once(tts):
    cache = TTSCache()
    x = cache("Good morning.", TRAIN_VOICES[1])
    y = cache("Good morning.", TRAIN_VOICES[1])
    cache("Good morning.", TRAIN_VOICES[2])
    assert y is x and (cache.hits, cache.misses) == (1, 2)


# -- exact layout -------------------------------------------------------------------------------------


def whole_listen(b: StreamBuilder, plan, dialogs, n_steps: int) -> np.ndarray:
    """[8, n_steps]: the users' utterances of a plan laid out as one waveform at their frames, encoded in one pass."""
    wav = np.zeros(n_steps * FRAME_SAMPLES, np.float32)
    for d, (_, dlg) in zip(plan, dialogs, strict=False):
        for u in d.turns:
            x = b.tts(dlg.turns[u.turn].user, voice_for(dlg.user_id, dlg.split))
            x = x[:max(0, len(wav) - u.user_start * FRAME_SAMPLES)]
            wav[u.user_start * FRAME_SAMPLES:u.user_start * FRAME_SAMPLES + len(x)] += x
    return encode(b.codec, wav)[:n_steps].T


@pytest.mark.parametrize("listen", ["whole", "spliced"])
def test_exact_positions_text_lead_and_query_words(codec, tts, listen):
    b = builder(codec, tts, replace(FIXED, listen=listen))
    s = b.build("x", [(0, GREET), (1, ASK)], index=0, noised=False)
    U, ids = b.utterance, ByteTokenizer().encode
    ada, bob = voice_for("ada", "train"), voice_for("bob", "train")
    # dialog 0, turn 0: the model greets at lead_in + reply_gap, audio 2 frames after its text
    t0 = TurnLayout(0, 4, 4, None, None, 7, 7 + len(ids(GREET.turns[0].reply)), 9,
                    9 + len(U(GREET.turns[0].reply, MODEL_VOICE)), False)
    u1 = t0.reply_end + 5
    ue = u1 + len(U(GREET.turns[1].user, ada))
    t1 = TurnLayout(1, u1, ue, None, None, ue + 3, ue + 3 + len(ids(GREET.turns[1].reply)), ue + 5,
                    ue + 5 + len(U(GREET.turns[1].reply, MODEL_VOICE)), False)
    # dialog 1: user audio, 2 frames, the query words, 1 frame (retrieval), reply text, +2 reply audio
    v0 = t1.reply_end + 20
    ve = v0 + len(U(ASK.turns[0].user, bob))
    q = ASK.turns[0].query.text()
    qe = ve + 2 + len(ids(q))
    t2 = TurnLayout(0, v0, ve, ve + 2, qe, qe + 1, qe + 1 + len(ids(ASK.turns[0].reply)), qe + 3,
                    qe + 3 + len(U(ASK.turns[0].reply, MODEL_VOICE)), False)
    lay = s.layout
    assert [d.turns for d in lay.dialogs] == [(t0, t1), (t2,)]
    assert [d.index for d in lay.dialogs] == [0, 1] and lay.dialogs[1].voice == str(bob)
    assert lay.n_steps == t2.reply_end + 4 and s.tokens.shape == (17, lay.n_steps) and s.tokens.dtype == np.int16
    text, speak, listen_row = s.tokens[0], s.tokens[1:9], s.tokens[9:]
    sil = b.silence[:, None]
    for (turn, u, voice) in ((GREET.turns[0], t0, ada), (GREET.turns[1], t1, ada), (ASK.turns[0], t2, bob)):
        r = ids(turn.reply)
        assert text[u.reply_text_start:u.reply_text_end].tolist() == r
        assert u.reply_audio_start - u.reply_text_start == 2  # the monologue leads its audio by 2 frames
        assert text[u.reply_text_start - 1] == PAD and text[u.reply_text_end] == PAD
        assert np.array_equal(speak[:, u.reply_audio_start:u.reply_audio_end], U(turn.reply, MODEL_VOICE).T)
        assert (speak[:, u.reply_audio_start - 1] == b.silence).all() and (speak[:, u.reply_audio_end] == b.silence).all()
        alone = U(turn.user, voice).T  # the utterance encoded on its own
        assert alone.shape[1] == u.user_end - u.user_start
        if listen == "spliced":
            assert np.array_equal(listen_row[:, u.user_start:u.user_end], alone)
        elif turn.user:  # encoded in the stream, Mimi's context changes the codes
            assert not np.array_equal(listen_row[:, u.user_start:u.user_end], alone)
    # the query words precede the reply on the text row while the model is silent
    assert text[t2.query_start:t2.query_end].tolist() == ids(q) and text[t2.query_start - 1] == PAD
    assert (text[t2.query_end:t2.reply_text_start] == PAD).all()
    assert (speak[:, t2.query_start:t2.reply_audio_start] == sil).all()
    # silence wherever nobody speaks
    heard = np.zeros(lay.n_steps, bool)
    said = np.zeros(lay.n_steps, bool)
    for u in (t0, t1, t2):
        heard[u.user_start:u.user_end] = True
        said[u.reply_audio_start:u.reply_audio_end] = True
    assert (speak[:, ~said] == sil).all()
    if listen == "spliced":
        assert (listen_row[:, ~heard] == sil).all()
    else:  # the users' audio at its frames, encoded in one pass, as serving's codec writes a microphone
        assert np.array_equal(listen_row, whole_listen(b, s.layout.dialogs, [(0, GREET), (1, ASK)], lay.n_steps))
        assert (listen_row[0, :t1.user_start] == b.silence[0]).mean() > 0.9  # nobody spoke yet: silence
    assert (text[:t0.reply_text_start] == PAD).all() and (text[t2.reply_text_end:] == PAD).all()


def test_interruptions_about_30_percent_cut_at_next_user_turn(codec, tts):
    b = builder(codec, tts, StreamSpec(), seed=3)  # the paper's p = 0.3, default gaps
    dlg = chatty(40)
    inter = total = 0
    for i in range(8):
        lay, _ = b.plan(f"s{i}", [(0, dlg)], np.random.default_rng([3, i]))
        turns = lay.dialogs[0].turns
        total += len(turns) - 1  # every turn but the last has a later user turn
        inter += sum(u.interrupted for u in turns)
        assert not turns[-1].interrupted
    assert total == 8 * 39
    assert 0.22 < inter / total < 0.38, inter / total  # binomial(312, 0.3): 3 sigma = 0.078

    s = b.build("cut", [(0, dlg)], index=5, noised=False)
    turns = s.layout.dialogs[0].turns
    cut = [(u, v) for u, v in zip(turns, turns[1:], strict=False) if u.interrupted]
    assert cut
    ids = ByteTokenizer().encode
    text, speak, listen = s.tokens[0], s.tokens[1:9], s.tokens[9:]
    for u, v in cut:
        turn, nxt = dlg.turns[u.turn], dlg.turns[v.turn]
        full = b.utterance(turn.reply, MODEL_VOICE)
        assert v.user_start == u.reply_audio_end  # the user starts where the model's audio stops
        assert u.reply_audio_start < u.reply_audio_end < u.reply_audio_start + len(full)  # inside the reply
        assert u.reply_text_end <= v.user_start and u.reply_end == v.user_start
        n = u.reply_text_end - u.reply_text_start
        assert text[u.reply_text_start:u.reply_text_end].tolist() == ids(turn.reply)[:n]  # a prefix, then cut
        assert (text[u.reply_text_end:v.reply_text_start] == PAD).all()
        a = u.reply_audio_end - u.reply_audio_start
        assert np.array_equal(speak[:, u.reply_audio_start:u.reply_audio_end], full[:a].T)
        assert (speak[:, u.reply_audio_end:v.reply_audio_start] == b.silence[:, None]).all()
        assert v.user_end - v.user_start == b.frames(nxt.user, voice_for("ada", "train"))
    assert np.array_equal(listen, whole_listen(b, s.layout.dialogs, [(0, dlg)], s.layout.n_steps))
    for u, v in zip(turns, turns[1:], strict=False):
        if not u.interrupted:
            assert v.user_start >= u.reply_end + 3  # waits for the reply to end (pause 3-12)


def test_truncation_to_the_cap(codec, tts):
    assert MAX_DIALOG_STEPS == 8192 - 768 and StreamSpec().max_steps == MAX_DIALOG_STEPS
    dlg = chatty(200)  # ~ 11,000 frames: far over the cap
    b = builder(codec, tts, StreamSpec(), seed=1)
    s = b.build("long", [(0, dlg), (1, chatty(3, user="bob"))], index=0, noised=False)
    lay = s.layout
    assert lay.n_steps == MAX_DIALOG_STEPS and s.tokens.shape == (17, MAX_DIALOG_STEPS)
    assert len(lay.dialogs) == 1  # the second dialog never starts
    turns = lay.dialogs[0].turns
    assert all(u.reply_end <= lay.n_steps for u in turns)
    assert lay.dropped_turns == 203 - len(turns) > 0
    # a small cap: whole turns only in the layout; a turn cut by the cap stays in the tokens as context
    small = builder(codec, tts, replace(FIXED, max_steps=150))
    s = small.build("small", [(0, chatty(6))], index=0, noised=False)
    lay, plan = small.plan("small", [(0, chatty(6))], np.random.default_rng([0, 0]))
    assert s.layout == lay and lay.n_steps == 150 and s.tokens.shape == (17, 150)
    kept = lay.dialogs[0].turns
    nxt = plan[0].turns[len(kept)]  # the first turn that does not end by frame 150
    assert nxt.reply_end > 150 and kept[-1].reply_end <= 150 and lay.dropped_turns == 6 - len(kept)
    # the listen row holds the cut-off turn's audio up to the cap: the full plan, encoded whole
    assert np.array_equal(s.tokens[9:], whole_listen(small, plan, [(0, chatty(6))], 150))
    if nxt.user_start < 150:
        assert not np.array_equal(s.tokens[9:], whole_listen(small, lay.dialogs, [(0, chatty(6))], 150))
    with pytest.raises(ValueError, match="first turn does not end within max_steps=10"):
        builder(codec, tts, StreamSpec(max_steps=10)).build("tiny", [(0, GREET)], index=0, noised=False)


def test_noised_copy_differs_in_listen_codes_only(codec, tts):
    b = builder(codec, tts, StreamSpec(), seed=2)
    held = Dialog("zed", "zed", 1, GREET.turns, "hand:1", "heldout")
    s = b.build("n", [(0, held)], index=7, noised=True)
    assert s.noised is not None and s.noised.shape == s.tokens.shape
    assert np.array_equal(s.noised[:9], s.tokens[:9])  # text and speak rows: the model is not noised
    u = s.layout.dialogs[0].turns[1]
    listen, noisy = s.tokens[9:], s.noised[9:]
    assert (noisy[:, u.user_start:u.user_end] != listen[:, u.user_start:u.user_end]).any()  # noisy speech
    assert (noisy[:, :u.user_start] != listen[:, :u.user_start]).any()  # background noise, not silence codes
    again = b.build("n", [(0, held)], index=7, noised=True)
    assert np.array_equal(again.noised, s.noised) and np.array_equal(again.tokens, s.tokens)  # seeded
    other = b.build("n", [(0, held)], index=8, noised=True)
    assert not np.array_equal(other.noised[9:], s.noised[9:])
    # the layout says the noised copy's SNR: the draw `noise_draw` makes (eval-dialog's `by_snr_db` reads it)
    snr = s.layout.meta["noise_snr_db"]
    assert snr == noise_draw(2, 7, b.spec.noise_snr_db)[1] and 0 <= snr <= 20 and snr != other.layout.meta["noise_snr_db"]
    assert "noise_snr_db" not in b.build("n", [(0, held)], index=7, noised=False).layout.meta


def test_the_recorded_snr_is_the_one_the_noise_was_mixed_at(codec, tts, monkeypatch):
    """The layout's `noise_snr_db` is the level the noised copy's background was mixed at: the audio the codec
    is handed (recorded on its way in, then encoded as ever) holds the user's speech that many dB above it."""
    import egomem.trigger.codec as codec_module

    heard: list[np.ndarray] = []
    real = codec_module.encode
    monkeypatch.setattr(codec_module, "encode", lambda c, wav: heard.append(wav.copy()) or real(c, wav))
    held = Dialog("zed", "zed", 1, GREET.turns, "hand:1", "heldout")
    for lo in (3.0, 17.0):
        heard.clear()
        s = builder(codec, tts, StreamSpec(noise_snr_db=(lo, lo + 1e-6)), seed=2).build("n", [(0, held)], 7, True)
        clean, noisy = [h for h in heard if len(h) == s.layout.n_steps * FRAME_SAMPLES]  # each copy's listen row
        u = s.layout.dialogs[0].turns[1]
        speech = clean[u.user_start * FRAME_SAMPLES:u.user_end * FRAME_SAMPLES]
        measured = 20 * np.log10(np.sqrt(np.mean(speech ** 2)) / np.sqrt(np.mean((noisy - clean) ** 2)))
        assert abs(measured - s.layout.meta["noise_snr_db"]) < 1.5, (lo, measured)



def test_bad_dialogs_are_refused(codec, tts):
    b = builder(codec, tts)
    mute = Dialog("ada", "ada", 1, (Turn("Hi.", "Hello."), Turn("", "Anyone there?")), "hand:1")
    with pytest.raises(ValueError, match="only the first turn may be the model's"):
        b.build("m", [(0, mute)], index=0, noised=False)
    held = Dialog("ada", "bob", 1, (Turn("Hi.", "Hello."),), "hand:1", "heldout")
    with pytest.raises(ValueError, match="mixes train and held-out"):
        b.build("m", [(0, GREET), (1, held)], index=0, noised=False)


def test_group_dialogs_by_household_and_split():
    dialogs = [Dialog(h, h, 1, (Turn("Hi.", "Hello."),), "hand:1", split)
               for h, split, n in (("ada", "train", 7), ("eve", "train", 5), ("zed", "heldout", 4)) for _ in range(n)]
    groups = group_dialogs(dialogs, seed=0, per_stream=(2, 3))
    assert sorted(i for g in groups for i in g) == list(range(16))  # every dialog once
    for g in groups:
        assert len({(dialogs[i].household, dialogs[i].split) for i in g}) == 1 and 1 <= len(g) <= 3
    assert groups == group_dialogs(dialogs, seed=0, per_stream=(2, 3))
    capped = group_dialogs(dialogs, seed=0, per_stream=(2, 3), streams_per_household=1)
    assert len(capped) == 3


def test_conversation_starts_restart_for_each_new_person_only():
    """finetune's context="dialog" / serving's new_person="restart": a conversation begins at frame 0 and again
    where a different person's dialog starts; the same person's next dialog continues their conversation."""
    def dialog(user: str, start: int) -> DialogLayout:
        return DialogLayout(0, user, "v", start, start + 10, ())

    users = [("ada", 2), ("ada", 20), ("bob", 40), ("cy", 60), ("cy", 80), ("ada", 100)]
    layout = StreamLayout("s0", 120, tuple(dialog(u, s) for u, s in users))
    assert conversation_starts(layout) == [0, 0, 40, 60, 60, 100]
    assert dialog_persons(layout) == ["first", "same", "new", "new", "same", "new"]  # eval-dialog's by_person
    assert conversation_starts(StreamLayout("s1", 5, ())) == [] == dialog_persons(StreamLayout("s1", 5, ()))
