"""`egomem finetune`: teach a Moshi-format `LMModel` to read its MemChunks (paper §4), with the masked loss.

The loop follows kyutai-labs/moshi-finetune (`train.py`): AdamW (betas 0.9 / 0.95, eps 1e-8, weight decay
0.1), gradient clipping at norm 1, the loss over the text channel and the 8 speak codebooks under the
sample's masks with text pad down-weighted (0.5) and the first codebook weighted up (100), fp32 master
weights and optimiser state when the model runs in bf16, LoRA as an option. The schedule is linear warmup
then cosine decay to `min_lr` (the issue: "cosine LR schedule as §4.2"; docs do not give §4.2's numbers,
so warmup defaults to moshi-finetune's 5 % of the steps). One forward = `egomem.training.forward.forward`
over `[L1 | L2 | dialog]`, proven equal to the serving engine (tests/test_training_parity.py). With
`--fresh-names` / `--drills` rows are transformed on the fly so that reading the MemChunk is the only way
to lower their loss (egomem/training/drills.py); with `--listen-drills` a share of the rows are listening
drills instead (spoken questions about the L1 profile, answered: egomem/training/listen.py), so the hearing
the listening stage taught is trained on, in the serving layout, while the corpus is learnt.

Files under `out/`: `lm.safetensors` (a plain LMModel state dict, LoRA merged: what `dialog.weights` and
`build_lm(weights=...)` load), `model_card.json`, `loss.jsonl` (one record per step and per evaluation),
`loss.png`, and `ckpt/state.pt`: the resumable state (trained weights, optimiser, scheduler, RNG states,
sample-order position, step). `--resume` continues it bit-exactly on the same device and thread count.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
from moshi.models.lm import LMModel
from moshi.utils.compile import no_compile

from egomem.config import MimiConfig
from egomem.dialog.checkpoint import DTYPES, CheckpointError, build_lm
from egomem.dialog.tokenizer import ByteTokenizer, TextTokenizer, load_tokenizer

from .batch import SampleError, SampleOrder, from_dialog_start, make_batch, validate_samples
from .drills import DrillMix, check_tokenizer
from .forward import forward, masked_loss
from .listen import DRILL_GENERATOR, ListenRow, finetune_rows
from .lora import LoraScope, apply_lora, merged_state_dict
from .query_drill import RELATIONS as QUERY_RELATIONS
from .query_drill import TEMPLATES as QUERY_TEMPLATES
from .query_drill import VOICES as QUERY_VOICES
from .types import Sample, to_json

log = logging.getLogger(__name__)

STATE_FORMAT = "egomem-finetune-state-v1"
# config fields a resumed run may change (where things live and how often to report); all others must match
RESUME_FREE = {"data", "out", "init_weights", "resume", "stop_after", "ckpt_every", "eval_every", "eval_data",
               "eval_samples", "threads", "device", "listen_bank", "query_bank"}


@dataclass
class TrainConfig:
    """One fine-tuning run. Defaults: the tiny preset, full fine-tuning on CPU (CLI: `egomem finetune`)."""

    data: Path  # dataset folder (docs/training.md#formats)
    out: Path  # run folder: lm.safetensors, model_card.json, loss.jsonl, loss.png, ckpt/
    preset: str = "tiny"  # egomem/dialog/presets.py
    init_weights: Path | None = None  # Moshi safetensors (dialog.weights); None = the preset's seeded random init
    model_overrides: dict[str, Any] = field(default_factory=dict)  # lm_kwargs overrides (tests shrink tiny)
    steps: int = 2000  # optimiser steps (the schedule's length)
    batch_size: int = 4
    lr: float = 1e-3  # peak; tiny from scratch. 7B LoRA: moshi-finetune's example uses 2e-6
    min_lr: float = 1e-4  # the cosine decays to this
    warmup: int | None = None  # linear warmup steps; None = 5 % of steps (moshi-finetune's pct_start 0.05)
    weight_decay: float = 0.1  # moshi-finetune
    grad_clip: float = 1.0  # moshi-finetune's max_norm
    text_pad_weight: float = 0.5  # moshi-finetune's text_padding_weight
    first_codebook_weight: float = 100.0  # moshi-finetune's first_codebook_weight_multiplier
    turn_head_weight: float = 1.0  # text loss weight of each utterance's first turn_head_tokens (forward.turn_heads)
    turn_head_tokens: int = 8  # ~ the reply's first two words ("You live", "Hey Ada!")
    lora: bool = False  # train LoRA adapters only (moshi-finetune's default for 7B); full fine-tuning otherwise
    lora_rank: int = 128  # moshi-finetune
    lora_alpha: float = 256.0  # scaling = alpha / rank = 2, moshi-finetune's lora.scaling
    lora_scope: LoraScope = "transformers"
    gradient_checkpointing: bool = False  # moshi's per-layer activation checkpointing (7B memory)
    dialog_steps: int | None = None  # longest dialog per row; None = context - n1 - n2 (the engine's ring)
    # What a row's dialog context holds: "stream" = the stream before its dialog too, as far as dialog_steps
    # reaches (the paper: a new person's L1 is swapped in mid-conversation); "dialog" = its person's
    # conversation only (serve with `[dialog] new_person = "restart"`: docs/training.md#a-new-person).
    context: Literal["stream", "dialog"] = "stream"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available
    seed: int = 0  # random init, LoRA init, sample order
    eval_every: int = 0  # steps between evaluations of the masked loss; 0 = only at the end
    eval_data: Path | None = None  # a held-out dataset folder; None = a fixed subset of the training samples
    eval_samples: int = 16
    fresh_names: float = 0.0  # per row: rename its people with pseudo-names (drills.py; byte tokenizer)
    drills: float = 0.0  # per row: make it a reading drill (writes a span of its L1 text)
    drill_random_l1: float = 0.0  # per drill: read random pseudo-words instead of the profile
    drill_span: tuple[int, int] = (24, 120)  # drill length in bytes
    listen_drills: float = 0.0  # per row: replace it with a listening drill (listen.py; byte tokenizer)
    listen_questions: tuple[int, int] = (2, 3)  # spoken questions per listening drill (min, max)
    listen_voices: int = 0  # the drills speak in the first N training voices only (0: all 192)
    listen_bank: Path | None = None  # the drills' clip-bank cache; None = out/listen_clips_train.npz
    listen_seed: int | None = None  # the listening drills' bank (None: seed); another run's bank with its seed
    query_drills: float = 0.0  # per row: replace it with a query drill (query_drill.py; byte tokenizer)
    query_bank: Path | None = None  # the query drills' clip-bank cache; None = out/query_clips_train.npz
    query_relations: int = QUERY_RELATIONS  # training relations the query drills ask about
    query_voices: int = QUERY_VOICES  # training voices the query drills speak in
    query_templates: int = QUERY_TEMPLATES  # sentences each relation is asked in, of its 18
    query_voices_per_question: int = 0  # each sentence spoken in this many of those voices (0: all)
    query_seed: int | None = None  # the drills' questions and bank (None: seed); another run's bank with its seed
    # per corpus row: its speak rows replaced by the codec's silence and its speak loss dropped, so what the model
    # hears and answers does not hang on its own speech being the corpus's (when served, it is the model's own)
    speak_dropout: float = 0.0
    # each Level-1 sample of a dialog that follows one with the same person (a greeting after a silence, no L1
    # refresh) comes this many times an epoch: the corpus holds few, and query-trained models read their
    # MemChunk aloud there (docs/training.md, session 53)
    same_person_repeat: int = 1
    ckpt_every: int = 100  # steps between resumable checkpoints (also written when a run stops)
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    resume: bool = False  # continue the run in out/ckpt (refused otherwise when one exists)
    stop_after: int | None = None  # end this invocation after this many steps (resume later)


class DataSource(Protocol):
    """What training reads: `egomem.training.dataset.Dataset` or an in-memory equivalent (tests)."""

    manifest: dict[str, Any]
    samples: list[Sample]

    def tokens(self, stream_id: str) -> np.ndarray: ...  # [17, T] aligned stream

    def conversation_starts(self, stream_id: str) -> list[int]: ...  # per dialog (context="dialog" only)


@dataclass
class TrainResult:
    lm: LMModel  # the trained model, in memory (with its LoRA adapters when cfg.lora)
    path: Path  # lm.safetensors when the run completed, else the checkpoint
    step: int
    complete: bool
    losses: list[float]  # training loss of every step so far


def open_dataset(path: Path | None) -> DataSource:
    """The dataset folder at `path`, with a clear error when it is not one."""
    if path is None or not Path(path).is_dir():
        raise FileNotFoundError(f"training data folder {path} does not exist: write a dataset first "
                                f"(egomem.training.dataset.write_dataset, docs/training.md#formats)")
    if not (Path(path) / "manifest.json").is_file():
        raise FileNotFoundError(f"{path} is not an EgoMem training dataset: it has no manifest.json "
                                f"(docs/training.md#formats)")
    from .dataset import Dataset

    return Dataset(Path(path))


def data_fingerprint(data: DataSource) -> str:
    """sha256 over the manifest and every sample record: what a model card and a resume check name."""
    h = hashlib.sha256(json.dumps(data.manifest, sort_keys=True, default=str).encode())
    for s in data.samples:
        h.update(json.dumps(to_json(s), sort_keys=True, default=str).encode())
    return h.hexdigest()


def _tokenizer(manifest: dict[str, Any], root: Path | None) -> TextTokenizer:
    name = manifest.get("tokenizer", "byte")  # "byte" or a SentencePiece path (relative: inside the dataset)
    return ByteTokenizer() if name == "byte" else load_tokenizer(Path(root or ".") / name)


def _resolve(cfg: TrainConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {cfg.device!r} asked for, but torch sees no CUDA device: use --device cpu")
    if cfg.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype {cfg.dtype!r}: choose auto, {', '.join(DTYPES)}")
    return device, DTYPES[cfg.dtype]


def _check_config(cfg: TrainConfig) -> None:
    bad = [f"{k} must be positive (got {getattr(cfg, k)})" for k in ("steps", "batch_size", "lr", "ckpt_every", "eval_samples")
           if getattr(cfg, k) <= 0]
    if not 0 <= cfg.min_lr <= cfg.lr:
        bad.append(f"min_lr must be in [0, lr] (got {cfg.min_lr})")
    if cfg.warmup is not None and not 0 <= cfg.warmup <= cfg.steps:
        bad.append(f"warmup must be in [0, steps] (got {cfg.warmup})")
    if cfg.stop_after is not None and cfg.stop_after <= 0:
        bad.append(f"stop_after must be positive (got {cfg.stop_after})")
    if cfg.turn_head_weight <= 0 or cfg.turn_head_tokens < 0:
        bad.append(f"turn_head_weight must be positive and turn_head_tokens >= 0 (got {cfg.turn_head_weight}, "
                   f"{cfg.turn_head_tokens})")
    bad += drill_mix(cfg).check()
    bad += [f"{k} must be in [0, 1] (got {getattr(cfg, k)})" for k in ("listen_drills", "query_drills",
                                                                       "speak_dropout") if not 0 <= getattr(cfg, k) <= 1]
    if not 1 <= cfg.listen_questions[0] <= cfg.listen_questions[1]:
        bad.append(f"listen_questions must satisfy 1 <= MIN <= MAX (got {cfg.listen_questions})")
    if cfg.query_relations < 1 or cfg.query_voices < 1 or cfg.query_templates < 1:
        bad.append(f"query_relations, query_voices and query_templates must be >= 1 (got {cfg.query_relations}, "
                   f"{cfg.query_voices}, {cfg.query_templates})")
    if not 0 <= cfg.query_voices_per_question <= cfg.query_voices:
        bad.append(f"query_voices_per_question must be in [0, query_voices] (got {cfg.query_voices_per_question})")
    if cfg.same_person_repeat < 1:
        bad.append(f"same_person_repeat must be >= 1 (got {cfg.same_person_repeat})")
    if cfg.listen_voices < 0:
        bad.append(f"listen_voices must be >= 0 (got {cfg.listen_voices})")
    if bad:
        raise ValueError("bad fine-tuning config: " + "; ".join(bad))


def sample_pool(data: DataSource, same_person_repeat: int) -> list[int]:
    """Sample indices an epoch goes through: each once, but a Level-1 sample of a same-person dialog
    `same_person_repeat` times. Same person (`streams.dialog_persons`' "same") is read off the conversation
    starts: a dialog continues the one before's conversation exactly when its person is that one's."""
    pool = list(range(len(data.samples)))
    if same_person_repeat == 1:
        return pool
    for i, s in enumerate(data.samples):
        if s.kind == "l1_response" and s.dialog > 0:
            starts = data.conversation_starts(s.stream)  # cached per stream by the dataset
            if starts[s.dialog] == starts[s.dialog - 1]:
                pool += [i] * (same_person_repeat - 1)
    return pool


def drill_mix(cfg: TrainConfig) -> DrillMix:
    """The run's fresh-name / reading-drill transforms (drills.py)."""
    return DrillMix(cfg.fresh_names, cfg.drills, cfg.drill_random_l1, tuple(cfg.drill_span))


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """LR multiplier of optimiser step `step` (0-based): linear warmup, then cosine to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def run_checkpoint(out: Path, resume: bool, what: str) -> Path:
    """`out/ckpt/state.pt`, after checking it agrees with `resume`: a run folder is never silently restarted."""
    ckpt = out / "ckpt" / "state.pt"
    if ckpt.is_file() and not resume:
        raise FileExistsError(f"{out} already holds a {what} run ({ckpt}); pass --resume to continue it "
                              f"or choose another --out")
    if resume and not ckpt.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint {ckpt} to continue; drop --resume to start a run there")
    return ckpt


def _config_json(cfg: TrainConfig) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()}


def _rng_state() -> dict[str, Any]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(), "cuda": cuda}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda"]])


class _Log:
    """loss.jsonl: one JSON record per training step and per evaluation; a resumed run drops the records
    written after its checkpoint (they belong to steps it redoes)."""

    def __init__(self, path: Path, keep_through: int):
        self.path = path
        old = path.read_text().splitlines() if keep_through and path.is_file() else []
        self.records = [r for r in map(json.loads, old) if r["step"] <= keep_through]
        path.write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def train_losses(self) -> list[float]:
        return [r["loss"] for r in self.records if r["kind"] == "train"]


def _plot(records: list[dict[str, Any]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, style in (("train", "-"), ("eval", "o-")):
        pts = [(r["step"], r["loss"]) for r in records if r["kind"] == kind]
        if pts:
            ax.plot(*zip(*pts), style, label=f"{kind} masked loss", ms=3, lw=1)
    ax.set(xlabel="step", ylabel="loss (text + speak codebooks)", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


class ListenSource(Protocol):
    """Where listening drills come from: `listen.ListenRows` (`listen.finetune_rows` builds the run's)."""

    def row(self, r: random.Random) -> ListenRow: ...

    def close(self) -> None: ...


def listen_source(cfg: TrainConfig, manifest: dict[str, Any], mimi: MimiConfig | None, progress: bool
                  ) -> ListenSource:
    """The run's listening drills, spoken through the codec of `mimi` (default: the offline default), which must
    be the one the dataset was encoded with."""
    from egomem.trigger.codec import build_codec

    seed = cfg.seed if cfg.listen_seed is None else cfg.listen_seed
    return finetune_rows(build_codec(mimi or MimiConfig()), manifest.get("codec"), seed, cfg.listen_voices or None,
                         tuple(cfg.listen_questions), int(manifest["n1"]),
                         Path(cfg.listen_bank) if cfg.listen_bank else Path(cfg.out) / "listen_clips_train.npz",
                         progress)


def query_source(cfg: TrainConfig, manifest: dict[str, Any], mimi: MimiConfig | None, progress: bool
                 ) -> ListenSource:
    """The run's query drills (query_drill.py), spoken through the codec of `mimi`, which must be the dataset's."""
    from egomem.trigger.codec import build_codec

    from .listen import check_codec
    from .query_drill import finetune_query_rows

    codec = build_codec(mimi or MimiConfig())
    check_codec(codec, manifest.get("codec"), "query drills")
    return finetune_query_rows(codec, cfg.seed if cfg.query_seed is None else cfg.query_seed, int(manifest["n1"]),
                               Path(cfg.query_bank) if cfg.query_bank else Path(cfg.out) / "query_clips_train.npz",
                               relations=cfg.query_relations, voices=cfg.query_voices,
                               templates=cfg.query_templates, per_question=cfg.query_voices_per_question or None,
                               progress=progress)


class _Trainer:
    """The state of one run: model, fp32 master weights, optimiser, schedule, sample order, step."""

    def __init__(self, cfg: TrainConfig, data: DataSource, device: torch.device, dtype: torch.dtype,
                 listen: ListenSource | None = None, silence: np.ndarray | None = None,
                 query: ListenSource | None = None):
        self.cfg, self.data, self.device, self.dtype, self.listen = cfg, data, device, dtype, listen
        self.query = query
        self.silence = silence  # [8] the codec's silence code (speak_dropout)
        man = data.manifest
        try:
            self.n1, self.n2 = int(man["n1"]), int(man["n2"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"dataset manifest needs integer n1 and n2 (MemChunk steps), got {man!r}") from e
        self.tokenizer = _tokenizer(man, Path(cfg.data) if cfg.data else None)
        overrides = dict(cfg.model_overrides) | ({"gradient_checkpointing": True} if cfg.gradient_checkpointing else {})
        self.lm = build_lm(cfg.preset, weights=cfg.init_weights, device=device, dtype=dtype, seed=cfg.seed, **overrides)
        lm = self.lm
        if self.tokenizer.vocab_size != lm.text_card:
            raise ValueError(f"the dataset's tokenizer has {self.tokenizer.vocab_size} ids; the model's text vocabulary "
                             f"holds {lm.text_card}: write the dataset with the model's tokenizer")
        ring = (lm.context or 0) - self.n1 - self.n2
        self.window = cfg.dialog_steps or ring
        if self.window <= 1 or (lm.context and self.window > ring):
            raise ValueError(f"the model's context ({lm.context}) minus the MemChunks ({self.n1} + {self.n2}) leaves "
                             f"{ring} dialog steps; dialog_steps={cfg.dialog_steps} does not fit")
        validate_samples(data.samples, self.tokenizer, self.n1, self.n2)
        if cfg.context == "dialog" and not callable(getattr(data, "conversation_starts", None)):
            raise ValueError("context='dialog' needs the dataset's stream layouts (a dataset folder: layouts.jsonl)")
        self.drills = drill_mix(cfg)
        if self.drills.active or cfg.listen_drills or cfg.query_drills:
            check_tokenizer(self.tokenizer)
        if cfg.listen_drills and listen is None:
            raise ValueError("listen_drills needs a source of listening drills (train() builds it from the codec)")
        if cfg.query_drills and query is None:
            raise ValueError("query_drills needs a source of query drills (train() builds it from the codec)")
        if cfg.speak_dropout and silence is None:
            raise ValueError("speak_dropout needs the codec's silence code (train() takes it from the codec)")
        if cfg.lora:
            apply_lora(lm, cfg.lora_rank, cfg.lora_alpha, cfg.seed, cfg.lora_scope)
        else:
            for p in lm.parameters():
                p.requires_grad_(True)
        lm.train()
        self.names = [n for n, p in lm.named_parameters() if p.requires_grad]
        self.params = [p for p in lm.parameters() if p.requires_grad]
        self.mixed = dtype != torch.float32  # bf16 model: the optimiser steps fp32 master copies
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params] if self.mixed \
            else self.params
        # fused: one kernel for all parameters; on a 2-core CPU the per-tensor loop costs ~1 s per step
        self.opt = torch.optim.AdamW(self.masters, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=cfg.weight_decay, fused=True)
        warmup = max(1, round(0.05 * cfg.steps)) if cfg.warmup is None else cfg.warmup
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_factor(s, cfg.steps, warmup, cfg.min_lr / cfg.lr))
        self.pool = sample_pool(data, cfg.same_person_repeat)  # what the order permutes: sample indices
        self.order = SampleOrder(len(self.pool), cfg.seed)
        self.step = 0
        self.fingerprint = data_fingerprint(data)

    def save(self, path: Path) -> None:
        # the fp32 weights the optimiser steps (in bf16 runs the model's copies are their rounding: not saved)
        trained = {n: m.detach() for n, m in zip(self.names, self.masters)}
        state = {"format": STATE_FORMAT, "step": self.step, "config": _config_json(self.cfg),
                 "data_fingerprint": self.fingerprint, "trained": trained,
                 "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                 "order": self.order.state_dict(), "rng": _rng_state()}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(path)  # atomic: a kill mid-save leaves the previous checkpoint intact

    def load(self, path: Path) -> None:
        state = torch.load(path, map_location=self.device, weights_only=False)
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"{path} is not an egomem finetune checkpoint ({state.get('format')!r})")
        # a setting added since the checkpoint was written counts as its default (what that run used)
        old = {**_config_json(TrainConfig(data=self.cfg.data, out=self.cfg.out)), **state["config"]}
        new = _config_json(self.cfg)
        changed = sorted(k for k in new if k not in RESUME_FREE and old.get(k) != new[k])
        if changed:
            raise ValueError(f"cannot resume {path}: the run was made with other settings for "
                             + ", ".join(f"{k} ({old.get(k)!r} -> {new[k]!r})" for k in changed)
                             + "; use the same settings or another --out")
        if state["data_fingerprint"] != self.fingerprint:
            raise ValueError(f"cannot resume {path}: the dataset changed since the run started "
                             f"(manifest/samples fingerprint differs); use another --out")
        if list(state["trained"]) != self.names:
            raise ValueError(f"cannot resume {path}: its trained parameters differ from this model's")
        with torch.no_grad():
            for m, p, n in zip(self.masters, self.params, self.names):
                m.copy_(state["trained"][n])
                p.copy_(m)  # a no-op copy in fp32 runs, where the masters are the parameters
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.order.load_state_dict(state["order"])
        _set_rng_state(state["rng"])
        self.step = state["step"]

    def _loss(self, samples: list[Sample], source: DataSource, training: bool = False
              ) -> tuple[torch.Tensor, dict[str, float]]:
        """The masked loss of `samples`; `training`: with the row transforms (drills) and the turn-head weight
        (an evaluation scores the plain loss, comparable between runs)."""
        items = [(s, source.tokens(s.stream)) for s in samples]
        if self.cfg.context == "dialog":  # the row starts where its person's conversation did (serving restarts
            # the stream for each new person: streams.conversation_starts)
            items = [from_dialog_start(s, t, source.conversation_starts(s.stream)[s.dialog]) for s, t in items]
        if training and self.drills.active:
            # one generator per (seed, step, row): a resumed run draws what an uninterrupted one would
            items = [self.drills.apply(s, t, random.Random(f"{self.cfg.seed}/{self.step}/{i}"), self.window,
                                       self.n1)
                     for i, (s, t) in enumerate(items)]
        if training and self.cfg.speak_dropout:
            items = [self._speak_dropout(i, *item) for i, item in enumerate(items)]
        if training and self.cfg.listen_drills:
            items = [self._listen_drill(i) or item for i, item in enumerate(items)]
        if training and self.cfg.query_drills:  # a row already a listening drill stays one
            items = [item if item[0].generator == DRILL_GENERATOR else self._query_drill(i) or item
                     for i, item in enumerate(items)]
        batch = make_batch(self.lm, self.tokenizer, items, self.n1, self.n2, self.window).to(self.device)
        with no_compile():
            out = forward(self.lm, batch.chunks, batch.stream)
        heads = (self.cfg.turn_head_weight, self.cfg.turn_head_tokens) if training else (1.0, 0)
        return masked_loss(out, batch.text_mask, batch.speak_mask, self.lm.text_padding_token_id,
                           self.cfg.text_pad_weight, self.cfg.first_codebook_weight, *heads)

    def _speak_dropout(self, i: int, sample: Sample, tokens: np.ndarray) -> tuple[Sample, np.ndarray]:
        """Row i of this step's batch with, drawn per (seed, step, row), its speak rows silenced (text loss only)."""
        if random.Random(f"{self.cfg.seed}/{self.step}/{i}/speak").random() >= self.cfg.speak_dropout:
            return sample, tokens
        tokens = tokens.copy()
        tokens[1:9] = self.silence[:, None]
        return dataclasses.replace(sample, speak=()), tokens

    def _listen_drill(self, i: int) -> tuple[Sample, np.ndarray] | None:
        """Row i of this step's batch as a listening drill, or None to keep it (drawn per (seed, step, row) from
        its own generator: the other transforms draw what they drew without drills)."""
        r = random.Random(f"{self.cfg.seed}/{self.step}/{i}/listen")
        if r.random() >= self.cfg.listen_drills:
            return None
        return self.listen.row(r).as_sample()

    def _query_drill(self, i: int) -> tuple[Sample, np.ndarray] | None:
        """Row i of this step's batch as a query drill, or None to keep it (its own generator, as `_listen_drill`)."""
        r = random.Random(f"{self.cfg.seed}/{self.step}/{i}/query")
        if r.random() >= self.cfg.query_drills:
            return None
        return self.query.row(r).as_sample()

    def train_step(self) -> dict[str, float]:
        """One optimiser step on the next batch of the sample order."""
        samples = [self.data.samples[self.pool[j]] for j in self.order.take(self.cfg.batch_size)]
        lr = self.sched.get_last_lr()[0]
        loss, parts = self._loss(samples, self.data, training=True)
        loss.backward()
        if self.mixed:
            for m, p in zip(self.masters, self.params):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.masters, self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        if self.mixed:
            with torch.no_grad():
                for m, p in zip(self.masters, self.params):
                    p.copy_(m)
        self.step += 1
        return {"loss": float(loss.detach()), **parts, "lr": lr, "grad_norm": float(norm)}

    @torch.no_grad()
    def evaluate(self, samples: list[Sample], source: DataSource) -> dict[str, float]:
        """Mean masked loss over `samples` (batches of batch_size), without touching any training state."""
        self.lm.eval()
        try:
            rows = [{"loss": float(loss), **parts} for loss, parts in (
                self._loss(samples[i:i + self.cfg.batch_size], source) for i in range(0, len(samples), self.cfg.batch_size))]
        finally:
            self.lm.train()
        return {k: _nanmean([r[k] for r in rows]) for k in rows[0]}


def _nanmean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return float(np.mean(xs)) if xs else float("nan")


def pick_eval_samples(source: DataSource, train_kinds: set[str], n: int, seed: int) -> list[Sample]:
    """A fixed, seeded subset of `source`'s samples of the kinds the run trains on (a loss on kinds it never
    sees, e.g. Level-2 queries in a Level-1 run, says nothing about how it fits what it learns)."""
    pool = [s for s in source.samples if s.kind in train_kinds]
    if not pool:
        kinds = sorted({s.kind for s in source.samples})
        raise SampleError(f"the evaluation data has no samples of the kinds this run trains on ({sorted(train_kinds)}); "
                          f"it has {kinds}: build it with the same --levels")
    idx = np.random.default_rng([seed, 7919]).choice(len(pool), size=min(n, len(pool)), replace=False)
    return [pool[int(i)] for i in sorted(idx)]


def _eval_set(cfg: TrainConfig, data: DataSource) -> tuple[list[Sample], DataSource, str]:
    source, name = (open_dataset(cfg.eval_data), "eval_data") if cfg.eval_data is not None else (data, "train_subset")
    return pick_eval_samples(source, {s.kind for s in data.samples}, cfg.eval_samples, cfg.seed), source, name


def train(cfg: TrainConfig, data: DataSource | None = None, progress: bool = True, mimi: MimiConfig | None = None,
          listen: ListenSource | None = None, silence: np.ndarray | None = None,
          query: ListenSource | None = None) -> TrainResult:
    """Run (or resume) the fine-tuning `cfg` describes; `data` defaults to the dataset folder `cfg.data`;
    with `listen_drills`, `listen` defaults to `listen_source` over the codec of `mimi` (closed at the end; a
    `listen` passed in is the caller's); with `query_drills`, `query` likewise to `query_source`; with
    `speak_dropout`, `silence` (`[8]` codes) to that codec's silence."""
    _check_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device, dtype = _resolve(cfg)
    data = open_dataset(cfg.data) if data is None else data
    out = Path(cfg.out)
    ckpt = run_checkpoint(out, cfg.resume, "fine-tuning")
    own = listen_source(cfg, data.manifest, mimi, progress) if cfg.listen_drills and listen is None else None
    own_query = query_source(cfg, data.manifest, mimi, progress) if cfg.query_drills and query is None else None
    try:
        if cfg.speak_dropout and silence is None:
            from egomem.trigger.codec import build_codec

            from .streams import silence_code

            silence = silence_code(build_codec(mimi or MimiConfig())).astype(np.int64)
        trainer = _Trainer(cfg, data, device, dtype, listen or own, silence, query or own_query)
        return _train(cfg, data, progress, trainer, ckpt)
    finally:
        for source in (own, own_query):
            if source is not None:
                source.close()


def _train(cfg: TrainConfig, data: DataSource, progress: bool, t: _Trainer, ckpt: Path) -> TrainResult:
    from tqdm import tqdm

    out = Path(cfg.out)
    if cfg.resume:
        t.load(ckpt)
        log.info("resuming %s at step %d", ckpt, t.step)
    out.mkdir(parents=True, exist_ok=True)
    records = _Log(out / "loss.jsonl", keep_through=t.step)
    eval_samples, eval_source, eval_name = _eval_set(cfg, data)
    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, t.step + cfg.stop_after)
    bar = tqdm(total=cfg.steps, initial=t.step, desc="finetune", unit="step", disable=not progress)
    t0, recent = time.perf_counter(), records.train_losses()[-10:]
    while t.step < end:
        rec = t.train_step()
        records.write({"kind": "train", "step": t.step, **rec, "seconds": round(time.perf_counter() - t0, 3)})
        bar.update(1)
        recent = [*recent[-9:], rec["loss"]]
        bar.set_postfix(loss=f"{np.mean(recent):.3f}", lr=f"{rec['lr']:.2e}")
        if cfg.eval_every and t.step % cfg.eval_every == 0 and t.step < cfg.steps:
            records.write({"kind": "eval", "step": t.step, "set": eval_name, **t.evaluate(eval_samples, eval_source)})
        if t.step % cfg.ckpt_every == 0 or t.step == end:
            t.save(ckpt)
    bar.close()
    losses = records.train_losses()
    if t.step < cfg.steps:
        log.info("stopped at step %d of %d; rerun with --resume to continue", t.step, cfg.steps)
        return TrainResult(t.lm, ckpt, t.step, False, losses)
    final_eval = t.evaluate(eval_samples, eval_source)
    if not any(r["kind"] == "eval" and r["step"] == t.step for r in records.records):
        records.write({"kind": "eval", "step": t.step, "set": eval_name, **final_eval})
    path = _write_model(t, out, losses, final_eval, eval_name)
    _plot(records.records, out / "loss.png", f"egomem finetune: {cfg.preset}{' LoRA' if cfg.lora else ''}")
    t.lm.eval()
    return TrainResult(t.lm, path, t.step, True, losses)


