"""Does a model hear which relation a query drill asks about, on the drills it trained on and on held-out ones?

Teacher-forced greedy scores (`query_drill.query_scores_teacher_forced`: the whole query, its relation words =
who, its keywords = what, its first byte = when) of query-drill rows in the serving layout (L1 512, L2 256;
`--layout short`: the bare L1 text, as `train-backbone --task query` trains),
clean and noised apart: training rows (training households, the run's own bank: relations and voices it
trained on), new-voice rows (held-out households asked about the run's training relations, up to
`--held-relations` of them, in held-out voices; cached at `--voice-bank`), new-sentence rows (the same
relations asked in 2 other of their 18 sentences, `query_drill.new_sentence_questions`, held-out voices;
`--sentence-bank`: a bank of 2 sentences a relation teaches the sentences, session 49) and held-out rows (held-out households,
held-out relations in held-out voices, a bank built here: `--held-relations` x 2 questions x `--held-voices`,
cached at `--held-bank`). A model that learnt the training drills but scores chance on the others memorised
clips; one that hears new voices but not new relations knows the training relations' words only; one that
scores low on all is undertrained. Every model is scored on the same rows:

    python bench/diag_query_drills.py runs/s47/l2q/run/lm.safetensors runs/s47/l2q2/run/lm.safetensors \
        --bank runs/s47/l2q/run/query_clips_train.npz --seed 3
    python bench/diag_query_drills.py <models> --bank runs/s48/qmix/run/query_clips_train.npz --seed 3 \
        --relations 80 --voices 48 --layout short    # a query stage's bank (--relations / --voices as it ran)
    python bench/diag_query_drills.py <models> --bank runs/s49/qsent/run/query_clips_train.npz --seed 3 \
        --relations 80 --voices 48 --templates 16 --voices-per-question 6 --layout short   # sentences: the 2 undrilled

Writes `bench/results/diag_query_drills.json`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from egomem.config import MimiConfig  # noqa: E402
from egomem.dialog.checkpoint import build_lm  # noqa: E402
from egomem.training.listen import ClipBank  # noqa: E402
from egomem.training.query_drill import (  # noqa: E402
    NOISED_COPIES,
    RELATIONS,
    TEMPLATES,
    VOICES,
    QueryRows,
    bank_questions,
    bank_voices,
    new_sentence_questions,
    new_voice_questions,
    query_scores_teacher_forced,
)
from egomem.training.streams import silence_code  # noqa: E402
from egomem.trigger.codec import build_codec  # noqa: E402

LAYOUT = (512, 256)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("weights", nargs="+", type=Path)
    p.add_argument("--bank", type=Path, required=True, help="the training run's query_clips_train.npz")
    p.add_argument("--seed", type=int, default=0, help="the training run's seed (its bank's questions)")
    p.add_argument("--relations", type=int, default=RELATIONS, help="the training run's bank: its relations")
    p.add_argument("--voices", type=int, default=VOICES, help="the training run's bank: its voices")
    p.add_argument("--templates", type=int, default=TEMPLATES, help="the training run's bank: sentences a relation")
    p.add_argument("--voices-per-question", type=int, default=0, help="the training run's bank: voices a sentence "
                   "(0: all)")
    p.add_argument("--rows", type=int, default=96, help="rows per split and condition")
    p.add_argument("--held-relations", type=int, default=40)
    p.add_argument("--held-voices", type=int, default=6)
    p.add_argument("--held-bank", type=Path, default=REPO / "runs" / "diag_query_drills_heldout_clips.npz",
                   help="the held-out clip bank's cache (built when absent)")
    p.add_argument("--voice-bank", type=Path, default=REPO / "runs" / "diag_query_drills_voice_clips.npz",
                   help="the new-voice clip bank's cache (built when absent or made for another training bank)")
    p.add_argument("--sentence-bank", type=Path, default=REPO / "runs" / "diag_query_drills_sentence_clips.npz",
                   help="the new-sentence clip bank's cache (built when absent or made for another training bank)")
    p.add_argument("--layout", choices=("serving", "short"), default="serving", help="serving: L1 512 + L2 256 "
                   "before the dialog (a fine-tuned model); short: the bare L1 text (a train-backbone --task query model)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "diag_query_drills.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    codec = build_codec(MimiConfig())
    silence = silence_code(codec)
    sources = {}
    train_q = bank_questions(a.relations, a.templates, a.seed)
    bank = ClipBank(codec, bank_voices(a.voices), sorted(train_q), a.seed, True, a.bank, copies=NOISED_COPIES,
                    per_question=a.voices_per_question or None)
    sources["train"] = (QueryRows(bank, train_q, silence), train_q)

    def held_out(questions: dict, cache: Path) -> tuple[QueryRows, dict]:
        """Held-out households asked `questions` in the held-out voices (bank seed 1, cached at `cache`)."""
        held_bank = ClipBank(codec, bank_voices(a.held_voices, "heldout"), sorted(questions), 1, True, cache,
                             copies=NOISED_COPIES)
        return QueryRows(held_bank, questions, silence, split="heldout"), questions

    sources["voices"] = held_out(new_voice_questions(train_q, a.held_relations), a.voice_bank)
    sources["sentences"] = held_out(new_sentence_questions(train_q, a.held_relations), a.sentence_bank)
    sources["heldout"] = held_out(bank_questions(a.held_relations, 2, 1, split="heldout"), a.held_bank)
    rows = {}
    for split, (src, _) in sources.items():
        for cond, noised_p in (("clean", 0.0), ("noised", 1.0)):
            src.noised_p = noised_p
            r = random.Random(f"diag-query-drills/{split}/{cond}")
            rows[(split, cond)] = [src.row(r) for _ in range(a.rows)]
    layout = LAYOUT if a.layout == "serving" else None
    report = {"rows": a.rows, "layout": a.layout, "models": []}
    for w in a.weights:
        lm = build_lm("tiny", weights=str(w))
        entry = {"weights": str(w)}
        for (split, cond), rs in rows.items():
            entry[f"{split}/{cond}"] = s = query_scores_teacher_forced(lm, rs, sources[split][1], layout)
            print(f"{w}  {split:<9} {cond:<6} " + "  ".join(f"{k} {v:.3f}" for k, v in s.items()), flush=True)
        report["models"].append(entry)
    for src, _ in sources.values():
        src.close()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
