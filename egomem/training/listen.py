"""Listening drills: short Level-1 dialogs with spoken questions, the second stage of `egomem train-backbone`.

A Level-1 answer is right only when the model heard which question was asked ("Where do I live again?"
-> "You live in Lisbon."). Fine-tuned on the corpus alone the tiny model takes *when* to answer from the
user's audio but not *what* (docs/training.md, "The answers did not move"): a 30-minute run holds about
2,000 answers, and a probe on the codes needed 40,000 labelled questions to hear the question in new
voices. This stage gives the backbone those answers cheaply (`--task listen`, after the copying stage):

- a row is a person's Level-1 MemChunk text (a training-split person of the corpus generator, rendered
  by the real memory store as serving renders it, `MemoryTexts`; stored without their relations, so the
  profile has no `people:` line and the chunk stays short), then a short dialog: with probability
  `greeting_p` the model's greeting, then `questions` of the corpus's questions about the person's own
  profile, each spoken in one training voice, the model's answer written on the text channel after it
  (`corpus.own_turns`: the same questions and replies the corpus has), with `StreamSpec`'s gaps;
- the chunk is the profile text with no pad after it and no Level-2 chunk (a short layout: about 3 times
  cheaper per answer than the serving layout, which `egomem finetune` then trains in); the speak rows
  hold the codec's silence; half the rows (`noised_p`) are heard through background noise, as the
  corpus's noised copies are;
- the loss is the text cross-entropy over the whole dialog (text pad weighted 0.5, as `egomem finetune`
  weights it): when to speak and what to say.

Only the questions whose words are the same for everyone are drilled (`corpus.fixed_questions`: 23 of
them, 11 kinds), so every (question, voice) pair is spoken and encoded once, into a `ClipBank`
(clean, and `NOISED_COPIES` noised copies each over its own background; each encoded after 2 s of silence
with the second after it, as a microphone encoded in one pass hears it), cached in the run folder. The
held-out rows (`held_scores`) are held-out people spoken in the held-out voices: the share of answers the
model writes right teacher-forced and greedy (whole reply; its words around the value, i.e. the kind
heard; the value, i.e. the fact read), and of greetings whose name it writes right.

`egomem finetune --listen-drills P` mixes the same rows into the fine-tune (`finetune_rows`, `ListenRow.as_sample`:
in the serving layout, the profile in the L1 chunk, an empty L2 chunk), so the hearing is kept while the
corpus is learnt.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from moshi.models.lm import LMModel
from moshi.utils.compile import no_compile

from egomem.dialog.engine import memchunk_inputs
from egomem.dialog.tokenizer import ByteTokenizer
from egomem.trigger.codec import FRAME_SAMPLES, codec_fingerprint, encode
from egomem.trigger.synth import colour_noise

from .corpus import fixed_questions, greeting, make_household, own_turns
from .forward import dialog_inputs, turn_heads
from .memory_text import MemoryTexts
from .streams import NOISE_CLIP_FRAMES, StreamSpec, silence_code
from .tts import HELDOUT_VOICES, TRAIN_VOICES, TTSCache, Voice
from .types import Household, Profile, Sample, SampleKind, Span, Split

HOUSEHOLD_SEED = 7  # the drills' people: corpus households of this seed (the training corpus uses 0)
HOUSEHOLDS = 100_000  # drawn from make_household(split, HOUSEHOLD_SEED, 0..HOUSEHOLDS-1)
NOISED_COPIES = 2  # noised copies of every clip, each over its own background (one per voice and copy)
TEXT_PAD_WEIGHT = 0.5  # as egomem finetune's default
HEAD_TOKENS = 10  # a reply's first tokens: every fixed question's reply differs from the others' within them
CLIP_LEAD_FRAMES = 25  # a question is encoded after 2 s of silence (or its noise), as the one-pass row hears it
CLIP_TAIL_FRAMES = 12  # ... and keeps the 1 s after it: the codes of the speech's decay, not the codec's silence
BANK_FORMAT = "egomem-listen-clips-v2"
GREETING_P, NOISED_P = 0.3, 0.5  # a row opens with the model's greeting; a row is heard through noise
DRILL_STREAM, DRILL_GENERATOR = "listen-drill", "listen-drill"  # a drill row's names as an `egomem finetune` sample


class ClipBank:
    """Mimi codes of every fixed question in every voice: `clean[(q, v)]` `[T, K]`, `noised[(q, v, b)]`
    over background b of that voice, whose noise-only codes are `background[(v, b)]`. Background b of voice v
    is one colour of noise (white, pink or brown) at an SNR of 0-20 dB below the voice's median question level,
    drawn from a generator seeded by (seed, voice, b): the bank is the same on every build.

    A clip is encoded in context, as serving's codec (and `make-corpus --listen whole`) encodes a microphone in
    one pass: `CLIP_LEAD_FRAMES` of silence (noised: of its noise) before the question, whose codes are dropped,
    and `tail` frames after it, whose codes are kept (`speech_frames` of a clip is its length without them).
    Encoded alone, a question's first codebook agrees with the one-pass encoding on 0.66 of its frames
    (docs/departures.md D26).

    `per_question`: each question is spoken in a seeded draw of that many of the voices (`speakers`), not in all.
    With a `cache`, the bank is saved there whole, and while it is built each voice is saved under
    `<cache>.parts/`, so a build that was killed goes on from the voices it had (a large bank takes hours)."""

    def __init__(self, codec: torch.nn.Module, voices: Sequence[Voice], questions: Sequence[str], seed: int,
                 progress: bool = True, cache: Path | None = None, copies: int = NOISED_COPIES,
                 per_question: int | None = None):
        self.voices, self.questions, self.copies = tuple(voices), tuple(questions), copies
        self.lead, self.tail = CLIP_LEAD_FRAMES, CLIP_TAIL_FRAMES
        if per_question is not None and not 1 <= per_question <= len(self.voices):
            raise ValueError(f"per_question must be in [1, {len(self.voices)}] (the bank's voices), got {per_question}")
        # who speaks each question: every voice, or (per_question) a seeded draw of that many, so that many
        # sentences fit a bank the size of a few sentences in every voice
        def draw(q: str, k: int) -> tuple[Voice, ...]:
            return tuple(self.voices[i] for i in sorted(random.Random(f"clip-bank/{seed}/{q}").sample(
                range(len(self.voices)), k)))

        self.speakers: dict[str, tuple[Voice, ...]] = {
            q: self.voices if per_question is None else draw(q, per_question) for q in self.questions}
        inputs = {"format": BANK_FORMAT, "codec": codec_fingerprint(codec), "seed": seed, "copies": copies,
                  "lead": self.lead, "tail": self.tail,
                  "voices": [str(v) for v in self.voices], "questions": list(self.questions)}
        if per_question is not None:  # (absent otherwise: the banks built before it keep their fingerprints)
            inputs["per_question"] = per_question
        self.fingerprint = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16]
        self.clean: dict[tuple[str, Voice], np.ndarray] = {}
        self.noised: dict[tuple[str, Voice, int], np.ndarray] = {}
        self.background: dict[tuple[Voice, int], np.ndarray] = {}
        if cache is not None and cache.is_file() and self._load(cache):
            return
        parts = cache.with_name(cache.name + ".parts") if cache is not None else None
        self._build(codec, seed, progress, parts)
        if cache is not None:
            self._save(cache)
        if parts is not None:  # the whole bank is saved: its per-voice parts are no longer needed
            for f in parts.glob("*.npz"):
                f.unlink()
            parts.rmdir()

    def _build(self, codec: torch.nn.Module, seed: int, progress: bool, parts: Path | None) -> None:
        """Every voice's clips; with `parts`, each voice is saved there once built and a voice found there (same
        fingerprint) is loaded, not rebuilt: a killed build goes on where it stopped (a voice's clips are seeded
        by (seed, voice index), so the bank is the same either way)."""
        from tqdm import tqdm

        def in_context(w: np.ndarray, noise: np.ndarray | None = None) -> np.ndarray:
            """The question's codes (and its tail's) from one pass over [lead | question | tail]."""
            wav = np.concatenate([np.zeros(self.lead * FRAME_SAMPLES), w, np.zeros(self.tail * FRAME_SAMPLES)])
            if noise is not None:
                wav = wav + noise[:len(wav)]
            n = -(-len(w) // FRAME_SAMPLES) + self.tail
            return encode(codec, wav)[self.lead:self.lead + n]

        tts = TTSCache(max_items=len(self.questions))
        bar = tqdm(total=len(self.voices), desc="listen clips", unit="voice", disable=not progress)
        for vi, v in enumerate(self.voices):
            part = parts / f"{self.fingerprint}-{vi}.npz" if parts is not None else None
            if part is not None and part.is_file():
                self._load(part, voices=(v,))
                bar.update(1)
                continue
            wavs = {q: tts(q, v) for q in self.spoken_by(v)}
            if not wavs:
                bar.update(1)
                continue
            speech_rms = float(np.median([np.sqrt(np.mean(w ** 2)) for w in wavs.values()]))
            for q, w in wavs.items():
                self.clean[(q, v)] = in_context(w)
            for b in range(self.copies):
                rng = np.random.default_rng([seed, vi, b])
                colour, level = int(rng.integers(3)), speech_rms / 10 ** (rng.uniform(0.0, 20.0) / 20)
                noise = colour_noise(rng, NOISE_CLIP_FRAMES * FRAME_SAMPLES, colour) * level
                self.background[(v, b)] = encode(codec, noise)[3:]  # past the codec's warm-up frames
                for q, w in wavs.items():
                    span = (self.lead + self.tail) * FRAME_SAMPLES + len(w)
                    self.noised[(q, v, b)] = in_context(w, colour_noise(rng, span, colour) * level)
            if part is not None:
                self._save(part, voices=(v,))
            bar.update(1)
        bar.close()

    def spoken_by(self, voice: Voice) -> tuple[str, ...]:
        """The questions `voice` speaks (all of them unless the bank was built `per_question`)."""
        return tuple(q for q in self.questions if voice in self.speakers[q])

    def speech_frames(self, clip: np.ndarray) -> int:
        """The frames of a clip's question, without the tail encoded after it."""
        return len(clip) - self.tail

    def _save(self, path: Path, voices: Sequence[Voice] | None = None) -> None:
        """The clips of `voices` (None: all) to `path`, under the bank's fingerprint."""
        arrays = {f"c{i}": self.clean[(q, v)] for i, (q, v) in enumerate(self._clean_keys(voices))}
        arrays |= {f"n{i}": self.noised[k] for i, k in enumerate(self._noised_keys(voices))}
        arrays |= {f"b{i}": self.background[k] for i, k in enumerate(self._background_keys(voices))}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as f:
            np.savez(f, fingerprint=np.array(self.fingerprint), **arrays)
        tmp.replace(path)

    def _load(self, path: Path, voices: Sequence[Voice] | None = None) -> bool:
        """The clips of `voices` (None: all) from `path`; False (nothing loaded) when it holds another bank."""
        with np.load(path) as z:
            if str(z["fingerprint"]) != self.fingerprint:
                return False  # another codec, voice list or seed: rebuilt (and the cache rewritten)
            self.clean |= {k: z[f"c{i}"] for i, k in enumerate(self._clean_keys(voices))}
            self.noised |= {k: z[f"n{i}"] for i, k in enumerate(self._noised_keys(voices))}
            self.background |= {k: z[f"b{i}"] for i, k in enumerate(self._background_keys(voices))}
        return True

    def _clean_keys(self, voices: Sequence[Voice] | None = None) -> list[tuple[str, Voice]]:
        return [(q, v) for v in voices or self.voices for q in self.spoken_by(v)]

    def _noised_keys(self, voices: Sequence[Voice] | None = None) -> list[tuple[str, Voice, int]]:
        return [(q, v, b) for v in voices or self.voices for b in range(self.copies) for q in self.spoken_by(v)]

    def _background_keys(self, voices: Sequence[Voice] | None = None) -> list[tuple[Voice, int]]:
        return [(v, b) for v in voices or self.voices if self.spoken_by(v) for b in range(self.copies)]


