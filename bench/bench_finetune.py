"""Benchmark issue #13: fine-tune the tiny preset on Level-1 MemChunk data on CPU, then Fact Score on
held-out people (names, relations, facts and voices never seen in training).

One run, three models on the same held-out streams, clean and noised (paper Table 3), decoded greedily
and, with `--temperature T` (default 0.5; 0: greedy only), sampled at T too. Training data is
Level 1 (the issue's run); the held-out set has Level-1 and Level-2 dialogs, so the report also says how
far an L1-trained model gets on Level 2 (query words, Fact Score):
  - finetuned:                   the tiny preset after `egomem finetune`;
  - finetuned, empty MemChunks:  the same weights, nothing written to L1/L2 (does it *use* the memory?);
  - before fine-tuning:          the preset's seeded random init, the weights finetune started from.
Every stage runs through the product's own commands (`egomem make-corpus`, `egomem finetune`,
`egomem eval-dialog --judge rules`), in this order, each timed:

    python bench/bench_finetune.py                    # the issue's run (fine-tuning <= 30 min on 2 cores)
    python bench/bench_finetune.py --steps 20 --train-households 10 --heldout-households 2   # a smoke run
    python bench/bench_finetune.py --train-levels 1,2 --work runs/bench_finetune_l12 \
        --out bench/results/bench_finetune_l12.json                                   # Level 1 + Level 2
    python bench/bench_finetune.py --fresh-names 1 --drills 0.5 --drill-random-l1 0.5 \
        --work runs/bench_finetune_drills --out bench/results/bench_finetune_drills.json  # reading drills
    (--init-weights PATH starts the fine-tune from a backbone; the 'before fine-tuning' peer is then it)
    python bench/bench_finetune.py --copy-backbone 600 --fresh-names 1 --drills 0.5 --drill-random-l1 0.5 \
        --drill-span 100 180 --lr 2e-3 --steps 1200 --served-fps --work runs/bench_ft_backbone \
        --out bench/results/bench_finetune_backbone.json          # from a backbone that copies (below)
    python bench/bench_finetune.py --copy-backbone 600 --fresh-names 1 --drills 0.2 --drill-random-l1 0.5 \
        --drill-span 100 180 --lr 2e-3 --steps 1200 --served-fps --work runs/bv \
        --out bench/results/bench_finetune_voices.json            # a fifth of the rows drills
        (bench_finetune_backbone_drills02.json: the same before the corpus had 192 training voices)
    ... the same ... --own-questions 2,3 --turn-head-weight 4 --work runs/bq \
        --out bench/results/bench_finetune_heads.json             # denser answers, reply heads weighted x4
    ... the same as _voices ... --listen-backbone 1600 --temperature 0.5 --work runs/ft2 \
        --out bench/results/bench_finetune_hear.json              # the README model card: a backbone that hears
    ... --listen-backbone 800 --listen-head-weight 1 --work runs/ft \
        --out bench/results/bench_finetune_listen.json            # its listening stage without reply heads
    ... the same as _hear ... --context dialog --work runs/s36 \
        --out bench/results/bench_finetune_restart.json           # rows from each person's conversation start,
                                                                  # evaluated with --new-person restart
    ... the same as _restart, on template:v2 (the main user's return visit) ... --work runs/s37 \
        --out bench/results/bench_finetune_return.json            # now the card; --return-visit P sets the
                                                                  # training corpus's rate (default 0.75)
    ... the same as _return ... --draws 3 --start-temperature 1.0 \
        --out bench/results/bench_finetune_starts.json            # its stages reused: the evals again, the
                                                                  # sampled ones drawn 3 times, and turn starts
                                                                  # drawn at T = 1 (docs/training.md#when-to-speak)
    ... the same with --return-visit 1.0 --temperature 0 --work runs/s37b \
        --out bench/results/bench_finetune_return1_starts.json    # every main user returning; greedy passes only
    ... the same as _return1_starts, --listen whole --work runs/s43/card \
        --out bench/results/bench_finetune_ctxdrills.json         # session 43: rows encoded whole, in-context
                                                                  # listening drills, every stage rebuilt
    ... the same with --turn-head-weight 4 --work runs/s43/thw4 \
        --out bench/results/bench_finetune_ctxdrills_thw4.json    # its stages copied in: the fine-tune again

--copy-backbone N first trains the tiny preset for N steps on synthetic reading drills only
(`egomem train-backbone`: letter words, random speech codes, never a dialog or a name of the corpus;
~8 min for 600 steps on one core), where it learns to copy from its context, and fine-tunes from that
(docs/training.md, "A backbone that copies"). --listen-backbone M then trains that backbone M steps on
listening drills (`egomem train-backbone --task listen`: short Level-1 dialogs of other training-split
people, the questions spoken in the training voices; ~1.2 s a step on two cores, 1,600 steps in the
recipe) and fine-tunes from it
(docs/training.md, "A backbone that hears").

Writes bench/results/bench_finetune.json (+ .png: the loss curve and Fact Score per model) and keeps the
datasets and the run folder under --work (delete it to start again; an existing run is resumed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def egomem(*args: str) -> float:
    """Run one `egomem` job in a child process (as a user would); its wall time in seconds."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "egomem.cli", *args]
    print("$ egomem " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
    return time.perf_counter() - t0


def copy_backbone(steps: int, out: Path, seed: int, *extra: str) -> float:
    """`egomem train-backbone` for `steps` steps (a model that copies from its context; with `extra`, e.g.
    `--task listen --weights ...`, another stage), its lm.safetensors copied to `out`; the wall time in seconds."""
    import shutil

    run = out.with_suffix("")  # the backbone's run folder (resumed when an earlier run stopped)
    resume = ["--resume"] if (run / "ckpt" / "state.pt").exists() else []
    seconds = egomem("train-backbone", "--out", str(run), "--steps", str(steps), "--seed", str(seed), "--threads",
                     "1" if not extra else "2", "--no-progress", *extra, *resume)
    shutil.copyfile(run / "lm.safetensors", out)
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench_finetune")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "bench_finetune.json")
    p.add_argument("--train-households", type=int, default=400)
    p.add_argument("--train-levels", default="1", help="dialog levels to train on (the issue's run: 1; '1,2' adds "
                   "Level-2 query and response samples)")
    p.add_argument("--own-questions", default="1,2", help="egomem make-corpus --own-questions for the training "
                   "corpus (min,max Level-1 questions in the main user's dialog); the held-out corpus keeps 1,2")
    p.add_argument("--return-visit", type=float, default=0.75, help="egomem make-corpus --return-visit for the "
                   "training corpus (the held-out set keeps the generator's default)")
    p.add_argument("--listen", choices=("whole", "spliced"), default="whole",
                   help="egomem make-corpus --listen for both sets: the listen row encoded whole as serving's codec "
                        "writes it, or spliced per utterance (every run before session 42)")
    p.add_argument("--heldout-households", type=int, default=16)
    p.add_argument("--steps", type=int, default=1400)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dialog-steps", type=int, default=192, help="longest dialog context per sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--init-weights", type=Path, help="egomem finetune --weights: start from this backbone (then the "
                   "'before fine-tuning' peer is it, not the random init)")
    p.add_argument("--copy-backbone", type=int, default=0, metavar="STEPS",
                   help="first train a copying backbone for STEPS steps (module docstring) and start from it")
    p.add_argument("--listen-backbone", type=int, default=0, metavar="STEPS",
                   help="then train it STEPS steps on listening drills (train-backbone --task listen, batch 8) and "
                        "start from that")
    p.add_argument("--listen-head-weight", type=float, default=4.0,
                   help="train-backbone --head-weight of the listening stage")
    p.add_argument("--fresh-names", type=float, default=0.0, help="egomem finetune --fresh-names (drills.py)")
    p.add_argument("--drills", type=float, default=0.0, help="egomem finetune --drills")
    p.add_argument("--drill-random-l1", type=float, default=0.0, help="egomem finetune --drill-random-l1")
    p.add_argument("--drill-span", type=int, nargs=2, default=(24, 120), help="egomem finetune --drill-span")
    p.add_argument("--turn-head-weight", type=float, default=1.0, help="egomem finetune --turn-head-weight")
    p.add_argument("--speak-dropout", type=float, default=0.0, help="egomem finetune --speak-dropout")
    p.add_argument("--listen-drills", type=float, default=0.0, help="egomem finetune --listen-drills (with "
                   "--listen-backbone its clip bank is reused)")
    p.add_argument("--context", choices=["stream", "dialog"], default="stream",
                   help="egomem finetune --context; 'dialog' evaluates with eval-dialog --new-person restart")
    p.add_argument("--served-fps", action="store_true", help="also time dialog_lm on a real tritonserver")
    p.add_argument("--temperature", type=float, default=0.5, help="also evaluate sampled at this temperature, beside "
                   "greedy (0: greedy only)")
    p.add_argument("--draws", type=int, default=1, help="the fine-tuned model's sampled passes decode every held-out "
                   "stream this many times (eval-dialog --draws); with more than one the peers run greedy only")
    p.add_argument("--start-temperature", type=float, help="also evaluate the fine-tuned model with turn starts drawn "
                   "at this temperature (eval-dialog --start-temperature), words greedy and sampled at --temperature")
    args = p.parse_args()
    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    if args.copy_backbone:
        if args.init_weights:
            p.error("--copy-backbone trains the backbone the run starts from: drop --init-weights")
        args.init_weights = w / "copy_backbone.safetensors"
        if not args.init_weights.exists():
            times["copy_backbone_s"] = copy_backbone(args.copy_backbone, args.init_weights, args.seed)
    if args.listen_backbone:
        if not args.copy_backbone:
            p.error("--listen-backbone trains on from the copying backbone: give --copy-backbone too")
        copied, args.init_weights = args.init_weights, w / "listen_backbone.safetensors"
        if not args.init_weights.exists():
            times["listen_backbone_s"] = copy_backbone(args.listen_backbone, args.init_weights, args.seed, "--task",
                                                       "listen", "--weights", str(copied), "--batch-size", "8",
                                                       "--head-weight", str(args.listen_head_weight))
    train, heldout, run = w / "train", w / "heldout", w / "run"
    if not (train / "manifest.json").exists():
        times["make_corpus_train_s"] = egomem("make-corpus", "--out", str(train), "--households",
                                              str(args.train_households), "--split", "train", "--seed",
                                              str(args.seed), "--levels", args.train_levels, "--generator", "template",
                                              "--own-questions", args.own_questions, "--return-visit",
                                              str(args.return_visit), "--listen", args.listen)
    if not (heldout / "manifest.json").exists():
        times["make_corpus_heldout_s"] = egomem("make-corpus", "--out", str(heldout), "--households",
                                                str(args.heldout_households), "--split", "heldout", "--seed",
                                                str(args.seed + 1), "--levels", "1,2", "--generator", "template",
                                                "--listen", args.listen)
    if not (run / "lm.safetensors").exists():
        resume = ["--resume"] if (run / "ckpt").exists() else []
        times["finetune_s"] = egomem("finetune", "--data", str(train), "--out", str(run), "--steps", str(args.steps),
                                     "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed",
                                     str(args.seed), "--dialog-steps", str(args.dialog_steps), "--threads",
                                     str(args.threads), "--eval-data", str(heldout), "--eval-every", "100",
                                     "--fresh-names", str(args.fresh_names), "--drills", str(args.drills),
                                     "--drill-random-l1", str(args.drill_random_l1),
                                     "--drill-span", *map(str, args.drill_span),
                                     "--turn-head-weight", str(args.turn_head_weight), "--context", args.context,
                                     "--listen-drills", str(args.listen_drills), "--speak-dropout",
                                     str(args.speak_dropout), *resume,
                                     *(["--listen-bank", str(w / "listen_backbone" / "listen_clips_train.npz")]
                                       if args.listen_drills and args.listen_backbone else []),
                                     *(["--weights", str(args.init_weights)] if args.init_weights else []))
    model_args = ["eval-dialog", "--data", str(heldout), "--weights", str(run / "lm.safetensors"), "--name",
                  "finetuned", "--judge", "rules", "--seed", str(args.seed),
                  "--new-person", "restart" if args.context == "dialog" else "swap"]
    eval_args = [*model_args, "--peer-empty", "--peer", f"before fine-tuning={args.init_weights or 'random'}"]
    eval_json, sampled_json = w / "eval_dialog.json", w / "eval_dialog_sampled.json"
    times["eval_dialog_s"] = egomem(*eval_args, "--out", str(eval_json), *(["--served-fps"] if args.served_fps else []))
    # the same streams decoded otherwise (throughput is measured once, above); name -> eval-dialog report
    decodings: dict[str, Path] = {}
    if args.temperature > 0:
        decodings[f"sampled, T={args.temperature}"] = sampled_json
        times["eval_dialog_sampled_s"] = egomem(*(eval_args if args.draws == 1 else model_args), "--temperature",
                                                str(args.temperature), "--draws", str(args.draws), "--out",
                                                str(sampled_json), "--fps-ticks", "0")
    if args.start_temperature is not None:
        for t in ([0.0, args.temperature] if args.temperature > 0 else [0.0]):
            name = f"{'greedy' if t == 0 else f'sampled, T={t}'}, turn starts at T={args.start_temperature}"
            decodings[name] = w / f"eval_dialog_start_T{t}.json"
            draws = str(args.draws if t > 0 or args.start_temperature > 0 else 1)
            times[f"eval_dialog_start_T{t}_s"] = egomem(*model_args, "--temperature", str(t), "--start-temperature",
                                                        str(args.start_temperature), "--draws", draws,
                                                        "--out", str(decodings[name]), "--fps-ticks", "0")
    card = json.loads((run / "model_card.json").read_text())
    report = json.loads(eval_json.read_text())
    others = {name: json.loads(path.read_text()) for name, path in decodings.items()}
    sampled = others.get(f"sampled, T={args.temperature}")
    losses = [json.loads(x) for x in (run / "loss.jsonl").read_text().splitlines() if x.strip()]
    result = {
        "what": f"tiny preset fine-tuned on Level-{args.train_levels} MemChunk data (CPU), Fact Score on held-out people",
        "command": "python bench/bench_finetune.py " + " ".join(sys.argv[1:]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "times_s": times,
        "train_card": card,
        "eval": report,
        "summary": summary(report),  # greedy decoding
    }
    if sampled is not None:
        result["eval_sampled"] = sampled
        result["summary_sampled"] = {"temperature": args.temperature, **summary(sampled)}
    starts = {name: r for name, r in others.items() if "turn starts" in name}
    if starts:
        result["eval_starts"] = starts
        result["summary_starts"] = {name: summary(r) for name, r in starts.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, losses, args.out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("summary", "summary_sampled", "summary_starts") if k in result},
                     indent=1))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def summary(report: dict) -> dict:
    """Model -> condition -> the Level-1 (greetings, answers) and Level-2 figures of an eval-dialog report."""
    return {m["name"]: {c: {"l1_fact_score": m[c]["l1"]["fact_score"], "n": m[c]["l1"]["n"],
                            "greetings": m[c]["l1"]["greetings"], "answers": m[c]["l1"]["answers"],
                            "by_person": m[c]["l1"].get("by_person"), "reference": m[c]["l1"].get("reference"),
                            "reachable": m[c]["l1"].get("reachable"),
                            "draws": m[c].get("draws", 1),
                            "per_draw_l1": [d["l1"] for d in m[c].get("per_draw", [])] or None,
                            "l2_fact_score": m[c]["l2"]["fact_score"], "l2_n": m[c]["l2"]["n"],
                            "l2_query": m[c]["l2"]["query"]}
                        for c in report["conditions"]} for m in report["models"]}


