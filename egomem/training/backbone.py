"""`egomem train-backbone`: a dialog model that copies from its context, the starting point of `egomem finetune`.

Greeting a person by a name it has never seen, the model must find the name in its Level-1 MemChunk and
write it out: copying by content. Fine-tuned from a random init, the tiny model did not learn that within
the CPU budget; trained first on synthetic reading drills it does, and the skill carries over to the real
MemChunk layout (docs/training.md, "A backbone that copies"). This job trains that backbone:

- a row is a chunk of up to `chunk` text tokens (a name line, then random letter words, 1-3 letters, a
  punctuation byte after every two: text the model cannot predict, only copy; text pad after it) with its
  audio rows at the initial token, as the engine's MemChunks; then `dialog` ticks whose text writes a span of `span` chunk tokens from a random place,
  starting at a random tick, text pad elsewhere; the dialog's 16 audio rows hold random codes (speech in
  the input sum, which the text has to stand out of: the preset's `text_emb_std`);
- the loss is cross-entropy over the written tokens only (what comes next in the chunk);
- `held_copy`: every `eval_every` steps, the share of written tokens after a span's first that the model
  predicts right (teacher-forced, greedy) on 48 rows drawn from another seed.

The rows are bench/diag_induction.py's drills in byte ids, where the recipe was found; with the same
seed this job reproduces that run's backbone bit for bit. Nothing of the corpus (no dialog, name or
profile) is used, so no held-out person leaks into training. Rows come from one generator seeded with
`seed`, whose state is checkpointed: `--resume` continues bit-exactly.

A second stage, `--task listen --weights <the copying backbone>`, trains on listening drills: short Level-1
dialogs whose questions are spoken in the training voices, the answers written from the profile in the chunk
(egomem/training/listen.py: the answers a 30-minute fine-tune has too few of). Its held-out scores
(`held_answer`, `held_form`, `held_form_after_start`, `held_value`, `held_greeting`) are on held-out people in held-out voices.
A third, `--task query --weights <a model that hears>`, trains on query drills (egomem/training/query_drill.py: a
spoken question about "my <relation>", the `<retr>` query naming that entry of the `people:` line), scored on
held-out relations in held-out voices (`held_query`, `held_who`, `held_what`, `held_start`) and on training
relations in held-out voices (`voice_query`, `voice_who`, ...).

Files under `out/`: `lm.safetensors` (a plain LMModel state dict: `egomem finetune --weights`, or
`dialog.weights`), `model_card.json`, `loss.jsonl` (a record per step, the held-out scores on evaluation
steps), `ckpt/state.pt` (weights, optimiser, row generator, step) and, for `listen`, the clip banks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from moshi.models.lm import LMModel
from moshi.utils.compile import no_compile

from egomem.config import MimiConfig
from egomem.dialog.checkpoint import build_lm
from egomem.dialog.presets import lm_kwargs
from egomem.dialog.tokenizer import ByteTokenizer

from .finetune import run_checkpoint
from .listen import GREETING_P, NOISED_P, ListenTask
from .query_drill import QueryTask

STATE_FORMAT = "egomem-backbone-state-v1"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
NAME_LINE, SEPARATORS = (":", ";"), ("\n", "=", ".")  # MemChunk-like punctuation (name: ... / people; fact=)
HELD_SEED = 12346  # held-out rows: their own generator (a run may not use this seed for training rows)
TASKS = ("copy", "listen", "query")
HELD_BATCHES, HELD_ROWS = 3, 16
RESUME_FREE = {"out", "resume", "stop_after", "ckpt_every", "eval_every", "threads"}


@dataclass
class BackboneConfig:
    """One backbone run (CLI: `egomem train-backbone`). Defaults: the run bench_finetune.py starts from."""

    out: Path
    task: str = "copy"  # "copy": the reading drills above; "listen": listening drills (listen.py); "query":
    # query drills (query_drill.py)
    weights: Path | None = None  # start from these weights (the listen stage: the copying backbone)
    preset: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)  # lm_kwargs overrides (tests shrink tiny)
    steps: int = 600  # held-out copying 0.975 at 600 on the tiny preset (docs/training.md)
    batch_size: int = 16
    lr: float = 2e-3
    warmup: int = 50  # linear warmup steps; the cosine (to 10 % of lr) runs over all steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    chunk: int = 96  # chunk tokens (a short MemChunk)
    dialog: int = 48  # dialog ticks
    span: tuple[int, int] = (40, 46)  # tokens a drill writes (at most dialog - 2)
    questions: tuple[int, int] = (3, 5)  # listen: spoken questions per row (min, max): more answers per chunk
    greeting_p: float = GREETING_P  # listen: a row opens with the model's greeting
    noised_p: float = NOISED_P  # listen: a row is heard through background noise
    voices: int = 0  # listen: speak in the first N training and held-out voices only (0: all; a quick run)
    relations: int = 0  # query: the relations the drills ask about (0: query_drill.RELATIONS; a quick run)
    templates: int = 0  # query: sentences a relation is asked in, of its 18 (0: query_drill.TEMPLATES)
    voices_per_question: int = 0  # query: each sentence spoken in this many of the bank's voices (0: all)
    listen_emb: str = "codec"  # listen: the listen rows' embeddings drawn from the codec ("codec") or kept ("keep")
    head_weight: float = 4.0  # listen, query: loss weight of each reply's (query's) first tokens (listen.HEAD_TOKENS)
    seed: int = 0
    eval_every: int = 100
    ckpt_every: int = 100
    threads: int = 0  # torch CPU threads (0: torch's default)
    resume: bool = False
    stop_after: int | None = None  # end this invocation after this many steps (resume later)

    def check(self) -> None:
        bad = [f"{k} must be positive (got {getattr(self, k)})" for k in
               ("steps", "batch_size", "lr", "warmup", "chunk", "dialog", "eval_every", "ckpt_every")
               if getattr(self, k) <= 0]
        if self.task not in TASKS:
            bad.append(f"task {self.task!r} is not one of {', '.join(TASKS)}")
        if self.task in ("listen", "query"):
            if self.voices < 0 or self.relations < 0:
                bad.append(f"voices and relations must be >= 0 (got {self.voices}, {self.relations})")
            if self.templates < 0 or self.voices_per_question < 0:
                bad.append(f"templates and voices_per_question must be >= 0 (got {self.templates}, "
                           f"{self.voices_per_question})")
            if not 1 <= self.questions[0] <= self.questions[1]:
                bad.append(f"questions {self.questions} must satisfy 1 <= MIN <= MAX")
            bad += [f"{k} must lie in [0, 1] (got {getattr(self, k)})" for k in ("greeting_p", "noised_p")
                    if not 0.0 <= getattr(self, k) <= 1.0]
            if self.head_weight <= 0:
                bad.append(f"head_weight must be positive (got {self.head_weight})")
            if self.listen_emb not in ("codec", "keep"):
                bad.append(f"listen_emb {self.listen_emb!r} must be 'codec' or 'keep'")
        lo, hi = self.span
        if not 1 <= lo <= hi <= self.dialog - 2:
            bad.append(f"span {self.span} must satisfy 1 <= MIN <= MAX <= dialog - 2 = {self.dialog - 2}")
        if self.seed == HELD_SEED:
            bad.append(f"seed {HELD_SEED} draws the held-out rows: pick another")
        if self.chunk < hi + 16:
            bad.append(f"chunk {self.chunk} must hold the longest span and a name line: at least span MAX + 16 "
                       f"= {hi + 16}")
        if bad:
            raise ValueError("; ".join(bad))


class CopyTask:
    """The `copy` task: reading drills (`make_batch`), scored by `held_copy` on rows of `HELD_SEED`."""

    name = "copy"

    def __init__(self, lm: LMModel, cfg: BackboneConfig, tok: ByteTokenizer):
        self.lm, self.cfg, self.tok = lm, cfg, tok
        held_r = random.Random(HELD_SEED)
        self.held = [make_batch(held_r, cfg, tok, HELD_ROWS, training=False) for _ in range(HELD_BATCHES)]

    def batch_loss(self, rows: random.Random, n: int) -> torch.Tensor:
        chunk, dialog, sup = make_batch(rows, self.cfg, self.tok, n)
        return F.cross_entropy(text_logits(self.lm, chunk, dialog)[sup].float(), dialog[sup])

    def prepare(self) -> None:
        pass

    def scores(self) -> dict[str, float]:
        return {"held_copy": held_copy(self.lm, self.held)}

    def close(self) -> None:
        pass


def lr_at(cfg: BackboneConfig, step: int) -> float:
    """Learning rate of optimiser step `step` (0-based): linear warmup times a cosine to 10 % over all steps."""
    return cfg.lr * (min(1, (step + 1) / cfg.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1, step / cfg.steps)))))


def make_row(r: random.Random, cfg: BackboneConfig, tok: ByteTokenizer, training: bool = True
             ) -> tuple[list[int], list[int], list[bool]]:
    """(chunk ids [chunk], dialog text ids [dialog], supervised [dialog]) of one drill row. The chunk is a
    name line and random letter words (1-3 letters, a separator after every two), text pad after them.
    A training row draws one number more (where bench/diag_induction.py, whose drills these are, picks a
    drill or a greeting): so `--seed 0` reproduces the backbone docs/training.md reports, bit for bit."""
    def word(n: int | None = None) -> str:
        return "".join(LETTERS[r.randrange(len(LETTERS))] for _ in range(n or r.randint(1, 3)))

    first, last = word(r.randint(2, 3)), word()
    text = NAME_LINE[0] + first + last + SEPARATORS[0] + NAME_LINE[1]
    while len(text) < cfg.chunk - 8:
        text += word() + word() + r.choice(SEPARATORS)
    ids = tok.encode(text[:cfg.chunk])
    if training:
        r.random()
    n = r.randint(cfg.span[0], cfg.span[1])
    s0 = r.randrange(len(ids) - n + 1)
    start = r.randint(1, cfg.dialog - n - 1)
    chunk = ids + [tok.pad_id] * (cfg.chunk - len(ids))
    dialog, sup = [tok.pad_id] * cfg.dialog, [False] * cfg.dialog
    dialog[start:start + n] = ids[s0:s0 + n]
    sup[start:start + n] = [True] * n
    return chunk, dialog, sup


def make_batch(r: random.Random, cfg: BackboneConfig, tok: ByteTokenizer, n: int, training: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = [make_row(r, cfg, tok, training) for _ in range(n)]
    return tuple(torch.tensor([x[i] for x in rows]) for i in range(3))  # type: ignore[return-value]


def text_logits(lm: LMModel, chunk: torch.Tensor, dialog: torch.Tensor) -> torch.Tensor:
    """Text logits [B, dialog, V] at the dialog's ticks: input `[chunk | initial, dialog[:-1]]` on the text
    row, the audio rows at the initial token over the chunk and random codes after it (drawn from a
    generator seeded by the batch's chunk ids: a batch always hears the same speech)."""
    B, C = chunk.shape
    T, K = dialog.shape[1], lm.num_codebooks
    rows = torch.full((B, K, C + T), lm.initial_token_id, dtype=torch.long)
    rows[:, 0, :C] = chunk
    rows[:, 0, C] = int(lm._get_initial_token()[0, 0, 0])
    rows[:, 0, C + 1:] = dialog[:, :-1]
    g = torch.Generator().manual_seed(int(chunk.sum()))
    rows[:, 1:, C:] = torch.randint(0, lm.card, (B, K - 1, T), generator=g)
    with no_compile():
        _, logits = lm.forward_text(rows)
    return logits[:, 0, C:]


@torch.no_grad()
def held_copy(lm: LMModel, held: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> float:
    """Share of written tokens after each span's first that greedy decoding copies right (teacher-forced)."""
    lm.eval()
    hits = n = 0
    for chunk, dialog, sup in held:
        pred = text_logits(lm, chunk, dialog).argmax(-1)
        after_first = sup & torch.roll(sup, 1, dims=1)
        hits += int((pred == dialog)[after_first].sum())
        n += int(after_first.sum())
    lm.train()
    return hits / max(n, 1)


def _config_json(cfg: BackboneConfig) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(cfg).items()}


@dataclass
class BackboneResult:
    path: Path  # lm.safetensors, or the checkpoint when stop_after ended the run early
    step: int
    complete: bool
    held: dict[str, float]  # the last held-out scores (copy: held_copy; listen: held_answer, ...); {} before any

    @property
    def held_copy(self) -> float | None:
        return self.held.get("held_copy")


def _start_model(cfg: BackboneConfig) -> LMModel:
    """The model a run starts from: `cfg.weights`, or the preset's seeded random init with its text embedding
    drawn at the preset's `text_emb_std` (presets.py) from torch's generator at `seed`."""
    if cfg.weights is not None:
        return build_lm(cfg.preset, weights=Path(cfg.weights), **cfg.model_overrides).train()
    lm = build_lm(cfg.preset, seed=cfg.seed, **(cfg.model_overrides | {"text_emb_std": None})).train()
    std = lm_kwargs(cfg.preset, **cfg.model_overrides)["text_emb_std"]
    if std is not None:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(cfg.seed)
            lm.text_emb.weight.normal_(0.0, std)
    return lm


def train_backbone(cfg: BackboneConfig, progress: bool = True, mimi: MimiConfig | None = None) -> BackboneResult:
    """Run (or resume) the backbone training `cfg` describes. `mimi`: the codec the listen task's questions are
    encoded with (default: the offline default, the shipped trained tiny codec)."""
    from tqdm import tqdm

    cfg.check()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out, tok = Path(cfg.out), ByteTokenizer()
    ckpt = run_checkpoint(out, cfg.resume, "backbone")
    lm = _start_model(cfg)
    if lm.text_card < tok.vocab_size:
        raise ValueError(f"preset {cfg.preset!r} has text_card {lm.text_card}: the byte tokenizer needs "
                         f"{tok.vocab_size}")
    task = _task(cfg, lm, tok, out, mimi, progress)
    if not cfg.resume:
        task.prepare()
    opt = torch.optim.AdamW(lm.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay)
    rows, step = random.Random(cfg.seed), 0  # one stream of rows over the run (its state is checkpointed)
    if cfg.resume:
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        # a setting added since the checkpoint was written counts as its default (what that run used)
        mine, theirs = _config_json(cfg), {**_config_json(BackboneConfig(cfg.out)), **state["config"]}
        changed = sorted(k for k in mine if k not in RESUME_FREE and mine[k] != theirs.get(k))
        if state.get("format") != STATE_FORMAT or changed:
            raise ValueError(f"cannot resume {ckpt}: the run was made with other settings for {changed}")
        lm.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        rows.setstate(state["rows"])
        step = state["step"]
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "loss.jsonl"
    old = log_path.read_text().splitlines() if step and log_path.is_file() else []
    log_path.write_text("".join(x + "\n" for x in old if json.loads(x)["step"] <= step))
    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, step + cfg.stop_after)
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train-backbone ({cfg.task})", unit="step", disable=not progress)
    t0, held = time.perf_counter(), {}

    def save() -> None:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": STATE_FORMAT, "config": _config_json(cfg), "step": step, "model": lm.state_dict(),
                    "optimizer": opt.state_dict(), "rows": rows.getstate()}, ckpt.with_suffix(".tmp"))
        ckpt.with_suffix(".tmp").replace(ckpt)

    try:
        with log_path.open("a") as log:
            while step < end:
                for group in opt.param_groups:
                    group["lr"] = lr_at(cfg, step)
                loss = task.batch_loss(rows, cfg.batch_size)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(lm.parameters(), cfg.grad_clip)
                opt.step()
                step += 1
                rec: dict[str, Any] = {"step": step, "loss": loss.item(), "lr": opt.param_groups[0]["lr"],
                                       "seconds": round(time.perf_counter() - t0, 3)}
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    held = task.scores()
                    rec |= held
                log.write(json.dumps(rec) + "\n")
                log.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", **{k.removeprefix("held_"): f"{v:.3f}" for k, v in held.items()})
                if step % cfg.ckpt_every == 0 or step == end:
                    save()
    finally:
        task.close()
    bar.close()
    if step < cfg.steps:
        return BackboneResult(ckpt, step, False, held)
    return BackboneResult(_write_model(lm, cfg, out, log_path, held), step, True, held)