def _write_model(t: _Trainer, out: Path, losses: list[float], final_eval: dict[str, float], eval_name: str) -> Path:
    """lm.safetensors (plain LMModel keys, LoRA merged) and model_card.json."""
    from safetensors.torch import save_file

    cfg = t.cfg
    state = {k: v.detach().contiguous().cpu() for k, v in merged_state_dict(t.lm).items()}
    path, tmp = out / "lm.safetensors", out / "lm.safetensors.tmp"
    # `context` tells serving how the model meets a new person (egomem/dialog/card.py: new_person "auto")
    save_file(state, str(tmp), metadata={"format": "moshi-lm", "preset": cfg.preset, "trained_by": "egomem finetune",
                                         "context": cfg.context})
    tmp.replace(path)
    card = {
        "format": "egomem-finetune-v1",
        "weights": path.name,
        "load": "egomem.dialog.checkpoint.build_lm(preset, weights=<weights>, **model_overrides); "
                "in a config: [dialog] weights = <weights>, preset = <preset>",
        "preset": cfg.preset,
        "model_overrides": cfg.model_overrides,
        "dtype": str(t.dtype).removeprefix("torch."),
        "params": {"total": sum(p.numel() for p in t.lm.parameters()), "trained": sum(p.numel() for p in t.params)},
        "steps": t.step,
        "first_loss": losses[0] if losses else None,
        "final_loss": float(np.mean(losses[-10:])) if losses else None,  # mean of the last 10 steps
        "final_eval": {"set": eval_name, **final_eval},
        "data": {"fingerprint_sha256": t.fingerprint, "samples": len(t.data.samples), "n1": t.n1, "n2": t.n2,
                 "dialog_steps": t.window, **{k: t.data.manifest.get(k) for k in ("format", "tokenizer", "codec", "seed")}},
        "config": _config_json(cfg),
    }
    (out / "model_card.json").write_text(json.dumps(card, indent=1, default=str) + "\n")
    return path


