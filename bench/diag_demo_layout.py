"""Which part of the demo's day 2 keeps a dialog model from writing its memory query? (engine only, no Triton)

`bench/bench_demo.py` measures the demo served; this takes it apart. Each variant is one stream layout, fed to
the dialog engine directly (codes from the shipped codec, the whole clip encoded at once as the corpus is),
Sonja's day-2 profile written as a restart at its tick (as `dialog.new_person = "restart"` serves it), the same
stream in `--draws` slots with draw seeds 0.. (turn starts at T = 1):

  demo         her LibriSpeech day-2 recording (6 s) + 4 s silence + the question (held-out eSpeak voice) + 10 s
  silence      10 s silence instead of the recording (no real speech before the question)
  train_voice  the demo's layout, the question in a training voice
  early        the profile at tick 2, 1 s silence, the question, 10 s (the corpus's own Level-2 layout)
  demo_opus    the demo's layout through an Opus encode + decode, as a client's audio reaches the server

Per variant: the share of draws whose text channel holds a `<retr>` query, and whether it is the right one
(relation "colleague", keywords "work, job"); the text is kept in the JSON. No Level-2 refresh happens here, so
what follows a query is not an answer.

    python bench/diag_demo_layout.py egomem/data/dialog_tiny.safetensors runs/s50/l2all/run/lm.safetensors
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from egomem.config import DialogConfig, MimiConfig
from egomem.demo import ASKED_RELATION, DEFAULT_DATA, PEOPLE, QUESTION, load_voice, question_audio
from egomem.dialog.serving import build_engine
from egomem.protocol import SAMPLE_RATE as SR
from egomem.retrieval import parse_query
from egomem.training.tts import TRAIN_VOICES
from egomem.trigger.codec import FRAME_SAMPLES as FRAME
from egomem.trigger.codec import build_codec

# what the demo's store renders for Sonja after day 1 (the rules extractor; session 50's run)
PROFILE = ('name: Sonja\npeople: Filippo (colleague)\nfact: lives in Paris\nlikes: tennis\npersona: Likes sports\n'
           'earlier: [offline fallback summary] Sonja talked (3 sentences); began: "Hello, my name is Sonja."')


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * SR), np.float32)


def opus_round_trip(pcm: np.ndarray) -> np.ndarray:
    """`pcm` as the server hears it: Opus-encoded 80 ms at a time (egomem.client), decoded (orchestrator)."""
    import sphn

    writer, reader = sphn.OpusStreamWriter(SR), sphn.OpusStreamReader(SR)
    out = []
    for i in range(0, len(pcm), FRAME):
        data = writer.append_pcm(pcm[i:i + FRAME])
        if len(data):
            got = reader.append_bytes(data)
            if got.size:
                out.append(got)
    heard = np.concatenate(out) if out else np.zeros(0, np.float32)
    return np.concatenate([heard, np.zeros(max(0, len(pcm) - len(heard)), np.float32)])[: len(pcm)]


def variants() -> dict[str, tuple[np.ndarray, int]]:
    """name -> (24 kHz audio, the tick the profile is written at)."""
    recording = load_voice(DEFAULT_DATA / PEOPLE[0].voice_day2, 6.0)
    held, train = question_audio(), question_audio(TRAIN_VOICES[0])
    return {
        "demo": (np.concatenate([recording, silence(4), held, silence(10)]), 30),
        "silence": (np.concatenate([silence(10), held, silence(10)]), 30),
        "train_voice": (np.concatenate([recording, silence(4), train, silence(10)]), 30),
        "early": (np.concatenate([silence(1), held, silence(10)]), 2),
        "demo_opus": (opus_round_trip(np.concatenate([recording, silence(4), held, silence(10)])), 30),
    }


def run_model(weights: str, draws: int, codes: dict[str, tuple[torch.Tensor, int]],
              start_floor: float = 0.0) -> dict[str, Any]:
    engine, tok = build_engine(DialogConfig(weights=Path(weights), max_streams=draws, start_temperature=1.0,
                                            start_floor=start_floor))
    profile = tok.encode(PROFILE)
    out: dict[str, Any] = {}
    for name, (c, at) in codes.items():
        slots = [engine.open(seed=i) for i in range(draws)]
        rows: list[list[int]] = [[] for _ in slots]
        for t in range(c.shape[1]):
            if t == at:  # a restart with the recognised person's profile
                for i, s in enumerate(slots):
                    engine.close(s)
                    slots[i] = engine.open(seed=i)
                    engine.write_memchunk(slots[i], 1, profile)
            text, _ = engine.step(slots, c[:, t][None].expand(len(slots), -1))
            for row, x in zip(rows, text.tolist(), strict=True):
                row.append(x)
        for s in slots:
            engine.close(s)
        said = [tok.decode([x for x in row if x >= 0]) for row in rows]
        queries = [parse_query(s, len(s) + 1) for s in said]  # the last whole query anywhere in the stream
        right = [q is not None and ASKED_RELATION in q.relations for q in queries]
        out[name] = {"query_written": sum(q is not None for q in queries) / draws, "query_right": sum(right) / draws,
                     "said": said}
        print(f"{weights}  {name:<12} query written {sum(q is not None for q in queries)}/{draws}, "
              f"naming {ASKED_RELATION!r} {sum(right)}/{draws}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("weights", nargs="+", help="dialog model files")
    p.add_argument("--draws", type=int, default=8, help="slots per variant (turn-start draw seeds 0..N-1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--start-floor", type=float, default=0.0, help="dialog.start_floor (turn starts at T = 1)")
    p.add_argument("--out", type=Path, default=Path("bench/results/diag_demo_layout.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    codec = build_codec(MimiConfig())
    codes = {}
    for name, (pcm, at) in variants().items():
        pcm = pcm[: len(pcm) // FRAME * FRAME]
        with torch.no_grad():
            codes[name] = (codec.encode(torch.from_numpy(pcm)[None, None])[0], at)  # [8, T]
    report = {"question": QUESTION, "draws": a.draws, "start_floor": a.start_floor,
              "models": {w: run_model(w, a.draws, codes, a.start_floor) for w in a.weights}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