def _task(cfg: BackboneConfig, lm: LMModel, tok: ByteTokenizer, out: Path, mimi: MimiConfig | None,
          progress: bool) -> CopyTask | ListenTask | QueryTask:
    if cfg.task == "copy":
        return CopyTask(lm, cfg, tok)
    from egomem.trigger.codec import build_codec

    if cfg.task == "query":
        if cfg.weights is None:
            raise ValueError("the query task starts from a model that hears and copies: give --weights (a listening "
                             "backbone's or a fine-tuned model's lm.safetensors)")
        return QueryTask(lm, build_codec(mimi or MimiConfig()), out, cfg.seed, HELD_SEED, cfg.greeting_p, cfg.noised_p,
                         cfg.voices or None, cfg.relations or None, cfg.head_weight, progress,
                         templates=cfg.templates or None, per_question=cfg.voices_per_question or None)

    return ListenTask(lm, build_codec(mimi or MimiConfig()), out, cfg.seed, HELD_SEED, cfg.questions, cfg.greeting_p,
                      cfg.noised_p, cfg.voices or None, cfg.listen_emb, cfg.head_weight, progress)


def _write_model(lm: LMModel, cfg: BackboneConfig, out: Path, log_path: Path, held: dict[str, float]) -> Path:
    from safetensors.torch import save_file

    path, tmp = out / "lm.safetensors", out / "lm.safetensors.tmp"
    save_file({k: v.detach().float().contiguous() for k, v in lm.state_dict().items()}, str(tmp),
              metadata={"format": "moshi-lm", "preset": cfg.preset, "trained_by": "egomem train-backbone"})
    tmp.replace(path)
    losses = [json.loads(x)["loss"] for x in log_path.read_text().splitlines()]
    card = {"format": "egomem-backbone-v1", "weights": path.name, "preset": cfg.preset, "task": cfg.task,
            "started_from": str(cfg.weights) if cfg.weights else None,
            "model_overrides": cfg.model_overrides, "steps": cfg.steps, **held,
            "first_loss": losses[0], "final_loss": sum(losses[-10:]) / len(losses[-10:]),
            "use": f"egomem finetune --weights {path}", "config": _config_json(cfg)}
    (out / "model_card.json").write_text(json.dumps(card, indent=1) + "\n")
    return path


