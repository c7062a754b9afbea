"""The listen row as a microphone records it: a stream's user speech and echo laid out as AUDIO, one
stationary background for the whole stream, encoded in one pass by the codec, as `mimi_codec` encodes
a live stream.

`synth.synth_recorded` cuts the listen row from codes cached per utterance. That is cheap, but a tagger
trained on it learns the splice: after a turn the row drops straight back to the codes of steady
near-silence, whereas a codec that encodes the whole stream (Mimi's encoder transformer attends over
seconds of context) writes other codes for the silence after speech. The trigger trained on spliced
rows (`bench/bench_trigger.py`, 200 held-out clean streams): F1@5 0.891 spliced, 0.470 with the rows
encoded whole; in one stream looked at closely, its sessions ended 7, 13 and 26 steps late. And the spliced noised row changes noise kind and
level at every utterance edge, where a room's background does not.

`encode_listen` keeps a stream's layout (sessions, labels, text and speak rows, who speaks where)
and rebuilds only its listen row: each user's utterance steps at one level per user per stream,
each assistant echo at its gain (added, also over the user), a -80 dB floor (the cache's near-silence), and
in a noised copy one background (`noise.background`, any kind) at 0-20 dB SNR to the users' speech.
`build_pool` makes a seeded set of such streams (each layout once clean, once noised, as the
paper's noised copies) that training draws from: encoding costs ~0.7 s per minute of audio on one
core, too much to do for every training batch.
The voice track: by default a stream's polls are read from the cached utterances' voice partials
(`synth.poll_voices`; a noised copy reads the cached noised partials, each utterance under its own noise).
That is not what serving records: the polling loop embeds the last 3 s of the microphone, echo and
background included, gated by the speaker encoder's VAD. `heard_voices` plays that over the laid-out
audio, and a pool built with `PoolSpec.heard_voices` stores each stream's heard track (`SynthStream.voices`)
for training to read (session 62: session 59's trigger, trained on cached tracks, lost 0.19 clean and
0.22 noised span F1@5 when it read heard ones; docs/trigger.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from egomem.trigger.synth import SynthStream, load_24k, source_files

FRAME = 1920  # samples per 80 ms step at 24 kHz
LEVEL_DB = (-20.0, -6.0)  # a user's peak level in a stream (the cache's level variety)
ECHO_GAIN = (0.02, 0.2)
SNR_DB = (0.0, 20.0)
# the 5 dB bands of SNR_DB that reports split noised figures by (bench_trigger, bench_codec, the diagnoses)
SNR_BANDS_DB = tuple((lo, lo + 5) for lo in range(int(SNR_DB[0]), int(SNR_DB[1]), 5))
FLOOR = 1e-4  # the near-silence under everything (what `synth.build_cache` encodes as silence)


@dataclass
class SourceAudio:
    """24 kHz audio of a split's sources, in the code cache's order (`synth.source_files`)."""

    users: list[np.ndarray]
    assistant: list[np.ndarray]

    @classmethod
    def load(cls, data_root: Path, split: str) -> SourceAudio:
        users, assistant = source_files(Path(data_root), split)
        return cls([load_24k(p) for p in users], [load_24k(p) for p in assistant])


def _peak_scaled(x: np.ndarray, db: float) -> np.ndarray:
    return x * (10 ** (db / 20) / (np.abs(x).max() + 1e-9))


def shifted_voice(x: np.ndarray, semitones: float) -> np.ndarray:
    """`x` (24 kHz) pitch-shifted by `semitones` at the same duration (librosa: phase-vocoder stretch, then
    resampling, so the formants move with the pitch: another vocal tract, as speed perturbation gives, with
    every step where it was and the layout's labels still true)."""
    import librosa

    return librosa.effects.pitch_shift(x, sr=24_000, n_steps=semitones).astype(np.float32)


def listen_waveform(stream: SynthStream, audio: SourceAudio, rng: np.random.Generator, noised: bool,
                    voice_shift: float = 0.0) -> tuple[np.ndarray, str | None, float | None]:
    """The listen row of `stream` as 24 kHz audio [T * 1920], the background's kind and its SNR to the
    users' speech in dB (both None when clean). `voice_shift` > 0: each user of the stream speaks
    pitch-shifted by a uniform draw in +-`voice_shift` semitones (`shifted_voice`; training pools only, to
    hear more voices than the 200 training speakers); 0 draws nothing more from `rng`."""
    from egomem.trigger.noise import KINDS, background

    T = stream.tokens.shape[0]
    x = np.zeros(T * FRAME, np.float32)
    level: dict[int, float] = {}
    voice: dict[int, np.ndarray] = {}
    t = 0
    while t < T:  # runs of one user's consecutive utterance steps
        u = int(stream.speaker[t])
        if u < 0:
            t += 1
            continue
        e, p = t + 1, int(stream.speaker_pos[t])
        while e < T and stream.speaker[e] == u and stream.speaker_pos[e] == p + (e - t):
            e += 1
        if u not in level:
            level[u] = float(rng.uniform(*LEVEL_DB))
            voice[u] = audio.users[u]
            if voice_shift > 0:
                voice[u] = shifted_voice(voice[u], float(rng.uniform(-voice_shift, voice_shift)))
        seg = _peak_scaled(voice[u], level[u])[p * FRAME:(p + e - t) * FRAME]
        x[t * FRAME:t * FRAME + len(seg)] += seg
        t = e
    user_steps = np.repeat(stream.speaker >= 0, FRAME)
    # the SNR's reference; a stream without user speech takes a typical speech RMS at these levels
    speech_rms = float(np.sqrt(np.mean(x[user_steps] ** 2))) if user_steps.any() else 0.03
    for k, lo, at, n in stream.echoes:
        src = _peak_scaled(audio.assistant[k], rng.uniform(*LEVEL_DB)) * rng.uniform(*ECHO_GAIN)
        seg = src[lo * FRAME:(lo + n) * FRAME]
        x[at * FRAME:at * FRAME + len(seg)] += seg
    x += rng.standard_normal(len(x)).astype(np.float32) * FLOOR
    kind, snr = None, None
    if noised:
        kind = KINDS[int(rng.integers(len(KINDS)))]
        snr = float(rng.uniform(*SNR_DB))
        x += background(rng, len(x), audio.users, kind=kind) * (speech_rms / 10 ** (snr / 20))
    return x.astype(np.float32), kind, snr


def heard_voices(wave: np.ndarray, encoder, poll_steps: int = 25, window_steps: int = 38,
                 first_poll: int = 24) -> list[tuple[int, np.ndarray]]:
    """The (step, voice embedding) track the orchestrator's polling loop records from a microphone that
    heard `wave` (24 kHz, the listen row's audio: users, echo and background as laid out): every `poll_steps`
    from `first_poll` on, the configured speaker encoder (`identity.voice.build_speaker_encoder`: its VAD
    gate, then the embedding of the speech it keeps) over the last `window_steps` of audio; a poll the gate
    refuses records nothing. Unlike `synth.poll_voices` (cached per-utterance partials, each utterance under
    its own noise), the track hears what the codes hear. Defaults as `poll_voices`'."""
    out: list[tuple[int, np.ndarray]] = []
    T = len(wave) // FRAME
    for t in range(first_poll, T, poll_steps):
        lo = max(0, t - window_steps + 1)
        result = encoder.encode(wave[lo * FRAME:(t + 1) * FRAME], 24000)
        if result.embedding is not None:
            out.append((t, np.asarray(result.embedding, np.float32)))
    return out


def encode_listen(stream: SynthStream, audio: SourceAudio, codec, rng: np.random.Generator, noised: bool,
                  voice_shift: float = 0.0, speaker=None) -> SynthStream:
    """A copy of `stream` whose listen row is `listen_waveform` encoded in one pass by `codec`; with a
    `speaker` encoder, also its heard voice track (`heard_voices`; it draws nothing from `rng`)."""
    wave, kind, snr = listen_waveform(stream, audio, rng, noised, voice_shift)
    s = with_listen_row(stream, codec, wave, kind, snr)
    return s if speaker is None else dataclasses.replace(s, voices=heard_voices(wave, speaker))


def with_listen_row(stream: SynthStream, codec, wave: np.ndarray, background: str | None = None,
                    snr_db: float | None = None) -> SynthStream:
    """A copy of `stream` whose listen row is the codes of `wave` (24 kHz, the row's audio) encoded in one
    pass by `codec`; noised when `background` is given."""
    from egomem.trigger.codec import encode

    tokens = stream.tokens.copy()
    tokens[:, 9:] = encode(codec, wave)[: tokens.shape[0]]
    return dataclasses.replace(stream, tokens=tokens, noised=background is not None, background=background,
                               snr_db=snr_db)


def draw_stream(cache, rng: np.random.Generator, spec, noised: bool, listen: tuple | None = None,
                speaker=None) -> SynthStream:
    """One stream drawn from `rng`: its listen row spliced from `cache`'s codes (`listen` None, as
    `synth.synth_recorded`), or laid out and encoded whole (`listen` = (SourceAudio, codec)) over the
    layout of a clean stream, the noise of a noised one added to the audio; then, with a `speaker`
    encoder, its heard voice track (`heard_voices`; it draws nothing from `rng`)."""
    from egomem.trigger.synth import synth_recorded

    if listen is None:
        if speaker is not None:
            raise ValueError("a heard voice track needs the stream's audio: pass listen=(SourceAudio, codec)")
        return synth_recorded(cache, rng, spec, noised=noised)
    audio, codec = listen
    return encode_listen(synth_recorded(cache, rng, spec, noised=False), audio, codec, rng, noised, speaker=speaker)


# ----------------------------------------------------------------------------------------------
# the training pool

POOL_VERSION = 1
POOL_SHARD = 50  # layouts per shard file: a killed build resumes at the next missing shard


@dataclass
class PoolSpec:
    """Which streams a pool holds: `layouts` layouts (each stored clean, then noised), drawn from
    rng([seed, 100, i]); a share `long_p` of them 1024..`max_steps` steps long, the rest `steps`;
    users' voices pitch-shifted by up to `voice_shift` semitones (`listen_waveform`)."""

    layouts: int = 1000
    steps: int = 768
    long_p: float = 0.05
    max_steps: int = 8192
    seed: int = 0
    voice_shift: float = 0.0
    heard_voices: bool = False  # store each stream's heard voice track (`heard_voices`), not the cached partials'

    def key(self, fingerprint: str) -> str:
        """Names the pool's shard files; `layouts` is not in it, so a larger pool reuses a smaller one's shards
        (`voice_shift` and `heard_voices` only when set, so pools built before them keep their names)."""
        import hashlib

        text = f"{POOL_VERSION}-{fingerprint}-{self.steps}-{self.long_p}-{self.max_steps}-{self.seed}"
        if self.voice_shift:
            text += f"-vs{self.voice_shift}"
        if self.heard_voices:
            text += "-heard"
        return hashlib.sha256(text.encode()).hexdigest()[:10]


def pool_layout(cache, audio: SourceAudio, codec, spec: PoolSpec, i: int, speaker=None
                ) -> tuple[SynthStream, SynthStream]:
    """Layout i of a pool, clean and noised (deterministic in (spec.seed, i): shards build in any order);
    with `spec.heard_voices`, each with its heard voice track from `speaker` (the configured speaker encoder)."""
    from egomem.trigger.synth import StreamSpec, synth_recorded

    if spec.heard_voices and speaker is None:
        raise ValueError("a pool of heard voice tracks needs the speaker encoder (identity.voice.build_speaker_encoder)")
    rng = np.random.default_rng([spec.seed, 100, i])
    steps = int(rng.integers(1024, spec.max_steps + 1)) if rng.random() < spec.long_p else spec.steps
    layout = synth_recorded(cache, rng, StreamSpec(steps=steps), noised=False)
    speaker = speaker if spec.heard_voices else None
    return (encode_listen(layout, audio, codec, rng, False, spec.voice_shift, speaker),
            encode_listen(layout, audio, codec, rng, True, spec.voice_shift, speaker))


def save_streams(path: Path, streams: list[SynthStream], fingerprint: str = "") -> None:
    """Streams (as a pool shard or a held-out set) to one .npz, atomically; `fingerprint`: the codec's."""
    arrays = {"fingerprint": np.array(fingerprint)}
    for j, s in enumerate(streams):
        arrays[f"{j}/tokens"] = s.tokens.astype(np.int16)
        arrays[f"{j}/labels"] = s.labels.astype(np.int8)
        arrays[f"{j}/speaker"] = s.speaker.astype(np.int16)
        arrays[f"{j}/speaker_pos"] = s.speaker_pos.astype(np.int16)
        arrays[f"{j}/sessions"] = np.asarray(s.sessions, np.int32).reshape(-1, 2)
        arrays[f"{j}/session_users"] = np.asarray(s.session_users, np.int32)
        arrays[f"{j}/noised"] = np.array(s.noised)
        arrays[f"{j}/background"] = np.array(s.background or "")
        if s.voices is not None:  # the heard track: (step, embedding) rows
            arrays[f"{j}/voice_steps"] = np.asarray([t for t, _ in s.voices], np.int32)
            arrays[f"{j}/voice_vecs"] = (np.stack([v for _, v in s.voices]).astype(np.float16) if s.voices
                                         else np.zeros((0, 0), np.float16))  # float16: unit vectors, half the disk
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)  # atomic: a killed build leaves no half shard


