"""Benchmark the episodic trigger: session metrics on held-out synthetic streams, and labelling speed.

Metrics (EgoMem paper: Jaccard 0.99, span_match F1@5 0.98 on its own data): Jaccard of session
spans and span_match@{0,5,10} precision/recall/F1 over `--streams` held-out streams per condition
(clean, noised), built from held-out users' and assistant utterances (egomem.trigger.synth). By default
(`--listen audio`) each stream's listen row is laid out as audio (user speech, echo, and in a noised
stream one background of any kind at 0-20 dB SNR) and encoded whole by the configured codec, as serving's
`mimi_codec` encodes a live stream (egomem.trigger.listen_audio); `--listen codes` splices it from the
code cache's per-utterance codes, the benchmark before (a trigger trained on spliced rows learnt the
splice: held-out clean F1@5 0.891 spliced, 0.447 encoded whole). The voice polls a tagger reading the
voice track gets (and the identity split reads) are by default (`--voice-track heard`) what serving
records: the speaker encoder on the last 3 s of the stream's laid-out audio every 2 s, echo and background
included (`listen_audio.heard_voices`); `--voice-track cached` reads them from the cached utterances'
partials, the benchmark before session 62, which serving never sees (docs/trigger.md).
A third condition, clean streams without user switches, shows how much of the error is telling
two users apart across a short pause (voice only). Segmenters per condition:
  - trigger: the shipped tagger alone, decoded as the labeler decodes (`trigger.short_gap_cost`, boundaries
    refined within `trigger.boundary_window_steps`); a
    tagger trained with the voice track (`voice_dim` > 0) reads the stream's recorded voice polls
    (below), as the memory manager hands them to it;
  - trigger_codes_only (a tagger that reads the voice track): the same tagger with the track withheld
    (a chunk recorded without a speaker encoder);
  - trigger_hard_gap: the same log-probabilities decoded with the hard gap rule (sessions adjacent
    or >= `trigger.min_gap_steps` apart, `short_gap_cost = inf`), the decoding shipped before;
  - trigger_no_refine: the same log-probabilities with each boundary where the Viterbi path put
    it (`boundary_window_steps = 0`: no `decode.refine_boundaries`), the decoding shipped before that;
  - trigger+split: its sessions split where the person changes (egomem.trigger.identity_split) using
    the voice track the orchestrator would record (synth.poll_voices: a GE2E embedding of the user's
    last 3 s every 2 s, from real Resemblyzer partials cached with the codes), the identity config's
    s-norm threshold, and the shipped s-norm cohort minus the held-out users' own rows (a deployment's
    cohort never holds its users);
  - trigger+split_1poll: the same with `trigger.split_min_polls = 1` (one differing poll is a change);
  - peer_trigger (with `--peer-checkpoint`): another trigger checkpoint alone, e.g. the one shipped before,
    on the same streams in the same run;
  - trigger_one_pass (long-chunk conditions only): the same tagger attending over a whole
    8,192-step chunk at once instead of `trigger.window_steps` windows;
  - activity_peer: a rule-based activity segmenter (a step is active when the text channel carries a
    word or a listen code differs from the stream's most common code row; runs of activity closer
    than 3 s are merged into one session) — what the trigger must beat.
Two more conditions, clean and noised streams of `trigger.max_chunk_steps` (8,192) steps (the chunk
the memory worker labels; `--long-streams` each), compare windowed labelling with one pass.
Each also gets an error breakdown of the gold sessions at span_match@5: matched / merged (one
predicted span covers two gold sessions) / split / shifted / missed; in the noised conditions the
trigger's metrics also come per kind of background noise on the listen row (`by_background`:
white, pink, brown, babble, music, recorded) and, with `--listen audio`, per 5 dB band of its SNR to
the users' speech (`by_snr_db`).
Speed: seconds to label one 8,192-step chunk (paper: 0.08 s on an H100), median of `--repeats`,
windowed and in one pass.

    python bench/bench_trigger.py                # shipped checkpoint, held-out code cache in tests/data
    python bench/bench_trigger.py --device cuda  # the same on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from egomem.config import REPO_ROOT, IdentityConfig, OrchestratorConfig, TriggerConfig
from egomem.identity.snorm import AdaptiveSNorm, default_cohort_file
from egomem.trigger import TriggerLabeler, decode_sessions
from egomem.trigger.decode import configured_decode
from egomem.trigger.identity_split import SplitRule, split_sessions
from egomem.trigger.listen_audio import SNR_BANDS_DB, draw_stream
from egomem.trigger.metrics import SHIPPED_BAR, error_breakdown, evaluate, meets_bar
from egomem.trigger.synth import (
    N_TRAIN_USERS,
    STEP_S,
    TEXT_PAD,
    CodeCache,
    StreamSpec,
    poll_voices,
    recorded_voices,
    synth_recorded,
)

DEFAULT_CACHE = REPO_ROOT / "tests" / "data" / "trigger" / "heldout_codes.npz"
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "speech"


def noise_breakdown(preds: list, golds: list, backgrounds: list, snrs: list) -> dict:
    """A segmenter's noised metrics per kind of background (`by_background`) and, when every stream knows its
    SNR (`--listen audio`), per 5 dB band of it (`by_snr_db`)."""
    def part(keep: list[bool]) -> dict:
        return evaluate([p for p, k in zip(preds, keep) if k], [g for g, k in zip(golds, keep) if k])

    out = {"by_background": {kind: part([b == kind for b in backgrounds]) for kind in sorted(set(backgrounds))}}
    if all(v is not None for v in snrs):
        out["by_snr_db"] = {f"{lo}-{hi}": part([lo <= v < hi for v in snrs])
                            for lo, hi in SNR_BANDS_DB if any(lo <= v < hi for v in snrs)}
    return out


def activity_segmenter(tokens: np.ndarray, merge_gap: int = 38) -> list[tuple[int, int]]:
    """Peer: sessions = runs of channel activity, merged across gaps shorter than `merge_gap` steps."""
    listen = tokens[:, 9:]
    rows, counts = np.unique(listen, axis=0, return_counts=True)
    background = rows[counts.argmax()]
    active = (tokens[:, 0] != TEXT_PAD) | np.any(listen != background, axis=1)
    idx = np.flatnonzero(active)
    if idx.size == 0:
        return []
    spans, a, prev = [], idx[0], idx[0]
    for t in idx[1:]:
        if t - prev > merge_gap:
            spans.append((int(a), int(prev)))
            a = t
        prev = t
    spans.append((int(a), int(prev)))
    return [(s, e) for s, e in spans if e - s + 1 >= 3]


def bench_split_rule() -> SplitRule:
    """The memory manager's split rule (memory.worker.split_rule) with default config, except the
    s-norm cohort: the shipped one holds one row per LibriSpeech cohort speaker in sorted order, and
    the held-out users are the speakers after the first N_TRAIN_USERS, so their rows are left out."""
    i, t = IdentityConfig(), TriggerConfig()
    cohort = np.load(default_cohort_file("resemblyzer_ge2e"))[:N_TRAIN_USERS]  # [200, 256]
    return SplitRule(i.face_threshold_dlib, i.voice_threshold_resemblyzer,
                     AdaptiveSNorm(cohort, i.cohort_top_k, i.cohort_size), min_polls=t.split_min_polls,
                     window_steps=int(round(OrchestratorConfig().identify_window_s / STEP_S)))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=None, help="trigger checkpoint (default: the shipped one)")
    p.add_argument("--peer-checkpoint", type=Path, default=None,
                   help="another trigger checkpoint to measure beside it (segmenter 'peer_trigger')")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="held-out code cache (.npz)")
    p.add_argument("--listen", choices=["audio", "codes"], default="audio",
                   help="audio: each stream's listen row laid out as audio and encoded whole by the codec, as "
                        "serving's mimi_codec encodes a live stream (needs --data); codes: spliced from the "
                        "cache's per-utterance codes (the benchmark before; no audio needed)")
    p.add_argument("--voice-track", choices=["heard", "cached"], default="heard",
                   help="heard: the voice polls serving records, the speaker encoder on the last 3 s of each stream's "
                        "laid-out audio (echo and background included) every 2 s (listen_audio.heard_voices; needs "
                        "--listen audio); cached: the cached utterances' GE2E partials (synth.poll_voices; the "
                        "benchmark before session 62)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="LibriSpeech root with cohort/ and test-other/ (the held-out sources' audio)")
    p.add_argument("--streams", type=int, default=200, help="held-out streams per condition")
    p.add_argument("--stream-steps", type=int, default=1024)
    p.add_argument("--long-streams", type=int, default=30,
                   help="held-out streams of trigger.max_chunk_steps (8,192) steps per condition, windowed vs one pass")
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "bench_trigger.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tcfg = TriggerConfig(checkpoint=args.checkpoint, device=args.device)
    labeler = TriggerLabeler(tcfg)
    peer = TriggerLabeler(TriggerConfig(checkpoint=args.peer_checkpoint, device=args.device)) \
        if args.peer_checkpoint else None
    cache = CodeCache.load(args.cache)
    if cache.fingerprint != labeler.meta.get("codec_fingerprint"):
        print(f"WARNING: cache codec {cache.fingerprint} != checkpoint codec {labeler.meta.get('codec_fingerprint')}")
    spec = StreamSpec(steps=args.stream_steps)
    listen = None  # --listen codes: spliced from the cache's codes
    if args.listen == "audio":
        from egomem.config import load_config
        from egomem.trigger.codec import build_codec, codec_fingerprint
        from egomem.trigger.listen_audio import SourceAudio

        if not (args.data / "cohort").is_dir():
            raise SystemExit(f"--listen audio needs the held-out sources' audio: {args.data}/cohort is missing; pass "
                             f"--data <LibriSpeech root> or --listen codes")
        codec = build_codec(load_config(None).mimi)
        if codec_fingerprint(codec) != cache.fingerprint:
            raise SystemExit(f"{args.cache} was encoded by another codec than the configured one")
        listen = (SourceAudio.load(args.data, "heldout"), codec)
    speaker = None
    if args.voice_track == "heard":
        if listen is None:
            raise SystemExit("--voice-track heard embeds each stream's audio: it needs --listen audio "
                             "(or pass --voice-track cached)")
        from egomem.trigger.listen_audio import heard_encoder

        speaker = heard_encoder()

    results: dict = {"checkpoint": str(labeler.checkpoint), "cache": str(args.cache), "device": args.device,
                     "listen": args.listen, "voice_track": args.voice_track,
                     "peer_checkpoint": str(peer.checkpoint) if peer else None,
                     "threads": torch.get_num_threads(), "streams_per_condition": args.streams,
                     "stream_steps": args.stream_steps,
                     "decoding": {"min_gap_steps": tcfg.min_gap_steps, "min_session_steps": tcfg.min_session_steps,
                                  "short_gap_cost": tcfg.short_gap_cost,
                                  "boundary_window_steps": tcfg.boundary_window_steps,
                                  "boundary_search_steps": tcfg.boundary_search_steps,
                                  "boundary_min_gain": tcfg.boundary_min_gain}, "metrics": {}}
    no_switch = StreamSpec(steps=args.stream_steps, switch_p=0.0)
    conditions = {"clean": (spec, False), "noised": (spec, True), "clean_no_user_switch": (no_switch, False)}
    one_pass = TriggerLabeler(dataclasses.replace(tcfg, window_steps=tcfg.max_chunk_steps))  # peer: one window
    long_spec = StreamSpec(steps=tcfg.max_chunk_steps)  # the worker's chunk: windowed vs one pass
    long_conditions = {f"clean_{long_spec.steps}_steps": (long_spec, False),
                       f"noised_{long_spec.steps}_steps": (long_spec, True)} if args.long_streams else {}
    results["long_streams_per_condition"] = args.long_streams
    results["windowing"] = {"window_steps": tcfg.window_steps, "window_overlap_steps": tcfg.window_overlap_steps}
    rule = bench_split_rule()
    one_poll = dataclasses.replace(rule, min_polls=1)  # trigger.split_min_polls = 1: fewer merges, more false splits
    results["split_rule"] = {"voice_threshold_snorm": rule.voice_threshold, "min_polls": rule.min_polls,
                             "window_steps": rule.window_steps, "cohort_rows": N_TRAIN_USERS}
    for i, (cond, (cspec, noised)) in enumerate(conditions.items()):
        rng = np.random.default_rng([args.seed, i])
        out: dict[str, list] = {"trigger": [], "trigger_hard_gap": [], "trigger_no_refine": [], "trigger+split": [],
                                "trigger+split_1poll": [], "activity_peer": []}
        if labeler.reads_voices:
            out["trigger_codes_only"] = []
        if peer is not None:
            out["peer_trigger"] = []
        golds, polls, backgrounds, snrs = [], 0, [], []
        for _ in range(args.streams):
            s = draw_stream(cache, rng, cspec, noised, listen, speaker)
            voices = recorded_voices(cache, s)
            polls += len(voices)
            log_probs = labeler.log_probs(s.tokens, voices)
            pred = decode_sessions(configured_decode(log_probs, tcfg))  # = labeler.label(s.tokens, voices)
            out["trigger_hard_gap"].append(decode_sessions(configured_decode(log_probs, tcfg, math.inf)))
            out["trigger_no_refine"].append(decode_sessions(configured_decode(log_probs, tcfg, boundary_window=0)))
            if labeler.reads_voices:
                out["trigger_codes_only"].append(decode_sessions(labeler.label(s.tokens)))
            out["trigger"].append(pred)
            out["trigger+split"].append([(p.start, p.end) for p in split_sessions(pred, s.tokens, [], voices, rule)])
            out["trigger+split_1poll"].append(
                [(p.start, p.end) for p in split_sessions(pred, s.tokens, [], voices, one_poll)])
            out["activity_peer"].append(activity_segmenter(s.tokens))
            if peer is not None:
                out["peer_trigger"].append(decode_sessions(peer.label(s.tokens, voices)))
            golds.append(s.sessions)
            backgrounds.append(s.background)
            snrs.append(s.snr_db)
        results["metrics"][cond] = {k: evaluate(v, golds) | {"errors@5": error_breakdown(v, golds, 5)}
                                    for k, v in out.items()}
        results["metrics"][cond]["trigger+split"]["voice_polls"] = polls
        if noised:  # the trigger alone per kind of background noise (listen_audio's, or synth.noise_clip_kind)
            results["metrics"][cond]["trigger"] |= noise_breakdown(out["trigger"], golds, backgrounds, snrs)
    for i, (cond, (cspec, noised)) in enumerate(long_conditions.items()):
        rng = np.random.default_rng([args.seed, 20 + i])
        out = {"trigger": [], "trigger_one_pass": [], "activity_peer": []}
        golds = []
        for _ in range(args.long_streams):
            s = draw_stream(cache, rng, cspec, noised, listen, speaker)
            voices = recorded_voices(cache, s)
            out["trigger"].append(decode_sessions(labeler.label(s.tokens, voices)))
            out["trigger_one_pass"].append(decode_sessions(one_pass.label(s.tokens, voices)))
            out["activity_peer"].append(activity_segmenter(s.tokens))
            golds.append(s.sessions)
        results["metrics"][cond] = {k: evaluate(v, golds) | {"errors@5": error_breakdown(v, golds, 5)}
                                    for k, v in out.items()}
    results["bar"] = SHIPPED_BAR
    results["meets_bar"] = {c: meets_bar(results["metrics"][c]["trigger"], b) for c, b in SHIPPED_BAR.items()}

    # speed: one 8,192-step chunk (several streams back to back)
    rng = np.random.default_rng([args.seed, 9])
    parts = [synth_recorded(cache, rng, StreamSpec(steps=1024), noised=False) for _ in range(8)]
    chunk = np.concatenate([s.tokens for s in parts])
    chunk_voices = [(t + 1024 * i, v) for i, s in enumerate(parts) for t, v in poll_voices(cache, s)]

    def timed(lab: TriggerLabeler) -> dict:
        lab.label(chunk, chunk_voices)  # warm-up
        times = []
        for _ in range(args.repeats):
            if args.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            lab.label(chunk, chunk_voices)  # the voice features are part of the cost
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return {"median": float(np.median(times)), "min": float(np.min(times)), "all": [round(x, 4) for x in times],
                "real_time_factor": float(np.median(times) / (8192 * STEP_S))}

    results["label_8192_steps_s"] = timed(labeler)
    results["label_8192_steps_one_pass_s"] = timed(one_pass)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    _print_table(results)
    _plot(results, args.out.with_suffix(".png"))
    return results


def _print_table(r: dict) -> None:
    print(f"{'condition':20} {'segmenter':19} {'Jaccard':>8} "
          + " ".join(f"{'P/R/F1@' + str(n):>20}" for n in (0, 5, 10))
          + "  gold sessions @5: matched/merged/split/shifted/missed")
    for cond, by in r["metrics"].items():
        for name, m in by.items():
            cells = " ".join(f"{m[f'span_match@{n}']['precision']:.3f}/{m[f'span_match@{n}']['recall']:.3f}/"
                             f"{m[f'span_match@{n}']['f1']:.3f}".rjust(20) for n in (0, 5, 10))
            e = m["errors@5"]
            errs = "/".join(str(e[k]) for k in ("matched", "merged", "split", "shifted", "missed"))
            print(f"{cond:20} {name:19} {m['jaccard']:8.3f} {cells}  {errs}")
            for kind, k in [*m.get("by_background", {}).items(), *((f"{b} dB", k) for b, k in m.get("by_snr_db", {}).items())]:
                print(f"{'':20}   {kind + ' (' + str(k['streams']) + ')':17} {k['jaccard']:8.3f} " + " ".join(
                    f"F1@{n} {k[f'span_match@{n}']['f1']:.3f}".rjust(20) for n in (0, 5, 10)))
    print("shipped bar (Jaccard, F1@5):", ", ".join(
        f"{c} {b['jaccard']}/{b['f1@5']} {'met' if r['meets_bar'][c] else 'MISSED'}" for c, b in r["bar"].items()))
    s = r["label_8192_steps_s"]
    print(f"label 8,192 steps on {r['device']} ({r['threads']} threads): median {s['median']:.3f} s "
          f"(paper: 0.08 s on H100); {1 / s['real_time_factor']:.0f}x faster than real time; "
          f"in one pass instead of {r['windowing']['window_steps']}-step windows: "
          f"{r['label_8192_steps_one_pass_s']['median']:.3f} s")


def _plot(r: dict, path: Path) -> None:
    """Jaccard and span F1@5 per condition (x) and segmenter (one colour each), and what happened to
    the gold sessions (span_match@5) per condition, trigger alone vs trigger + identity split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conds = list(r["metrics"])
    names = list(dict.fromkeys(n for c in conds for n in r["metrics"][c]))  # every segmenter, first-seen order
    colour = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2), gridspec_kw={"width_ratios": [3, 3, 2]})
    w = 0.8 / len(names)
    for ax, (title, get) in zip(axes[:2], [("Jaccard", lambda m: m["jaccard"]),
                                           ("span_match F1@5", lambda m: m["span_match@5"]["f1"])]):
        for j, n in enumerate(names):
            xs = [i for i, c in enumerate(conds) if n in r["metrics"][c]]
            ax.bar(np.array(xs) + j * w, [get(r["metrics"][conds[i]][n]) for i in xs], w, color=colour[n], label=n)
        ax.set_xticks(np.arange(len(conds)) + 0.4 - w / 2, [c.replace("_", "\n", 1) for c in conds], fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower left")
    rows = {"audio": "listen rows encoded whole", "codes": "listen rows spliced from codes"}.get(r.get("listen", "codes"))
    fig.suptitle(f"episodic trigger on held-out streams, {rows} ({r['streams_per_condition']} per condition, "
                 f"{r.get('long_streams_per_condition', 0)} of 8,192 steps); 8,192 steps labelled in "
                 f"{r['label_8192_steps_s']['median']:.2f} s ({r['device']}, {r['threads']} thread(s))", fontsize=10)
    ax2 = axes[2]
    kinds = ["matched", "merged", "split", "shifted", "missed"]
    cols = [(c, n) for c in conds for n in ("trigger", "trigger+split") if n in r["metrics"][c]]
    bottom = np.zeros(len(cols))
    for kind in kinds:
        vals = np.array([r["metrics"][c][n]["errors@5"][kind] for c, n in cols], float)
        ax2.bar(np.arange(len(cols)), vals, 0.7, bottom=bottom, label=kind)
        bottom += vals
    ax2.set_xticks(np.arange(len(cols)), [f"{c}\n{n}" for c, n in cols], fontsize=6, rotation=60, ha="right")
    ax2.set_ylim(0, bottom.max() * 1.15)
    ax2.set_ylabel("gold sessions")
    ax2.set_title("gold sessions at span_match@5\n(merged: one span covers two)", fontsize=9)
    ax2.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
