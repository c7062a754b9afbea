"""`egomem make-corpus`: the training corpus (paper §4.1) written as an `egomem-memchunk-v1` dataset.

People and relation graphs come from the seeded template generator; dialogs from the template
generator (offline default) or, with `--generator llm` (or `auto` and an `[llm]` endpoint with a
key), from the configured LLM. Then streams (eSpeak NG user speech as codes of the configured Mimi),
masks and samples go to disk (egomem/training/dataset.py, docs/training.md#formats).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from egomem.config import load_config
from egomem.dialog.tokenizer import load_tokenizer
from egomem.trigger.codec import build_codec

from .corpus import GENERATOR, GRAPH_DIALOGS, OWN_QUESTIONS, RETURN_VISIT, make_corpus
from .corpus_llm import configured_client, make_llm_corpus
from .dataset import build_dataset
from .memory_text import MemoryTexts
from .streams import LISTEN_ENCODINGS, StreamSpec


def add_build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="dataset folder to create (must not exist)")
    p.add_argument("--households", type=int, default=200, help="households (a main user + 3-5 related people)")
    p.add_argument("--split", choices=("train", "heldout"), default="train",
                   help="which pools people, relations, facts and voices come from (held-out never meets train)")
    p.add_argument("--relation-words", choices=("split", "train"), default="split",
                   help="which pool the relation graph's words come from: the split's own (held-out relations never "
                        "occur in training) or the training pool ('train' with --split heldout: new people, names, "
                        "facts and voices asked about relation words a model was taught; template generator)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generator", choices=("auto", "template", "llm"), default="auto",
                   help="who writes the dialogs; auto = the [llm] endpoint when its key is set, else templates")
    p.add_argument("--levels", default="0,1,2", help="dialog levels to keep: 0 general, 1 profile, 2 relation graph")
    p.add_argument("--dialogs-per-stream", default="2,4", help="min,max dialogs concatenated into one stream")
    p.add_argument("--own-questions", default=",".join(map(str, OWN_QUESTIONS)),
                   help="min,max questions about their own profile in the main user's Level-1 dialog (template "
                        "generator; more gives a model more answers to learn from per stream)")
    p.add_argument("--return-visit", type=float, default=RETURN_VISIT, metavar="P",
                   help="chance of the main user's return visit, a second Level-1 dialog (template generator; "
                        "docs/training.md#corpus-41)")
    p.add_argument("--graph-dialogs", type=int, default=GRAPH_DIALOGS, metavar="N",
                   help="Level-2 dialogs about the main user's relation graph per household (template generator)")
    p.add_argument("--visit-asks", type=float, default=0.0, metavar="P",
                   help="chance that the return visit ends with a relation-graph question, as `egomem demo`'s day 2 "
                        "does (template generator; such a visit is a Level-2 dialog)")
    spec = StreamSpec()
    p.add_argument("--pause", default=",".join(map(str, spec.pause)),
                   help="min,max frames (80 ms) of silence between the model's reply and the user's next turn; "
                        "longer pauses teach the model to wait for a user who takes their time")
    p.add_argument("--dialog-gap", default=",".join(map(str, spec.dialog_gap)),
                   help="min,max frames of silence between two dialogs of a stream (the same person's return "
                        "visit is greeted after it: keep it longer than --pause)")
    p.add_argument("--no-noised", action="store_true", help="skip the noised copy of each stream")
    p.add_argument("--listen", choices=LISTEN_ENCODINGS, default=spec.listen,
                   help="the user's listen row: 'whole' encodes the stream's microphone audio in one pass, as serving "
                        "does; 'spliced' cuts in each utterance's own codes (corpora made before session 42)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the codec (1 is fastest on small CPUs)")


def run_build(args: argparse.Namespace) -> int:
    if (args.out / "manifest.json").exists():
        raise SystemExit(f"{args.out} already holds a dataset; choose a new --out or delete it first")
    cfg = load_config(args.config)
    torch.set_num_threads(args.threads)
    levels = {int(x) for x in args.levels.split(",") if x.strip()}
    if not levels <= {0, 1, 2}:
        raise SystemExit(f"--levels takes 0, 1 and/or 2, got {args.levels!r}")
    lo, hi = _pair(args.dialogs_per_stream, "--dialogs-per-stream")
    own = _pair(args.own_questions, "--own-questions")
    pause, dialog_gap = _pair(args.pause, "--pause"), _pair(args.dialog_gap, "--dialog-gap")
    client = None if args.generator == "template" else configured_client(cfg)
    if args.generator == "llm" and client is None:
        raise SystemExit("--generator llm needs an [llm] endpoint with an API key (see README 'Configuration')")
    if not 0.0 <= args.return_visit <= 1.0:
        raise SystemExit(f"--return-visit is a probability in [0, 1], got {args.return_visit}")
    if args.graph_dialogs < 0:
        raise SystemExit(f"--graph-dialogs takes a count >= 0, got {args.graph_dialogs}")
    if not 0.0 <= args.visit_asks <= 1.0:
        raise SystemExit(f"--visit-asks is a probability in [0, 1], got {args.visit_asks}")
    template_only = (own != OWN_QUESTIONS or args.return_visit != RETURN_VISIT
                     or args.graph_dialogs != GRAPH_DIALOGS or args.visit_asks > 0)
    if client is not None and template_only:
        raise SystemExit("--own-questions, --return-visit, --graph-dialogs and --visit-asks shape the template "
                         "generator's dialogs; with an LLM endpoint configured add --generator template, or drop them")
    relation_words = None if args.relation_words == "split" else args.relation_words
    if client is not None and relation_words is not None:
        raise SystemExit("--relation-words train needs the template generator; add --generator template")
    if client is None:
        households, dialogs = make_corpus(args.households, args.split, args.seed, own, args.return_visit,
                                          relation_words, args.graph_dialogs, args.visit_asks)
        print(f"{len(dialogs)} dialogs from {GENERATOR}")
    else:
        households, dialogs, rejected = make_llm_corpus(args.households, args.split, args.seed, client)
        print(f"{len(dialogs)} dialogs from llm:{cfg.llm.model}; rejected: {dict(rejected) or 'none'}")
    dialogs = [d for d in dialogs if d.level in levels]
    if not dialogs:
        raise SystemExit(f"no dialogs left at levels {sorted(levels)}")
    codec = build_codec(cfg.mimi)
    with MemoryTexts(households, l1_bytes=cfg.dialog.l1_steps, l2_bytes=cfg.dialog.l2_steps) as texts:
        ds = build_dataset(args.out, households, dialogs, texts, codec, args.seed, dialogs_per_stream=(lo, hi),
                           n1=cfg.dialog.l1_steps, n2=cfg.dialog.l2_steps, noised=not args.no_noised,
                           spec=StreamSpec(listen=args.listen, pause=pause, dialog_gap=dialog_gap),
                           tokenizer=load_tokenizer(cfg.dialog.tokenizer),
                           tokenizer_name=str(cfg.dialog.tokenizer or "byte"),
                           corpus_options={"own_questions": list(own), "return_visit": args.return_visit,
                                           **({"relation_words": relation_words} if relation_words else {}),
                                           **({"graph_dialogs": args.graph_dialogs}
                                              if args.graph_dialogs != GRAPH_DIALOGS else {}),
                                           **({"visit_asks": args.visit_asks} if args.visit_asks > 0 else {})}
                           if client is None else None)
    print(f"wrote {args.out}: {ds.manifest.get('counts')}")
    return 0


def _pair(text: str, flag: str) -> tuple[int, int]:
    """"1,2" -> (1, 2), refused unless two integers 0 <= min <= max."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"{flag} takes min,max (two integers, e.g. 1,2), got {text!r}") from None
    if not 0 <= lo <= hi:
        raise SystemExit(f"{flag} needs 0 <= min <= max, got {text!r}")
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    """`egomem make-corpus ...` with its own parser (torch loads only when it runs)."""
    p = argparse.ArgumentParser(prog="egomem make-corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", metavar="PATH", help="TOML config ([mimi], [dialog] chunk sizes and tokenizer, [llm])")
    add_build_args(p)
    return run_build(p.parse_args(argv))
