"""`egomem eval-dialog` (paper Table 3): held-out people -> dialogs -> streams (or a dataset's held-out
streams), every model x condition (clean, noised) through `evaluate.evaluate`, throughput
(throughput.py), a JSON report and a PNG (docs/training.md#evaluation).
"""

from __future__ import annotations

from typing import Any

from egomem.dialog.engine import DialogEngine
from egomem.dialog.memchunk_text import fit
from egomem.dialog.tokenizer import TextTokenizer

from .evaluate import EvalError, evaluate
from .streams import Stream
from .types import Dialog


def add_eval_args(p: Any) -> None:
    """`egomem eval-dialog`'s options (the caller adds --config)."""
    import argparse
    from pathlib import Path

    a = p.add_argument
    a("--people", type=Path, metavar="JSONL", help="held-out households, one per line (docs/training.md#people-jsonl); "
                                                   "their dialogs come from the template generator unless --dialogs")
    a("--dialogs", type=Path, metavar="JSONL", help="dialogs of those households (types.Dialog per line)")
    a("--data", type=Path, metavar="DIR", help="a dataset folder: evaluate its held-out streams as they are")
    a("--households", type=int, default=8, help="without --people/--data: generate this many held-out households")
    a("--weights", type=Path, help="the model under test (default: dialog.weights; unset: the shipped tiny model, or the "
      "seeded random init with dialog.random_init)")
    a("--name", default="model", help="its label in the report")
    a("--peer-empty", action="store_true", help="also the same model with empty MemChunks")
    a("--peer", action="append", default=[], metavar="NAME=WEIGHTS",
      help="another model in the same run (WEIGHTS 'random': the preset's seeded random init); repeatable")
    a("--conditions", default="clean,noised", help="clean and/or noised, comma-separated")
    a("--judge", choices=["auto", "rules", "llm"], default="auto", help="auto: the LLM when its key is set, else rules")
    a("--judge-cache", type=Path, help="SQLite file of cached LLM verdicts (default: beside --out)")
    a("--batch", type=int, default=8, help="streams stepped together (engine slots)")
    a("--reply-frames", type=int, default=250, help="longest reply window, in 80 ms frames")
    a("--limit-streams", type=int, default=0, help="evaluate at most this many streams (0: all)")
    a("--fps-ticks", type=int, default=40, help="timed ticks per throughput measurement (0: no throughput)")
    a("--served-fps", action="store_true", help="also measure dialog_lm on a real tritonserver (slow to start)")
    a("--temperature", type=float, metavar="T",
      help="decoding: 0 greedy, > 0 samples text and audio at T with dialog.top_k_text / top_k_audio, seeded by "
           "--seed (default: dialog.temperature, 0)")
    a("--start-temperature", type=float, metavar="T",
      help="while the text channel is silent, draw whether it starts speaking at T, the word then at "
           "--temperature (default: dialog.start_temperature; its 'auto' = what the model under test records, the "
           "shipped model 1.0, else one draw; docs/training.md#when-to-speak)")
    a("--start-floor", type=float, metavar="P",
      help="with a start temperature: a turn start whose chance is below P is not taken (default: "
           "dialog.start_floor; docs/training.md#when-to-speak)")
    a("--query-grammar", action=argparse.BooleanOptionalAction, default=None,
      help="every model draws a query's relation line among the relations its Level-1 profile names, or not "
           "(default: dialog.query_grammar; docs/training.md#a-grammar-for-the-query)")
    a("--peer-grammar", action="store_true",
      help="also the model under test with the query grammar, in the same run (its free decoding beside it)")
    a("--new-person", choices=["swap", "restart"],
      help="a new person's L1: swapped into the running conversation, or the stream restarted with it (default: "
           "dialog.new_person; its 'auto' = 'restart' for a model fine-tuned with --context dialog, else 'swap')")
    a("--seed", type=int, default=0, help="held-out generation and the sampling draws")
    a("--draws", type=int, default=1, help="sampled decoding: decode every stream this many times (seeds --seed, "
                                           "--seed + 1, ...); the figures pool them, per_draw gives each")
    a("--out", type=Path, default=Path("runs/eval_dialog.json"), help="JSON report; the PNG goes beside it")


