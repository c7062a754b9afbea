"""Speech recognisers for the user's (listen-channel) audio of a memory session.

One small interface, `Recogniser.recognise(audio [S] float32, sample_rate) -> str`, and one class
per backend (config `[asr] backend`):

- `pocketsphinx` (offline default): CMU PocketSphinx 5 with the US-English acoustic model,
  pronouncing dictionary and 3-gram language model that ship inside its PyPI wheel. The audio is
  resampled to 16 kHz (polyphase, anti-aliased), cut at pauses by PocketSphinx's own voice-activity
  endpointer, and each speech segment is decoded on its own (bounded memory for long sessions).
- `openai`: any OpenAI-compatible `/audio/transcriptions` endpoint (16 kHz 16-bit WAV upload).
- `whisper`: a Whisper-family model from a local folder (`asr.whisper_path`): a CTranslate2
  folder (`model.bin`, run by `faster-whisper`) or a transformers folder (`config.json` of
  model_type "whisper" + weights). Nothing is ever downloaded: a missing folder or file is an error
  naming it.
- `none`: no recogniser (`make_recogniser` returns None).

Input rules, the same for every backend (`check_audio`): mono float PCM in [-1, 1] (louder samples
are clipped), a sample rate of 8-192 kHz (else `AsrInputError`), NaN/inf samples are an
`AsrInputError`; empty audio gives "" without calling the backend. A backend that cannot be reached
(endpoint down) raises `AsrUnavailable`, so the memory job fails and the queue retries it later.
"""

from __future__ import annotations

import io
import os
import re
import threading
from math import gcd
from pathlib import Path
from typing import Any, Protocol

import numpy as np

ASR_RATE = 16000  # every backend here is trained on 16 kHz speech
MIN_RATE, MAX_RATE = 8000, 192000


class AsrError(RuntimeError):
    """Base of the recogniser errors; the message says what to do."""


class AsrInputError(AsrError, ValueError):
    """The audio itself cannot be recognised (bad rate, shape, dtype, NaN): retrying will not help."""


class AsrUnavailable(AsrError):
    """The recogniser cannot run now (endpoint down, model missing): fix the setup or retry later."""


class Recogniser(Protocol):
    name: str  # goes into Transcript.source as 'asr:<name>'

    def recognise(self, audio: np.ndarray, sample_rate: int) -> str:
        """The words said in `audio` [S] float32 at `sample_rate`; "" for silence or empty audio."""
        ...


