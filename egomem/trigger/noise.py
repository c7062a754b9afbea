"""Background noises for noised streams, made from what ships (no noise corpus is downloaded).

Six kinds, each returned at unit RMS so the caller sets the SNR:
  - white / pink / brown: coloured noise (`synth.make_noise`);
  - babble: three to six other speakers of the same split talking at once (crops of their speech);
  - music: chords of harmonic tones on a random scale, changing every 0.15-0.8 s, with filtered-noise
    percussion on a 80-160 bpm grid;
  - recorded: what a room microphone adds: coloured noise through a synthetic room impulse response
    (exponential decay, RT60 0.2-0.8 s), mains hum (50 or 60 Hz and harmonics), low handling thumps
    and sparse clicks.
"""

from __future__ import annotations

import numpy as np

RATE = 24_000
KINDS = ("white", "pink", "brown", "babble", "music", "recorded")


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / (np.sqrt(np.mean(x**2)) + 1e-9)).astype(np.float32)


def coloured(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    from egomem.trigger.synth import colour_noise

    return colour_noise(rng, n, ("white", "pink", "brown").index(kind))


def babble(rng: np.random.Generator, n: int, sources: list[np.ndarray]) -> np.ndarray:
    """3-6 random crops of `sources` (speech at 24 kHz) summed, each at its own level."""
    out = np.zeros(n, np.float32)
    for _ in range(int(rng.integers(3, 7))):
        s = sources[int(rng.integers(len(sources)))]
        if len(s) <= n:
            s = np.tile(s, -(-n // max(1, len(s))) + 1)
        a = int(rng.integers(0, len(s) - n + 1))
        out += _unit(s[a:a + n]) * 10 ** rng.uniform(-0.5, 0.0)
    return _unit(out)


def music(rng: np.random.Generator, n: int) -> np.ndarray:
    """Chords of harmonic tones with note changes and percussion: music-like, stationary over seconds."""
    root = rng.uniform(110, 220)
    scale = np.array([0, 2, 4, 5, 7, 9, 11]) if rng.random() < 0.5 else np.array([0, 2, 3, 5, 7, 8, 10])
    out = np.zeros(n, np.float32)
    t = 0
    while t < n:
        d = min(n - t, int(rng.uniform(0.15, 0.8) * RATE))
        tt = np.arange(d) / RATE
        env = np.minimum(1.0, tt / 0.01) * np.exp(-tt * rng.uniform(1.0, 6.0))  # attack then decay
        for _ in range(int(rng.integers(2, 5))):
            step = scale[int(rng.integers(len(scale)))] + 12 * int(rng.integers(0, 2))
            f = root * 2 ** (step / 12)
            tone = sum(np.sin(2 * np.pi * f * k * tt) / k**1.5 for k in range(1, 6))
            out[t:t + d] += (env * tone).astype(np.float32)
        t += d
    beat = int(60 / rng.uniform(80, 160) * RATE)
    for b in range(int(rng.integers(0, beat)), n, beat):
        m = min(n - b, 2400)
        hit = rng.standard_normal(m) * np.exp(-np.arange(m) / rng.uniform(200, 800))
        out[b:b + m] += (hit * rng.uniform(0.3, 1.5)).astype(np.float32)
    return _unit(out)


def recorded(rng: np.random.Generator, n: int) -> np.ndarray:
    """Room tone: reverberant coloured noise, mains hum, handling thumps and clicks."""
    from scipy.signal import fftconvolve

    rt60 = rng.uniform(0.2, 0.8)
    m = int(rt60 * RATE)
    ir = rng.standard_normal(m) * np.exp(-6.9 * np.arange(m) / m)  # -60 dB at rt60
    ir[0] = 1.0
    base = fftconvolve(coloured(rng, n, KINDS[int(rng.integers(3))]), ir)[:n]
    tt = np.arange(n) / RATE
    mains = 50.0 if rng.random() < 0.5 else 60.0
    hum = sum(np.sin(2 * np.pi * mains * k * tt + rng.uniform(0, 6)) / k for k in (1, 2, 3, 5))
    out = _unit(base) + _unit(hum) * 10 ** rng.uniform(-1.5, -0.3)
    for _ in range(int(rng.poisson(n / RATE * 0.3))):  # a thump every ~3 s
        a, d = int(rng.integers(0, n)), int(rng.uniform(0.05, 0.2) * RATE)
        d = min(d, n - a)
        out[a:a + d] += np.sin(np.pi * np.arange(d) / d) * np.sin(2 * np.pi * rng.uniform(20, 80) * np.arange(d) / RATE) * 3
    for _ in range(int(rng.poisson(n / RATE * 1.0))):  # clicks
        a = int(rng.integers(0, n - 24))
        out[a:a + 24] += rng.standard_normal(24) * 4
    return _unit(out)


def background(rng: np.random.Generator, n: int, sources: list[np.ndarray] | None = None,
               kind: str | None = None) -> np.ndarray:
    """One unit-RMS background of `n` samples: `kind`, or one drawn at random (babble only with `sources`)."""
    kinds = KINDS if sources else tuple(k for k in KINDS if k != "babble")
    kind = kind or kinds[int(rng.integers(len(kinds)))]
    if kind in ("white", "pink", "brown"):
        return coloured(rng, n, kind)
    if kind == "babble":
        if not sources:
            raise ValueError("babble noise needs speech sources")
        return babble(rng, n, sources)
    if kind == "music":
        return music(rng, n)
    if kind == "recorded":
        return recorded(rng, n)
    raise ValueError(f"unknown noise kind {kind!r}; allowed: {', '.join(KINDS)}")