def load_people(path: Any) -> list[Any]:
    """Households of a people JSONL (docs/training.md#people-jsonl), made held-out (held-out voices)."""
    import dataclasses
    import json

    from .types import household_from_json

    out, seen = [], set()
    for no, line in enumerate(open(path, encoding="utf-8"), 1):
        if not line.strip():
            continue
        try:
            h = household_from_json(json.loads(line))
        except (ValueError, KeyError, TypeError) as e:
            raise EvalError(f"{path}:{no}: not a household ({type(e).__name__}: {e}); "
                            f"the schema: docs/training.md#people-jsonl") from e
        ids = [p.user_id for p in (h.main, *h.related)]
        if len(set(ids)) != len(ids) or seen & set(ids) or not all(p.name.strip() for p in (h.main, *h.related)):
            raise EvalError(f"{path}:{no}: user_ids must be unique in the file and every person needs a name")
        if any(e.other not in ids[1:] for e in h.edges):
            raise EvalError(f"{path}:{no}: each edge's 'other' must be the user_id of one of 'related'")
        seen |= set(ids)
        out.append(dataclasses.replace(h, split="heldout"))
    if not out:
        raise EvalError(f"{path} holds no household")
    return out


def _eval_set(args: Any, cfg: Any, tokenizer: TextTokenizer, noised: bool) -> tuple[list, list[Dialog], list[Stream]]:
    """(households, dialogs, held-out streams) from --data, or --people/--dialogs, or the generator."""
    import dataclasses
    import json

    from .types import dialog_from_json

    limit = args.limit_streams or None
    if args.data is not None:
        from .dataset import NOISED_SUFFIX, Dataset

        ds = Dataset(args.data)
        have = {p.stem for p in (args.data / "streams").glob("*.npy")}
        streams = [Stream(lay, ds.tokens(lay.stream), ds.tokens(lay.stream + NOISED_SUFFIX)
                          if lay.stream + NOISED_SUFFIX in have else None)
                   for lay in ds.layouts if lay.meta.get("split") == "heldout"][:limit]
        if not streams:
            raise EvalError(f"{args.data} holds no held-out stream: build it with a held-out split")
        return ds.households, ds.dialogs, streams
    if args.people is None and args.dialogs is None:
        from .corpus import make_corpus

        households, dialogs = make_corpus(args.households, "heldout", args.seed)
    elif args.people is None:
        raise EvalError("--dialogs needs --people (the households those dialogs are about)")
    else:
        households = load_people(args.people)
        if args.dialogs is not None:
            dialogs = [dataclasses.replace(dialog_from_json(json.loads(x)), split="heldout")
                       for x in open(args.dialogs, encoding="utf-8") if x.strip()]
        else:
            import random

            from .corpus import make_dialogs

            try:
                dialogs = [d for i, h in enumerate(households)
                           for d in make_dialogs(h, random.Random(f"egomem-dialogs/heldout/{args.seed}/{i}"))]
            except ValueError as e:
                raise EvalError(f"{args.people}: the template generator cannot write dialogs for it: {e}") from e
    homes = {h.main.user_id for h in households}
    dialogs = [d for d in dialogs if d.household in homes]
    if not dialogs:
        raise EvalError("no dialog belongs to the given households")
    from egomem.trigger.codec import build_codec

    from .streams import StreamBuilder, group_dialogs

    builder = StreamBuilder(build_codec(cfg.mimi), tokenizer, seed=args.seed)
    streams = [builder.build(f"eval-{i:04d}", [(j, dialogs[j]) for j in g], i, noised=noised)
               for i, g in enumerate(group_dialogs(dialogs, args.seed)[:limit])]
    return households, dialogs, streams


