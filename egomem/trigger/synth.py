"""Synthetic training streams for the episodic trigger (EgoMem paper §4.1), built from cached codes.

A stream is what the dialog model records: per 80 ms step, 1 text token (its inner monologue),
8 speak codes (its own voice) and 8 listen codes (the microphone). Dialog sessions with users are
concatenated with stretches of no dialog; inside a session the user (listen) and the assistant
(speak + text) take turns with short pauses; a session mostly opens with the user speaking (80 %;
else the assistant greets); sometimes a new user takes over right after the previous one left (user
switch: short gap, only the voice tells it apart). As in the paper's §4.1 streams:
  - the text channel is a real monologue: the model replies (and Level-2 `<retr>` queries) of the
    training corpus's dialogs (`egomem.training.corpus`, the split's own people), byte-tokenised as
    the offline dialog model writes them, one token per step, starting 2 steps before the reply's
    audio (no word alignment); a query is written before the reply, while the model is silent;
  - a later turn interrupts the current one with probability 0.3; when the user interrupts the
    model, the model's audio and text stop at the step the user starts;
  - streams run up to 8,192 steps (`StreamSpec.steps`), several users per stream.
Turns start and end on speech (per-step activity of each utterance), so gold boundaries are audible.
Gold labels per step: 0 no dialog, 1 session start, 2 in session, 3 session end.

Audio: LibriSpeech utterances (users: `cohort/`, one speaker each; assistant voices: `test-other/`).
Every source is encoded by the project's Mimi ONCE (`build_cache`) and a stream is cut from the
cached code sequences (encoding each synthetic stream's audio would cost ~100x more on 2 cores).
A listen row cut this way is a splice that serving never sees (the codes of silence after speech
differ when the codec encodes the whole stream): the trigger now trains and is measured on rows laid
out as audio and encoded whole (`egomem.trigger.listen_audio`); the layouts, the speak row, the text
and the voice partials still come from here. The spliced row:
  - noise: mixed in the AUDIO domain per cached utterance (SNR 0-20 dB) and encoded as a second
    variant; noise-only clips fill silences of noised streams. Kinds (`egomem.trigger.noise`):
    white/pink/brown, babble of the split's own speakers, music-like, recorded room tone;
  - echo (speak -> listen, p = 0.3 per assistant turn, gain 0-0.2, delay 0.1-0.5 s): each assistant
    utterance is also encoded at a random gain 0.02-0.2 (clean and noisy); the echo is placed at
    TOKEN level, delayed by round(delay / 80 ms) steps, where the user is silent (over user speech
    the user's codes win: at <= 0.2 gain the echo is a small perturbation we do not model);
  - code sequences are concatenated at step boundaries; Mimi's few-frame encoder context across a
    seam is not reproduced (accepted: seams sit at pauses, where the signal is near silence).
Splits: users = cohort speakers sorted by id, first 200 train / rest held out; assistant = each
test-other speaker's utterances sorted, first 7 train / last 3 held out.

Voice evidence (what the orchestrator's 2 s polling loop records, for the identity split and its
benchmark): every user utterance also carries GE2E (Resemblyzer) embeddings of 1.6 s partials taken
every 10 steps (0.8 s, about Resemblyzer's own 1.3 partials/s), of the clean and of the noised audio.
`poll_voices` then plays the polling loop over a stream: every 25 steps (2 s) the voice embedding of
the user's speech in the last 3 s = the normalised mean of the partials heard inside that window
(a partial counts when >= 75 % of it was heard, Resemblyzer's coverage rule for a last partial; when
none is, the most-heard one, as Resemblyzer pads speech shorter than a partial), or nothing when the
window holds under 1 s of user speech (the encoder's `min_voiced_s` gate). A window
that straddles two users averages both, as the real encoder does over the concatenated speech.
Not modelled: the assistant's echo reaching the voice encoder, and noise-only windows passing the VAD.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from egomem.trigger.model import END, IN_SESSION, NO_DIALOG, START

STEP_S = 0.08
TEXT_PAD = 3  # moshi's existing_text_padding_id
CACHE_VERSION = 6  # 2: frame activity ("vad"); 3: 48/12 noise clips; 4: GE2E voice partials; 5: noise kinds, split;
# 6: several noised copies of each training utterance, 144 training noise clips
# Noised copies of each user utterance ("noisy", "noisy1", ...) and noise-only clips per split: a trigger
# that saw each voice in one noise only learns that noise (held-out noised F1@5 0.19 vs 0.72 on training
# voices); the held-out split keeps one of each, so its streams are the same as before.
NOISY_VARIANTS = {"train": 4, "heldout": 1}
NOISE_CLIPS = {"train": 144, "heldout": 12}
VOICE_PARTIAL_STEPS = 20  # one GE2E partial utterance: 1.6 s
VOICE_HOP_STEPS = 10  # a partial every 0.8 s (Resemblyzer's embed_utterance takes 1.3 per second)
N_TRAIN_USERS = 200
N_TRAIN_ASSISTANT_UTTS = 7


def _steps(seconds: float) -> int:
    return max(1, int(round(seconds / STEP_S)))


# ----------------------------------------------------------------------------------------------
# the code cache


@dataclass
class CodeCache:
    """Mimi codes [T, 8] int16 of every source, one split. Noised variants align step-for-step."""

    # per speaker: clean, noisy (+ noisy1.. in training), vad, and voice_clean / voice_noisy (of "noisy"):
    # GE2E partials [P, 256] uint8
    # (partial p covers steps [p * VOICE_HOP_STEPS, + VOICE_PARTIAL_STEPS); unit vectors scaled to 255
    # per row: GE2E embeddings are non-negative (ReLU), and a row's scale is lost to normalisation anyway)
    users: list[dict[str, np.ndarray]] = field(default_factory=list)
    assistant: list[dict[str, np.ndarray]] = field(default_factory=list)  # + echo, echo_noisy
    silence: np.ndarray | None = None  # codes of digital near-silence (steady state)
    noise: list[np.ndarray] = field(default_factory=list)  # noise-only clips
    fingerprint: str = ""
    split: str = "train"  # whose monologue lines the streams of this cache draw (train / heldout people)

    def save(self, path: Path) -> None:
        arrays = {"meta": np.array([CACHE_VERSION]), "fingerprint": np.array(self.fingerprint),
                  "split": np.array(self.split)}
        for i, u in enumerate(self.users):
            for k, v in u.items():
                arrays[f"user/{i}/{k}"] = v
        for i, a in enumerate(self.assistant):
            for k, v in a.items():
                arrays[f"assistant/{i}/{k}"] = v
        arrays["silence"] = self.silence
        for i, n in enumerate(self.noise):
            arrays[f"noise/{i}"] = n
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: Path) -> CodeCache:
        z = np.load(path)
        if int(z["meta"][0]) not in (5, CACHE_VERSION):  # a version-5 cache is a 6 with one noised copy each
            raise ValueError(f"{path}: code cache version {int(z['meta'][0])}, expected {CACHE_VERSION}; rebuild it")
        c = cls(fingerprint=str(z["fingerprint"]), silence=z["silence"], split=str(z["split"]))
        users: dict[int, dict] = {}
        assistant: dict[int, dict] = {}
        noise: dict[int, np.ndarray] = {}
        for key in z.files:
            parts = key.split("/")
            if parts[0] == "user":
                users.setdefault(int(parts[1]), {})[parts[2]] = z[key]
            elif parts[0] == "assistant":
                assistant.setdefault(int(parts[1]), {})[parts[2]] = z[key]
            elif parts[0] == "noise":
                noise[int(parts[1])] = z[key]
        c.users = [users[i] for i in sorted(users)]
        c.assistant = [assistant[i] for i in sorted(assistant)]
        c.noise = [noise[i] for i in sorted(noise)]
        return c


def source_files(data_root: Path, split: str) -> tuple[list[Path], list[Path]]:
    """(user utterances, assistant utterances) of a split ('train' or 'heldout') under LibriSpeech root."""
    cohort = sorted((data_root / "cohort").glob("*.flac"))
    other = data_root / "test-other"
    if not cohort or not other.is_dir():
        raise FileNotFoundError(
            f"{data_root} must hold LibriSpeech 'cohort/*.flac' and 'test-other/<speaker>/*.flac' "
            f"(e.g. /work/shared/data/speech); pass it with --data"
        )
    users = cohort[:N_TRAIN_USERS] if split == "train" else cohort[N_TRAIN_USERS:]
    assistant: list[Path] = []
    for spk in sorted(p for p in other.iterdir() if p.is_dir()):
        utts = sorted(spk.glob("*.flac"))
        assistant += utts[:N_TRAIN_ASSISTANT_UTTS] if split == "train" else utts[N_TRAIN_ASSISTANT_UTTS:]
    return users, assistant


def load_24k(path: Path) -> np.ndarray:
    """A speech file (any rate, any channels) as mono float32 at 24 kHz (the codec's rate)."""
    import librosa
    import soundfile as sf

    a, sr = sf.read(str(path), dtype="float32", always_2d=False)
    if a.ndim > 1:
        a = a.mean(axis=1)
    return librosa.resample(a, orig_sr=sr, target_sr=24_000).astype(np.float32)


def make_noise(rng: np.random.Generator, n: int) -> np.ndarray:
    """Unit-RMS white, pink or brown noise (drawn at random)."""
    return colour_noise(rng, n, int(rng.integers(3)))


def colour_noise(rng: np.random.Generator, n: int, kind: int) -> np.ndarray:
    """Unit-RMS noise of one colour: 0 white, 1 pink, 2 brown."""
    w = rng.standard_normal(n)
    if kind == 1:  # pink: 1/f spectrum
        spec = np.fft.rfft(w)
        spec[1:] /= np.sqrt(np.arange(1, len(spec)))
        w = np.fft.irfft(spec, n)
    elif kind == 2:  # brown: integrated white, high-passed a little
        w = np.cumsum(w)
        c = np.concatenate([[0.0], np.cumsum(w)])
        k = 2400  # subtract a 0.1 s moving average (running-sum form: O(n))
        w = w[k:] - (c[k:-1] - c[:-k - 1]) / k
        w = np.concatenate([w, w[: n - len(w)]])
    return (w / (np.sqrt(np.mean(w**2)) + 1e-9)).astype(np.float32)


def _noisy(rng: np.random.Generator, x: np.ndarray, sources: list[np.ndarray]) -> np.ndarray:
    """`x` plus a background of any kind (`noise.background`) at 0-20 dB SNR."""
    from egomem.trigger.noise import background

    snr_db = rng.uniform(0, 20)
    rms = np.sqrt(np.mean(x**2)) + 1e-9
    return x + background(rng, len(x), sources) * rms / 10 ** (snr_db / 20)


def frame_activity(x: np.ndarray, rel_db: float = -35.0) -> np.ndarray:
    """Per 80 ms step: is there speech? Frame RMS within `rel_db` of the utterance's loud frames."""
    n = -(-len(x) // 1920)
    frames = np.pad(x, (0, n * 1920 - len(x))).reshape(n, 1920)  # T,1920
    db = 10 * np.log10(np.mean(frames**2, axis=1) + 1e-12)
    return db > np.percentile(db, 95) + rel_db


def build_cache(data_root: Path, split: str, codec, seed: int, max_seconds: float | None = None,
                voice_encoder=None) -> CodeCache:
    """Encode every source of a split once (clean + noised variants, echo variants, fillers), and the
    GE2E voice partials of every user utterance (`voice_encoder`: default the offline Resemblyzer)."""
    from tqdm import tqdm

    from egomem.trigger.codec import codec_fingerprint, encode

    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    variants_rng = np.random.default_rng([seed, 0 if split == "train" else 1, 2])  # leaves `rng`'s draws as they were
    users, assistant = source_files(data_root, split)
    cache = CodeCache(fingerprint=codec_fingerprint(codec), split=split)
    cap = None if max_seconds is None else int(max_seconds * 24_000)
    voice = voice_encoder if voice_encoder is not None else default_voice_encoder()
    audio = [load_24k(p)[:cap] for p in tqdm(users + assistant, desc=f"load {split} sources", unit="utt")]
    babble = audio[: len(users)]  # babble is made of the split's own users
    for p, x in zip(tqdm(users + assistant, desc=f"encode {split} sources", unit="utt"), audio):
        x = x / (np.abs(x).max() + 1e-9) * 10 ** rng.uniform(-1.0, -0.3)  # level variety
        noisy = _noisy(rng, x, babble)
        entry = {"clean": encode(codec, x), "noisy": encode(codec, noisy), "vad": frame_activity(x)}
        if p in assistant:
            e = x * rng.uniform(0.02, 0.2)
            entry["echo"] = encode(codec, e)
            entry["echo_noisy"] = encode(codec, e + _noise_like(rng, x, babble))  # at the speech's SNR, not the echo's
            cache.assistant.append(entry)
        else:
            entry["voice_clean"], entry["voice_noisy"] = voice_partials(voice, x), voice_partials(voice, noisy)
            for v in range(1, NOISY_VARIANTS[split]):
                entry[f"noisy{v}"] = encode(codec, _noisy(variants_rng, x, babble))
            cache.users.append(entry)
    cache.silence = encode(codec, rng.standard_normal(24_000 * 4).astype(np.float32) * 1e-4)[8:]
    cache.noise = noise_clips(codec, split, seed, babble)
    return cache


def default_voice_encoder():
    """The offline GE2E speaker encoder (Resemblyzer weights from its wheel) with the identity config's gate."""
    from egomem.config import IdentityConfig
    from egomem.identity.voice import ResemblyzerEncoder, VoiceActivity

    cfg = IdentityConfig()
    return ResemblyzerEncoder(cfg.voice_threshold_resemblyzer, VoiceActivity(cfg.vad_threshold))


def voice_partials(encoder, x24k: np.ndarray) -> np.ndarray:
    """GE2E embeddings of 1.6 s partials of 24 kHz audio every VOICE_HOP_STEPS steps -> [P, D] uint8.

    Each partial is embedded alone by the encoder's `embed_speech` (one 1.6 s clip = exactly one GE2E
    partial), so these are the vectors the served speaker encoder averages."""
    from egomem.identity.voice import to_16k

    x = to_16k(np.asarray(x24k, np.float32), 24_000)
    per_step = 1280  # 80 ms at 16 kHz
    n_steps = len(x) // per_step
    rows = []
    for a in range(0, max(1, n_steps - VOICE_PARTIAL_STEPS + 1), VOICE_HOP_STEPS):
        seg = x[a * per_step:(a + VOICE_PARTIAL_STEPS) * per_step]
        seg = np.pad(seg, (0, VOICE_PARTIAL_STEPS * per_step - len(seg)))
        e = np.maximum(np.asarray(encoder.embed_speech(seg), np.float32), 0.0)
        rows.append(np.round(e / max(float(e.max()), 1e-12) * 255))
    return np.stack(rows).astype(np.uint8)  # [P, D]


def noise_clip_kind(i: int) -> str:
    """The kind (noise.KINDS) of `noise_clips`' clip i: the kinds take turns."""
    from egomem.trigger.noise import KINDS

    return KINDS[i % len(KINDS)]


def noise_clips(codec, split: str, seed: int, babble: list[np.ndarray]) -> list[np.ndarray]:
    """Codes of background-noise clips (10 s each, every kind of `noise.KINDS` in turn, levels varied,
    own seeded stream; babble from `babble`, the split's own speech).

    Many clips (`NOISE_CLIPS`: 144 train / 12 held out): with few, a trigger memorises the noise codes
    and takes unseen noise for speech."""
    from egomem.trigger.codec import encode
    from egomem.trigger.noise import background

    rng = np.random.default_rng([seed, 0 if split == "train" else 1, 1])
    n = NOISE_CLIPS[split]
    return [encode(codec, background(rng, 24_000 * 10, babble, kind=noise_clip_kind(i))
                   * 10 ** rng.uniform(-2.5, -1.3)) for i in range(n)]


def _noise_like(rng: np.random.Generator, speech: np.ndarray, babble: list[np.ndarray]) -> np.ndarray:
    """Background noise (any kind) at 0-20 dB SNR relative to the (un-echoed) speech level."""
    from egomem.trigger.noise import background

    rms = np.sqrt(np.mean(speech**2)) + 1e-9
    return background(rng, len(speech), babble) * rms / 10 ** (rng.uniform(0, 20) / 20)


def cache_path(cache_dir: Path, split: str, fingerprint: str, seed: int) -> Path:
    key = hashlib.sha256(f"{CACHE_VERSION}-{fingerprint}-{seed}".encode()).hexdigest()[:10]
    return cache_dir / f"trigger_codes_{split}_{key}.npz"


# ----------------------------------------------------------------------------------------------
# streams


@dataclass
class StreamSpec:
    """Knobs of the synthetic stream generator (seconds unless stated)."""

    steps: int = 1024
    turns: tuple[int, int] = (2, 6)
    turn_s: tuple[float, float] = (1.5, 6.0)
    pause_s: tuple[float, float] = (0.2, 1.5)  # inside a session
    gap_s: tuple[float, float] = (3.0, 15.0)  # between sessions (no dialog)
    user_first_p: float = 0.8  # a session usually opens with the user addressing the assistant
    switch_p: float = 0.3  # the next session is a different user right away
    switch_gap_s: tuple[float, float] = (0.4, 2.5)
    interrupt_p: float = 0.3  # the paper's: the next turn starts before the current one ends
    overlap_s: tuple[float, float] = (0.3, 1.5)
    echo_p: float = 0.3
    echo_delay_s: tuple[float, float] = (0.1, 0.5)
    text_lead: int = 2  # the monologue starts this many steps before the reply's audio
    query_p: float = 0.5  # a Level-2 line's query is written (else only its reply)
    retrieval_wait: tuple[int, int] = (2, 6)  # steps between a query's end and the reply's text


@functools.lru_cache(maxsize=4)
def monologue_lines(split: str, seed: int = 0) -> list[tuple[np.ndarray | None, np.ndarray]]:
    """(query ids or None, reply ids) of every model turn of the training corpus's dialogs of `split`
    (300 households of the template generator), in the offline dialog model's byte-level tokens."""
    from egomem.dialog.tokenizer import ByteTokenizer
    from egomem.training.corpus import make_corpus

    tok = ByteTokenizer()
    # return_visit=0: the lines the shipped trigger was trained on (a return visit only repeats greetings)
    _, dialogs = make_corpus(300, "train" if split == "train" else "heldout", seed, return_visit=0.0)
    lines = []
    for d in dialogs:
        for t in d.turns:
            q = np.asarray(tok.encode(t.query.text()), np.int64) if t.query is not None else None
            lines.append((q, np.asarray(tok.encode(t.reply), np.int64)))
    return lines


def _slice(rng: np.random.Generator, vad: np.ndarray, n: int) -> tuple[int, int]:
    """A window of at most n steps that starts and ends on speech (so a turn's edges are audible);
    skips the encoder's 3 warm-up frames."""
    active = np.flatnonzero(vad[3:]) + 3
    if active.size == 0:
        return 3, min(len(vad), 3 + n)
    a = int(active[rng.integers(max(1, np.searchsorted(active, len(vad) - n // 2)))])
    ends = active[(active >= a) & (active < a + n)]
    return a, int(ends[-1]) + 1


def _fill(rng: np.random.Generator, filler: np.ndarray, T: int) -> np.ndarray:
    """Tile a filler code clip to T steps from a random offset."""
    reps = -(-T // len(filler)) + 1
    tiled = np.concatenate([filler] * reps)
    a = int(rng.integers(0, len(filler)))
    return tiled[a:a + T]


@dataclass
class SynthStream:
    """A synthetic recorded stream and who spoke where (the ground truth the identity split needs)."""

    tokens: np.ndarray  # [T, 17] int64
    labels: np.ndarray  # [T] int64 gold trigger labels
    sessions: list[tuple[int, int]]  # gold sessions (start, end inclusive)
    session_users: list[int]  # the user (cache.users index) of each gold session
    speaker: np.ndarray  # [T] int64: cache.users index whose speech is on the listen channel, -1 none
    speaker_pos: np.ndarray  # [T] int64: that utterance's step there, -1 none
    noised: bool
    background: str | None = None  # noised: the kind of the listen row's background clip (noise.KINDS)
    # the assistant's echo on the listen row: (cache.assistant index, its first utterance step, stream step, steps)
    echoes: list[tuple[int, int, int, int]] = field(default_factory=list)
    snr_db: float | None = None  # noised, listen row encoded whole: the background's SNR to the users' speech
    # the voice track as the polling loop records it from the listen row's audio (listen_audio.heard_voices);
    # None: read it from the cache's per-utterance partials (poll_voices)
    voices: list[tuple[int, np.ndarray]] | None = None


def synth_stream(cache: CodeCache, rng: np.random.Generator, spec: StreamSpec, noised: bool
                 ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """One stream: tokens [T, 17] int64, labels [T] int64, gold sessions [(start, end inclusive)]."""
    s = synth_recorded(cache, rng, spec, noised)
    return s.tokens, s.labels, s.sessions


def synth_recorded(cache: CodeCache, rng: np.random.Generator, spec: StreamSpec, noised: bool) -> SynthStream:
    """One stream with its speaker ground truth; draws exactly what `synth_stream` draws from `rng`."""
    T = spec.steps
    u = lambda r: rng.uniform(*r)  # noqa: E731
    lines = monologue_lines(cache.split)
    clip = int(rng.integers(len(cache.noise))) if noised else None
    listen_bg = _fill(rng, cache.noise[clip] if clip is not None else cache.silence, T)
    listen = listen_bg.copy()
    user_mask = np.zeros(T, bool)  # where the user's own speech was written
    speaker = np.full(T, -1, np.int64)
    speaker_pos = np.full(T, -1, np.int64)
    session_users: list[int] = []
    speak = _fill(rng, cache.silence, T)
    text = np.full(T, TEXT_PAD, np.int64)
    labels = np.full(T, NO_DIALOG, np.int64)
    sessions: list[tuple[int, int]] = []
    echoes: list[tuple[int, int, int, int]] = []
    t = _steps(u((0.0, 8.0)))
    user = int(rng.integers(len(cache.users)))
    while True:
        n_turns = int(rng.integers(spec.turns[0], spec.turns[1] + 1))
        who = 0 if rng.random() < spec.user_first_p else 1  # 0 user first, 1 assistant first
        plan, cur = [], t
        for _ in range(n_turns):
            plan.append((who, cur, _steps(u(spec.turn_s))))
            end = cur + plan[-1][2]
            if rng.random() < spec.interrupt_p:
                cur = max(cur + 1, end - _steps(u(spec.overlap_s)))
            else:
                cur = end + _steps(u(spec.pause_s))
            who = 1 - who
        placed = []
        for who, a, n in plan:
            k = user if who == 0 else int(rng.integers(len(cache.assistant)))
            src = cache.users[k] if who == 0 else cache.assistant[k]
            lo, hi = _slice(rng, src["vad"], n)
            placed.append([who, a, a + (hi - lo), lo, hi, src, k])
        for cur, nxt in zip(placed, placed[1:]):  # the user cuts into the model's reply: the model stops
            if cur[0] == 1 and nxt[0] == 0 and nxt[1] < cur[2]:
                cur[4] = cur[3] + (nxt[1] - cur[1])
                cur[2] = nxt[1]
        s_start = min(p[1] for p in placed)
        s_end = max(p[2] for p in placed) - 1
        if s_end >= T - 1:
            break  # the session would not end inside the stream: stop here, rest is no dialog
        for i, (who, a, b, lo, hi, src, _) in enumerate(placed):
            if who == 0:
                listen[a:b] = _user_codes(rng, src, noised)[lo:hi]
                user_mask[a:b] = True
                speaker[a:b] = user
                speaker_pos[a:b] = np.arange(lo, hi)
            else:
                speak[a:b] = src["clean"][lo:hi]
                query, reply = lines[int(rng.integers(len(lines)))]
                t0 = max(s_start, a - spec.text_lead)
                r = reply[: b - t0]  # the monologue stops with the audio
                text[t0:t0 + len(r)] = r
                if query is not None and i > 0 and rng.random() < spec.query_p:
                    q0 = t0 - int(rng.integers(spec.retrieval_wait[0], spec.retrieval_wait[1] + 1)) - len(query)
                    q = query[max(0, s_start - q0):]  # written while the model is silent, inside the session
                    text[max(q0, s_start):max(q0, s_start) + len(q)] = q
        for who, a, b, lo, hi, src, k in placed:  # echo after all user speech is known
            if who == 1 and rng.random() < spec.echo_p:
                d = _steps(u(spec.echo_delay_s))
                e = src["echo_noisy" if noised else "echo"][lo:hi]
                a2, b2 = a + d, min(b + d, T)
                if a2 < b2:
                    seg = e[: b2 - a2]
                    free = ~user_mask[a2:b2]
                    listen[a2:b2][free] = seg[free]
                    echoes.append((k, lo, a2, b2 - a2))
        labels[s_start] = START
        labels[s_start + 1:s_end] = IN_SESSION
        labels[s_end] = END
        sessions.append((s_start, s_end))
        session_users.append(user)
        if rng.random() < spec.switch_p and len(cache.users) > 1:
            user = (user + 1 + int(rng.integers(len(cache.users) - 1))) % len(cache.users)
            t = s_end + 1 + _steps(u(spec.switch_gap_s))
        else:
            user = int(rng.integers(len(cache.users)))
            t = s_end + 1 + _steps(u(spec.gap_s))
        if t >= T - _steps(spec.turn_s[0]) * 2:
            break
    tokens = np.concatenate([text[:, None], speak.astype(np.int64), listen.astype(np.int64)], axis=1)  # [T,17]
    return SynthStream(tokens, labels, sessions, session_users, speaker, speaker_pos, noised,
                       background=noise_clip_kind(clip) if clip is not None else None, echoes=echoes)


def _user_codes(rng: np.random.Generator, src: dict[str, np.ndarray], noised: bool) -> np.ndarray:
    """A user utterance's codes: clean, or one of its noised copies (a draw only when it has several)."""
    if not noised:
        return src["clean"]
    n = sum(k.startswith("noisy") for k in src)
    k = int(rng.integers(n)) if n > 1 else 0
    return src["noisy" if k == 0 else f"noisy{k}"]


def poll_voices(cache: CodeCache, stream: SynthStream, poll_steps: int = 25, window_steps: int = 38,
                min_voiced_steps: int = 13, first_poll: int = 24) -> list[tuple[int, np.ndarray]]:
    """The (step, voice embedding [D]) track the orchestrator's polling loop records for this stream.

    Defaults follow the orchestrator's: a poll every 2 s (25 steps; the first one 2 s after the
    stream opened, recorded at step 24), the last 3 s of the user's audio (38 steps), and the
    speaker encoder's gate of 1 s of speech (13 steps, counted with each utterance's activity mask).
    The embedding is the normalised mean of the cached GE2E partials heard in the window (module
    docstring); a noised stream uses the partials of the noised audio."""
    key = "voice_noisy" if stream.noised else "voice_clean"
    if any(key not in u for u in cache.users):
        raise ValueError(f"code cache has no '{key}' voice partials; rebuild it (CACHE_VERSION {CACHE_VERSION})")
    min_cover = int(np.ceil(0.75 * VOICE_PARTIAL_STEPS))  # Resemblyzer keeps a partial >= 75 % full
    out: list[tuple[int, np.ndarray]] = []
    T = stream.tokens.shape[0]
    for t in range(first_poll, T, poll_steps):
        lo = max(0, t - window_steps + 1)
        spk, pos = stream.speaker[lo:t + 1], stream.speaker_pos[lo:t + 1]  # [W] each
        heard = np.flatnonzero(spk >= 0)
        if heard.size == 0:
            continue
        voiced = sum(int(cache.users[int(spk[i])]["vad"][int(pos[i])]) for i in heard)
        if voiced < min_voiced_steps:
            continue
        rows, best = [], (0, None)  # best: the most-covered partial, for speech shorter than one partial
        for u in np.unique(spk[heard]):
            steps = pos[spk == u]  # utterance steps of user u heard in the window
            parts = cache.users[int(u)][key]
            for p in range(parts.shape[0]):
                a = p * VOICE_HOP_STEPS
                cover = int(np.count_nonzero((steps >= a) & (steps < a + VOICE_PARTIAL_STEPS)))
                v = parts[p].astype(np.float32)
                v = v / max(float(np.linalg.norm(v)), 1e-12)
                if cover >= min_cover:
                    rows.append(v)
                if cover > best[0]:
                    best = (cover, v)
        if not rows and best[1] is not None:
            rows = [best[1]]  # Resemblyzer embeds speech shorter than a partial as one zero-padded partial
        if rows:
            m = np.mean(rows, axis=0)
            out.append((t, (m / max(float(np.linalg.norm(m)), 1e-12)).astype(np.float32)))
    return out


def recorded_voices(cache: CodeCache, stream: SynthStream, window_steps: int = 38) -> list[tuple[int, np.ndarray]]:
    """The voice polls the memory manager hands the trigger for this stream: its heard track when it has
    one (`stream.voices`, listen_audio.heard_voices), else the cached partials' (`poll_voices`)."""
    return stream.voices if stream.voices is not None else poll_voices(cache, stream, window_steps=window_steps)


def track_features(cache: CodeCache, stream: SynthStream, dim: int, window_steps: int,
                   rng: np.random.Generator | None = None, drop_track_p: float = 0.0,
                   drop_poll_p: float = 0.0) -> np.ndarray:
    """The voice features [T, dim + 2] a trigger reading the voice track gets for this stream (its heard
    track `stream.voices` when it has one, else `poll_voices`; -> `voice_track.voice_features`). In
    training (`rng`), the whole track is dropped
    with `drop_track_p` (a chunk recorded without speaker encoder: the trigger must still label from
    the codes) and each poll with `drop_poll_p` (a missed poll); no draw is made when both are 0."""
    from egomem.trigger.voice_track import voice_features

    track = recorded_voices(cache, stream, window_steps)
    if rng is not None and (drop_track_p > 0 or drop_poll_p > 0):
        keep = rng.random(len(track)) >= drop_poll_p
        track = [] if rng.random() < drop_track_p else [p for p, k in zip(track, keep) if k]
    return voice_features(track, stream.tokens.shape[0], dim, window_steps)


def synth_batch(cache: CodeCache, rng: np.random.Generator, spec: StreamSpec, batch: int,
                noised_p: float = 0.5) -> list[SynthStream]:
    """B streams of the same spec, each noised with probability `noised_p`, with their speaker ground truth."""
    return [synth_recorded(cache, rng, spec, noised=rng.random() < noised_p) for _ in range(batch)]


def voice_change_targets(speaker: np.ndarray) -> np.ndarray:
    """[T] per step of user speech: 1 when this run of speech is another user than the run before it,
    0 the same user; -1 (no target) outside user speech and on the stream's first run."""
    out = np.full(len(speaker), -1, np.int64)
    prev, t = -1, 0
    while t < len(speaker):
        who = int(speaker[t])
        end = t + 1
        while end < len(speaker) and speaker[end] == who:
            end += 1
        if who >= 0:
            if prev >= 0:
                out[t:end] = int(who != prev)
            prev = who
        t = end
    return out