@dataclass(frozen=True)
class Answer:
    """Where one reply sits in a row's dialog (ticks) and, inside it, its value (the fact or name)."""

    start: int
    end: int
    value_start: int
    value_end: int
    greeting: bool


@dataclass
class ListenRow:
    chunk: list[int]  # the L1 text's token ids
    stream: np.ndarray  # [17, T] aligned dialog frames (text, 8 speak, 8 listen)
    answers: list[Answer]
    voice: Voice | None = None  # who asks the questions ...
    noise_copy: int | None = None  # ... over which of the bank's backgrounds (None: clean)
    spoken: list[tuple[int, str]] = field(default_factory=list)  # (tick, question): what the listen rows hold
    l1_text: str = ""  # the L1 MemChunk text `chunk` encodes
    kind: SampleKind = "l1_response"  # what `as_sample` calls it: a query drill (query_drill.py) is "l2_query"
    supervised: tuple[int, int] | None = None  # the text ticks `as_sample` supervises; None: the whole dialog
    generator: str = DRILL_GENERATOR

    def as_sample(self) -> tuple[Sample, np.ndarray]:
        """The row as `egomem finetune` trains it (`--listen-drills`, `--query-drills`): a sample in the serving
        layout (this profile as the L1 MemChunk, an empty L2, the dialog from position n1 + n2), its text
        channel supervised over `supervised` (a listening drill: the whole dialog, as this stage supervises
        it), no speak loss (the speak rows hold the codec's silence)."""
        a, b = self.supervised or (0, self.stream.shape[1])
        return Sample(DRILL_STREAM, self.kind, self.l1_text, "", (Span(a, b),), (),
                      generator=self.generator), self.stream