def plot(result: dict, losses: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("greedy", result["summary"])]
    if "summary_sampled" in result:
        sampled = dict(result["summary_sampled"])
        panels.append((f"sampled, T={sampled.pop('temperature')}", sampled))
    panels += list(result.get("summary_starts", {}).items())
    fig, (a, *bars) = plt.subplots(1, 1 + len(panels), figsize=(6 + 6 * len(panels), 4.2))
    for kind, style in (("train", "-"), ("eval", "o-")):
        pts = [(r["step"], r["loss"]) for r in losses if r.get("kind", "train") == kind and "loss" in r]
        if pts:
            a.plot(*zip(*pts), style, label=f"{kind} masked loss", ms=3)
    a.set_xlabel("step")
    a.set_ylabel("masked loss (text + speak)")
    a.legend()
    took = result["times_s"].get("finetune_s")
    a.set_title(f"finetune ({took / 60:.1f} min)" if took else "finetune (an earlier run's, reused: not timed here)")
    conds = result["eval"]["conditions"]
    width = 0.8 / (2 * len(conds))
    for b, (decoding, table) in zip(bars, panels, strict=True):
        names = list(table)
        for i, c in enumerate(conds):
            for j, part in enumerate(("greetings", "answers")):
                vals = [table[n][c][part]["fact_score"] or 0.0 for n in names]
                xs = [k + (2 * i + j - len(conds) + 0.5) * width for k in range(len(names))]
                b.bar(xs, vals, width, label=f"{c}, {part}")
        b.axhline(0.85, ls="--", c="k", lw=0.8)
        b.set_xticks(range(len(names)), names, fontsize=8)
        b.set_ylim(0, 1)
        b.set_ylabel("Level-1 Fact Score (held-out people)")
        b.set_title(f"decoding: {decoding}")
        b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