def fact_vocabulary() -> dict[str, str]:
    """Every profile fact value of the corpus generator, both splits: value -> its kind ("Oslo" -> "city")."""
    from .vocab import pools

    return {v: kind for split in ("train", "heldout") for kind, vs in pools(split).facts.items() for v in vs}


def run_eval(args: Any) -> int:
    """`egomem eval-dialog`: every model x condition, JSON report + PNG; 0 on success, 2 on bad input."""
    import copy
    import json
    from dataclasses import replace
    from pathlib import Path

    from egomem.config import ConfigError, load_config, validate
    from egomem.dialog.card import dialog_weights, serving_settings
    from egomem.dialog.checkpoint import CheckpointError
    from egomem.dialog.serving import build_engine
    from egomem.memory.llm import LLMNotConfigured
    from egomem.serving.launcher import LaunchError, free_ports

    from .judge import JudgeError, make_judge
    from .memory_text import MemoryTexts
    from .throughput import ServedTickError, engine_fps, served_fps

    memory = None
    try:
        cfg = load_config(getattr(args, "config", None))
        conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
        if not conditions or set(conditions) - {"clean", "noised"}:
            raise EvalError(f"--conditions takes clean and/or noised, got {args.conditions!r}")
        # weights None: the preset's seeded random init (`--peer NAME=random`)
        grammar = cfg.dialog.query_grammar if args.query_grammar is None else args.query_grammar
        models = [(args.name, args.weights or dialog_weights(cfg.dialog), True, grammar)]
        if args.peer_grammar:
            if grammar:
                raise EvalError("--peer-grammar adds the model under test with the query grammar; it already has it "
                                "(--query-grammar or dialog.query_grammar): drop one")
            models.append((f"{args.name} + query grammar", models[0][1], True, True))
        if args.peer_empty:
            models.append((f"{args.name} (empty MemChunks)", models[0][1], False, grammar))
        for spec in args.peer:
            name, sep, w = spec.partition("=")
            if not (sep and name and w):
                raise EvalError(f"--peer takes NAME=WEIGHTS (a safetensors file or 'random'), got {spec!r}")
            models.append((name, None if w == "random" else w, True, grammar))
        if args.temperature is not None and not args.temperature >= 0:
            raise EvalError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
        temperature = cfg.dialog.temperature if args.temperature is None else args.temperature
        if args.start_temperature is not None and not args.start_temperature >= 0:
            raise EvalError(f"--start-temperature must be >= 0, got {args.start_temperature}")
        start_floor = cfg.dialog.start_floor if args.start_floor is None else args.start_floor
        if not 0 <= start_floor < 1:
            raise EvalError(f"--start-floor must be in [0, 1), got {start_floor}")
        # "auto" settings are read from the model under test, and every peer is decoded the same way
        settings = serving_settings(replace(cfg.dialog, weights=models[0][1], random_init=models[0][1] is None))
        start_temperature = settings.start_temperature if args.start_temperature is None else args.start_temperature
        if args.draws < 1:
            raise EvalError(f"--draws must be at least 1, got {args.draws}")
        if args.draws > 1 and temperature == 0 and not start_temperature:
            raise EvalError("--draws repeats a sampled decoding; this one is greedy (--temperature 0 and no "
                            "--start-temperature above 0) and gives the same replies every draw")
        new_person = args.new_person or settings.new_person
        engine_cfg = replace(cfg.dialog, max_streams=args.batch, temperature=temperature,
                             start_temperature=start_temperature, start_floor=start_floor)
        engines: dict[str, DialogEngine] = {}
        engines[f"{models[0][1]}:{grammar}"], tokenizer = build_engine(replace(
            engine_cfg, weights=models[0][1], random_init=models[0][1] is None, query_grammar=grammar))
        households, dialogs, streams = _eval_set(args, cfg, tokenizer, "noised" in conditions)
        memory = MemoryTexts(households, l1_bytes=cfg.dialog.l1_steps, l2_bytes=cfg.dialog.l2_steps,
                             retrieval=cfg.retrieval)  # byte budgets: a step holds at least one byte
        judge = make_judge(args.judge, cfg.llm, households, dialogs, args.judge_cache or
                           args.out.with_suffix(".judge.sqlite3"), fact_vocabulary())
        users = [d.user_id for s in streams for d in s.layout.dialogs][:args.batch]
        l1_texts = [memory.l1(u) for u in users]
        l2_texts = [memory.l2(dialogs[d.index].user_id, dialogs[d.index].turns[u.turn].query) for s in streams
                    for d in s.layout.dialogs for u in d.turns if dialogs[d.index].turns[u.turn].query][:args.batch]
        l2_texts = l2_texts or l1_texts  # no Level-2 turn: any text loads the L2 MemChunk alike
        n1, n2 = engine_cfg.l1_steps, engine_cfg.l2_steps
        l1_texts, l2_texts = [fit(t, n1) for t in l1_texts], [fit(t, n2) for t in l2_texts]
        l1_ids, l2_ids = [tokenizer.encode(t) for t in l1_texts], [tokenizer.encode(t) for t in l2_texts]
        results = []
        for name, weights, use_memory, with_grammar in models:
            key = f"{weights}:{with_grammar}"
            if key not in engines:
                engines[key] = build_engine(replace(engine_cfg, weights=weights, random_init=weights is None,
                                                    query_grammar=with_grammar))[0]
            entry: dict[str, Any] = {"name": name, "weights": None if weights is None else str(weights),
                                     "memory": use_memory, "query_grammar": with_grammar}
            for c in conditions:
                entry[c] = evaluate(engines[key], tokenizer, dialogs, streams, memory, judge, c == "noised", use_memory,
                                    reply_frames=args.reply_frames, max_query_chars=cfg.retrieval.max_query_chars,
                                    seed=args.seed, new_person=new_person, draws=args.draws)
            if use_memory and args.fps_ticks > 0:  # throughput of these weights (the empty-MemChunk peer: the same)
                fps = entry["fps"] = {"engine": engine_fps(engines[key], l1_ids, l2_ids, ticks=args.fps_ticks)}
                if args.served_fps:
                    served = copy.deepcopy(cfg)  # the server's own slot pool: at least --batch slots
                    served.dialog = replace(cfg.dialog, weights=None if weights is None else Path(weights).resolve(),
                                            random_init=weights is None, new_person=new_person,
                                            max_streams=max(args.batch, cfg.dialog.max_streams), temperature=temperature,
                                            start_temperature=start_temperature, start_floor=start_floor,
                                            query_grammar=with_grammar)
                    http, grpc, metrics = free_ports(3)
                    served.server = replace(cfg.server, http_port=http, grpc_port=grpc, metrics_port=metrics,
                                            run_dir=args.out.parent.resolve() / "eval_triton")
                    validate(served, source="eval-dialog --served-fps")
                    fps["served"] = served_fps(served, l1_texts, l2_texts, args.batch, args.fps_ticks)
            results.append(entry)
            _print_row(entry, conditions)
    except (EvalError, JudgeError, CheckpointError, ConfigError, LLMNotConfigured, FileNotFoundError, LaunchError,
            ServedTickError) as e:
        print(f"eval-dialog: {e}", flush=True)
        return 2
    finally:
        if memory is not None:
            memory.close()
    report = {"judge": judge.name, "households": len(households), "dialogs": len(dialogs), "streams": len(streams),
              "conditions": conditions, "seed": args.seed, "draws": args.draws, "temperature": temperature,
              "start_temperature": start_temperature, "start_floor": start_floor, "reply_frames": args.reply_frames,
              "new_person": new_person, "query_grammar": grammar,
              "models": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`egomem eval-dialog [options]` (egomem/cli.py runs it with the arguments after the job's name)."""
    import argparse

    p = argparse.ArgumentParser(prog="egomem eval-dialog", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", metavar="PATH", help="TOML config file (default: $EGOMEM_CONFIG, else built-in defaults)")
    add_eval_args(p)
    return run_eval(p.parse_args(argv))


def _print_row(entry: dict[str, Any], conditions: list[str]) -> None:
    f = lambda x: "  -  " if x is None else f"{x:.3f}"  # noqa: E731
    for c in conditions:
        r, q, aq = entry[c], entry[c]["l2"]["query"], entry[c]["answer_quality"]
        spread = "" if "per_draw" not in r else " [draws " + " ".join(f(d["l1"]) for d in r["per_draw"]) + "]"
        print(f"{entry['name']:<28} {c:<6} L1 fact {f(r['l1']['fact_score'])}{spread} (n={r['l1']['n']}; reference "
              f"{f(r['l1']['reference']['fact_score'])}, on its {r['l1']['reachable']['n']}: "
              f"{f(r['l1']['reachable']['fact_score'])}; read-outs {r['l1'].get('read_outs', {}).get('n', '-')})  L2 fact "
              f"{f(r['l2']['fact_score'])} (n={r['l2']['n']})  query P {f(q['precision'])} R {f(q['recall'])} "
              f"EM {f(q['exact'])} (who {f(q.get('relations_exact'))}, what {f(q.get('keywords_exact'))})  "
              f"AQ {aq if isinstance(aq, str) else f(aq['mean'])}", flush=True)
        if "by_snr_db" in r["l1"]:  # where the background drowns the user (clean: the same streams without it)
            print(f"{'':<28} {'':<6} L1 fact by {'SNR' if c == 'noised' else 'the SNR of its noised copy'}: " + ", ".join(
                f"{band} dB {f(b['all']['fact_score'])} (n={b['all']['n']}; answers {f(b['answers']['fact_score'])})"
                for band, b in r["l1"]["by_snr_db"].items()), flush=True)


def plot(report: dict[str, Any], path: Any) -> None:
    """Bar chart per model x condition: Level-1 and Level-2 Fact Score, and the Level-2 query's exact match
    (#15's bar: the relations and keywords the model wrote both right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models, conds = report["models"], report["conditions"]
    fig, axes = plt.subplots(1, 3, figsize=(max(12, 3.6 * len(models)), 4), sharey=True)
    w = 0.8 / len(conds)
    panels = (("l1", "fact_score", "Level-1 Fact Score (dotted: the reference's)"),
              ("l2", "fact_score", "Level-2 Fact Score (dotted: the reference's)"),
              ("l2", "exact", "Level-2 query exact match"))
    for ax, (level, key, title) in zip(axes, panels, strict=True):
        for k, c in enumerate(conds):
            vals = [m[c][level]["fact_score"] if key == "fact_score" else (m[c][level].get("query") or {}).get(key)
                    for m in models]
            bars = ax.bar([i + (k - (len(conds) - 1) / 2) * w for i in range(len(models))], [v or 0 for v in vals], w,
                          label=c)
            for b, v, m in zip(bars, vals, models, strict=True):
                ceiling = m[c][level]["reference"]["fact_score"] if key == "fact_score" else None
                if ceiling is not None:  # the held-out text channel's own score
                    ax.hlines(ceiling, b.get_x(), b.get_x() + w, colors="k", linestyles=":", linewidth=1)
                ax.annotate("n/a" if v is None else f"{v:.2f}\nn={m[c][level]['n']}",
                            (b.get_x() + w / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(models)), [m["name"] for m in models], rotation=15, fontsize=8)
        ax.set(ylim=(0, 1.15), title=title, ylabel="score")
        ax.legend(fontsize=8)
    decoding = f"sampled at T={report['temperature']}" if report.get("temperature") else "greedy"
    if report.get("start_temperature") is not None:
        decoding += f", turn starts at T={report['start_temperature']}"
        if report.get("start_floor"):
            decoding += f" above {report['start_floor']}"
    fig.suptitle(f"eval-dialog ({report['judge']} judge, {report['streams']} held-out streams, {decoding})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
