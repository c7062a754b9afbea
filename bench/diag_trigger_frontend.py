"""Could an audio front end close the trigger's noised gap? Two pretrained ones that registry wheels ship.

The shipped trigger's held-out noised span F1@5 is 0.72 against issue #14's 0.80, and most of its
shifted sessions start late: over noise the tagger hears a user's first words late (docs/trigger.md).
This diagnosis draws `bench/bench_trigger.py`'s held-out streams (same seed, same streams, listen row
laid out as audio and encoded whole) and labels each with the shipped trigger three ways:
  - trigger: the row as serving encodes it, with the cached voice track (`synth.poll_voices`; what the
    benchmark measured before session 62; `heard` below is what it measures now);
  - rnnoise: the row's audio through RNNoise (the `pyrnnoise` wheel's librnnoise, its weights compiled
    in; 48 kHz, 10 ms frames, its two-frame lag removed) before the codec, the trigger unchanged;
  - vad_onset: the trigger's sessions, each start after a gap moved back to the onset of the Silero VAD
    speech run (the `silero-vad` wheel's ONNX model, 16 kHz) that reaches it, when that onset lies within
    `--snap-back` steps before it (a late start pulled to where speech began).
  - codec:PATH (session 58): the row encoded by another Mimi (e.g. `bench/diag_robust_encoder.py`'s
    noise-robust student encoder), the trigger unchanged;
  - trigger:PATH (session 58): another trigger checkpoint labelling the same row (two recipes on the
    same streams, e.g. `--codebook-emb frozen` against its peer).
  - heard (session 62): the shipped trigger on the same row with the voice track serving records: the
    speaker encoder on the last 3 s of the row's audio every 2 s (`listen_audio.heard_voices`), not the
    cached per-utterance partials (`synth.poll_voices`, each utterance under its own noise) the benchmark
    and the training pool use. heard+trigger:PATH: that checkpoint with the heard track. heard_noecho: the
    heard track of the same stream laid out without the assistant's echo (a microphone with echo
    cancellation; the same users at the same levels, another draw of any background). novoice: the
    shipped trigger with no voice track at all (what steps without a poll see).
It also reports, per gold session that opens with the user, how many steps after the gold start Silero
first hears speech (p >= 0.5) on the clean and on the noised audio: how audible the first words are
(with `vad_onset` among `--front-ends`).
Per background kind and per 5 dB band of its SNR, as `bench_trigger.py`'s `by_background` / `by_snr_db`.
Neither wheel is a dependency of the project: `pip install pyrnnoise silero-vad --no-deps` first (only
for the front ends that use them).

    python bench/diag_trigger_frontend.py --streams 200 --clean-streams 100 \
        --out bench/results/diag_trigger_frontend.json
    # or the two conditions in two processes (session 57's figures, ~25 min on this 2-core CPU):
    python bench/diag_trigger_frontend.py --conditions noised --out bench/results/diag_trigger_frontend_noised.json &
    python bench/diag_trigger_frontend.py --conditions clean --out bench/results/diag_trigger_frontend_clean.json
    # a student encoder instead (session 58):
    python bench/diag_trigger_frontend.py --front-ends codec:runs/s58/robust/mimi.safetensors --conditions noised \
        --out bench/results/diag_robust_encoder_trigger_noised.json
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trigger import DEFAULT_CACHE, DEFAULT_DATA, noise_breakdown

from egomem.config import REPO_ROOT, TriggerConfig, load_config
from egomem.trigger import TriggerLabeler, decode_sessions
from egomem.trigger.codec import build_codec
from egomem.trigger.listen_audio import FRAME, SourceAudio, heard_voices, listen_waveform, with_listen_row
from egomem.trigger.metrics import error_breakdown, evaluate
from egomem.trigger.synth import CodeCache, StreamSpec, poll_voices, synth_recorded

SR = 24000
VAD_SR, VAD_CHUNK = 16000, 512  # Silero's window at 16 kHz (32 ms)
VAD_SPEECH = 0.5


def _missing(wheel: str) -> SystemExit:
    return SystemExit(f"{wheel} is not installed: pip install pyrnnoise silero-vad --no-deps (diagnosis only)")


class RNNoise:
    """librnnoise from the pyrnnoise wheel, loaded directly (the package's __init__ imports audiolab)."""

    def __init__(self) -> None:
        spec = importlib.util.find_spec("pyrnnoise")
        if spec is None or not spec.submodule_search_locations:
            raise _missing("pyrnnoise")
        lib = ctypes.CDLL(str(Path(spec.submodule_search_locations[0]) / "librnnoise.so"))
        lib.rnnoise_create.argtypes, lib.rnnoise_create.restype = [ctypes.c_void_p], ctypes.c_void_p
        lib.rnnoise_destroy.argtypes = [ctypes.c_void_p]
        ptr = ctypes.POINTER(ctypes.c_float)
        lib.rnnoise_process_frame.argtypes = [ctypes.c_void_p, ptr, ptr]
        lib.rnnoise_process_frame.restype = ctypes.c_float
        self.lib, self.n = lib, lib.rnnoise_get_frame_size()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """24 kHz float audio -> denoised, same length and time base."""
        import torchaudio.functional as AF

        y = AF.resample(torch.from_numpy(x), SR, 48000).numpy().astype(np.float32) * 32768.0
        lag = 2 * self.n  # measured: the output trails the input by two frames
        buf = np.concatenate([y, np.zeros((-len(y)) % self.n + lag, np.float32)])
        out = np.empty_like(buf)
        state = self.lib.rnnoise_create(None)
        ptr = ctypes.POINTER(ctypes.c_float)
        try:
            for i in range(0, len(buf), self.n):
                frame = np.ascontiguousarray(buf[i:i + self.n])
                o = np.empty(self.n, np.float32)
                self.lib.rnnoise_process_frame(state, o.ctypes.data_as(ptr), frame.ctypes.data_as(ptr))
                out[i:i + self.n] = o
        finally:
            self.lib.rnnoise_destroy(state)
        z = torch.from_numpy(out[lag:lag + len(y)] / 32768.0)
        return AF.resample(z, 48000, SR).numpy().astype(np.float32)[: len(x)]


class SileroSteps:
    """Silero VAD speech probability per 80 ms step (the max of the 32 ms windows centred in it)."""

    def __init__(self) -> None:
        try:
            from silero_vad import load_silero_vad
        except ImportError as e:
            raise _missing("silero-vad") from e
        self.model = load_silero_vad(onnx=True)

    def __call__(self, x: np.ndarray, steps: int) -> np.ndarray:
        import torchaudio.functional as AF

        p = self.model.audio_forward(AF.resample(torch.from_numpy(x), SR, VAD_SR), sr=VAD_SR)[0].numpy()
        at = ((np.arange(len(p)) * VAD_CHUNK + VAD_CHUNK // 2) * SR / VAD_SR / FRAME).astype(int)
        out = np.zeros(steps, np.float32)
        np.maximum.at(out, np.minimum(at, steps - 1), p)
        return out


def other_codec(path: Path):
    """A Mimi of the tiny preset with `path`'s weights (a student encoder, say), as serving would load it."""
    if not path.is_file():
        raise SystemExit(f"codec weights {path} not found (bench/diag_robust_encoder.py writes <out>/mimi.safetensors)")
    return build_codec(dataclasses.replace(load_config(None).mimi, weights=path))


def speech_runs(p: np.ndarray, hole: int = 3) -> list[tuple[int, int]]:
    """Runs of steps with p >= VAD_SPEECH, holes of up to `hole` steps closed."""
    runs: list[list[int]] = []
    for t in np.flatnonzero(p >= VAD_SPEECH).tolist():
        if runs and t - runs[-1][1] - 1 <= hole:
            runs[-1][1] = t
        else:
            runs.append([t, t])
    return [(a, b) for a, b in runs]


def snap_starts(sessions: list[tuple[int, int]], p: np.ndarray, back: int) -> list[tuple[int, int]]:
    """Each start after a gap moved back to the onset of the speech run that reaches it, within `back` steps."""
    runs, out = speech_runs(p), [list(s) for s in sessions]
    for i, (a, _) in enumerate(out):
        if i > 0 and out[i - 1][1] == a - 1:
            continue  # a user switch: the shared boundary stays
        floor = out[i - 1][1] + 2 if i > 0 else 0
        onsets = [ra for ra, rb in runs if max(floor, a - back) <= ra <= a and rb >= a - 3]
        if onsets:
            out[i][0] = min(onsets)
    return [(a, b) for a, b in out]


def onset_delays(stream, p: np.ndarray) -> list[int]:
    """Per gold session opened by the user: steps from its start to the first step Silero hears speech
    (up to 40; 40 = not within 3.2 s)."""
    out = []
    for a, _ in stream.sessions:
        if stream.speaker[a] < 0:
            continue  # the assistant opened it
        hit = np.flatnonzero(p[a:a + 40] >= VAD_SPEECH)
        out.append(int(hit[0]) if hit.size else 40)
    return out


def summarise(preds: dict[str, list], golds: list, kinds: list, snrs: list) -> dict:
    out = {}
    for name, pred in preds.items():
        m = evaluate(pred, golds) | {"errors@5": error_breakdown(pred, golds, 5)}
        if any(k is not None for k in kinds):
            m |= noise_breakdown(pred, golds, kinds, snrs)
        out[name] = m
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=200, help="noised held-out streams (bench_trigger's draw)")
    p.add_argument("--clean-streams", type=int, default=100)
    p.add_argument("--stream-steps", type=int, default=1024)
    p.add_argument("--seed", type=int, default=123, help="bench_trigger.py's --seed: the same streams")
    p.add_argument("--snap-back", type=int, default=15)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--conditions", default="clean,noised", help="which to run (two processes can share the work)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--front-ends", default="rnnoise,vad_onset",
                   help="comma-separated: rnnoise, vad_onset, heard, codec:<Mimi safetensors>, trigger:<checkpoint>, "
                        "heard+trigger:<checkpoint> (each beside the shipped trigger)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "diag_trigger_frontend.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    front_ends = [f for f in args.front_ends.split(",") if f]
    unknown = [f for f in front_ends if f not in ("rnnoise", "vad_onset", "heard", "heard_noecho", "novoice")
               and not f.startswith(("codec:", "trigger:", "heard+trigger:"))]
    if unknown:
        raise SystemExit(f"unknown --front-ends {unknown}; allowed: rnnoise, vad_onset, heard, heard_noecho, "
                         "novoice, codec:<path>, trigger:<path>, heard+trigger:<path>")
    denoise = RNNoise() if "rnnoise" in front_ends else None
    vad = SileroSteps() if "vad_onset" in front_ends else None
    codecs = {f: other_codec(Path(f.split(":", 1)[1])) for f in front_ends if f.startswith("codec:")}
    triggers = {f: TriggerLabeler(dataclasses.replace(TriggerConfig(), checkpoint=Path(f.split(":", 1)[1])))
                for f in front_ends if f.startswith(("trigger:", "heard+trigger:"))}
    speaker = None
    if any(f.startswith("heard") for f in front_ends):
        from egomem.trigger.listen_audio import heard_encoder

        speaker = heard_encoder()
    tcfg = TriggerConfig()
    labeler = TriggerLabeler(tcfg)
    cache = CodeCache.load(DEFAULT_CACHE)
    if not (args.data / "cohort").is_dir():
        raise SystemExit(f"{args.data}/cohort is missing: pass --data <LibriSpeech root>")
    audio, codec = SourceAudio.load(args.data, "heldout"), build_codec(load_config(None).mimi)
    results: dict = {"checkpoint": str(labeler.checkpoint), "seed": args.seed, "snap_back": args.snap_back,
                     "vad_speech_threshold": VAD_SPEECH, "front_ends": front_ends, "conditions": {}}
    from tqdm import tqdm

    for i, (cond, n) in enumerate((("clean", args.clean_streams), ("noised", args.streams))):
        if cond not in args.conditions.split(","):
            continue
        rng = np.random.default_rng([args.seed, i])  # bench_trigger's conditions: clean 0, noised 1
        preds: dict[str, list] = {name: [] for name in ["trigger", *front_ends]}
        golds, kinds, snrs, delays, delays_clean = [], [], [], [], []
        for _ in tqdm(range(n), desc=cond, unit="stream"):
            layout = synth_recorded(cache, rng, StreamSpec(steps=args.stream_steps), noised=False)
            before = rng.bit_generator.state
            wave, kind, snr = listen_waveform(layout, audio, rng, cond == "noised")
            s = with_listen_row(layout, codec, wave, kind, snr)
            voices = poll_voices(cache, s)
            pred = decode_sessions(labeler.label(s.tokens, voices))
            preds["trigger"].append(pred)
            if denoise is not None:
                preds["rnnoise"].append(decode_sessions(labeler.label(
                    with_listen_row(layout, codec, denoise(wave), kind, snr).tokens, voices)))
            heard = heard_voices(wave, speaker) if speaker is not None else None
            if "heard" in preds:
                preds["heard"].append(decode_sessions(labeler.label(s.tokens, heard)))
            if "novoice" in preds:
                preds["novoice"].append(decode_sessions(labeler.label(s.tokens, None)))
            if "heard_noecho" in preds:
                again = np.random.default_rng()
                again.bit_generator.state = before  # the same user levels; no echo drawn
                quiet_wave, _, _ = listen_waveform(dataclasses.replace(layout, echoes=[]), audio, again,
                                                   cond == "noised")
                preds["heard_noecho"].append(decode_sessions(labeler.label(s.tokens, heard_voices(quiet_wave, speaker))))
            for name, other in triggers.items():
                track = heard if name.startswith("heard+") else voices
                preds[name].append(decode_sessions(other.label(s.tokens, track)))
            for name, other in codecs.items():
                preds[name].append(decode_sessions(labeler.label(
                    with_listen_row(layout, other, wave, kind, snr).tokens, voices)))
            if vad is not None:
                speech = vad(wave, s.tokens.shape[0])
                preds["vad_onset"].append(snap_starts(pred, speech, args.snap_back))
                delays += onset_delays(s, speech)
                if cond == "noised":  # the same stream without its background: the onset as spoken
                    again = np.random.default_rng()
                    again.bit_generator.state = before  # the same levels and echo, no background
                    clean_wave, _, _ = listen_waveform(layout, audio, again, False)
                    delays_clean += onset_delays(s, vad(clean_wave, s.tokens.shape[0]))
            golds.append(s.sessions)
            kinds.append(kind)
            snrs.append(snr)
        c = summarise(preds, golds, kinds, snrs)
        if delays:
            c["silero_onset_delay_steps"] = {"median": float(np.median(delays)), "share_over_5": float(np.mean(
                np.asarray(delays) > 5)), "sessions": len(delays)}
        if delays_clean:
            c["silero_onset_delay_steps_without_background"] = {
                "median": float(np.median(delays_clean)), "share_over_5": float(np.mean(np.asarray(delays_clean) > 5))}
        results["conditions"][cond] = c
        for name, m in c.items():
            if name in preds:
                print(f"{cond:7} {name:10} Jaccard {m['jaccard']:.3f} F1@0 {m['span_match@0']['f1']:.3f} "
                      f"F1@5 {m['span_match@5']['f1']:.3f} F1@10 {m['span_match@10']['f1']:.3f}")
        if delays:
            print(cond, "Silero onset delay", c["silero_onset_delay_steps"],
                  c.get("silero_onset_delay_steps_without_background", ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