def load_streams(path: Path, fingerprint: str | None = None) -> list[SynthStream]:
    """The streams `save_streams` wrote; with `fingerprint`, refused if another codec encoded them."""
    z = np.load(path)
    if fingerprint is not None and str(z["fingerprint"]) != fingerprint:
        raise ValueError(f"{path} was encoded by codec {str(z['fingerprint'])!r}, not {fingerprint!r}: rebuild it")
    out = []
    for j in range(len({k.split("/")[0] for k in z.files if "/" in k})):
        voices = None
        if f"{j}/voice_steps" in z.files:
            vecs = z[f"{j}/voice_vecs"].astype(np.float32)
            voices = [(int(t), v) for t, v in zip(z[f"{j}/voice_steps"], vecs, strict=True)]
        out.append(SynthStream(
            tokens=z[f"{j}/tokens"].astype(np.int64), labels=z[f"{j}/labels"].astype(np.int64),
            sessions=[(int(a), int(b)) for a, b in z[f"{j}/sessions"]],
            session_users=[int(u) for u in z[f"{j}/session_users"]],
            speaker=z[f"{j}/speaker"].astype(np.int64), speaker_pos=z[f"{j}/speaker_pos"].astype(np.int64),
            noised=bool(z[f"{j}/noised"]), background=str(z[f"{j}/background"]) or None, voices=voices))
    return out


