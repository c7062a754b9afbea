"""Token streams of the training corpus (paper §4.1): several dialogs' audio and monologue in one 17-row stream.

A stream is what the model would have heard and said in one session: dialogs (of one household's
users) one after another, separated by silence. Per 80 ms frame it holds `[text, 8 speak, 8 listen]`
(the aligned layout of `egomem.training.forward`):

- listen: the user's turns, spoken by the user's voice (`tts.voice_for`) and encoded by the
  configured Mimi; the codec's code of silence (`silence_code`) where the user is silent;
- speak: the model's replies in its own fixed voice (`tts.MODEL_VOICE`), silence elsewhere;
- text: the model's monologue, one tokenizer id per frame (no word alignment), starting
  `text_lead` = 2 frames before the reply's audio; text pad (3) elsewhere. On a Level-2 turn the
  model first writes `query.text()` (`<retr>:...<answer>`) while silent, then the reply.

Timing per turn: the user speaks, a short gap, then the model's monologue and, 2 frames later, its
audio. The next user turn waits for the reply to end, or with probability `interrupt_p` = 0.3 cuts
into the reply's audio: the model's audio and text stop at the frame the user starts. A dialog's
first turn may be the model's greeting (`Turn.user == ""`). Streams end at `max_steps` = 8192 - 768
(the whole context with the 768 MemChunk steps fits 8,192): turns that do not end by then stay in
the tokens as unsupervised context but leave the `StreamLayout`, which lists the frame boundaries
the supervision masks (`masks.py`) are cut from.

The listen row is encoded whole (`StreamSpec.listen = "whole"`, the default): the user's utterances
are laid out as one 24 kHz waveform at their frames (digital silence between) and the configured Mimi
encodes it in one pass, which is what serving's codec writes for a microphone. Mimi's encoder attends
over seconds of audio, so an utterance encoded alone gets other codes: against the whole encoding
the first codebook agrees on 0.66 of the speech frames and 0.40 of the 8 frames after it, and all 8
codebooks on almost none (held-out corpus streams, docs/departures.md D26). `listen = "spliced"`
keeps the corpus before that (each utterance's codes cached and cut in; the runs measured before
session 42 were trained on it).

Noise augmentation: each stream also comes as a noised copy, same layout and same text and speak
rows; only the microphone is noisy. One background per stream (white, pink or brown noise from
`egomem.trigger.synth.make_noise`, 0-20 dB below the stream's median user-speech RMS), added to the
whole waveform before it is encoded ("spliced": mixed into each utterance, its noise-only codes tiled
over the silences). Everything is seeded: (seed, stream index) fixes a stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from egomem.dialog.tokenizer import ByteTokenizer, TextTokenizer
from egomem.training.tts import MODEL_VOICE, TTSCache, Voice, voice_for
from egomem.training.types import Dialog
from egomem.trigger.codec import FRAME_SAMPLES
from egomem.trigger.synth import make_noise

N_ROWS = 17  # text, 8 speak, 8 listen
CONTEXT_STEPS = 8192  # the paper's whole training context
CHUNK_STEPS = 512 + 256  # L1 + L2 MemChunks in front of the dialog
MAX_DIALOG_STEPS = CONTEXT_STEPS - CHUNK_STEPS
NOISE_CLIP_FRAMES = 75  # a noised stream's noise-only background: 6 s, encoded once per stream, tiled
LISTEN_ENCODINGS = ("whole", "spliced")


@dataclass(frozen=True)
class StreamSpec:
    """How dialogs are laid out in a stream; ranges are inclusive, in frames (80 ms)."""

    max_steps: int = MAX_DIALOG_STEPS
    interrupt_p: float = 0.3  # a later user turn cuts into the model's reply
    text_lead: int = 2  # the monologue starts this many frames before the reply's audio
    lead_in: tuple[int, int] = (2, 12)  # silence before the first turn
    reply_gap: tuple[int, int] = (1, 6)  # user audio end -> the reply's first text token
    query_gap: tuple[int, int] = (1, 4)  # user audio end -> the first query word (Level 2)
    retrieval_wait: tuple[int, int] = (0, 0)  # query end -> the reply's first text token (L2 refill)
    pause: tuple[int, int] = (3, 12)  # reply end -> the next user turn, when not interrupting
    dialog_gap: tuple[int, int] = (12, 38)  # silence between two dialogs
    tail: int = 4  # silence after the last turn
    noise_snr_db: tuple[float, float] = (0.0, 20.0)  # noised copy: user speech over its background noise
    listen: str = "whole"  # the listen row: "whole" (one-pass encoding, as served) or "spliced" (per utterance)

    def __post_init__(self) -> None:
        if self.listen not in LISTEN_ENCODINGS:
            raise ValueError(f"StreamSpec.listen must be one of {LISTEN_ENCODINGS}, got {self.listen!r}")
        for name in ("lead_in", "reply_gap", "query_gap", "retrieval_wait", "pause", "dialog_gap"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"StreamSpec.{name} must be a range 0 <= lo <= hi, got {(lo, hi)}")
        if not 0.0 <= self.interrupt_p <= 1.0:
            raise ValueError(f"StreamSpec.interrupt_p must lie in [0, 1], got {self.interrupt_p}")
        if self.max_steps <= 0 or self.text_lead < 0 or self.tail < 0:
            raise ValueError("StreamSpec.max_steps must be > 0, text_lead and tail >= 0")


@dataclass(frozen=True)
class TurnLayout:
    """Frame boundaries of one turn (half-open, dialog frames: frame 0 sits at position 768)."""

    turn: int  # index in Dialog.turns
    user_start: int  # user audio [user_start, user_end); empty when the model opens
    user_end: int
    query_start: int | None  # Level-2 query words [query_start, query_end) on the text row
    query_end: int | None
    reply_text_start: int
    reply_text_end: int  # after any interruption cut
    reply_audio_start: int
    reply_audio_end: int  # after any interruption cut
    interrupted: bool  # the next user turn starts at reply_audio_end

    @property
    def reply_end(self) -> int:
        """Where the model stops: its text or its audio, whichever ends later."""
        return max(self.reply_text_end, self.reply_audio_end)


@dataclass(frozen=True)
class DialogLayout:
    """One dialog of a stream: whose it is, in which voice, and its turns' frames ([start, end) spans them)."""

    index: int  # the dialog's index in the corpus's dialog list
    user_id: str
    voice: str  # the user's voice (tts.Voice as text)
    start: int
    end: int
    turns: tuple[TurnLayout, ...]


