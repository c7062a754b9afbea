"""Diagnostic for issue #13: do the model's Level-1 answers answer the question asked?

The Fact Score counts an answer right when it states the asked fact. This reads an `egomem eval-dialog`
report (or a `bench_finetune.py` JSON, both decodings) beside the held-out dataset it scored, and asks
a weaker question of every Level-1 answer: does the reply take the asked kind's form, i.e. contain the
gold reply's first two words ("You live", "Your favourite", "We talked")? Twelve kinds: a model that
picks one at random scores about 1 in 12 whatever its facts.

    python bench/diag_answer_form.py bench/results/bench_finetune_voices.json runs/bv/heldout [--show]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def form(reply: str) -> str:
    """The gold reply's first two words, its kind's form: "You live in Zurich." -> "You live"."""
    return " ".join(reply.split()[:2]).rstrip(".,!?")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", type=Path, help="eval-dialog JSON or bench_finetune JSON")
    p.add_argument("data", type=Path, help="the held-out dataset folder the report scored")
    p.add_argument("--show", action="store_true", help="print every answer beside its question and gold reply")
    a = p.parse_args()
    report = json.loads(a.report.read_text())
    dialogs = [json.loads(line) for line in (a.data / "dialogs.jsonl").read_text().splitlines() if line.strip()]
    runs = {k: report[k] for k in ("eval", "eval_sampled") if k in report} or {"eval": report}
    out = {}
    for decoding, r in runs.items():
        for m in r["models"]:
            for cond in r["conditions"]:
                answers = [t for t in m[cond]["turns"] if t["level"] == 1 and not t["greeting"]]
                hits = 0
                for t in answers:
                    gold = dialogs[t["dialog"]]["turns"][t["turn"]]
                    ok = form(gold["reply"]) in t["reply"]
                    hits += ok
                    if a.show:
                        print(f"{cond:6} form {int(ok)} fact {t['fact_score']}  {gold['user']!r} -> "
                              f"{t['reply'].strip()[:50]!r}  (gold {gold['reply']!r})")
                key = f"{decoding}/{m['name']}/{cond}"
                out[key] = {"answers": len(answers), "form_of_asked_kind": hits / max(1, len(answers)),
                            "fact_score": m[cond]["l1"]["answers"]["fact_score"]}
                print(f"{key}: {len(answers)} answers, asked kind's form {out[key]['form_of_asked_kind']:.2f}, "
                      f"Fact Score {out[key]['fact_score']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
