"""Does a fine-tuned model hear the held-out corpus's questions when it is fed the gold dialog?

`bench/diag_drills_whole.py` scores hearing on listening-drill rows; the eval's answers are judged on the
held-out corpus streams, decoded free-running. This sits between the two: every Level-1 answer to a spoken
question of the held-out corpus (its `l1_response` samples, each row laid out as `egomem finetune` lays it
out: `--context dialog`, the 192-step window), teacher-forced, scored as `listen.held_scores` scores drill
replies: `form_after_start` = the reply's first `HEAD` bytes after its first one right (the asked kind's
words: the question heard), `reply_after_start` = all of them, by answer kind (the gold reply's first two
words), clean and noised apart. High here and low in the eval = the model hears the gold context but not its
own (what it said before is its own); low here too = the corpus's questions are not heard as the drills' are.

    python bench/diag_answers_teacher.py runs/s43/card/run/lm.safetensors runs/s44/ld/run/lm.safetensors \
        runs/s44/sd/run/lm.safetensors --data runs/s43/card/heldout --speak gold \
        --out bench/results/diag_answers_teacher_gold.json                   # and --speak silence: _silence
    python bench/diag_answers_teacher.py runs/s49/l2q/run/lm.safetensors runs/s49/l2s/run/lm.safetensors \
        runs/s49/qsent/run/lm.safetensors --data runs/s49/heldout_trainrel --level 2 --drilled-relations 80 \
        --out bench/results/diag_l2_teacher_s49.json          # the Level-2 queries (session 49)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moshi.utils.compile import no_compile  # noqa: E402

from egomem.dialog.checkpoint import build_lm  # noqa: E402
from egomem.dialog.tokenizer import ByteTokenizer  # noqa: E402
from egomem.training.batch import from_dialog_start, make_batch  # noqa: E402
from egomem.training.dataset import Dataset  # noqa: E402
from egomem.training.forward import forward  # noqa: E402
from egomem.training.vocab import CORE_RELATIONS  # noqa: E402

HEAD = 10  # as listen.HEAD_TOKENS: every fixed question's reply differs from the others' within them
WINDOW = 192  # bench_finetune's --dialog-steps


def kind(reply: str) -> str:
    if reply.startswith(("Yes, you like", "No, you dislike", "Yes, you dislike", "No, you like")):
        return "preference"
    if " is your " in reply:
        return "who is"
    return " ".join(reply.split()[:2]).rstrip(".,!?")


@torch.no_grad()
def teacher_forced(lm, data: Dataset, kind: str, speak: np.ndarray | None, batch_size: int = 8):
    """Every `kind` sample of `data` laid out as `egomem finetune --context dialog` lays it out, teacher-forced:
    yields (sample, its row's text hits `[L]` (argmax == target), the stream frame of the row's index 0, its
    length); `speak` as `score`'s."""
    tok = ByteTokenizer()
    n1, n2 = int(data.manifest["n1"]), int(data.manifest["n2"])
    samples = [s for s in data.samples if s.kind == kind]
    for i in range(0, len(samples), batch_size):
        group = samples[i:i + batch_size]
        items, starts = [], []
        for s in group:
            start = data.conversation_starts(s.stream)[s.dialog]
            tokens = data.tokens(s.stream)
            if speak is not None:
                tokens = tokens.copy()
                tokens[1:9] = speak[:, None]
            items.append(from_dialog_start(s, tokens, start))
            starts.append(start)
        batch = make_batch(lm, tok, items, n1, n2, WINDOW)
        with no_compile():
            right = (forward(lm, batch.chunks, batch.stream).text_logits.argmax(-1) == batch.stream[:, 0]).numpy()
        for j, s in enumerate(group):
            yield s, right[j], starts[j] + batch.crop_start[j], batch.lengths[j]


@torch.no_grad()
def score(lm, data: Dataset, speak: np.ndarray | None = None, batch_size: int = 8) -> dict:
    """Hits by condition and answer kind; `speak` (`[8]` codes): every speak frame replaced by it (the model said
    nothing audible), else the gold speech."""
    dialogs = data.dialogs
    layouts = {x.stream: x for x in data.layouts}
    hits: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for s, right, off, length in teacher_forced(lm, data, "l1_response", speak, batch_size):
        cond = "noised" if s.meta.get("noised") else "clean"
        for u in layouts[s.stream.removesuffix("-noised")].dialogs[s.dialog].turns:
            turn = dialogs[s.meta["corpus_dialog"]].turns[u.turn]
            if turn.level != 1 or not turn.user.strip() or u.reply_text_start - off < 1:
                continue  # not a Level-1 answer to a question, or cropped out of the window
            a, b = u.reply_text_start - off, min(u.reply_text_end - off, length)
            for k in ("all", kind(turn.reply)):
                hits[cond][f"{k}/form_after_start"].append(bool(right[a + 1:min(a + HEAD, b)].all()))
                hits[cond][f"{k}/reply_after_start"].append(bool(right[a + 1:b].all()))
    return {c: {k: {"rate": float(np.mean(v)), "n": len(v)} for k, v in sorted(h.items())} for c, h in hits.items()}