@dataclass(frozen=True)
class StreamLayout:
    """Where every dialog and turn of a stream lies; the masks are built from it. Only turns that end
    inside the stream are listed (`dropped_turns` counts those cut off by `max_steps`)."""

    stream: str
    n_steps: int
    dialogs: tuple[DialogLayout, ...]
    dropped_turns: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def dialog_persons(layout: StreamLayout) -> list[str]:
    """Per dialog, whose it is next to the dialog before: "first" (the stream's first person), "new" (another
    person: an L1 refresh when served) or "same" (that person again: no refresh)."""
    return ["first" if n == 0 else "same" if d.user_id == layout.dialogs[n - 1].user_id else "new"
            for n, d in enumerate(layout.dialogs)]


def conversation_starts(layout: StreamLayout) -> list[int]:
    """Per dialog, the frame where its conversation began when serving restarts the stream for each new person
    (`[dialog] new_person = "restart"`, finetune's `context = "dialog"`): 0 for the stream's first person, else
    the first frame of the first of the consecutive dialogs with this dialog's person (the same person seen
    again is no new person: no L1 refresh, no restart)."""
    out: list[int] = []
    for d, person in zip(layout.dialogs, dialog_persons(layout), strict=True):
        out.append(0 if person == "first" else out[-1] if person == "same" else d.start)
    return out


def layout_from_json(d: dict[str, Any]) -> StreamLayout:
    return StreamLayout(d["stream"], d["n_steps"], tuple(
        DialogLayout(g["index"], g["user_id"], g["voice"], g["start"], g["end"],
                     tuple(TurnLayout(**t) for t in g["turns"])) for g in d["dialogs"]),
        d.get("dropped_turns", 0), d.get("meta", {}))


@dataclass
class Stream:
    layout: StreamLayout
    tokens: np.ndarray  # int16 [17, T]: the clean stream
    noised: np.ndarray | None  # int16 [17, T]: same, listen row with noise; None when not asked for


