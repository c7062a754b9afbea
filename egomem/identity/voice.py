"""Voice pipeline: PCM (16 kHz, or the stream's 24 kHz resampled here) -> voiced speech -> speaker embedding.

Voice-activity gating (silero-vad) keeps only the speech segments, so silence and noise are never
enrolled or matched: with less than `min_voiced_s` of speech the result has `embedding=None`.

Backends (`IdentityConfig.voice_backend`):
  - "resemblyzer" (offline default): the GE2E LSTM encoder (256-d) with the weights file shipped
    in the Resemblyzer wheel. We run the network ourselves (same layers and partial-utterance
    averaging as `resemblyzer.VoiceEncoder.embed_utterance`) because importing the `resemblyzer`
    package pulls in `webrtcvad`, which imports the removed `pkg_resources`.
  - "wavlm" (the paper's): a local WavLM speaker-verification checkpoint folder (Hugging Face
    `WavLMForXVector` layout: config.json, preprocessor_config.json, weights); `paper` extra.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from math import gcd
from pathlib import Path
from typing import Protocol

import numpy as np

from egomem.config import IdentityConfig
from egomem.identity.errors import InputError, ModelFilesMissing

SAMPLE_RATE = 16000  # every speaker model here runs at 16 kHz
STREAM_RATE = 24000  # Mimi / Moshi stream rate
MIN_SAMPLES_16K = 512  # one silero-vad window (32 ms); shorter input is an error, not "silence"


@dataclass(frozen=True)
class VoiceResult:
    """Embedding of the voiced part of a clip; `embedding` is None when too little speech was heard."""

    embedding: np.ndarray | None  # [D] float32 unit norm
    voiced_s: float  # seconds of speech found by the VAD
    voiced_ratio: float  # voiced_s / clip duration

    @property
    def voiced(self) -> bool:
        return self.embedding is not None


class SpeakerEncoder(Protocol):
    model_id: str
    dim: int
    threshold: float  # accept when the (s-normed) score is above it

    def encode(self, pcm: np.ndarray, sample_rate: int) -> VoiceResult: ...


def validate_pcm(pcm: object, sample_rate: int, max_s: float) -> np.ndarray:
    """Return mono float32 PCM, or raise `InputError` naming the problem."""
    if not isinstance(pcm, np.ndarray):
        raise InputError(f"audio must be a numpy float32 array [T], got {type(pcm).__name__}")
    if pcm.dtype != np.float32:
        raise InputError(f"audio dtype must be float32 PCM in [-1, 1], got {pcm.dtype}")
    if pcm.ndim != 1:
        raise InputError(f"audio must be mono, shape [T]; got {list(pcm.shape)}")
    if sample_rate not in (SAMPLE_RATE, STREAM_RATE):
        raise InputError(f"sample rate must be {SAMPLE_RATE} or {STREAM_RATE} Hz, got {sample_rate}")
    need = MIN_SAMPLES_16K * sample_rate // SAMPLE_RATE
    if pcm.shape[0] < need:
        raise InputError(f"audio has {pcm.shape[0]} samples; need at least {need} ({need / sample_rate * 1000:.0f} ms)")
    if pcm.shape[0] > max_s * sample_rate:
        raise InputError(f"audio is {pcm.shape[0] / sample_rate:.1f} s; the limit is {max_s:.0f} s (identity.max_audio_s)")
    if not np.isfinite(pcm).all():
        raise InputError("audio contains NaN or Inf samples")
    return pcm


def to_16k(pcm: np.ndarray, sample_rate: int) -> np.ndarray:
    """Polyphase resampling to 16 kHz (24 kHz -> 16 kHz is up 2, down 3)."""
    if sample_rate == SAMPLE_RATE:
        return pcm
    from scipy.signal import resample_poly

    g = gcd(SAMPLE_RATE, sample_rate)
    return resample_poly(pcm, SAMPLE_RATE // g, sample_rate // g).astype(np.float32)


class VoiceActivity:
    """silero-vad (weights in the silero-vad wheel): which samples of 16 kHz PCM are speech."""

    def __init__(self, threshold: float = 0.5) -> None:
        from silero_vad import get_speech_timestamps, load_silero_vad

        self._model = load_silero_vad()
        self._timestamps = get_speech_timestamps
        self.threshold = float(threshold)

    def speech(self, pcm16k: np.ndarray) -> np.ndarray:
        """The concatenated speech segments of `pcm16k` (possibly empty)."""
        import torch

        segs = self._timestamps(torch.from_numpy(pcm16k), self._model, threshold=self.threshold,
                                sampling_rate=SAMPLE_RATE)
        if not segs:
            return np.zeros(0, np.float32)
        return np.concatenate([pcm16k[s["start"]:s["end"]] for s in segs])


class _GatedEncoder:
    """Shared flow: validate -> 16 kHz -> VAD -> embed the speech, if there is enough of it."""

    model_id: str
    dim: int
    threshold: float

    def __init__(self, vad: VoiceActivity, min_voiced_s: float, max_audio_s: float) -> None:
        self.vad = vad
        self.min_voiced_s = float(min_voiced_s)
        self.max_audio_s = float(max_audio_s)

    def encode(self, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE) -> VoiceResult:
        pcm = to_16k(validate_pcm(pcm, sample_rate, self.max_audio_s), sample_rate)
        speech = self.vad.speech(pcm)
        voiced_s = speech.shape[0] / SAMPLE_RATE
        ratio = voiced_s / (pcm.shape[0] / SAMPLE_RATE)
        if voiced_s < self.min_voiced_s:
            return VoiceResult(None, voiced_s, ratio)
        return VoiceResult(self.embed_speech(speech), voiced_s, ratio)

    def embed_speech(self, speech: np.ndarray) -> np.ndarray:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# Resemblyzer GE2E


def resemblyzer_weights() -> Path:
    """`pretrained.pt` inside the installed Resemblyzer wheel (located without importing the package)."""
    spec = importlib.util.find_spec("resemblyzer")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFilesMissing("package Resemblyzer is not installed; `pip install resemblyzer==0.1.4`")
    path = Path(list(spec.submodule_search_locations)[0]) / "pretrained.pt"
    if not path.is_file():
        raise ModelFilesMissing(f"Resemblyzer weights {path} are missing; reinstall resemblyzer==0.1.4")
    return path


class ResemblyzerEncoder(_GatedEncoder):
    """GE2E: 40-band mel (25 ms / 10 ms) -> 3-layer LSTM(256) -> linear -> ReLU -> L2 norm, averaged
    over 1.6 s partial utterances taken 1.3 times a second (Resemblyzer's `embed_utterance`)."""

    model_id = "resemblyzer_ge2e"
    dim = 256
    PARTIAL_FRAMES = 160  # 1.6 s of 10 ms mel frames
    HOP = 160  # 10 ms at 16 kHz
    RATE = 1.3  # partials per second
    MIN_COVERAGE = 0.75  # keep a zero-padded last partial when it is at least this full

    def __init__(self, threshold: float, vad: VoiceActivity, min_voiced_s: float = 1.0, max_audio_s: float = 60.0,
                 weights: Path | None = None) -> None:
        super().__init__(vad, min_voiced_s, max_audio_s)
        import torch

        self.threshold = float(threshold)
        self._torch = torch
        self.lstm = torch.nn.LSTM(40, 256, 3, batch_first=True)
        self.linear = torch.nn.Linear(256, 256)
        state = torch.load(weights or resemblyzer_weights(), map_location="cpu", weights_only=False)["model_state"]
        own = {f"lstm.{k}": v for k, v in self.lstm.state_dict().items()} | {f"linear.{k}": v for k, v in self.linear.state_dict().items()}
        for k in own:  # assert every key and shape: no silent strict=False
            if k not in state or state[k].shape != own[k].shape:
                raise ModelFilesMissing(f"Resemblyzer weights lack {k} {tuple(own[k].shape)}: wrong file?")
        self.lstm.load_state_dict({k[5:]: state[k] for k in own if k.startswith("lstm.")})
        self.linear.load_state_dict({k[7:]: state[k] for k in own if k.startswith("linear.")})
        self.lstm.eval()

    def embed_speech(self, speech: np.ndarray) -> np.ndarray:
        import librosa

        wav = _normalize_volume(speech, target_dbfs=-30.0)
        n_frames = int(np.ceil((len(wav) + 1) / self.HOP))
        step = int(np.round(SAMPLE_RATE / self.RATE / self.HOP))
        starts = list(range(0, max(1, n_frames - self.PARTIAL_FRAMES + step + 1), step))
        coverage = (len(wav) - starts[-1] * self.HOP) / (self.PARTIAL_FRAMES * self.HOP)
        if coverage < self.MIN_COVERAGE and len(starts) > 1:
            starts = starts[:-1]
        end = (starts[-1] + self.PARTIAL_FRAMES) * self.HOP
        wav = np.pad(wav, (0, max(0, end - len(wav))))
        mel = librosa.feature.melspectrogram(y=wav, sr=SAMPLE_RATE, n_fft=400, hop_length=self.HOP, n_mels=40)
        mel = mel.astype(np.float32).T  # [frames, 40]
        mels = np.stack([mel[s:s + self.PARTIAL_FRAMES] for s in starts])  # [P, 160, 40]
        torch = self._torch
        with torch.inference_mode():
            _, (hidden, _) = self.lstm(torch.from_numpy(mels))  # hidden: [layers, P, 256]
            e = torch.relu(self.linear(hidden[-1]))
            e = e / e.norm(dim=1, keepdim=True).clamp_min(1e-12)  # [P, 256]
        raw = e.mean(0).numpy()
        return (raw / max(np.linalg.norm(raw), 1e-12)).astype(np.float32)


def _normalize_volume(wav: np.ndarray, target_dbfs: float) -> np.ndarray:
    """Raise quiet speech to `target_dbfs` (never lower it), as Resemblyzer's preprocessing does."""
    rms = np.sqrt(np.mean(wav.astype(np.float64) ** 2))
    change_db = target_dbfs - 20 * np.log10(max(rms, 1e-10))
    if change_db < 0:
        return wav
    return (wav * (10 ** (change_db / 20))).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# WavLM (paper)

WAVLM_FILES = ("config.json", "preprocessor_config.json")


class WavLMEncoder(_GatedEncoder):
    """WavLM speaker verification (x-vector head) from a local Hugging Face folder; never from a hub."""

    model_id = "wavlm_sv"

    def __init__(self, checkpoint: Path | None, threshold: float, vad: VoiceActivity, min_voiced_s: float = 1.0,
                 max_audio_s: float = 60.0) -> None:
        super().__init__(vad, min_voiced_s, max_audio_s)
        if checkpoint is None:
            raise ModelFilesMissing(
                "identity.voice_backend = 'wavlm' needs identity.wavlm_checkpoint: a local folder with "
                f"{', '.join(WAVLM_FILES)} and model.safetensors (WavLMForXVector)"
            )
        ck = Path(checkpoint)
        missing = [str(ck / f) for f in WAVLM_FILES if not (ck / f).is_file()]
        if not any((ck / w).is_file() for w in ("model.safetensors", "pytorch_model.bin")):
            missing.append(str(ck / "model.safetensors"))
        if missing:
            raise ModelFilesMissing(f"WavLM checkpoint files missing: {', '.join(missing)} (we never download)")
        from transformers import AutoFeatureExtractor, WavLMForXVector

        self._fe = AutoFeatureExtractor.from_pretrained(ck, local_files_only=True)
        self._model = WavLMForXVector.from_pretrained(ck, local_files_only=True).eval()
        self.dim = int(self._model.config.xvector_output_dim)
        self.threshold = float(threshold)

    def embed_speech(self, speech: np.ndarray) -> np.ndarray:
        import torch

        inputs = self._fe(speech, sampling_rate=SAMPLE_RATE, return_tensors="pt")
        with torch.inference_mode():
            e = self._model(**inputs).embeddings[0].numpy()
        return (e / max(np.linalg.norm(e), 1e-12)).astype(np.float32)


def build_speaker_encoder(cfg: IdentityConfig, vad: VoiceActivity | None = None) -> SpeakerEncoder:
    """The configured voice backend, with its threshold and VAD settings from config."""
    vad = vad or VoiceActivity(cfg.vad_threshold)
    if cfg.voice_backend == "resemblyzer":
        return ResemblyzerEncoder(cfg.voice_threshold_resemblyzer, vad, cfg.min_voiced_s, cfg.max_audio_s)
    return WavLMEncoder(cfg.wavlm_checkpoint, cfg.voice_threshold_wavlm, vad, cfg.min_voiced_s, cfg.max_audio_s)