def check_audio(audio: Any, sample_rate: Any) -> np.ndarray:
    """Validate and return audio as float32 [S] clipped to [-1, 1]; raises AsrInputError saying why."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or not (
            MIN_RATE <= int(sample_rate) <= MAX_RATE):
        raise AsrInputError(f"sample rate {sample_rate!r}: expected an integer number of Hz between {MIN_RATE} "
                            f"and {MAX_RATE} (the memory jobs record 24000)")
    x = np.asarray(audio)
    if x.ndim == 2 and 1 in x.shape:
        x = x.reshape(-1)  # [1, S] or [S, 1] -> [S]
    if x.ndim != 1:
        raise AsrInputError(f"audio of shape {x.shape}: expected mono samples [S]")
    if x.size and not np.issubdtype(x.dtype, np.floating):
        raise AsrInputError(f"audio of dtype {x.dtype}: expected float PCM in [-1, 1] (divide int16 by 32768)")
    x = x.astype(np.float32, copy=False)
    if x.size and not np.isfinite(x).all():
        bad = int((~np.isfinite(x)).sum())
        raise AsrInputError(f"audio has {bad} NaN/inf samples of {x.size}: nothing to recognise")
    return np.clip(x, -1.0, 1.0)


def resample(x: np.ndarray, rate: int, target: int = ASR_RATE) -> np.ndarray:
    """Polyphase resampling with scipy's Kaiser-windowed anti-aliasing filter (24 kHz -> 16 kHz: up 2, down 3)."""
    if rate == target:
        return x
    from scipy.signal import resample_poly

    g = gcd(int(rate), int(target))
    return resample_poly(x, target // g, int(rate) // g).astype(np.float32)


def to_int16(x: np.ndarray) -> np.ndarray:
    return (np.clip(x, -1.0, 1.0) * 32767.0).round().astype(np.int16)


def _sentence_case(text: str) -> str:
    """PocketSphinx's dictionary is lower case: write the pronoun 'I' (and I'm, I've, ...) as English does."""
    return re.sub(r"\bi(?=\b|')", "I", text)


# ------------------------------------------------------------------------------------------------
# backends


def speech_regions(pcm: bytes, max_s: float = 60.0) -> list[tuple[float, float, bytes]]:
    """(start_s, end_s, pcm) of each speech region of 16 kHz int16 `pcm`, by PocketSphinx's endpointer.

    Unlike `pocketsphinx.segmenter.Segmenter`, speech still going on when the audio ends is kept
    (Segmenter drops it when the length is a whole number of frames), and a region is cut after
    `max_s` so a long monologue decodes in bounded memory."""
    from pocketsphinx import Endpointer

    ep = Endpointer(sample_rate=ASR_RATE)
    fb, limit, to_s = ep.frame_bytes, int(max_s * ASR_RATE * 2), 1.0 / (2 * ASR_RATE)
    out: list[tuple[float, float, bytes]] = []
    cur: list[bytes] = []
    size, start = 0, 0.0

    for i in range(0, len(pcm), fb):
        frame = pcm[i:i + fb]
        if len(frame) < fb:
            speech = ep.end_stream(frame) if ep.in_speech else None
        else:
            speech = ep.process(frame)
        if speech is None:
            continue
        if not cur:  # a new region, or the rest of one cut at max_s
            start = float(ep.speech_start) if not out or out[-1][1] < ep.speech_start else out[-1][1]
        cur.append(speech)
        size += len(speech)
        if not ep.in_speech or size >= limit:
            end = float(ep.speech_end) if not ep.in_speech else start + size * to_s
            out.append((start, end, b"".join(cur)))
            cur, size = [], 0
    if ep.in_speech:  # the audio ended on a frame boundary inside speech: close it with a frame of silence
        rest = ep.end_stream(bytes(fb))
        if rest:
            cur.append(rest)
            size += len(rest)
    if cur:
        out.append((start, len(pcm) * to_s, b"".join(cur)))
    return out


class PocketSphinxRecogniser:
    """Offline, CPU, English: the model inside the `pocketsphinx` wheel (no path, no download)."""

    name = "pocketsphinx"

    def __init__(self, language: str = "en") -> None:
        if not language.lower().startswith("en"):
            raise AsrUnavailable(f"asr.language = {language!r}: the pocketsphinx wheel ships US English only; "
                                 "use asr.backend = 'whisper' with a local multilingual model, or 'openai'")
        try:
            from pocketsphinx import Decoder, get_model_path
        except ImportError as e:
            raise AsrUnavailable("asr.backend = 'pocketsphinx' but the pocketsphinx package is not installed: "
                                 "pip install pocketsphinx (the project's dependencies include it)") from e
        model = Path(get_model_path())
        for f in ("en-us/en-us/mdef", "en-us/en-us.lm.bin", "en-us/cmudict-en-us.dict"):
            if not (model / f).exists():
                raise AsrUnavailable(f"the pocketsphinx wheel lacks its model file {model / f}: reinstall pocketsphinx")
        self.model_dir = model
        self._decoder = Decoder(samprate=ASR_RATE, loglevel="FATAL")  # default config = the wheel's en-us model
        self._lock = threading.Lock()  # one decoder, one utterance at a time

    def segments(self, audio: np.ndarray, sample_rate: int) -> list[tuple[float, float, str]]:
        """(start_s, end_s, text) per speech segment found by PocketSphinx's endpointer."""
        x = check_audio(audio, sample_rate)
        if x.size == 0:
            return []
        out = []
        for start, end, pcm in speech_regions(to_int16(resample(x, int(sample_rate))).tobytes()):
            with self._lock:
                self._decoder.start_utt()
                self._decoder.process_raw(pcm, full_utt=True)
                self._decoder.end_utt()
                hyp = self._decoder.hyp()
            text = _sentence_case(hyp.hypstr.strip()) if hyp is not None else ""
            if text:
                out.append((start, end, text))
        return out

    def recognise(self, audio: np.ndarray, sample_rate: int) -> str:
        return " ".join(t for _, _, t in self.segments(audio, sample_rate))


class OpenAIRecogniser:
    """Any OpenAI-compatible `/audio/transcriptions` endpoint (OpenAI, a local whisper.cpp / vLLM server...)."""

    def __init__(self, asr_cfg: Any, llm_cfg: Any | None = None, api_key: str | None = None) -> None:
        if not asr_cfg.base_url:
            raise AsrUnavailable("asr.backend = 'openai' needs asr.base_url, e.g. 'https://api.openai.com/v1'")
        import openai

        env = asr_cfg.api_key_env or (llm_cfg.api_key_env if llm_cfg is not None else None)
        key = api_key if api_key is not None else (os.environ.get(env, "") if env else "")
        self.base_url, self.model, self.language = asr_cfg.base_url, asr_cfg.model, asr_cfg.language
        self.name = asr_cfg.model
        self._client = openai.OpenAI(base_url=asr_cfg.base_url, api_key=key or "none", timeout=asr_cfg.timeout_s,
                                     max_retries=max(0, asr_cfg.max_attempts - 1))

    def recognise(self, audio: np.ndarray, sample_rate: int) -> str:
        import openai
        import soundfile as sf

        x = check_audio(audio, sample_rate)
        if x.size == 0:
            return ""
        buf = io.BytesIO()
        sf.write(buf, resample(x, int(sample_rate)), ASR_RATE, format="WAV", subtype="PCM_16")
        try:
            r = self._client.audio.transcriptions.create(model=self.model, file=("session.wav", buf.getvalue()),
                                                         language=self.language)
        except openai.APIConnectionError as e:  # includes timeouts
            raise AsrUnavailable(f"transcription endpoint {self.base_url} unreachable ({e}); check asr.base_url, "
                                 "or use asr.backend = 'pocketsphinx' (offline)") from e
        except openai.APIStatusError as e:
            raise AsrUnavailable(f"transcription endpoint {self.base_url} answered HTTP {e.status_code}: "
                                 f"{e.message}; check asr.model and the API key "
                                 "(asr.api_key_env, else llm.api_key_env)") from e
        return (r.text or "").strip()


_CT2_FILES = ("model.bin", "config.json")
_HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")


class WhisperRecogniser:
    """A Whisper-family model from a local folder: CTranslate2 (faster-whisper) or transformers."""

    window_s = 30.0  # Whisper's encoder sees 30 s; longer sessions are decoded window by window

    def __init__(self, path: Path | str | None, language: str = "en", device: str = "cpu") -> None:
        if path is None:
            raise AsrUnavailable("asr.backend = 'whisper' needs asr.whisper_path: a local folder holding a "
                                 "faster-whisper (CTranslate2: model.bin) or transformers Whisper model; "
                                 "nothing is downloaded")
        p = Path(path).expanduser()
        if not p.is_dir():
            raise AsrUnavailable(f"asr.whisper_path {p} does not exist or is not a folder: put a Whisper model "
                                 "folder there (faster-whisper CTranslate2 or transformers); nothing is downloaded")
        self.path, self.language, self.name = p, language, f"whisper:{p.name}"
        if (p / "model.bin").exists():
            self.kind = "ctranslate2"
            missing = [f for f in _CT2_FILES if not (p / f).exists()]
            if not (p / "tokenizer.json").exists() and not list(p.glob("vocabulary.*")):
                missing.append("tokenizer.json")
            if missing:
                raise AsrUnavailable(f"asr.whisper_path {p}: CTranslate2 Whisper folder without "
                                     f"{', '.join(str(p / f) for f in missing)}")
            try:
                from faster_whisper import WhisperModel
            except ImportError as e:
                raise AsrUnavailable(f"asr.whisper_path {p} is a CTranslate2 model: pip install faster-whisper") from e
            self._ct2 = WhisperModel(str(p), device=device, compute_type="int8" if device == "cpu" else "default",
                                     local_files_only=True)
        elif (p / "config.json").exists():
            self.kind = "transformers"
            missing = [str(p / "model.safetensors")] if not any((p / w).exists() for w in _HF_WEIGHTS) else []
            missing += [str(p / f) for f in ("preprocessor_config.json",) if not (p / f).exists()]
            if not (p / "tokenizer.json").exists() and not (p / "vocab.json").exists():
                missing.append(str(p / "tokenizer.json"))
            if missing:
                raise AsrUnavailable(f"asr.whisper_path {p}: transformers Whisper folder without {', '.join(missing)}")
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from transformers import WhisperForConditionalGeneration, WhisperProcessor

            self._proc = WhisperProcessor.from_pretrained(str(p), local_files_only=True)
            self._hf = WhisperForConditionalGeneration.from_pretrained(str(p), local_files_only=True).to(device).eval()
            self._device = device
            multilingual = getattr(self._hf.generation_config, "is_multilingual", False)  # *.en models take no language
            self._lang = {"language": language, "task": "transcribe"} if multilingual else {}
        else:
            raise AsrUnavailable(f"asr.whisper_path {p} holds neither {p / 'model.bin'} (CTranslate2 / faster-whisper) "
                                 f"nor {p / 'config.json'} (transformers Whisper)")

    def recognise(self, audio: np.ndarray, sample_rate: int) -> str:
        x = check_audio(audio, sample_rate)
        if x.size == 0:
            return ""
        x = resample(x, int(sample_rate))
        if self.kind == "ctranslate2":
            segs, _ = self._ct2.transcribe(x, language=self.language, beam_size=5)
            return " ".join(s.text.strip() for s in segs if s.text.strip())
        import torch

        n, out = int(self.window_s * ASR_RATE), []
        for a in range(0, x.size, n):
            feats = self._proc(x[a:a + n], sampling_rate=ASR_RATE,
                               return_tensors="pt").input_features  # [1, n_mels, 3000]
            with torch.inference_mode():
                ids = self._hf.generate(feats.to(self._device), **self._lang)
            text = self._proc.batch_decode(ids, skip_special_tokens=True)[0].strip()
            if text:
                out.append(text)
        return " ".join(out)


def make_recogniser(asr_cfg: Any, llm_cfg: Any | None = None) -> Recogniser | None:
    """The configured backend, or None for `backend = "none"`. Errors name what to fix."""
    backend = asr_cfg.backend
    if backend == "none":
        return None
    if backend == "pocketsphinx":
        return PocketSphinxRecogniser(asr_cfg.language)
    if backend == "openai":
        return OpenAIRecogniser(asr_cfg, llm_cfg)
    if backend == "whisper":
        return WhisperRecogniser(asr_cfg.whisper_path, asr_cfg.language)
    raise AsrUnavailable(f"asr.backend = {backend!r}: expected 'pocketsphinx', 'openai', 'whisper' or 'none'")


def describe(asr_cfg: Any) -> str:
    """One line for logs and `egomem doctor`: which recogniser the memory worker runs."""
    b = asr_cfg.backend
    if b == "pocketsphinx":
        return "pocketsphinx (offline, en-us model inside the wheel)"
    if b == "openai":
        return f"OpenAI-compatible endpoint {asr_cfg.base_url} (model {asr_cfg.model})"
    if b == "whisper":
        return f"local Whisper model at {asr_cfg.whisper_path}"
    return "none: the user's words come only from the client's transcript lines"


# ------------------------------------------------------------------------------------------------
# scoring (tests and bench/bench_asr.py)

_SPOKEN = {"mr": "mister", "mrs": "missus", "dr": "doctor", "st": "saint"}  # LibriSpeech spells these out


def normalise(text: str) -> list[str]:
    """Words for WER: lower case, punctuation dropped (apostrophes inside words kept), Mr -> mister."""
    words = re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()
    return [_SPOKEN.get(w, w) for w in (w.strip("'") for w in words) if w]


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(substitutions + deletions + insertions, reference words): Levenshtein over normalised words."""
    ref, hyp = normalise(reference), normalise(hypothesis)
    d = list(range(len(hyp) + 1))  # d[j] = edits between ref[:i] and hyp[:j]
    for i in range(1, len(ref) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(hyp) + 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (ref[i - 1] != hyp[j - 1]))
    return d[len(hyp)], len(ref)