@torch.no_grad()
def silence_code(codec: torch.nn.Module) -> np.ndarray:
    """The codec's steady-state code of digital silence [K] (a frame from the middle of 2 s of zeros)."""
    from egomem.trigger.codec import encode

    codes = encode(codec, np.zeros(2 * 24_000, np.float32))  # [T, K]
    return codes[len(codes) // 2].copy()


def _draw(rng: np.random.Generator, r: tuple[int, int]) -> int:
    return int(rng.integers(r[0], r[1] + 1))


class StreamBuilder:
    """Builds streams from dialogs: TTS -> layout -> Mimi codes (the listen row encoded whole, the replies per
    utterance, cached) -> tokens."""

    def __init__(self, codec: torch.nn.Module, tokenizer: TextTokenizer | None = None, spec: StreamSpec | None = None,
                 seed: int = 0, model_voice: Voice = MODEL_VOICE, tts: TTSCache | None = None):
        self.codec = codec
        self.tokenizer = tokenizer or ByteTokenizer()
        self.spec = spec or StreamSpec()
        self.seed = seed
        self.model_voice = model_voice
        self.tts = tts or TTSCache()
        self.silence = silence_code(codec)  # [K] int16
        self.pad = self.tokenizer.pad_id
        self._codes: dict[tuple[str, Voice], np.ndarray] = {}

    def utterance(self, text: str, voice: Voice) -> np.ndarray:
        """Clean Mimi codes [T, K] int16 of `text` in `voice` (cached: one encode per line and voice)."""
        key = (text, voice)
        if key not in self._codes:
            from egomem.trigger.codec import encode

            wav = self.tts(text, voice)
            self._codes[key] = encode(self.codec, wav) if len(wav) else np.zeros((0, len(self.silence)), np.int16)
        return self._codes[key]

    def frames(self, text: str, voice: Voice) -> int:
        """How many frames `text` spoken in `voice` lasts (the length of its codes)."""
        return -(-len(self.tts(text, voice)) // FRAME_SAMPLES)

    def text_ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        if ids and max(ids) > np.iinfo(np.int16).max:
            raise ValueError(f"text id {max(ids)} does not fit the int16 stream format")
        return ids

    # -- layout -----------------------------------------------------------------------------------
    def plan(self, stream: str, dialogs: Sequence[tuple[int, Dialog]], rng: np.random.Generator
             ) -> tuple[StreamLayout, list[DialogLayout]]:
        """(the layout, the full plan incl. turns cut off by max_steps). `dialogs`: (corpus index, Dialog)."""
        if not dialogs:
            raise ValueError(f"stream {stream}: no dialogs to lay out")
        if len({d.split for _, d in dialogs}) > 1:
            raise ValueError(f"stream {stream} mixes train and held-out dialogs; group them by split (group_dialogs)")
        s, full = self.spec, []
        t = _draw(rng, s.lead_in)
        for n, (index, dialog) in enumerate(dialogs):
            if n > 0:
                t = full[-1].end + _draw(rng, s.dialog_gap)
            if t >= s.max_steps:
                break
            voice = voice_for(dialog.user_id, dialog.split)
            start, turns = t, []
            for j, turn in enumerate(dialog.turns):
                if j > 0 and not turn.user:
                    raise ValueError(f"dialog {index}: only the first turn may be the model's (user == ''), "
                                     f"turn {j} has no user words")
                if t >= s.max_steps:
                    break
                us, ue = t, t + self.frames(turn.user, voice)
                qs = qe = None
                if turn.query is not None:
                    qs = ue + _draw(rng, s.query_gap)
                    qe = qs + len(self.text_ids(turn.query.text()))
                    ts = qe + _draw(rng, s.retrieval_wait)
                else:
                    ts = ue + _draw(rng, s.reply_gap)
                a0 = ts + s.text_lead
                te, ae = ts + len(self.text_ids(turn.reply)), a0 + len(self.utterance(turn.reply, self.model_voice))
                interrupted = False
                if j + 1 < len(dialog.turns):
                    if rng.random() < s.interrupt_p and ae - a0 >= 2:
                        cut = int(rng.integers(a0 + 1, ae))  # strictly inside the reply's audio
                        te, ae, interrupted = min(te, cut), cut, True
                        t = cut
                    else:
                        t = max(te, ae) + _draw(rng, s.pause)
                turns.append(TurnLayout(j, us, ue, qs, qe, ts, te, a0, ae, interrupted))
            if not turns:
                break
            full.append(DialogLayout(index, dialog.user_id, str(voice), start, turns[-1].reply_end, tuple(turns)))
        too_short = ValueError(f"stream {stream}: its first turn does not end within max_steps={s.max_steps} "
                               f"frames; raise StreamSpec.max_steps or shorten the turn")
        if not full:
            raise too_short
        n_steps = min(full[-1].end + s.tail, s.max_steps)
        kept = []
        for d in full:
            turns = tuple(u for u in d.turns if u.reply_end <= n_steps)
            if turns:
                kept.append(DialogLayout(d.index, d.user_id, d.voice, d.start, turns[-1].reply_end, turns))
        dropped = sum(len(dlg.turns) for _, dlg in dialogs) - sum(len(d.turns) for d in kept)
        if not kept:
            raise too_short
        first = dialogs[0][1]
        meta = {"household": first.household, "split": first.split}
        return StreamLayout(stream, n_steps, tuple(kept), dropped, meta), full

    # -- tokens -----------------------------------------------------------------------------------
    def render(self, plan: list[DialogLayout], dialogs: Sequence[tuple[int, Dialog]], n_steps: int,
               noise_rng: np.random.Generator | None = None, snr_db: float = 0.0) -> np.ndarray:
        """The int16 [17, n_steps] stream of a plan; with `noise_rng`, the noised copy, its background `snr_db`
        below the users' speech (`noise_draw`)."""
        K = len(self.silence)
        text = np.full(n_steps, self.pad, np.int16)
        speak = np.repeat(self.silence[None], n_steps, 0)  # [T, K]
        whole = self.spec.listen == "whole"
        if whole:
            listen = self._listen_whole(plan, dialogs, n_steps, noise_rng, snr_db)
        elif noise_rng is None:
            listen, level = speak.copy(), 0.0
        else:
            listen, level = self._background(plan, dialogs, n_steps, noise_rng, snr_db)

        def put(row: np.ndarray, start: int, values: np.ndarray) -> None:
            end = min(start + len(values), n_steps)
            if end > start:
                row[start:end] = values[:end - start]

        for d, (_, dialog) in zip(plan, dialogs, strict=False):
            voice = voice_for(dialog.user_id, dialog.split)
            for u in d.turns:
                turn = dialog.turns[u.turn]
                if turn.user and not whole:
                    put(listen, u.user_start, self._user_codes(turn.user, voice, noise_rng, level))
                if turn.query is not None:
                    put(text, u.query_start, np.asarray(self.text_ids(turn.query.text()), np.int16))
                reply = np.asarray(self.text_ids(turn.reply), np.int16)[:u.reply_text_end - u.reply_text_start]
                put(text, u.reply_text_start, reply)
                audio = self.utterance(turn.reply, self.model_voice)[:u.reply_audio_end - u.reply_audio_start]
                put(speak, u.reply_audio_start, audio)
        assert listen.shape == (n_steps, K)
        return np.concatenate([text[None], speak.T, listen.T], axis=0).astype(np.int16)  # [17, T]

    def _user_codes(self, text: str, voice: Voice, noise_rng: np.random.Generator | None, level: float) -> np.ndarray:
        if noise_rng is None:
            return self.utterance(text, voice)
        from egomem.trigger.codec import encode

        wav = self.tts(text, voice)
        return encode(self.codec, wav + make_noise(noise_rng, len(wav)) * level)

    def _listen_whole(self, plan: list[DialogLayout], dialogs: Sequence[tuple[int, Dialog]], n_steps: int,
                      noise_rng: np.random.Generator | None, snr_db: float) -> np.ndarray:
        """The listen row [n_steps, K] as serving's codec writes it: the user's utterances laid out as one
        waveform at their frames, with `noise_rng` over one background of noise, encoded in one pass."""
        from egomem.trigger.codec import encode

        wav = np.zeros(n_steps * FRAME_SAMPLES, np.float32)
        for d, (_, dialog) in zip(plan, dialogs, strict=False):
            voice = voice_for(dialog.user_id, dialog.split)
            for u in d.turns:
                speech = self.tts(dialog.turns[u.turn].user, voice)
                start = u.user_start * FRAME_SAMPLES
                n = max(0, min(len(speech), len(wav) - start))
                wav[start:start + n] += speech[:n]
        if noise_rng is not None:
            wav += make_noise(noise_rng, len(wav)) * self._noise_level(plan, dialogs, snr_db)
        return encode(self.codec, wav)[:n_steps]

    def _noise_level(self, plan: list[DialogLayout], dialogs: Sequence[tuple[int, Dialog]], snr_db: float) -> float:
        """A noised stream's noise RMS: `snr_db` below the stream's median user-speech RMS."""
        rms = []
        for d, (_, dialog) in zip(plan, dialogs, strict=False):
            voice = voice_for(dialog.user_id, dialog.split)
            for u in d.turns:
                wav = self.tts(dialog.turns[u.turn].user, voice)
                if len(wav):
                    rms.append(float(np.sqrt(np.mean(wav ** 2))))
        return (float(np.median(rms)) if rms else 0.05) / 10 ** (snr_db / 20)

    def _background(self, plan: list[DialogLayout], dialogs: Sequence[tuple[int, Dialog]], n_steps: int,
                    rng: np.random.Generator, snr_db: float) -> tuple[np.ndarray, float]:
        """("spliced") A noised stream's listen row before the user speaks into it, and the noise's RMS
        level (`_noise_level`): its noise-only codes (a few seconds, encoded once) tiled over the row."""
        from egomem.trigger.codec import encode

        level = self._noise_level(plan, dialogs, snr_db)
        clip = encode(self.codec, make_noise(rng, NOISE_CLIP_FRAMES * FRAME_SAMPLES) * level)[3:]  # past warm-up
        reps = -(-n_steps // len(clip)) + 1
        a = int(rng.integers(len(clip)))
        return np.concatenate([clip] * reps)[a:a + n_steps].astype(np.int16), level

    def build(self, stream: str, dialogs: Sequence[tuple[int, Dialog]], index: int, noised: bool = True) -> Stream:
        """Stream number `index` of a build (it seeds the draws) from (corpus index, Dialog) pairs."""
        layout, plan = self.plan(stream, dialogs, np.random.default_rng([self.seed, index]))
        tokens = self.render(plan, dialogs, layout.n_steps)
        if not noised:
            return Stream(layout, tokens, None)
        rng, snr_db = noise_draw(self.seed, index, self.spec.noise_snr_db)
        noisy = self.render(plan, dialogs, layout.n_steps, rng, snr_db)
        # the noised copy's SNR, in the layout both copies share: what eval-dialog's `by_snr_db` reads
        return Stream(replace(layout, meta={**layout.meta, "noise_snr_db": snr_db}), tokens, noisy)


def noise_draw(seed: int, index: int, snr_range: Sequence[float]) -> tuple[np.random.Generator, float]:
    """The noised copy of build `seed`'s stream number `index`: the generator its noise is drawn from and its
    SNR in dB (that generator's first draw, uniform in `snr_range`). A dataset built before layouts recorded
    the SNR recovers it from here (`Dataset.layouts`)."""
    rng = np.random.default_rng([seed, index, 1])
    return rng, float(rng.uniform(*snr_range))


def group_dialogs(dialogs: Sequence[Dialog], seed: int, per_stream: tuple[int, int] = (2, 4),
                  streams_per_household: int | None = None) -> list[list[int]]:
    """Which dialogs make each stream: per (household, split), the dialogs shuffled and cut into groups
    of `per_stream` (inclusive range); at most `streams_per_household` groups each (None: use them all)."""
    if not 1 <= per_stream[0] <= per_stream[1]:
        raise ValueError(f"per_stream must be a range 1 <= lo <= hi, got {per_stream}")
    by_home: dict[tuple[str, str], list[int]] = {}
    for i, d in enumerate(dialogs):
        by_home.setdefault((d.household, d.split), []).append(i)
    rng = np.random.default_rng([seed, 2])
    groups: list[list[int]] = []
    for key in sorted(by_home):
        idx = [by_home[key][i] for i in rng.permutation(len(by_home[key]))]
        mine: list[list[int]] = []
        while idx and (streams_per_household is None or len(mine) < streams_per_household):
            k = _draw(rng, per_stream)
            mine.append(idx[:k])
            idx = idx[k:]
        groups += mine
    return groups
