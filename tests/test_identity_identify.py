"""Enrol-then-identify with real face and voice embeddings; unknown people are rejected; decision rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from egomem.config import IdentityConfig
from egomem.identity.face import build_face_encoder
from egomem.identity.identify import Identifier
from egomem.identity.index import KeyRecord, UserKeyIndex
from egomem.identity.snorm import AdaptiveSNorm
from egomem.identity.voice import build_speaker_encoder

DATA = Path(__file__).parent / "data" / "identity"


@pytest.fixture(scope="module")
def faces() -> dict[str, np.ndarray]:
    enc = build_face_encoder(IdentityConfig())
    out = {}
    for n in ["img1", "img2", "img3", "img12", "img8"]:
        r = enc.encode(np.asarray(Image.open(DATA / f"{n}.jpg").convert("RGB")))
        out[n] = r.embeddings[r.speaker]
    return out


@pytest.fixture(scope="module")
def voices() -> dict[str, np.ndarray]:
    enc = build_speaker_encoder(IdentityConfig())
    out = {}
    for f in sorted(DATA.glob("*.flac")):
        pcm, sr = sf.read(f, dtype="float32")
        out[f.stem] = enc.encode(pcm, sr).embedding
    return out


@pytest.fixture()
def ident(faces, voices) -> Identifier:
    """ann: face img1 + voice 1998; ben: face img3 + voice 2033; cy: voice 2414 only."""
    idt = Identifier.from_config(IdentityConfig())
    idt.enrol_face("ann", faces["img1"])
    idt.enrol_voice("ann", voices["1998-15444-0007"])
    idt.enrol_face("ben", faces["img3"])
    idt.enrol_voice("ben", voices["2033-164914-0004"])
    idt.enrol_voice("cy", voices["2414-128291-0003"])
    return idt


def test_face_identifies_enrolled_and_rejects_unknown(ident: Identifier, faces) -> None:
    r = ident.identify(faces["img2"][None])
    assert (r.user_id, r.decided_by) == ("ann", "face") and r.face_distance < ident.face_threshold
    assert ident.identify(faces["img12"][None]).user_id == "ben"
    r = ident.identify(faces["img8"][None])  # never enrolled
    assert r.user_id is None and r.decided_by == "none" and r.face_distance >= ident.face_threshold


def test_voice_identifies_enrolled_and_rejects_unknown(ident: Identifier, voices) -> None:
    for utt, user in [("1998-15444-0008", "ann"), ("2033-164914-0005", "ben"), ("2414-128291-0009", "cy")]:
        r = ident.identify(voice_vec=voices[utt])
        assert (r.user_id, r.decided_by) == (user, "voice"), r
        assert r.voice_score > ident.voice_threshold
    r = ident.identify(voice_vec=voices["2609-156975-0003"])  # never enrolled
    assert r.user_id is None and r.voice_score <= ident.voice_threshold


def test_voice_score_is_snormed(ident: Identifier, voices) -> None:
    v = voices["1998-15444-0008"]
    user, s_norm, raw = ident.match_voice(v)
    sn = ident.snorm
    assert sn is not None
    enrol = sn.stats(voices["1998-15444-0007"])
    assert s_norm == pytest.approx(float(sn.normalize(raw, enrol, sn.stats(v))[0]), rel=1e-5)


def test_face_and_voice_agree_or_follow_the_rule(ident: Identifier, faces, voices) -> None:
    r = ident.identify(faces["img2"][None], voices["1998-15444-0008"])
    assert (r.user_id, r.decided_by, r.conflict) == ("ann", "both", False)
    # the talker is the second visible face (ben), not the speaker candidate (ann): voice + that face agree
    r = ident.identify(np.stack([faces["img2"], faces["img12"]]), voices["2033-164914-0005"], speaker=0)
    assert (r.user_id, r.decided_by) == ("ben", "both")
    # ann's face, cy's voice, cy not in view: a conflict, resolved by conflict_rule
    for rule, want in [("face", "ann"), ("voice", "cy"), ("reject", None)]:
        ident.conflict_rule = rule
        r = ident.identify(faces["img2"][None], voices["2414-128291-0009"])
        assert r.conflict and r.user_id == want
    # unknown face, known voice: the voice decides
    r = ident.identify(faces["img8"][None], voices["2414-128291-0009"])
    assert (r.user_id, r.decided_by) == ("cy", "voice")


def test_forget_and_rebuild_from_records(ident: Identifier, faces, voices) -> None:
    ann_voice = ident.index.user_key_ids("ann", "voice", ident.voice_model_id)
    assert ann_voice and all(k in ident._enrol_stats for k in ann_voice)
    assert ident.forget("ann") == 2
    assert not any(k in ident._enrol_stats for k in ann_voice)  # derived biometric data goes too
    assert "ann" not in ident.index.users("voice", ident.voice_model_id)
    assert ident.identify(faces["img2"][None], voices["1998-15444-0008"]).user_id is None
    records = [KeyRecord("ann", "face", ident.face_model_id, faces["img1"]),
               KeyRecord("ann", "voice", ident.voice_model_id, voices["1998-15444-0007"])]
    fresh = Identifier(UserKeyIndex.rebuild(records), ident.face_model_id, ident.voice_model_id,
                       ident.face_threshold, ident.voice_threshold, ident.snorm)
    r = fresh.identify(faces["img2"][None], voices["1998-15444-0008"])  # s-norm stats computed lazily
    assert (r.user_id, r.decided_by) == ("ann", "both")
    # swapping a rebuilt index into a live identifier (as the orchestrator does) drops stale statistics
    ident.identify(voice_vec=voices["2414-128291-0009"])
    ident.index = UserKeyIndex.rebuild(records)
    assert ident._enrol_stats == {}
    r = ident.identify(faces["img2"][None], voices["1998-15444-0008"])
    assert (r.user_id, r.decided_by) == ("ann", "both")
    assert r.voice_score == pytest.approx(fresh.match_voice(voices["1998-15444-0008"])[1], rel=1e-6)


def test_many_distractors_keep_the_right_answer(ident: Identifier, voices) -> None:
    rng = np.random.default_rng(0)
    assert isinstance(ident.snorm, AdaptiveSNorm)
    idt = Identifier(UserKeyIndex(), "f", "resemblyzer_ge2e", 0.1, ident.voice_threshold, ident.snorm, snorm_candidates=64)
    # GE2E vectors are non-negative (ReLU): |gaussian| distractors sit in the same orthant
    idt.index.add_many([f"x{i}" for i in range(5000)], "voice", "resemblyzer_ge2e",
                       np.abs(rng.standard_normal((5000, 256), dtype=np.float32)))
    idt.enrol_voice("ann", voices["1998-15444-0007"])
    assert idt.identify(voice_vec=voices["1998-15444-0008"]).user_id == "ann"


def test_nan_embedding_is_refused(ident: Identifier) -> None:
    with pytest.raises(ValueError, match="NaN"):
        ident.identify(voice_vec=np.full(256, np.nan, np.float32))
