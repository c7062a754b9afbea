"""Offline text-to-speech for the training corpus: eSpeak NG from the `espeakng-loader` wheel.

The wheel bundles `libespeak-ng` and its voice data, so nothing is downloaded at run time. eSpeak
is a process-global C library (one synthesiser, one callback): every call holds `_LOCK`, and each
utterance runs in a freshly loaded library so it is deterministic (`_Espeak`). It speaks at 22,050 Hz; `synthesize` resamples to
Mimi's 24 kHz (polyphase, 160/147) and returns float32 in [-1, 1].

Voices are an eSpeak voice file plus an optional variant (`en-us+f3`), a pitch (0-100, eSpeak's
default 50) and a rate (words per minute, default 175). `TRAIN_VOICES` and `HELDOUT_VOICES` share
no accent and no variant, so held-out streams are spoken by voices never heard in training;
`MODEL_VOICE` is the model's own voice (the speak channel), in neither list.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_RATE = 24_000
_ESPEAK_RATE = 22_050  # what espeak_Initialize reports for AUDIO_OUTPUT_SYNCHRONOUS
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_CHARS_UTF8 = 1
_POS_CHARACTER = 1
_PARAM_RATE, _PARAM_PITCH = 1, 3


@dataclass(frozen=True)
class Voice:
    """An eSpeak NG voice: `name` is a voice file (`en-us`, `en` = British) with an optional `+variant`."""

    name: str
    pitch: int = 50  # 0-100
    rate: int = 175  # words per minute, 80-450

    def __str__(self) -> str:
        return f"{self.name}@p{self.pitch}r{self.rate}"


# Users in training: 5 accents x male and female variants (12), each at 4 pitches x 4 rates: 192 voices.
# The pitch/rate grid is what lets a listener generalise to voices it never heard: a probe that tells
# the Level-1 question kinds apart from the trained tiny codec's codes scores 0.86 on the held-out voices
# when trained on these 192, 0.44 when trained on the 12 at two settings each (bench/diag_hear_question.py,
# docs/training.md "Voices"). Variants with breath noise (f2, f3, f5, ...) or the klatt synthesiser are
# left out: eSpeak NG does not synthesise them reproducibly (`_Espeak.speak` refuses them).
TRAIN_PITCHES, TRAIN_RATES = (30, 45, 60, 75), (140, 165, 190, 215)
TRAIN_VOICES: tuple[Voice, ...] = tuple(
    Voice(f"{accent}+{variant}", pitch, rate)
    for accent, variants in (("en-us", ("m1", "f1", "m3")), ("en", ("m2", "Annie", "m7")),
                             ("en-gb-scotland", ("m1", "linda")), ("en-029", ("m3", "f1")),
                             ("en-gb-x-rp", ("m2", "steph")))
    for variant in variants
    for pitch in TRAIN_PITCHES
    for rate in TRAIN_RATES
)
# Held-out users: other accents and other variants (none of the above).
HELDOUT_VOICES: tuple[Voice, ...] = tuple(
    Voice(f"{accent}+{variant}", 45, 170)
    for accent, variants in (("en-us-nyc", ("m4", "f4")), ("en-gb-x-gbclan", ("m5", "belinda")),
                             ("en-gb-x-gbcwmd", ("m6", "aunty")))
    for variant in variants
)
MODEL_VOICE = Voice("en-us+anika", 50, 175)  # the model's own voice: neither a training nor a held-out user's


def voice_for(user_id: str, split: str) -> Voice:
    """A user's voice, fixed by their id (stable across processes and builds) within their split's list."""
    voices = TRAIN_VOICES if split == "train" else HELDOUT_VOICES
    h = int.from_bytes(hashlib.sha256(user_id.encode()).digest()[:8], "big")
    return voices[h % len(voices)]


class TTSError(RuntimeError):
    """eSpeak NG is missing, or a voice is not in its data."""


_LOCK = threading.Lock()
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


class _Espeak:
    """eSpeak NG, loaded fresh for every utterance (use under `_LOCK`).

    The library keeps synthesis state in C statics that survive `espeak_Terminate` (a line's
    samples depend on every line spoken before it in the process), so each utterance loads the
    library, speaks, and unloads it again: the same line and voice then give the same samples in
    any order and any process. Costs ~10 ms and ~3 KB of unreturned memory per utterance.
    """

    def __init__(self) -> None:
        try:
            import espeakng_loader
        except ImportError as e:
            raise TTSError("the offline TTS needs the `espeakng-loader` wheel (eSpeak NG library and voice data): "
                           "pip install espeakng-loader") from e
        self.data = Path(espeakng_loader.get_data_path())
        self.library = espeakng_loader.get_library_path()
        self.variants = {p.name: p for p in (self.data / "voices" / "!v").iterdir()}
        self.chunks: list[np.ndarray] = []
        self._cb = _CALLBACK(self._collect)  # keep a reference: the C library calls it

    def _collect(self, wav, n: int, _events) -> int:
        if n > 0 and wav:
            self.chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0  # 0 = go on

    def _load(self) -> ctypes.CDLL:
        try:
            lib = ctypes.CDLL(self.library)
        except OSError as e:
            raise TTSError(f"cannot load eSpeak NG from the espeakng-loader wheel ({e}); reinstall espeakng-loader") from e
        lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                     ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, str(self.data).encode(), 0)
        if rate != _ESPEAK_RATE:
            raise TTSError(f"eSpeak NG failed to initialise from {self.data} (returned {rate}); "
                           f"reinstall espeakng-loader")
        lib.espeak_SetSynthCallback(self._cb)
        return lib

    def speak(self, text: str, voice: Voice) -> np.ndarray:
        base, _, variant = voice.name.partition("+")
        if variant and variant not in self.variants:  # eSpeak silently ignores an unknown variant
            raise TTSError(f"eSpeak NG has no voice variant {variant!r} (voice {voice.name!r}); "
                           f"choose one of {sorted(self.variants)[:12]}...")
        if variant and _noisy_variant(self.variants[variant]):
            raise TTSError(f"voice variant {variant!r} uses breath noise or the klatt synthesiser, which eSpeak NG "
                           f"does not synthesise reproducibly; choose another (e.g. f1, f4, m1-m8)")
        lib = self._load()
        try:
            if lib.espeak_SetVoiceByName(voice.name.encode()) != 0:
                raise TTSError(f"eSpeak NG has no voice {base!r} (voice {voice.name!r}); use a voice file name "
                               f"such as 'en-us', 'en' (British), 'en-gb-scotland', 'en-029'")
            lib.espeak_SetParameter(_PARAM_RATE, int(voice.rate), 0)
            lib.espeak_SetParameter(_PARAM_PITCH, int(voice.pitch), 0)
            data = text.encode("utf-8")
            self.chunks = []
            err = lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
            lib.espeak_Synchronize()
            if err != 0:
                raise TTSError(f"eSpeak NG failed to speak {text[:40]!r} (error {err})")
            pcm = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int16)
        finally:
            self.chunks = []
            lib.espeak_Terminate()
            _unload(lib)
        return pcm


def _noisy_variant(path: Path) -> bool:
    words = [line.split()[0] for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return any(w.startswith(("breath", "klatt")) for w in words)


def _unload(lib: ctypes.CDLL) -> None:
    import _ctypes

    handle = lib._handle
    del lib
    _ctypes.dlclose(handle)


_ENGINE: _Espeak | None = None


def _engine() -> _Espeak:
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = _Espeak()
    return _ENGINE


def synthesize(text: str, voice: Voice) -> np.ndarray:
    """`text` spoken by `voice` -> 24 kHz mono float32 in [-1, 1] (empty for empty text)."""
    from scipy.signal import resample_poly

    if not text.strip():
        return np.zeros(0, np.float32)
    with _LOCK:
        pcm = _engine().speak(text, voice)
    x = resample_poly(pcm.astype(np.float32) / 32768.0, SAMPLE_RATE // 150, _ESPEAK_RATE // 150)  # 160 / 147
    return np.clip(x, -1.0, 1.0).astype(np.float32)


class TTSCache:
    """`synthesize` with a bounded LRU cache per (text, voice): one build re-speaks the same lines often
    (greetings, a stream's noised copy). Callers must not modify the arrays it returns."""

    def __init__(self, max_items: int = 256):
        self.max_items = max_items
        self._items: OrderedDict[tuple[str, Voice], np.ndarray] = OrderedDict()
        self.hits = self.misses = 0

    def __call__(self, text: str, voice: Voice) -> np.ndarray:
        key = (text, voice)
        if key in self._items:
            self.hits += 1
            self._items.move_to_end(key)
            return self._items[key]
        self.misses += 1
        x = synthesize(text, voice)
        self._items[key] = x
        if len(self._items) > self.max_items:
            self._items.popitem(last=False)
        return x