class ListenRows:
    """Draws listening-drill rows (module docstring) of one split: people from `make_household(split,
    HOUSEHOLD_SEED, i)`, questions spoken from `bank`. Every draw comes from the `random.Random` passed in."""

    def __init__(self, bank: ClipBank, split: Split, silence: np.ndarray, questions: tuple[int, int],
                 greeting_p: float, noised_p: float, l1_bytes: int = 512, spec: StreamSpec | None = None):
        self.bank, self.split, self.silence = bank, split, np.asarray(silence, np.int64)
        self.questions, self.greeting_p, self.noised_p = questions, greeting_p, noised_p
        self.spec = spec or StreamSpec()
        self.tok = ByteTokenizer()
        self.texts = MemoryTexts([], l1_bytes=l1_bytes)
        self._homes: dict[int, Household] = {}

    def close(self) -> None:
        self.texts.close()

    def _person(self, r: random.Random) -> tuple[Household, Profile]:
        i = r.randrange(HOUSEHOLDS)
        if i not in self._homes:
            h = make_household(self.split, HOUSEHOLD_SEED, i)
            self._homes[i] = Household(h.main, h.related, (), h.split)  # no relations: no `people:` line in L1
            self.texts.add(self._homes[i])
        h = self._homes[i]
        people = (h.main, *h.related)
        return h, people[0] if r.random() < 0.5 else r.choice(people[1:])

    def row(self, r: random.Random) -> ListenRow:
        h, p = self._person(r)
        voice = r.choice(self.bank.voices)
        copy = r.randrange(self.bank.copies) if r.random() < self.noised_p else None
        asked = [t for t in own_turns(h, p) if (t.user, voice) in self.bank.clean]
        turns = ([greeting(p, r)] if r.random() < self.greeting_p else [])
        asked = list({t.reply: t for t in asked}.values())  # one question per reply ("hobby" and "fun" ask alike)
        turns += r.sample(asked, min(r.randint(*self.questions), len(asked)))
        s = self.spec
        t = r.randint(*s.lead_in)
        text: list[tuple[int, list[int]]] = []  # (tick, ids)
        heard: list[tuple[int, np.ndarray]] = []  # (tick, codes)
        spoken: list[tuple[int, str]] = []  # (tick, question)
        answers: list[Answer] = []
        for turn in turns:
            if turn.user:
                codes = self.bank.clean[(turn.user, voice)] if copy is None else self.bank.noised[(turn.user, voice, copy)]
                heard.append((t, codes))
                spoken.append((t, turn.user))
                t += self.bank.speech_frames(codes) + r.randint(*s.reply_gap)
            ids = self.tok.encode(turn.reply)
            value = (turn.names or turn.facts or ("",))[0]
            a = turn.reply.find(value) if value else -1
            v0, v1 = (len(self.tok.encode(turn.reply[:a])), len(self.tok.encode(turn.reply[:a + len(value)]))) \
                if a >= 0 else (len(ids), len(ids))
            text.append((t, ids))
            answers.append(Answer(t, t + len(ids), t + v0, t + v1, not turn.user))
            t += len(ids) + r.randint(*s.pause)
        stream = drill_stream(t + s.tail, text, heard, self.silence, self.bank, voice, copy, r)
        l1 = self.texts.l1(p.user_id)
        return ListenRow(self.tok.encode(l1), stream, answers, voice, copy, spoken, l1)