def load_or_build_pool(pool_dir: Path, cache, codec, spec: PoolSpec, data_root: Path | None,
                       shards: range | None = None, progress: bool = True, speaker=None) -> list[SynthStream]:
    """The pool's streams (2 per layout), building the missing shards from `data_root`'s audio.
    `shards` limits a call to some shard indices (to build them in several processes at once); `speaker`:
    the encoder a `spec.heard_voices` pool hears with (None: the default config's, `heard_encoder`)."""
    from tqdm import tqdm

    from egomem.trigger.codec import codec_fingerprint

    fp = codec_fingerprint(codec)
    if fp != cache.fingerprint:
        raise ValueError(f"code cache {cache.fingerprint} was made by another codec than this one ({fp})")
    key = spec.key(fp)
    n_shards = -(-spec.layouts // POOL_SHARD)
    todo = shards if shards is not None else range(n_shards)
    paths = {k: Path(pool_dir) / f"listen_pool_{cache.split}_{key}_{k:04d}.npz" for k in todo}
    missing = [k for k, p in paths.items() if not p.is_file()]
    if missing:
        if data_root is None:
            raise SystemExit(f"listen pool {paths[missing[0]]} is missing: pass --data <LibriSpeech root> to build it")
        audio = SourceAudio.load(data_root, cache.split)
        if spec.heard_voices and speaker is None:
            speaker = heard_encoder()
        Path(pool_dir).mkdir(parents=True, exist_ok=True)
        for k in tqdm(missing, desc=f"encode listen pool ({cache.split})", unit="shard", disable=not progress):
            lo, hi = k * POOL_SHARD, min(spec.layouts, (k + 1) * POOL_SHARD)
            save_streams(paths[k], [s for i in range(lo, hi)
                                    for s in pool_layout(cache, audio, codec, spec, i, speaker)], fp)
    return [s for k in todo for s in load_streams(paths[k], fp)]


def heard_encoder(identity=None):
    """The speaker encoder the polling loop uses (`identity` config; None: the default config's, whose
    Resemblyzer and Silero weights ship in registry wheels), for heard voice tracks."""
    from egomem.config import load_config
    from egomem.identity.voice import build_speaker_encoder

    return build_speaker_encoder(identity if identity is not None else load_config(None).identity)


def heldout_set(cache, audio: SourceAudio, codec, n: int, seed: int, steps: int = 1024, speaker=None
                ) -> list[SynthStream]:
    """n clean then n noised held-out streams, layouts from rng([seed, 0 / 1]) as the spliced benchmarks
    draw them, listen rows encoded whole (what tests/data/trigger/heldout_listen.npz holds); with a
    `speaker` encoder, each with its heard voice track (the same streams: the track draws nothing)."""
    from egomem.trigger.synth import StreamSpec

    out = []
    for noised in (False, True):
        rng = np.random.default_rng([seed, int(noised)])
        out += [draw_stream(cache, rng, StreamSpec(steps=steps), noised, (audio, codec), speaker) for _ in range(n)]
    return out


def main(argv: list[str] | None = None) -> int:
    """Build some shards of a training pool (`python -m egomem.trigger.listen_audio --shards 0:10`), e.g. in
    two processes at once before `egomem train-trigger --listen-pool` uses them all."""
    import argparse

    from egomem.config import REPO_ROOT, load_config
    from egomem.trigger.codec import build_codec, codec_fingerprint
    from egomem.trigger.synth import CodeCache, cache_path

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--config", type=Path)
    p.add_argument("--cache-dir", type=Path, default=REPO_ROOT / "runs" / "trigger_cache")
    p.add_argument("--layouts", type=int, default=PoolSpec.layouts)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", default=None, help="a:b, shard indices to build (default all)")
    p.add_argument("--voice-shift", type=float, default=0.0, help="as egomem train-trigger --voice-shift")
    p.add_argument("--heard-voices", action="store_true", help="as egomem train-trigger --heard-voices")
    p.add_argument("--heldout-set", type=Path, default=None,
                   help="instead: write the test's held-out set (48 clean + 48 noised streams, seed 2024) here")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    codec = build_codec(load_config(args.config).mimi)
    fp = codec_fingerprint(codec)
    if args.heldout_set is not None:
        held = CodeCache.load(cache_path(args.cache_dir, "heldout", fp, args.seed))
        streams = heldout_set(held, SourceAudio.load(args.data, "heldout"), codec, 48, 2024,
                              speaker=heard_encoder() if args.heard_voices else None)
        save_streams(args.heldout_set, streams, fp)
        print(f"{len(streams)} streams -> {args.heldout_set}")
        return 0
    path = cache_path(args.cache_dir, "train", fp, args.seed)
    if not path.is_file():
        raise SystemExit(f"no code cache {path}: run egomem train-trigger --data ... once to build it")
    cache = CodeCache.load(path)
    spec = PoolSpec(layouts=args.layouts, seed=args.seed, voice_shift=args.voice_shift, heard_voices=args.heard_voices)
    shards = None
    if args.shards:
        a, b = (int(v) for v in args.shards.split(":"))
        shards = range(a, b)
    streams = load_or_build_pool(args.cache_dir, cache, codec, spec, args.data, shards)
    print(f"{len(streams)} streams")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
