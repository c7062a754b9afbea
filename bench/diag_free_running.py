"""What does a fine-tuned model do differently when it runs free? Its own speech, and when its answers start.

Teacher-forced on the held-out corpus (`bench/diag_answers_teacher.py`) a model hears the questions better than
its free-running answers in `egomem eval-dialog` show. This runs the eval itself (`training.evaluate.evaluate`,
the engine as served, greedy words, turn starts drawn at `--start-temperature`, `--new-person restart`) over
the held-out streams of one condition and records, beside each turn's verdict:

- the speak codes the model produced, against the corpus's own speech on the same streams: the share of
  frames that are the codec's silence, and how many distinct first-codebook codes each uses (its variety);
- for every Level-1 answer to a spoken question, the tick its text starts relative to the end of the
  question, against where the corpus's reply starts (an answer begun before the question ended answers a
  question half heard).

    python bench/diag_free_running.py runs/s44/ld/run/lm.safetensors --data runs/s43/card/heldout \
        --out bench/results/diag_free_running_listendrills.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from egomem.config import MimiConfig, load_config  # noqa: E402
from egomem.dialog.serving import DialogStreamPool, build_engine  # noqa: E402
from egomem.training import evaluate as ev  # noqa: E402
from egomem.training.dataset import NOISED_SUFFIX, Dataset  # noqa: E402
from egomem.training.eval_dialog import fact_vocabulary  # noqa: E402
from egomem.training.judge import make_judge  # noqa: E402
from egomem.training.memory_text import MemoryTexts  # noqa: E402
from egomem.training.streams import silence_code  # noqa: E402
from egomem.trigger.codec import build_codec  # noqa: E402


def speech_stats(codes: np.ndarray, silence: np.ndarray) -> dict:
    """`codes` `[N, 8]` speak frames: the silent share and the first codebook's variety."""
    first = codes[:, 0]
    _, counts = np.unique(first, return_counts=True)
    p = counts / counts.sum()
    return {"frames": len(codes), "silent_share": float((codes == silence[:codes.shape[1]]).all(1).mean()),
            "distinct_first_codes": len(counts), "first_code_entropy_bits": float(-(p * np.log2(p)).sum())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("weights", type=Path, help="a fine-tuned lm.safetensors")
    p.add_argument("--data", type=Path, required=True, help="the held-out dataset folder")
    p.add_argument("--noised", action="store_true", help="the noised copies (default: clean)")
    p.add_argument("--start-temperature", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "diag_free_running.json")
    args = p.parse_args()
    torch.set_num_threads(2)
    cfg = load_config(None)
    ds = Dataset(args.data)
    streams = [ev.Stream(lay, ds.tokens(lay.stream), ds.tokens(lay.stream + NOISED_SUFFIX) if args.noised else None)
               for lay in ds.layouts]
    engine, tok = build_engine(replace(cfg.dialog, max_streams=8, weights=args.weights,
                                       start_temperature=args.start_temperature))
    memory = MemoryTexts(ds.households, l1_bytes=cfg.dialog.l1_steps, l2_bytes=cfg.dialog.l2_steps,
                         retrieval=cfg.retrieval)
    judge = make_judge("rules", cfg.llm, ds.households, ds.dialogs, args.out.with_suffix(".judge.sqlite3"),
                       fact_vocabulary())
    spoken: list[np.ndarray] = []  # every speak frame the model produced
    texts: dict[str, tuple[ev.Stream, list[int]]] = {}  # stream -> its aligned text frames, free-running
    serve, judge_stream = DialogStreamPool.serve, ev._judge_stream

    def recording_serve(self, requests):
        results = serve(self, requests)
        spoken.extend(np.asarray(r.speak_codes) for r in results if hasattr(r, "speak_codes"))
        return results

    def recording_judge(run, *a, **k):
        texts[run.stream.layout.stream] = (run.stream, list(run.texts))
        return judge_stream(run, *a, **k)

    DialogStreamPool.serve, ev._judge_stream = recording_serve, recording_judge
    try:
        report = ev.evaluate(engine, tok, ds.dialogs, streams, memory, judge, args.noised, True, new_person="restart")
    finally:
        DialogStreamPool.serve, ev._judge_stream = serve, judge_stream
    silence = silence_code(build_codec(MimiConfig()))
    made = np.stack(spoken)
    made = made[(made >= 0).all(1)]  # past the delays' warm-up
    gold = np.concatenate([(s.noised if args.noised else s.tokens)[1:9].T for s in streams])
    verdicts = {(r["stream"], r["dialog"], r["turn"]): r["fact_score"] for r in report["turns"]}
    answers = []
    for sid, (stream, frames) in texts.items():
        t = np.asarray(frames)
        for d in stream.layout.dialogs:
            for u in d.turns:
                turn = ds.dialogs[d.index].turns[u.turn]
                if turn.level != 1 or not turn.user.strip() or (sid, d.index, u.turn) not in verdicts:
                    continue
                said = [i for i in range(u.user_start, min(len(t), u.reply_text_end + 20))
                        if t[i] >= 0 and t[i] != tok.pad_id]
                answers.append({"start": said[0] - u.user_end if said else None,
                                "gold_start": u.reply_text_start - u.user_end,
                                "fact_score": verdicts[(sid, d.index, u.turn)]})
    early = [a for a in answers if a["start"] is not None and a["start"] < 0]
    out = {"weights": str(args.weights), "data": str(args.data), "noised": args.noised,
           "start_temperature": args.start_temperature,
           "speech": {"model": speech_stats(made, silence), "corpus": speech_stats(gold, silence)},
           "answers": {"n": len(answers), "pass": sum(a["fact_score"] for a in answers),
                       "started_before_the_question_ended": len(early),
                       "of_which_pass": sum(a["fact_score"] for a in early),
                       "start_ticks_after_question": dict(Counter(a["start"] for a in answers).most_common()),
                       "corpus_start_ticks_after_question": dict(Counter(a["gold_start"] for a in answers).most_common())},
           "turns": answers}
    args.out.write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: out[k] for k in ("speech", "answers")}, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