@torch.no_grad()
def score_queries(lm, data: Dataset, speak: np.ndarray | None = None, batch_size: int = 8,
                  drilled: frozenset[str] = frozenset()) -> dict:
    """Every Level-2 query of the held-out corpus (its `l2_query` samples), teacher-forced in the same rows:
    `query` its bytes all right, `who` its relation words, `what` its keywords, `start` its first byte at its
    tick; by condition, `first` / `later` (the dialog's first question or one after it: a later query follows
    the model's own earlier query and an L2 already filled) and what was asked about: `core` (one of the 23 core
    relations), `other` (another training relation) or `value` ("Who do I know that speaks Dutch?": no relation,
    the value is the keyword; the query drills never ask these); with `drilled` (the relations a query stage
    drilled) also `drilled` / `undrilled` by the relation asked."""
    tok = ByteTokenizer()
    dialogs = data.dialogs
    layouts = {x.stream: x for x in data.layouts}
    hits: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for s, right, off, length in teacher_forced(lm, data, "l2_query", speak, batch_size):
        cond = "noised" if s.meta.get("noised") else "clean"
        sup_end = max(sp.end for sp in s.text)  # the sample supervises up to its query's end (stream frames)
        asked = 0
        for u in layouts[s.stream.removesuffix("-noised")].dialogs[s.dialog].turns:
            turn = dialogs[s.meta["corpus_dialog"]].turns[u.turn]
            if turn.query is None or u.query_start is None:
                continue
            asked += 1
            if u.query_end != sup_end or u.query_start - off < 1:
                continue  # another sample's query, or cropped out of the window
            q0, q1 = u.query_start - off, min(u.query_end - off, length)
            r0 = q0 + len(tok.encode("<retr>:\n"))
            r1 = r0 + len(tok.encode(", ".join(turn.query.relations)))
            k1 = r1 + 1 + len(tok.encode(", ".join(turn.query.keywords)))
            rel = turn.query.relations
            group = "value" if not rel else "core" if set(rel) <= CORE_RELATIONS else "other"
            keys = ["all", "first" if asked == 1 else "later", group]
            if drilled and rel:
                keys.append("drilled" if set(rel) <= drilled else "undrilled")
            for k in keys:
                hits[cond][f"{k}/query"].append(bool(right[q0:q1].all()))
                hits[cond][f"{k}/who"].append(bool(right[r0:r1].all()))
                hits[cond][f"{k}/what"].append(bool(right[r1:k1].all()))
                hits[cond][f"{k}/start"].append(bool(right[q0]))
    return {c: {k: {"rate": float(np.mean(v)), "n": len(v)} for k, v in sorted(h.items())} for c, h in hits.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("weights", type=Path, nargs="+", help="fine-tuned lm.safetensors files")
    p.add_argument("--data", type=Path, required=True, help="the held-out dataset folder (make-corpus --split heldout)")
    p.add_argument("--speak", choices=("gold", "silence"), default="gold", help="the speak rows as recorded, or "
                   "the codec's silence throughout (a model whose own speech is not what it was trained on)")
    p.add_argument("--level", type=int, choices=(1, 2), default=1, help="1: the Level-1 answers; 2: the Level-2 "
                   "queries (who / what / start, as bench/diag_query_drills.py scores drill rows)")
    p.add_argument("--drilled-relations", type=int, default=0, help="--level 2: also split by whether the relation "
                   "asked is one of a query stage's N relations (its --relations; 0: no split)")
    p.add_argument("--drilled-seed", type=int, default=3, help="that stage's --seed")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "diag_answers_teacher.json")
    args = p.parse_args()
    torch.set_num_threads(2)
    data = Dataset(args.data)
    speak = None
    if args.speak == "silence":
        from egomem.config import MimiConfig
        from egomem.training.streams import silence_code
        from egomem.trigger.codec import build_codec

        speak = silence_code(build_codec(MimiConfig())).astype(np.int64)[:8]
    drilled = frozenset()
    if args.drilled_relations:
        from egomem.training.query_drill import bank_questions

        drilled = frozenset(rel for rel, _ in bank_questions(args.drilled_relations, 2, args.drilled_seed).values())
    out = {"data": str(args.data), "window": WINDOW, "head": HEAD, "speak": args.speak, "level": args.level,
           "models": {}}
    for w in args.weights:
        lm = build_lm("tiny", weights=str(w)).eval()
        res = score(lm, data, speak) if args.level == 1 else score_queries(lm, data, speak, drilled=drilled)
        out["models"][str(w)] = res
        for c, r in res.items():
            print(w, c, {k: f"{v['rate']:.2f} ({v['n']})" for k, v in r.items()
                         if args.level == 2 or k.endswith("form_after_start")}, flush=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