def finetune(cfg: TrainConfig, data: DataSource | None = None, progress: bool = True, mimi: MimiConfig | None = None,
             listen: ListenSource | None = None, silence: np.ndarray | None = None,
             query: ListenSource | None = None) -> Path:
    """Run `cfg` (`train`'s arguments); the path of `lm.safetensors` (or of the checkpoint when `stop_after`
    ended it early)."""
    return train(cfg, data, progress, mimi, listen, silence, query).path


# ---------------------------------------------------------------- CLI (wired by egomem/cli.py)


def add_finetune_args(p: argparse.ArgumentParser) -> None:
    """`egomem finetune` options (add the shared --config first: dialog.weights / dialog.preset are defaults)."""
    d = TrainConfig(Path(), Path())
    p.add_argument("--data", type=Path, required=True, help="dataset folder (docs/training.md#formats)")
    p.add_argument("--out", type=Path, required=True, help="run folder: lm.safetensors, model_card.json, loss.*, ckpt/")
    p.add_argument("--preset", help="model shape (default: dialog.preset)")
    p.add_argument("--weights", dest="init_weights", type=Path, help="Moshi safetensors to start from (default: "
                   "dialog.weights; unset = the preset's seeded random init)")
    helps = {"lr": f"peak learning rate (default {d.lr}; 7B LoRA: ~2e-6)", "min_lr": "the cosine schedule's floor",
             "turn_head_weight": "text loss weight of each utterance's first --turn-head-tokens tokens (where the "
                                 "reply is chosen; 1 = off)",
             "threads": "torch CPU threads (0 = torch's default)", "ckpt_every": "steps between resumable checkpoints"}
    for name in ("steps", "batch_size", "lr", "min_lr", "weight_decay", "grad_clip", "text_pad_weight",
                 "first_codebook_weight", "turn_head_weight", "turn_head_tokens", "lora_rank", "lora_alpha", "seed",
                 "eval_every", "eval_samples", "ckpt_every", "threads"):
        default = getattr(d, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=helps.get(name))
    p.add_argument("--warmup", type=int, help="warmup steps (default: 5%% of --steps)")
    p.add_argument("--fresh-names", type=float, default=d.fresh_names,
                   help="share of rows whose people get new pseudo-names, so names must be read from L1 (byte tokenizer)")
    p.add_argument("--drills", type=float, default=d.drills,
                   help="share of rows turned into reading drills (the text channel copies a span of L1)")
    p.add_argument("--drill-random-l1", type=float, default=d.drill_random_l1,
                   help="share of drills that read random pseudo-words instead of the profile")
    p.add_argument("--drill-span", type=int, nargs=2, default=d.drill_span, metavar=("MIN", "MAX"),
                   help="drill length in bytes")
    p.add_argument("--listen-drills", type=float, default=d.listen_drills,
                   help="share of rows replaced by listening drills (spoken questions about the L1 profile, answered; "
                        "the codec is the config's [mimi], the one the dataset was made with)")
    p.add_argument("--listen-questions", type=int, nargs=2, default=d.listen_questions, metavar=("MIN", "MAX"),
                   help="spoken questions per listening drill")
    p.add_argument("--listen-voices", type=int, default=d.listen_voices,
                   help="listening drills speak in the first N training voices (0: all)")
    p.add_argument("--listen-bank", type=Path, help="the drills' clip-bank cache (default: <out>/listen_clips_train.npz; "
                   "a train-backbone --task listen run folder's listen_clips_train.npz is the same bank)")
    p.add_argument("--listen-seed", type=int, default=d.listen_seed,
                   help="the listening drills' bank (default: --seed), so a later fine-tune with another --seed "
                        "reuses a bank")
    p.add_argument("--query-drills", type=float, default=d.query_drills,
                   help="share of rows replaced by query drills (a spoken question about 'my <relation>', then the "
                        "<retr> query with that entry of the profile's people: line)")
    p.add_argument("--query-bank", type=Path, help="the query drills' clip-bank cache (default: "
                   "<out>/query_clips_train.npz; a train-backbone --task query run folder's is the same bank when "
                   "--query-seed (else --seed) and the --query-* settings match that run's)")
    p.add_argument("--query-seed", type=int, default=d.query_seed,
                   help="the query drills' questions and bank (default: --seed), so a later fine-tune with another "
                        "--seed reuses a bank")
    p.add_argument("--query-relations", type=int, default=d.query_relations,
                   help="training relations the query drills ask about (the 23 core ones first)")
    p.add_argument("--query-voices", type=int, default=d.query_voices,
                   help="training voices the query drills speak in")
    p.add_argument("--query-templates", type=int, default=d.query_templates,
                   help="sentences each relation is asked in, of its 18")
    p.add_argument("--query-voices-per-question", type=int, default=d.query_voices_per_question,
                   help="each sentence spoken in a seeded draw of this many of the --query-voices (0: all)")
    p.add_argument("--speak-dropout", type=float, default=d.speak_dropout,
                   help="share of corpus rows whose speak rows are the codec's silence (text loss only), so the "
                        "model hears whatever it said itself")
    p.add_argument("--same-person-repeat", type=int, default=d.same_person_repeat, metavar="K",
                   help="draw each Level-1 sample of a dialog that follows the same person's K times an epoch "
                        "(the greeting after a silence, with no L1 refresh; 1: once, as every sample)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters only (merged into lm.safetensors)")
    p.add_argument("--lora-scope", choices=["transformers", "all"], default=d.lora_scope)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--dialog-steps", type=int, help="longest dialog per sample (default: context - n1 - n2)")
    p.add_argument("--context", choices=["stream", "dialog"], default=d.context,
                   help="a row's dialog context: the stream before its dialog too ('stream', the paper's) or its own "
                        "dialog only ('dialog': serve such a model with [dialog] new_person = 'restart')")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", *DTYPES])
    p.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--eval-data", type=Path, help="held-out dataset folder (default: a subset of the training samples)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--stop-after", type=int, help="stop this invocation after N steps (continue with --resume)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """A TrainConfig from parsed `egomem finetune` arguments, dialog.* config for unset --preset/--weights."""
    from egomem.config import load_config

    dialog = load_config(getattr(args, "config", None)).dialog
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
    given["drill_span"] = tuple(args.drill_span)  # as TrainConfig's default, so a resume compares equal
    given["listen_questions"] = tuple(args.listen_questions)
    given["preset"] = args.preset or dialog.preset
    given["init_weights"] = args.init_weights if args.init_weights is not None else dialog.weights
    return TrainConfig(**given)


def run_finetune(args: argparse.Namespace) -> int:
    """`egomem finetune`: 0 on success, 2 with a one-line reason on bad input."""
    try:
        from egomem.config import load_config

        mimi = load_config(getattr(args, "config", None)).mimi
        res = train(config_from_args(args), progress=not args.no_progress, mimi=mimi)
    except (SampleError, CheckpointError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"egomem finetune: {e}", file=sys.stderr)
        return 2
    losses = res.losses
    print(json.dumps({"out": str(res.path), "step": res.step, "complete": res.complete,
                      "first_loss": losses[0] if losses else None,
                      "final_loss": float(np.mean(losses[-10:])) if losses else None}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`egomem finetune ...` with its own parser (as `egomem train-trigger`: torch loads only when it runs)."""
    p = argparse.ArgumentParser(prog="egomem finetune", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", metavar="PATH", help="TOML config (dialog.preset / dialog.weights are the defaults)")
    add_finetune_args(p)
    return run_finetune(p.parse_args(argv))
