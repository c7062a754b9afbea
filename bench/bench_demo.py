"""Does the served dialog model use its memory in the demo's scenario, by itself? `egomem demo`, repeated.

Each run starts a fresh private stack (tritonserver with the models, the orchestrator, the memory worker,
a new SQLite store) and plays the demo's two days (egomem/demo.py) with nothing injected: day 1 two people
introduce themselves; day 2 they come back, and the first asks aloud what her colleague does. Per run and
over all runs, for every model named (`--weights`, repeatable; the shipped model when none), side by side:

  - greeted by name: the person's name on the model's own text channel after their Level-1 refresh, and how
    many seconds after recognition (#15: "within a few seconds of recognition");
  - query written: a `retrieval` event on the asking stream (the orchestrator found a `<retr>` query on the
    model's text channel), its relations and keywords, and whether it names the colleague relation;
  - answered: the colleague's fact ("engineer") on the text channel after the query.

The turn starts are drawn (the shipped model's start temperature), and each stream's draws follow its Triton
correlation id, so runs differ: `--runs` repeats the scenario. About 60-100 s a run on a 2-core CPU.

    python bench/bench_demo.py --runs 5 --out bench/results/bench_demo.json
    python bench/bench_demo.py --weights shipped=egomem/data/dialog_tiny.safetensors \\
        --weights l2all=runs/s50/l2all/run/lm.safetensors --start-temperature 1.0 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from egomem.config import load_config, with_overrides
from egomem.demo import ASKED_RELATION, PEOPLE, QUESTION, run_scenario, scenario_config

ASKER, OTHER = PEOPLE[0].name, PEOPLE[1].name
FACT = "engineer"  # what the asker's question needs: her colleague Filippo works as an engineer


def score_run(result: dict[str, Any]) -> dict[str, Any]:
    """One scenario's day 2, scored."""
    asker = result["day2"][ASKER]
    queries = asker["queries"]
    said = asker["model_said"]
    after_query = said[said.find("<answer>"):] if "<answer>" in said else ""
    return {
        "greeted": {p.name: result["day2"][p.name]["name_after_s"] for p in PEOPLE},
        "query_written": bool(queries),
        "queries": queries,
        "query_names_relation": any(ASKED_RELATION in q["relations"] for q in queries),
        "answered": FACT in after_query,
        "asker_said": said,
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    greet_s = [s for r in runs for s in r["greeted"].values() if s is not None]
    visits = sum(len(r["greeted"]) for r in runs)
    return {
        "runs": len(runs),
        "greeted_by_name": len(greet_s) / visits if visits else None,
        "greeting_after_recognition_s_median": statistics.median(greet_s) if greet_s else None,
        "query_written": sum(r["query_written"] for r in runs) / len(runs),
        "query_names_relation": sum(r["query_names_relation"] for r in runs) / len(runs),
        "answered": sum(r["answered"] for r in runs) / len(runs),
    }


def plot(report: dict[str, Any], path: Path) -> None:
    """Bars per model: greeted by name, query written, query names the relation, answered (share of runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("greeted_by_name", "query_written", "query_names_relation", "answered")
    models = report["models"]
    w = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(9, 4))
    for k, m in enumerate(models):
        vals = [m["summary"][key] or 0 for key in keys]
        bars = ax.bar([i + (k - (len(models) - 1) / 2) * w for i in range(len(keys))], vals, w, label=m["name"])
        for b, v in zip(bars, vals, strict=True):
            ax.annotate(f"{v:.2f}", (b.get_x() + w / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(keys)), [k.replace("_", " ") for k in keys])
    ax.set(ylim=(0, 1.1), ylabel=f"share of {report['runs']} runs (greetings: of the day-2 visits)")
    ax.set_title(f"egomem demo, nothing injected: day 2 asks \"{report['question']}\"")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_model(name: str, weights: str | None, runs: int, start_temperature: float | None,
              start_floor: float | None = None) -> dict[str, Any]:
    from egomem.stack import Stack

    scored = []
    for i in range(runs):
        with tempfile.TemporaryDirectory(prefix="egomem-bench-demo-") as tmp:
            over: dict[str, Any] = {"server": {"run_dir": tmp}, "dialog": {}}
            if weights:
                over["dialog"] |= {"weights": weights, "new_person": "restart"}
            if start_temperature is not None:
                over["dialog"]["start_temperature"] = start_temperature
            if start_floor is not None:
                over["dialog"]["start_floor"] = start_floor
            cfg = scenario_config(with_overrides(load_config(), over, source="bench_demo"), Path(tmp))
            with Stack(cfg) as stack:
                result = asyncio.run(run_scenario(stack.url, stack.tokens["stream"], stack.tokens["admin"],
                                                  poll_s=cfg.orchestrator.poll_interval_s))
            s = score_run(result)
            print(f"[{name}] run {i + 1}/{runs}: greeted {s['greeted']}  query {s['queries'] or 'none'}  "
                  f"answered {s['answered']}", flush=True)
            scored.append(s)
    return {"name": name, "weights": weights, "summary": summary(scored), "runs": scored}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", action="append", default=[], metavar="NAME=FILE",
                   help="a dialog model to serve (repeatable); none: the configured one (the shipped model)")
    p.add_argument("--runs", type=int, default=3, help="scenarios per model")
    p.add_argument("--start-temperature", type=float, help="dialog.start_temperature (default: the configured)")
    p.add_argument("--start-floor", type=float, help="dialog.start_floor (default: the configured)")
    p.add_argument("--out", type=Path, default=Path("bench/results/bench_demo.json"))
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error("--runs must be >= 1")
    models = [tuple(w.split("=", 1)) if "=" in w else (Path(w).stem, w) for w in a.weights] or [("configured", None)]
    for _, w in models:
        if w and not Path(w).is_file():
            p.error(f"no dialog weights at {w}")
    report = {"runs": a.runs, "question": QUESTION, "start_temperature": a.start_temperature,
              "start_floor": a.start_floor,
              "models": [run_model(n, w, a.runs, a.start_temperature, a.start_floor) for n, w in models]}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1, default=str))
    plot(report, a.out.with_suffix(".png"))
    for m in report["models"]:
        print(m["name"], json.dumps(m["summary"]))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