def drill_stream(T: int, text: Sequence[tuple[int, list[int]]], heard: Sequence[tuple[int, np.ndarray]],
                 silence: np.ndarray, bank: ClipBank, voice: Voice, copy: int | None, r: random.Random) -> np.ndarray:
    """A drill row's `[17, T]` frames: `text` (tick, ids) on the text row (pad elsewhere), the speak rows the
    codec's silence, the listen rows the `heard` (tick, codes) clips over silence, or (`copy` not None) over
    that background of `voice` from a random offset (drawn from `r`)."""
    stream = np.empty((17, T), np.int64)
    stream[0] = ByteTokenizer.pad_id
    stream[1:9] = silence[:, None]
    if copy is None:
        stream[9:] = silence[:, None]
    else:
        bg = bank.background[(voice, copy)]
        a0 = r.randrange(len(bg))
        stream[9:] = np.concatenate([bg] * (-(-(T + a0) // len(bg))))[a0:a0 + T].T
    for at, ids in text:
        stream[0, at:at + len(ids)] = ids
    for at, codes in heard:  # a clip's tail runs on under the reply (cut where the row ends)
        codes = codes[:T - at]
        stream[9:, at:at + len(codes)] = codes.T
    return stream


@dataclass
class ListenBatch:
    """Rows packed one after another's length: row i is `[its chunk | its dialog]` from position 0, right-padded
    (causal, so the padding reaches no real position); `offsets[i]` is where its dialog starts."""

    inputs: torch.Tensor  # [B, K, L] model input: chunk steps (text, then the chunk audio token) and dialog ticks
    targets: torch.Tensor  # [B, L] the text each position predicts (a dialog tick t: its text frame t)
    mask: torch.Tensor  # [B, L] supervised positions: every dialog tick of the row
    offsets: list[int]
    answers: list[list[Answer]]


def collate(lm: LMModel, rows: Sequence[ListenRow], layout: tuple[int, int] | None = None) -> ListenBatch:
    """The rows packed (`ListenBatch`), each chunk its bare L1 text; with `layout` (n1, n2) each as serving lays it
    out instead, its L1 padded to n1 steps and an empty L2 of n2 before the dialog (what `egomem finetune
    --listen-drills` trains on: `forward.forward`'s input over `ListenRow.as_sample`)."""
    steps = [len(x.chunk) if layout is None else sum(layout) for x in rows]
    L = max(c + x.stream.shape[1] for c, x in zip(steps, rows, strict=True))
    inputs = torch.full((len(rows), lm.num_codebooks, L), lm.initial_token_id, dtype=torch.long)
    inputs[:, 0] = lm.text_padding_token_id
    targets = torch.full((len(rows), L), lm.text_padding_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.bool)
    for i, (c, x) in enumerate(zip(steps, rows, strict=True)):
        n = x.stream.shape[1]
        stream = torch.from_numpy(x.stream)[None]
        if layout is None:
            inputs[i, :, :c] = memchunk_inputs(lm, x.chunk, c)
        else:
            inputs[i, :, :c] = torch.cat([memchunk_inputs(lm, x.chunk, layout[0]), memchunk_inputs(lm, [], layout[1])], 1)
        inputs[i, :, c:c + n] = dialog_inputs(lm, stream)[0]
        targets[i, c:c + n] = stream[0, 0]
        mask[i, c:c + n] = True
    return ListenBatch(inputs, targets, mask, steps, [x.answers for x in rows])


def text_logits(lm: LMModel, batch: ListenBatch) -> torch.Tensor:
    """Text logits `[B, L, V]` at every position of the packed rows (a dialog tick t predicts its text frame t)."""
    with no_compile():
        _, logits = lm.forward_text(batch.inputs)
    return logits[:, 0]


def loss(lm: LMModel, batch: ListenBatch, head_weight: float = 1.0) -> torch.Tensor:
    """Text cross-entropy over the supervised ticks, text pad weighted `TEXT_PAD_WEIGHT`; the first
    `HEAD_TOKENS` tokens of every reply (where the question heard picks its words: "You l|ive", "You w|ork")
    weighted `head_weight` (`forward.turn_heads`)."""
    logits = text_logits(lm, batch)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch.targets.reshape(-1), reduction="none")
    w = torch.where(batch.targets == lm.text_padding_token_id, TEXT_PAD_WEIGHT, 1.0) * batch.mask
    if head_weight != 1.0:
        w = w * torch.where(turn_heads(batch.targets, lm.text_padding_token_id, HEAD_TOKENS), head_weight, 1.0)
    return (ce.view_as(w) * w).sum() / w.sum().clamp_min(1e-6)


@torch.no_grad()
def held_scores(lm: LMModel, held: Sequence[ListenBatch]) -> dict[str, float]:
    """Teacher-forced greedy scores of held-out rows: `answer` (every byte of the reply right), `form` (its bytes
    outside the value: the question heard), `form_after_start` (the same from the reply's second byte: the
    question heard, whatever the turn-start timing its first byte carries), `value` (the value's bytes: the fact
    read) and `greeting` (the greeted name's bytes), each the share of replies of that kind."""
    lm.eval()
    hits = {"answer": [], "form": [], "form_after_start": [], "value": [], "greeting": []}
    for batch in held:
        right = (text_logits(lm, batch).argmax(-1) == batch.targets).numpy()
        for i, (c, answers) in enumerate(zip(batch.offsets, batch.answers, strict=True)):
            for a in answers:
                ok = right[i, c + a.start:c + a.end]
                val = right[i, c + a.value_start:c + a.value_end]
                if a.greeting:
                    hits["greeting"].append(bool(val.all()))
                    continue
                hits["answer"].append(bool(ok.all()))
                words = ok.copy()
                words[a.value_start - a.start:a.value_end - a.start] = True
                hits["form"].append(bool(words.all()))
                hits["form_after_start"].append(bool(words[1:].all()))
                hits["value"].append(bool(val.all()))
    lm.train()
    return {k: float(np.mean(v)) if v else float("nan") for k, v in hits.items()}


HELD_BATCHES, HELD_ROWS = 3, 16  # held-out rows: held-out people in the held-out voices, half of them noised
LISTEN_EMB_RMS = 0.5  # per-dimension RMS of the codec's image in the summed listen input (the text embedding's: 1)
LATENT_RANK_TOL = 1e-4  # latent directions with less variance than this times the largest are not whitened


def code_vectors(codec: torch.nn.Module) -> torch.Tensor:
    """`[n_q, card, D]`: what each code of each codebook adds to the codec's latent (its codebook vector through
    its quantizer's output projection). Mimi's quantizer is linear in them: the latent of a frame of codes is
    the sum over codebooks of these vectors (`tests/test_training_listen.py` checks it against `decode`)."""
    q = codec.quantizer
    parts = [(q.rvq_first, 0)] + [(q.rvq_rest, j) for j in range(q.rvq_rest.n_q)]
    out = []
    for rvq, j in parts[:codec.num_codebooks]:
        book = rvq.vq.layers[j]._codebook.embedding  # [card, d]
        proj = rvq.output_proj
        out.append(book @ proj.weight[:, :, 0].T if isinstance(proj, torch.nn.Conv1d) else book)
    return torch.stack(out).detach().float()


@torch.no_grad()
def init_listen_embeddings(lm: LMModel, codec: torch.nn.Module, frames: np.ndarray, seed: int,
                           rms: float = LISTEN_EMB_RMS, rank_tol: float = LATENT_RANK_TOL) -> int:
    """Add to the model's 8 listen-codebook embeddings an image of the codec's latent: code c of codebook k gains
    `s * P W (v_kc - mean/8)`, v_kc its latent vector (`code_vectors`), W the whitening of the latents of
    `frames` (`[N, n_q]` codes of speech) over their r directions of variance above `rank_tol` times the
    largest (the rest is dropped: near-zero directions would only amplify rounding), P a seeded random
    isometry from those r directions into the model's width, and s the scale that gives that summed image
    `rms` per dimension over `frames`. So the model hears, from its first step, what the codec heard, with
    similar sounds near each other whatever their code ids; learnt from the random tables alone, every code's
    meaning had to be found from the few answers it took part in. The tables' own values stay under the image
    (what identifies a code beyond its latent); the speak rows and the initial token's row (the MemChunks'
    audio) are left as they are. Returns r."""
    vec = code_vectors(codec)  # [n_q, card, D]
    n_q, card, D = vec.shape
    codes = torch.as_tensor(np.asarray(frames, np.int64))
    z = vec[torch.arange(n_q), codes].sum(1)  # [N, D] latents of the frames
    mean = z.mean(0)
    evals, evecs = torch.linalg.eigh(torch.cov(z.T))
    keep = evals > rank_tol * evals.max()
    white = evecs[:, keep] * evals[keep].rsqrt()  # [D, r]: latent -> whitened coordinates
    r = int(keep.sum())
    g = torch.Generator().manual_seed(seed)
    iso = torch.linalg.qr(torch.randn(max(lm.dim, r), min(lm.dim, r), generator=g))[0]
    iso = iso if lm.dim >= r else iso.T  # [dim, r]: an isometry into the model's width (a projection when narrower)
    listen = [lm.emb[lm.num_audio_codebooks - n_q + k] for k in range(n_q)]  # the last n_q audio rows: the user's
    images = [(vec[k] - mean / n_q) @ white @ iso.T for k in range(n_q)]  # [card, dim] each
    scale = rms / float(sum(t[codes[:, k]] for k, t in enumerate(images)).pow(2).mean().sqrt())
    for emb, image in zip(listen, images, strict=True):
        emb.weight[:card] += (scale * image).to(emb.weight.dtype)
    return r


def check_codec(codec: torch.nn.Module, dataset_codec: str | None, what: str) -> None:
    """Refuse drills (`what`) spoken through another codec than the dataset's (`dataset_codec`: the fingerprint
    its manifest records): a codec that hears otherwise would teach the model two languages."""
    got = codec_fingerprint(codec)
    if dataset_codec is not None and got != dataset_codec:
        raise ValueError(f"the dataset's audio was encoded by codec {dataset_codec}; the {what} would be "
                         f"encoded by {got}: give the [mimi] config the dataset was made with (--config)")


def finetune_rows(codec: torch.nn.Module, dataset_codec: str | None, seed: int, voices: int | None,
                  questions: tuple[int, int], l1_bytes: int, cache: Path | None, progress: bool = True,
                  greeting_p: float = GREETING_P, noised_p: float = NOISED_P) -> ListenRows:
    """The training rows `egomem finetune --listen-drills` mixes in: training people and voices, the bank of
    `train-backbone --task listen` (same codec, voices and seed: its cache is reused), the L1 cut to the
    dataset's `l1_bytes`. `dataset_codec`: the fingerprint the dataset's manifest records (`check_codec`)."""
    check_codec(codec, dataset_codec, "listening drills")
    bank = ClipBank(codec, TRAIN_VOICES[:voices or None], fixed_questions(), seed, progress, cache)
    return ListenRows(bank, "train", silence_code(codec), questions, greeting_p, noised_p, l1_bytes=l1_bytes)


class ListenTask:
    """The `listen` task of `egomem train-backbone`: training rows from the training voices and people, the
    held-out rows (their own generator, `held_seed`) scored by `held_scores`; `voices` keeps the first N voices
    of each list (None: all). The clip banks are cached in `out` (`listen_clips_<split>.npz`: about 10 minutes
    for the 192 training voices on one core, reused on `--resume`)."""

    name = "listen"

    def __init__(self, lm: LMModel, codec: torch.nn.Module, out: Path, seed: int, held_seed: int,
                 questions: tuple[int, int], greeting_p: float, noised_p: float, voices: int | None = None,
                 listen_emb: str = "codec", head_weight: float = 1.0, progress: bool = True):
        self.lm, self.codec, self.seed, self.listen_emb, self.head_weight = lm, codec, seed, listen_emb, head_weight
        self.silence = silence_code(codec).astype(np.int64)
        banks = {split: ClipBank(codec, vs[:voices], fixed_questions(), s, progress, out / f"listen_clips_{split}.npz")
                 for split, vs, s in (("train", TRAIN_VOICES, seed), ("heldout", HELDOUT_VOICES, held_seed))}
        self.fingerprint = {split: b.fingerprint for split, b in banks.items()}
        self.bank = banks["train"]
        self.train = ListenRows(banks["train"], "train", self.silence, questions, greeting_p, noised_p)
        heldout = ListenRows(banks["heldout"], "heldout", self.silence, questions, greeting_p, noised_p)
        r = random.Random(held_seed)
        self.held = [collate(lm, [heldout.row(r) for _ in range(HELD_ROWS)]) for _ in range(HELD_BATCHES)]
        heldout.close()

    def prepare(self) -> None:
        """Before the first step (not on resume): with `listen_emb` "codec", the listen embeddings from the codec
        (`init_listen_embeddings`, statistics over every clip of the training bank); "keep": as the weights have them."""
        if self.listen_emb == "codec":
            frames = np.concatenate([*self.bank.clean.values(), *self.bank.noised.values()])
            init_listen_embeddings(self.lm, self.codec, frames, self.seed)

    def batch_loss(self, rows: random.Random, n: int) -> torch.Tensor:
        return loss(self.lm, collate(self.lm, [self.train.row(rows) for _ in range(n)]), self.head_weight)

    def scores(self) -> dict[str, float]:
        return {f"held_{k}": v for k, v in held_scores(self.lm, self.held).items()}

    def close(self) -> None:
        self.train.close()