# ---------------------------------------------------------------- CLI (wired by egomem/cli.py)


def main(argv: list[str] | None = None) -> int:
    """`egomem train-backbone ...`: 0 on success, 2 with a one-line reason on bad input."""
    d = BackboneConfig(Path())
    p = argparse.ArgumentParser(prog="egomem train-backbone", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="run folder: lm.safetensors, model_card.json, loss.jsonl, "
                   "ckpt/")
    p.add_argument("--config", metavar="PATH", help="TOML config (dialog.preset is the default --preset; [mimi] the codec "
                   "the listen task encodes its questions with)")
    p.add_argument("--preset", help="model shape (egomem/dialog/presets.py; default: dialog.preset)")
    for name in ("steps", "batch_size", "lr", "warmup", "chunk", "dialog", "seed", "eval_every", "ckpt_every",
                 "threads"):
        p.add_argument("--" + name.replace("_", "-"), type=type(getattr(d, name)), default=getattr(d, name))
    p.add_argument("--span", type=int, nargs=2, default=d.span, metavar=("MIN", "MAX"),
                   help="copy: tokens a drill writes")
    p.add_argument("--task", choices=TASKS, default=d.task, help="copy: reading drills (the first stage); listen: "
                   "spoken questions answered from the profile (the second, from --weights); query: spoken relation "
                   "questions and the <retr> query they need (from --weights)")
    p.add_argument("--weights", type=Path, help="start from these Moshi safetensors (listen: the copying backbone's "
                   "lm.safetensors)")
    p.add_argument("--questions", type=int, nargs=2, default=d.questions, metavar=("MIN", "MAX"),
                   help="listen: spoken questions per row")
    p.add_argument("--greeting-p", type=float, default=d.greeting_p, help="listen, query: share of rows the model opens "
                   "with a greeting")
    p.add_argument("--noised-p", type=float, default=d.noised_p, help="listen, query: share of rows heard through noise")
    p.add_argument("--listen-emb", choices=("codec", "keep"), default=d.listen_emb, help="listen: draw the user's "
                   "audio embeddings from the codec's codebooks (default) or keep the weights' own")
    p.add_argument("--head-weight", type=float, default=d.head_weight, help="listen, query: weight of each reply's (query's) first "
                   "10 tokens in the loss, where the question heard decides the words (1: no extra weight)")
    p.add_argument("--voices", type=int, default=d.voices, help="listen: only the first N training and held-out "
                   "voices (0: all 192 and 6; fewer builds the clip banks faster, for a quick run); query: N training "
                   "voices spread over the 192 (0: 24)")
    p.add_argument("--relations", type=int, default=d.relations, help="query: the relations the drills ask about "
                   "(0: 160, the 23 core ones and a seeded draw; fewer builds the clip banks faster)")
    p.add_argument("--templates", type=int, default=d.templates, help="query: sentences each relation is asked "
                   "in, of its 18 (0: 2); the others are the held-out `sentence_*` rows")
    p.add_argument("--voices-per-question", type=int, default=d.voices_per_question, help="query: each sentence "
                   "spoken in a seeded draw of this many of the --voices (0: all of them): many sentences, a bank "
                   "of the same size")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--stop-after", type=int, help="stop this invocation after N steps (continue with --resume)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(BackboneConfig) if hasattr(a, f.name)}
    try:
        from egomem.config import load_config

        cfg = load_config(a.config)
        if a.preset is None:
            given["preset"] = cfg.dialog.preset
        res = train_backbone(BackboneConfig(**(given | {"span": tuple(a.span), "questions": tuple(a.questions)})),
                             progress=not a.no_progress, mimi=cfg.mimi)
    except (FileNotFoundError, FileExistsError, ValueError, KeyError) as e:  # ConfigError is a ValueError
        print(f"egomem train-backbone: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(res.path), "step": res.step, "complete": res.complete, **res.held}))
    return 0
