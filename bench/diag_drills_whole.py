"""Does a listening backbone hear the drills' questions as well when the row is encoded whole?

The drills (`egomem train-backbone --task listen`) splice per-question clips into their rows; serving's codec
(and `make-corpus --listen whole`) encodes the microphone in one pass. This takes held-out drill rows (held-out
people, the 6 held-out voices, the training run's own held-out generator), re-encodes each row's listen channel
whole (its questions laid out at their ticks as one waveform; a noised row under one background of the clip's
colour at 0-20 dB below the voice's median question level) and scores the backbone on both versions of the same
rows (`listen.held_scores`: answer, form = the question heard, value = the fact read; form_after_start = form
without the reply's first byte, which is when to speak), clean and noised apart:

    python bench/diag_drills_whole.py runs/s43/card/listen_backbone.safetensors --bank runs/s43/card/listen_backbone
    python bench/diag_drills_whole.py runs/s43/card/run/lm.safetensors --bank runs/s43/card/listen_backbone \
        --out bench/results/diag_drills_whole_finetuned.json          # the model fine-tuned from it
    python bench/diag_drills_whole.py runs/s44/ld/run/lm.safetensors --bank runs/s43/card/listen_backbone \
        --layout serving --out bench/results/diag_drills_whole_listendrills_serving.json
                                       # the same rows as serving lays them out (L1 padded to 512, empty L2)

Writes `bench/results/diag_drills_whole.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from egomem.config import DialogConfig, MimiConfig  # noqa: E402
from egomem.dialog.checkpoint import build_lm  # noqa: E402
from egomem.training.backbone import HELD_SEED  # noqa: E402
from egomem.training.corpus import fixed_questions  # noqa: E402
from egomem.training.listen import ClipBank, ListenRow, ListenRows, collate, held_scores  # noqa: E402
from egomem.training.streams import silence_code  # noqa: E402
from egomem.training.tts import HELDOUT_VOICES, TTSCache  # noqa: E402
from egomem.trigger.codec import FRAME_SAMPLES, build_codec, encode  # noqa: E402
from egomem.trigger.synth import colour_noise  # noqa: E402


def whole(codec: torch.nn.Module, row: ListenRow, tts: TTSCache, rng: np.random.Generator) -> ListenRow:
    """The same row with its listen channel encoded in one pass."""
    T = row.stream.shape[1]
    wav = np.zeros(T * FRAME_SAMPLES, np.float32)
    for at, q in row.spoken:
        w = tts(q, row.voice)[:len(wav) - at * FRAME_SAMPLES]
        wav[at * FRAME_SAMPLES:at * FRAME_SAMPLES + len(w)] += w
    if row.noise_copy is not None:
        rms = np.median([np.sqrt(np.mean(tts(q, row.voice) ** 2)) for q in fixed_questions()])
        level = rms / 10 ** (rng.uniform(0.0, 20.0) / 20)
        wav = wav + colour_noise(rng, len(wav), int(rng.integers(3))) * level
    stream = row.stream.copy()
    stream[9:] = encode(codec, wav)[:T].T
    return dataclasses.replace(row, stream=stream)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("weights", type=Path, help="a listening backbone's lm.safetensors")
    p.add_argument("--bank", type=Path, required=True, help="its run folder (holds listen_clips_heldout.npz)")
    p.add_argument("--rows", type=int, default=96, help="rows per condition")
    p.add_argument("--layout", choices=("short", "serving"), default="short", help="the rows as the listening stage "
                   "lays them out (the bare L1 text before the dialog) or as serving and egomem finetune "
                   "--listen-drills do (L1 padded to 512 steps, an empty 256-step L2)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "diag_drills_whole.json")
    args = p.parse_args()
    torch.set_num_threads(2)
    codec = build_codec(MimiConfig())
    lm = build_lm("tiny", weights=str(args.weights))
    bank = ClipBank(codec, HELDOUT_VOICES, fixed_questions(), HELD_SEED, True, args.bank / "listen_clips_heldout.npz")
    tts, rng = TTSCache(), np.random.default_rng(0)
    layout = None if args.layout == "short" else (DialogConfig.l1_steps, DialogConfig.l2_steps)
    out: dict = {"weights": str(args.weights), "rows_per_condition": args.rows, "layout": args.layout}
    for cond, noised_p in (("clean", 0.0), ("noised", 1.0)):
        rows = ListenRows(bank, "heldout", silence_code(codec), (3, 5), 0.3, noised_p)
        r = random.Random(f"diag-drills-whole/{cond}")
        spliced = [rows.row(r) for _ in range(args.rows)]
        rows.close()
        wholes = [whole(codec, x, tts, rng) for x in spliced]
        for name, got in (("spliced", spliced), ("whole", wholes)):
            batches = [collate(lm, got[i:i + 16], layout) for i in range(0, len(got), 16)]
            out[f"{cond}_{name}"] = held_scores(lm, batches)
            print(cond, name, {k: round(v, 3) for k, v in out[f"{cond}_{name}"].items()}, flush=True)
        agree = [float((a.stream[9] == b.stream[9]).mean()) for a, b in zip(spliced, wholes, strict=True)]
        out[f"{cond}_first_codebook_agreement"] = float(np.mean(agree))
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
