"""Train the episodic trigger on synthetic streams (`egomem train-trigger`).

Steps: (1) encode the LibriSpeech sources once with the project's Mimi into a code cache
(`--cache-dir`, reused on later runs with the same Mimi); (2) build the listen pool once
(`--listen-pool` layouts, `egomem.trigger.listen_audio`): each layout's listen row laid out as audio
and encoded whole by the codec, clean and over one background, as serving's codec writes a live
stream (a trigger trained on rows spliced from the cached codes learnt the splice); (3) train on
batches drawn from the pool (batch b of step s from `rng([seed, s])`, so a resumed run sees the same
data as an uninterrupted one; `--listen-pool 0`: freshly synthesised spliced streams, as before);
(4) evaluate on held-out streams (held-out users and assistant utterances, clean and noised, listen
rows encoded whole); (5) write fp16 weights + metadata to `--out`.

The shipped offline default `egomem/data/trigger_tiny.safetensors` (4.2 MB), trained on the codes
of the shipped trained tiny codec (`egomem train-codec`), is session 59's trigger

    python -m egomem.trigger.train --data /work/shared/data/speech --seed 0 --steps 3000 --code-aug-p 0.3 \
        --listen-pool 1600 --codebook-emb init --out runs/trigger_s59.safetensors

continued (session 62) on the voice track serving records (`--heard-voices`, a pool of 400 layouts):

    python -m egomem.trigger.train --data /work/shared/data/speech --seed 0 --draw-seed 1 --steps 1000 \
        --code-aug-p 0.3 --listen-pool 400 --heard-voices --init-weights runs/trigger_s59.safetensors --lr 1e-3 \
        --out egomem/data/trigger_tiny.safetensors

(LibriSpeech FLAC as in the project's shared data; no espeak/flite needed) with today's defaults:
`[trigger]` dim 128, 4 layers, audio embedding rank 32, reading the recorded voice track
(`trigger.voice_dim = 256`, withheld on `--drop-track-p 0.05` of the streams, a tenth of the polls
dropped), the auxiliary voice-change loss (`--voice-change-weight 0.5`), `--dropout 0.1`, a listen pool
of 1,600 layouts (3,200 streams; the default), 0.3 of the fine audio codes replaced, and every audio code's
embedding started from its codebook centroid (`--codebook-emb init`, `init_audio_emb_from_codebooks`; session
59): the trained codec writes other codes for noised speech nearly everywhere, and embeddings that start
where the centroids lie read a code that noise moved to a neighbour almost as the clean one. Held out
(`bench/bench_trigger.py`, `bench/results/bench_trigger_codebook_emb.json`; README, "episodic_trigger"):
Jaccard / F1@5 clean 0.995 / 0.927, noised 0.975 / 0.755, against 0.993 / 0.910 and 0.969 / 0.718 for the
same recipe without it (the trigger shipped before, session 42) on the same streams in the same run; `frozen`
(tables kept fixed) reached 0.974 / 0.747 noised (docs/trigger.md has the versions before).
Training: ≈36 min on a 2-core CPU (one torch thread, beside a second run); the pool the first
time: ≈1 h of one core (`python -m egomem.trigger.listen_audio --data ... --shards 0:16` and `16:32`
build its halves in two processes); the code cache: ≈5 min idle (≈20 min shared).
Rerunning the command after a kill resumes from `--ckpt-dir` (and from the pool shards already built).
For real Mimi weights set `mimi.weights` in the config (`--config`) and run the same command.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from egomem.config import REPO_ROOT, TriggerConfig, load_config
from egomem.trigger.decode import configured_decode, decode_sessions
from egomem.trigger.listen_audio import draw_stream
from egomem.trigger.metrics import evaluate
from egomem.trigger.model import TriggerModel, TriggerModelConfig, save_trigger
from egomem.trigger.synth import (
    STEP_S,
    CodeCache,
    StreamSpec,
    SynthStream,
    build_cache,
    cache_path,
    synth_batch,
    track_features,
    voice_change_targets,
)

log = logging.getLogger(__name__)

CLASS_WEIGHTS = (1.0, 8.0, 1.0, 8.0)  # start/end are ~1% of steps; weigh them up so boundaries are learnt


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="egomem train-trigger", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, help="LibriSpeech root with cohort/ and test-other/ (needed to build the code cache)")
    p.add_argument("--config", type=Path, help="EgoMem TOML config (mimi.* picks the tokeniser, trigger.* the dims)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "trigger" / "trigger.safetensors")
    p.add_argument("--cache-dir", type=Path, default=REPO_ROOT / "runs" / "trigger_cache")
    p.add_argument("--ckpt-dir", type=Path, default=REPO_ROOT / "runs" / "trigger" / "ckpt",
                   help="resumable training state (last.pt); a rerun of the same command resumes from it")
    p.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in --ckpt-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--stream-steps", type=int, default=768, help="training stream length (80 ms steps)")
    p.add_argument("--max-stream-steps", type=int, default=8192,
                   help="a share --long-p of the steps trains on one stream of 1024..this many steps (the paper's 8,192)")
    p.add_argument("--long-p", type=float, default=0.1, help="share of steps that train on one long stream")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--voice-change-weight", type=float, default=0.5,
                   help="weight of an auxiliary loss (training only): on every step of user speech, is this "
                        "another user than the one who spoke before? (a second head; not in the checkpoint; "
                        "0 turns it off)")
    p.add_argument("--codebook-emb", choices=CODEBOOK_EMB, default="off",
                   help="audio code embeddings from the codec's codebook centroids (init_audio_emb_from_codebooks): "
                        "off (random init), init (a start; the shipped trigger's recipe), frozen (fixed)")
    p.add_argument("--init-weights", type=Path, default=None,
                   help="start from this trained trigger checkpoint (same dims, same codec) instead of a fresh "
                        "network: a continuation on more steps with a fresh warmup and cosine; its audio tables "
                        "replace a --codebook-emb start (frozen still keeps them fixed)")
    p.add_argument("--draw-seed", type=int, default=None,
                   help="seed of the batch draws, augmentation and dropout masks (default --seed; --seed also "
                        "keys the code cache, the pool and the held-out streams): a continuation should draw "
                        "other batches than the run it continues")
    p.add_argument("--activity-weight", type=float, default=0.0,
                   help="weight of an auxiliary loss (training only): on every step, is a user speaking on the "
                        "listen row? A dense signal for where speech starts under noise, where the label loss "
                        "has one start step per session (a third head; not in the checkpoint; 0 turns it off)")
    p.add_argument("--drop-track-p", type=float, default=0.05,
                   help="a trigger reading the voice track (trigger.voice_dim > 0): share of training streams whose "
                        "whole track is withheld, so it still labels chunks recorded without a speaker encoder")
    p.add_argument("--drop-poll-p", type=float, default=0.1, help="likewise, share of single polls withheld")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="dropout on the network's residual branches (training only; "
                        "stored in the checkpoint's config, inactive when labelling)")
    p.add_argument("--code-aug-p", type=float, default=0.2,
                   help="share of the fine audio codes (codebooks 2-8 of both channels) replaced by random codes "
                        "in training, so the tagger cannot learn the few training utterances' exact code sequences")
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--eval-streams", type=int, default=48, help="held-out streams per condition at the end")
    p.add_argument("--listen-pool", type=int, default=1600,
                   help="train on a pool of this many stream layouts whose listen row is encoded whole from audio "
                        "(egomem.trigger.listen_audio: what serving's codec writes; each layout clean and noised; "
                        "built once into --cache-dir from --data); 0: listen rows spliced from cached codes")
    p.add_argument("--voice-shift", type=float, default=0.0,
                   help="pool users' voices pitch-shifted by a draw in +-this many semitones (one per user per "
                        "stream, at the same duration): more voices than the 200 training speakers; 0: none")
    p.add_argument("--noised-share", type=float, default=None,
                   help="share of the pool's short training streams drawn from its noised copies (default: "
                        "uniform over the pool, i.e. half); more weighs the noised condition up")
    p.add_argument("--heard-voices", action="store_true",
                   help="the pool's streams and the held-out ones read the voice track serving records (the speaker "
                        "encoder on the last 3 s of each stream's laid-out audio every 2 s: listen_audio.heard_voices), "
                        "not the cached utterances' partials; needs --listen-pool")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: fastest on a shared 2-core machine, and reproducible; 0: torch's default)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.heard_voices and not args.listen_pool:
        p.error("--heard-voices embeds each stream's laid-out audio: it needs --listen-pool")
    if args.voice_shift < 0:
        p.error(f"--voice-shift is a range in semitones, 0 or more (got {args.voice_shift})")
    if args.noised_share is not None and not 0 <= args.noised_share <= 1:
        p.error(f"--noised-share must lie in [0, 1] (got {args.noised_share})")
    return args


def load_or_build_cache(args: argparse.Namespace, codec, fp: str, split: str) -> CodeCache:
    """The split's code cache for this Mimi (`codec`, its fingerprint `fp`), built (once) from --data if it is
    not there yet."""
    path = cache_path(args.cache_dir, split, fp, args.seed)
    if path.is_file():
        return CodeCache.load(path)
    if args.data is None:
        raise SystemExit(f"no code cache {path}: pass --data <LibriSpeech root> (cohort/, test-other/) to build it")
    cache = build_cache(args.data, split, codec, seed=args.seed)
    cache.save(path)
    return cache


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    w = torch.tensor(CLASS_WEIGHTS, device=logits.device)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), weight=w)  # (B*T),4


def voices_of(model: TriggerModel, cache: CodeCache, streams: list, rng: np.random.Generator | None = None,
              drop_track_p: float = 0.0, drop_poll_p: float = 0.0) -> torch.Tensor | None:
    """[B, T, voice_dim + 2] voice-track features of the streams, or None for a codes-only trigger."""
    c = model.cfg
    if not c.voice_dim:
        return None
    return torch.from_numpy(np.stack([track_features(cache, st, c.voice_dim, c.voice_window_steps, rng, drop_track_p,
                                                     drop_poll_p) for st in streams]))


@torch.no_grad()
def evaluate_model(model: TriggerModel, cache: CodeCache, n: int, seed: int, noised: bool,
                   spec: StreamSpec | None = None, decoding: TriggerConfig | None = None,
                   voices: bool = True, listen: tuple | None = None, speaker=None) -> dict:
    """span metrics on n held-out streams (seeded: the same streams for every model), decoded as the
    labeler decodes (`configured_decode`: `decoding`'s gap rule, minimum session length, boundary
    refinement).
    A trigger that reads the voice track gets the streams' polls unless `voices` is False.
    `listen` = (SourceAudio, codec): each stream's listen row encoded whole from audio (`listen_audio`),
    the noise of a noised one added to that audio; else spliced from the cache's codes. With a `speaker`
    encoder (and `listen`), the voice track is the one heard from that audio (`listen_audio.heard_voices`)."""
    decoding = decoding or TriggerConfig()
    spec = spec or StreamSpec(steps=1024)
    rng = np.random.default_rng([seed, 7, int(noised)])
    preds, golds = [], []
    model.eval()
    for _ in range(n):
        st = draw_stream(cache, rng, spec, noised, listen, speaker)
        v = voices_of(model, cache, [st]) if voices else None
        log_probs = torch.log_softmax(model(torch.from_numpy(st.tokens)[None], v)[0], -1).numpy()  # T,4
        preds.append(decode_sessions(configured_decode(log_probs, decoding)))
        golds.append(st.sessions)
    return evaluate(preds, golds)


FINE_CODEBOOKS = np.r_[2:9, 10:17]  # token columns of codebooks 2-8 of the speak (1-8) and listen (9-16) channels


def augment_codes(tokens: np.ndarray, rng: np.random.Generator, p: float) -> np.ndarray:
    """A copy of tokens [B, T, 17] with a share `p` of the fine audio codes (codebooks 2-8, the residual
    detail of each step; the first codebook and the text are kept) replaced by random codes. A training
    augmentation: 200 users with one utterance each are few enough for a tagger to learn their exact
    code sequences (an 8,000-step run over-split held-out streams); noise in the detail keeps it on what
    generalises."""
    from egomem.trigger.model import AUDIO_CARD

    out = tokens.copy()
    fine = out[..., FINE_CODEBOOKS]  # B,T,14 (a copy)
    hit = (rng.random(fine.shape) < p) & (fine >= 0)  # never turn "no input" (-1) into a code
    fine[hit] = rng.integers(0, AUDIO_CARD, int(hit.sum()))
    out[..., FINE_CODEBOOKS] = fine
    return out


CODEBOOK_EMB = ("off", "init", "frozen")


@torch.no_grad()
def init_audio_emb_from_codebooks(model: TriggerModel, vectors: torch.Tensor, freeze: bool) -> None:
    """Set every audio code's low-rank embedding to the top principal components of its codebook centroid.

    `vectors` [8, 2048, d] (`codec.codebook_vectors`), used for both the speak and the listen codebooks (one
    codec). Noise moves a frame's latent a little and the trained codec's dense codebooks then write another
    code, nearly always (bench/bench_codec.py, code stability): embeddings that follow the centroids keep
    such codes close. `freeze`: the tables stay fixed (each codebook's contribution is then a trainable linear
    map of its code's centroid, top `emb_rank` components); else they are a starting point only. The
    start-of-stream token (id 2048) keeps its random row."""
    K, card, rank = model.audio_emb.shape[0], vectors.shape[1], model.cfg.emb_rank
    if vectors.shape[0] * 2 != K or card != model.cfg.audio_card:
        raise ValueError(f"codebook vectors {tuple(vectors.shape)} do not fit the trigger's {K} audio tokens of "
                         f"{model.cfg.audio_card} codes")
    for k in range(vectors.shape[0]):
        centred = vectors[k] - vectors[k].mean(0)
        _, _, vt = torch.linalg.svd(centred, full_matrices=False)
        emb = centred @ vt[:rank].T  # [2048, rank] (fewer columns if the centroids have fewer dims)
        emb = emb / (emb.std() + 1e-9)  # the scale of the default init (unit normal)
        for half in (0, vectors.shape[0]):  # speak codebook k and listen codebook k
            model.audio_emb[half + k, :card, : emb.shape[1]] = emb
            model.audio_emb[half + k, :card, emb.shape[1]:] = 0.0
    model.audio_emb.requires_grad_(not freeze)


def load_start(model: TriggerModel, path: Path, fp: str) -> None:
    """Load a trained trigger's weights into `model` (a continuation's start), refusing one of other dims or
    trained on another codec's codes (its `codec_fingerprint` metadata against `fp`, the configured Mimi's)."""
    from egomem.trigger.model import load_trigger

    start, meta = load_trigger(path)
    ours = {k: v for k, v in model.cfg.to_dict().items() if k != "dropout"}
    theirs = {k: v for k, v in start.cfg.to_dict().items() if k != "dropout"}
    if ours != theirs:
        diff = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
        raise SystemExit(f"--init-weights {path}: its dims differ from the configured trigger's "
                         f"(checkpoint, config): {diff}")
    if meta.get("codec_fingerprint") != fp:
        raise SystemExit(f"--init-weights {path} was trained on codec {meta.get('codec_fingerprint')!r}, the "
                         f"configured Mimi is {fp!r}: continue a trigger only on its own codec's codes")
    model.load_state_dict(start.state_dict())  # in place: a frozen table stays out of the optimiser


def make_model(t, seed: int, voice_window_steps: int = 38, dropout: float = 0.0) -> TriggerModel:
    """A fresh trigger network with the dims of a TriggerConfig section, seeded; `voice_window_steps`:
    how many steps one voice poll covers (orchestrator.identify_window_s / 80 ms, rounded up)."""
    mcfg = TriggerModelConfig(dim=t.dim, num_layers=t.num_layers, num_heads=t.num_heads, emb_rank=t.emb_rank,
                              text_buckets=t.text_buckets, conv_kernel=t.conv_kernel, voice_dim=t.voice_dim,
                              voice_window_steps=voice_window_steps, dropout=dropout)
    torch.manual_seed(seed)
    return TriggerModel(mcfg)


# What a resumable state records of how its run was made, each with the option that sets it: a resume with
# another is refused, naming the options that differ.
RESUME_RECIPE = {
    "model_cfg": "trigger config (dims, dropout)", "seed": "--seed", "total_steps": "--steps",
    "voice_change_weight": "--voice-change-weight", "drop_track_p": "--drop-track-p (voice dropout)",
    "drop_poll_p": "--drop-poll-p (voice dropout)", "code_aug_p": "--code-aug-p", "pool_streams": "--listen-pool",
    "activity_weight": "--activity-weight", "codebook_emb": "--codebook-emb", "draw_seed": "--draw-seed",
    "init_weights": "--init-weights", "voice_shift": "--voice-shift", "noised_share": "--noised-share",
    "heard_voices": "--heard-voices",
}
# what a state saved before a recipe field existed ran with (draw_seed: its seed, model_cfg: today's defaults)
RESUME_BEFORE = {"total_steps": None, "voice_change_weight": 0.0, "drop_track_p": 0.0, "drop_poll_p": 0.0,
                 "code_aug_p": 0.0, "pool_streams": 0, "activity_weight": 0.0, "codebook_emb": "off",
                 "init_weights": "", "voice_shift": 0.0, "noised_share": None, "heard_voices": False}


def pool_batch(rng: np.random.Generator, streams: list[SynthStream], batch: int,
               noised_share: float | None = None) -> list[SynthStream]:
    """`batch` of the pool's `streams`: uniform over them, or each a noised one with probability
    `noised_share` (then uniform among those)."""
    if noised_share is None:
        return [streams[int(i)] for i in rng.integers(len(streams), size=batch)]
    groups = [[st for st in streams if st.noised == want] for want in (False, True)]
    picks = [groups[int(rng.random() < noised_share)] for _ in range(batch)]
    return [group[int(rng.integers(len(group)))] for group in picks]


def fit(model: TriggerModel, cache: CodeCache, *, steps: int, batch: int, stream_steps: int, lr: float,
        seed: int, ckpt: Path | None = None, ckpt_every: int = 100, resume: bool = True,
        stop_after: int | None = None, progress: bool = True, max_stream_steps: int | None = None,
        long_p: float = 0.0, voice_change_weight: float = 0.0, drop_track_p: float = 0.0,
        drop_poll_p: float = 0.0, code_aug_p: float = 0.0, pool: list[SynthStream] | None = None,
        activity_weight: float = 0.0, codebook_emb: str = "off", draw_seed: int | None = None,
        init_weights: str = "", voice_shift: float = 0.0, noised_share: float | None = None,
        heard_voices: bool = False) -> list[float]:
    """Train `model` in place for `steps` optimiser steps; returns the loss of every step so far.

    A share `long_p` of the steps trains on ONE stream of 1024..`max_stream_steps` steps instead of
    `batch` streams of `stream_steps` (long streams cost quadratically in attention, so they are few).

    `voice_change_weight` > 0 adds a second head on the same features, trained on every step of user
    speech to say whether this is another user than the previous speech run's (`voice_change_targets`):
    a dense signal for what a user switch after a short pause hangs on, the voice. The head is part of
    the resumable state, not of the model (the shipped checkpoint and its serving are unchanged).
    `activity_weight` > 0 adds a third such head, trained on every step to say whether a user is speaking
    on the listen row (`SynthStream.speaker` >= 0): where the label loss sees one start step per session,
    this sees every step of speech and of the noise around it.

    A model with `voice_dim` > 0 also reads each stream's voice track (`track_features`), the whole
    track dropped with `drop_track_p` and each poll with `drop_poll_p`, so it labels without one too.
    `code_aug_p` > 0 replaces that share of the fine audio codes by random ones (`augment_codes`).
    `codebook_emb` names how the caller initialised the audio embeddings (`init_audio_emb_from_codebooks`;
    a resume refuses another), and a frozen table stays out of the optimiser. `init_weights` names the
    checkpoint the caller loaded into `model` ("" for a fresh network; a resume refuses another), and
    `voice_shift` and `heard_voices` the pool's (`listen_audio.PoolSpec`) and `noised_share` the batches'
    (likewise).

    With `ckpt`, state (weights, optimiser, schedule, step, losses) is saved atomically every
    `ckpt_every` steps and a run resumes from it. Batch s is drawn from rng([seed, s]), so a resumed
    run continues exactly where the interrupted one was (`draw_seed`, default `seed`, replaces `seed` in
    those draws: a continuation of a trained trigger sees other batches). `stop_after` ends this call early
    (tests).

    With a `pool` (`listen_audio.load_or_build_pool`: streams whose listen row is encoded whole from
    audio), batches are drawn from it instead of synthesised: `batch` of its `stream_steps`-long
    streams, or on a long step one of its longer ones; with `noised_share` each short stream is a noised
    one with that probability (None: uniform over the pool, half of it noised).
    """
    from tqdm import tqdm

    draw_seed = seed if draw_seed is None else draw_seed
    voice_head = torch.nn.Linear(model.cfg.dim, 2) if voice_change_weight > 0 else None
    activity_head = torch.nn.Linear(model.cfg.dim, 2) if activity_weight > 0 else None
    heads = {"voice_head": voice_head, "activity_head": activity_head}  # training-only, saved in the state by name
    params = [p for p in model.parameters() if p.requires_grad]
    params += [p for h in heads.values() if h is not None for p in h.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + np.cos(np.pi * min(1.0, s / steps))))
    recipe = {"model_cfg": model.cfg.to_dict(), "seed": seed, "total_steps": steps,
              "voice_change_weight": voice_change_weight, "drop_track_p": drop_track_p, "drop_poll_p": drop_poll_p,
              "code_aug_p": code_aug_p, "pool_streams": len(pool or []), "activity_weight": activity_weight,
              "codebook_emb": codebook_emb, "draw_seed": draw_seed, "init_weights": init_weights,
              "voice_shift": voice_shift, "noised_share": noised_share, "heard_voices": heard_voices}
    assert recipe.keys() == RESUME_RECIPE.keys()
    start, losses = 0, []
    if ckpt is not None and ckpt.is_file() and resume:
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        made = {**RESUME_BEFORE, "draw_seed": state["seed"], **{k: state[k] for k in recipe if k in state}}
        made["model_cfg"] = {**TriggerModelConfig().to_dict(), **made["model_cfg"]}
        differ = [RESUME_RECIPE[k] for k in recipe if made[k] != recipe[k]]
        if differ:
            raise SystemExit(f"{ckpt} was made with another {', '.join(differ)}; pass --no-resume or another "
                             f"--ckpt-dir")
        model.load_state_dict(state["model"])
        for name, h in heads.items():
            if h is not None:
                h.load_state_dict(state[name])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start, losses = state["step"], state["losses"]
        log.info("resuming from %s at step %d", ckpt, start)
    end = steps if stop_after is None else min(steps, start + stop_after)
    short = [st for st in pool or [] if st.tokens.shape[0] == stream_steps]
    longer = [st for st in pool or [] if st.tokens.shape[0] > stream_steps]
    if pool is not None and not short:
        raise ValueError(f"the pool holds no stream of {stream_steps} steps (--stream-steps)")
    if noised_share is not None and len({st.noised for st in short}) < 2:
        raise ValueError("--noised-share needs clean and noised streams in the pool")
    model.train()
    bar = tqdm(range(start, end), initial=start, total=steps, desc="train trigger", unit="step", disable=not progress)
    for step in bar:
        rng = np.random.default_rng([draw_seed, step])
        if max_stream_steps and rng.random() < long_p:
            spec, b = StreamSpec(steps=int(rng.integers(1024, max_stream_steps + 1))), 1
        else:
            spec, b = StreamSpec(steps=stream_steps), batch
        if pool is None:
            streams = synth_batch(cache, rng, spec, b)
        elif b == 1 and longer:
            streams = [longer[int(rng.integers(len(longer)))]]
        else:
            streams = pool_batch(rng, short, batch, noised_share)
        voices = voices_of(model, cache, streams, rng, drop_track_p, drop_poll_p)
        tokens = np.stack([st.tokens for st in streams])  # B,T,17
        if code_aug_p > 0:  # drawn after the streams and the track: with 0 the run draws what it drew before
            tokens = augment_codes(tokens, rng, code_aug_p)
        with torch.random.fork_rng(devices=[], enabled=model.cfg.dropout > 0):  # the caller's generator is left alone
            if model.cfg.dropout > 0:  # dropout's masks from a per-step seed, so a resumed run draws the same ones
                torch.manual_seed(int(np.random.default_rng([draw_seed, step, 1]).integers(2**62)))
            feats = model.features(torch.from_numpy(tokens), voices)  # B,T,dim
        loss = loss_fn(model.head(feats), torch.from_numpy(np.stack([st.labels for st in streams])))
        if voice_head is not None:
            change = torch.from_numpy(np.stack([voice_change_targets(st.speaker) for st in streams]))  # B,T
            if bool((change >= 0).any()):
                loss = loss + voice_change_weight * F.cross_entropy(
                    voice_head(feats).reshape(-1, 2), change.reshape(-1), ignore_index=-1)
        if activity_head is not None:
            speaking = torch.from_numpy(np.stack([st.speaker >= 0 for st in streams]).astype(np.int64))  # B,T
            loss = loss + activity_weight * F.cross_entropy(activity_head(feats).reshape(-1, 2), speaking.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}")
        if ckpt is not None and ((step + 1) % ckpt_every == 0 or step + 1 == end):
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "step": step + 1, "losses": losses, **recipe,
                        **{name: h.state_dict() if h is not None else None for name, h in heads.items()}}, tmp)
            tmp.replace(ckpt)  # atomic: a kill mid-save leaves the previous checkpoint intact
    model.eval()
    return losses


def train(args: argparse.Namespace) -> dict:
    cfg = load_config(args.config)
    if args.threads:
        torch.set_num_threads(args.threads)
    from egomem.trigger.codec import build_codec, codebook_vectors, codec_fingerprint

    codec = build_codec(cfg.mimi)  # one per run: the caches, the pool, the code embeddings and the metadata read it
    fp = codec_fingerprint(codec)
    train_cache = load_or_build_cache(args, codec, fp, "train")
    held_cache = load_or_build_cache(args, codec, fp, "heldout")
    model = make_model(cfg.trigger, args.seed, int(np.ceil(cfg.orchestrator.identify_window_s / STEP_S - 1e-9)),
                       dropout=args.dropout)
    pool, listen, speaker = None, None, None
    if args.listen_pool:
        from egomem.trigger.listen_audio import PoolSpec, SourceAudio, heard_encoder, load_or_build_pool

        if args.data is None:
            raise SystemExit("--listen-pool evaluates on held-out audio: pass --data <LibriSpeech root>")
        spec = PoolSpec(layouts=args.listen_pool, steps=args.stream_steps, max_steps=args.max_stream_steps,
                        seed=args.seed, voice_shift=args.voice_shift, heard_voices=args.heard_voices)
        speaker = heard_encoder(cfg.identity) if args.heard_voices else None  # one encoder: the pool's and the eval's
        pool = load_or_build_pool(args.cache_dir, train_cache, codec, spec, args.data, speaker=speaker)
        listen = (SourceAudio.load(args.data, "heldout"), codec)
    if args.codebook_emb != "off":
        init_audio_emb_from_codebooks(model, codebook_vectors(codec), args.codebook_emb == "frozen")
    if args.init_weights is not None:
        load_start(model, args.init_weights, fp)
    ckpt = args.ckpt_dir / "last.pt"
    t0 = time.time()
    losses = fit(model, train_cache, steps=args.steps, batch=args.batch, stream_steps=args.stream_steps, lr=args.lr,
                 seed=args.seed, ckpt=ckpt, ckpt_every=args.ckpt_every, resume=not args.no_resume,
                 max_stream_steps=args.max_stream_steps, long_p=args.long_p,
                 voice_change_weight=args.voice_change_weight, drop_track_p=args.drop_track_p,
                 drop_poll_p=args.drop_poll_p, code_aug_p=args.code_aug_p, pool=pool,
                 activity_weight=args.activity_weight, codebook_emb=args.codebook_emb, draw_seed=args.draw_seed,
                 init_weights=str(args.init_weights or ""), voice_shift=args.voice_shift,
                 noised_share=args.noised_share, heard_voices=args.heard_voices)
    train_s = time.time() - t0
    results = {cond: evaluate_model(model, held_cache, args.eval_streams, args.seed, noised=(cond == "noised"),
                                 decoding=cfg.trigger, listen=listen, speaker=speaker)
               for cond in ("clean", "noised")}
    meta = {
        "codec_fingerprint": fp,
        "mimi_preset": cfg.mimi.preset,
        "mimi_weights": str(cfg.mimi.weights),
        "mimi_codec": codec_name(cfg.mimi),
        "voice_encoder": cfg.identity.voice_backend if model.cfg.voice_dim else "none",
        "train_command": "python -m egomem.trigger.train " + shlex.join(args.argv),
        "seed": args.seed,
        "steps": args.steps,
        "init_weights": str(args.init_weights or ""),
        "voice_shift": args.voice_shift,
        "heard_voices": args.heard_voices,
        "noised_share": args.noised_share,
        "final_loss": float(np.mean(losses[-50:])) if losses else float("nan"),
        "heldout": json.dumps(results),
    }
    save_trigger(model, args.out, meta)
    summary = {"out": str(args.out), "train_seconds_this_run": round(train_s, 1),
               "first_loss": losses[0] if losses else None, "final_loss": meta["final_loss"], "heldout": results}
    print(json.dumps(summary, indent=1))
    return summary


def codec_name(mimi) -> str:
    """Which Mimi made the codes: its weights file name, or "random_init"."""
    from egomem.codec.mimi import codec_weights

    w = codec_weights(mimi)
    return "random_init" if w is None else Path(w).name


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
