"""`egomem chat --video`: video files decoded with PyAV (frames at the chat's rate, scaled; the audio
track at 24 kHz mono), clear errors before the chat opens, and a person recognised from the frames
of a recording through the real stack (tritonserver + orchestrator on loopback)."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from egomem import video
from egomem.chat import run_chat
from egomem.demo import load_voice
from egomem.memory import open_store
from tests.orchestrator_harness import IDENTIFY_MODELS, STREAM_TOKEN, run, served_orchestrator

DATA = Path(__file__).parent / "data" / "identity"
SPEECH = [DATA / "1998-15444-0007.flac", DATA / "1998-15444-0008.flac"]  # 3.2 s + 2.9 s, one speaker


def make_video(path: Path, images: list[Path], seconds_each: float, speech: list[Path] | None = None,
               fps: int = 5, size: tuple[int, int] = (640, 480), vcodec: str = "libx264", acodec: str = "aac") -> Path:
    """A small video of still photos (each centred on a black canvas) with the speech files as its sound."""
    out = av.open(str(path), "w")
    vs = out.add_stream(vcodec, rate=fps)
    vs.width, vs.height, vs.pix_fmt = size[0], size[1], "yuv420p" if vcodec != "mjpeg" else "yuvj420p"
    aus = None
    if speech:
        pcm = np.concatenate([sf.read(str(p), dtype="float32")[0] for p in speech])
        sr = sf.info(str(speech[0])).samplerate
        aus = out.add_stream(acodec, rate=sr)
        aus.layout = "mono"
    for img_path in images:
        img = Image.open(img_path).convert("RGB")
        img.thumbnail(size)
        canvas = Image.new("RGB", size)
        canvas.paste(img, ((size[0] - img.width) // 2, (size[1] - img.height) // 2))
        for _ in range(int(seconds_each * fps)):
            for packet in vs.encode(av.VideoFrame.from_image(canvas)):
                out.mux(packet)
    for packet in vs.encode():
        out.mux(packet)
    if aus is not None:
        frame = av.AudioFrame.from_ndarray(pcm[None, :], format="flt", layout="mono")  # packed mono: [1, T]
        frame.sample_rate = sr
        for packet in list(aus.encode(frame)) + list(aus.encode()):
            out.mux(packet)
    out.close()
    return path


@pytest.mark.parametrize("name, vcodec, acodec", [("rec.mp4", "libx264", "aac"), ("rec.avi", "mjpeg", "pcm_s16le")])
def test_frames_at_the_chat_rate_scaled_and_the_audio_track_at_24k(tmp_path, name, vcodec, acodec):
    path = make_video(tmp_path / name, [DATA / "img2.jpg", DATA / "img8.jpg"], 2.0, SPEECH, vcodec=vcodec,
                      acodec=acodec)
    info = video.probe(path)
    assert (info.width, info.height, info.has_audio) == (640, 480, True)
    got = list(video.frames(path, fps=1.0, max_side=320))
    assert [round(t, 1) for t, _ in got] == [0.0, 1.0, 2.0, 3.0]  # 4 s of video at 1 frame/s
    images = [Image.open(io.BytesIO(jpeg)) for _, jpeg in got]
    assert all(im.format == "JPEG" and im.size == (320, 240) for im in images)
    # the frames follow the video: the first two show one photo, the last two the other
    px = [np.asarray(im.convert("L"), np.float32) for im in images]
    assert np.abs(px[0] - px[1]).mean() < 8 < np.abs(px[1] - px[2]).mean()
    assert len(list(video.frames(path, fps=2.0))) == 8 and len(list(video.frames(path, fps=1.0, seconds=2.5))) == 3
    small = list(video.frames(path, fps=1.0, max_pixels=100 * 100))[0][1]
    w, h = Image.open(io.BytesIO(small)).size
    assert w * h <= 100 * 100 and w / h == pytest.approx(4 / 3, rel=0.05)

    pcm = video.audio(path)
    want = load_voice(SPEECH[0])
    assert pcm.dtype == np.float32 and pcm.ndim == 1
    assert abs(pcm.size / 24000 - sum(sf.info(str(p)).duration for p in SPEECH)) < 0.15
    # the same speech, resampled to 24 kHz: the track correlates with the source at some small lag (codec delay)
    seg = want[2400:2400 + 24000]
    corr = max(float(np.dot(pcm[2400 + lag:2400 + lag + seg.size], seg)) for lag in range(0, 2400, 8))
    assert corr / float(np.dot(seg, seg)) > 0.8


def test_a_video_without_sound_and_files_that_are_not_videos(tmp_path):
    silent = make_video(tmp_path / "silent.mp4", [DATA / "img5.jpg"], 1.0)
    assert video.probe(silent).has_audio is False and video.audio(silent) is None
    fake = tmp_path / "notes.mp4"
    fake.write_text("this is not a video\n" * 50)
    with pytest.raises(video.VideoError, match="notes.mp4"):
        video.probe(fake)
    with pytest.raises(video.VideoError, match="no video stream"):
        video.probe(SPEECH[0])
    with pytest.raises(video.VideoError, match="does not exist"):
        video.probe(tmp_path / "missing.webm")


def test_chat_refuses_a_bad_video_before_connecting(tmp_path, capsys):
    fake = tmp_path / "holiday.mkv"
    fake.write_bytes(b"\x00" * 4096)
    # nothing listens on this URL: reaching it would raise, so 2 + the message means it never tried
    rc = run(run_chat("http://127.0.0.1:9", "t", None, [], None, None, None, video=fake))
    assert rc == 2 and "holiday.mkv" in capsys.readouterr().err


@pytest.fixture(scope="module")
def stack(triton, tmp_path_factory):
    d = tmp_path_factory.mktemp("chat_video")
    with served_orchestrator(triton, d, IDENTIFY_MODELS, retrieval=False, poll_interval_s=1.0) as orch:
        yield triton, orch, d


def test_chat_recognises_the_person_in_a_video_from_its_frames(stack, capsys):
    """Jane is enrolled from one photo (face only); a recording of her (another photo, her voice
    unknown to the store) streamed with `--video` gets her recognised, decided by face."""
    import tritonclient.grpc as grpcclient

    triton, orch, d = stack
    image = np.asarray(Image.open(DATA / "img1.jpg").convert("RGB"))
    inp = grpcclient.InferInput("IMAGE", list(image.shape), "UINT8")
    inp.set_data_from_numpy(image)
    r = triton.client().infer("face_encoder", [inp])
    store = open_store(orch.cfg.memory)
    try:
        jane = store.create_user("Jane Roe")
        store.add_key(jane.user_id, "face", r.as_numpy("MODEL_ID")[0].decode(),
                      r.as_numpy("EMBEDDINGS")[int(r.as_numpy("SPEAKER")[0])])
    finally:
        store.close()
    rec = make_video(d / "jane.mp4", [DATA / "img2.jpg"], 9.0, SPEECH + SPEECH[:1])  # 9 s: ~8 polls at 1 s

    rc = run(run_chat(orch.url, STREAM_TOKEN, None, [], None, None, None, video=rec, fps=1.0))
    out = capsys.readouterr().out
    assert rc == 0 and "audio from" in out and "jane.mp4's audio track" in out
    line = next((ln for ln in out.splitlines() if "recognised Jane Roe" in ln), None)
    assert line is not None, out[-3000:]
    assert "by face" in line or "by both" in line


def test_chat_refuses_an_image_that_is_not_jpeg_or_png_before_connecting(tmp_path, capsys):
    notes = tmp_path / "me.jpg"
    notes.write_text("not a photo\n")
    rc = run(run_chat("http://127.0.0.1:9", "t", SPEECH[0], [notes], None, None, None))
    err = capsys.readouterr().err
    assert rc == 2 and "me.jpg" in err and "not a JPEG or PNG" in err
    rc = run(run_chat("http://127.0.0.1:9", "t", SPEECH[0], [tmp_path / "gone.png"], None, None, None))
    assert rc == 2 and "gone.png" in capsys.readouterr().err


def test_the_model_text_is_printed_an_utterance_at_a_time(capsys):
    """One piece arrives per 80 ms tick; the terminal gets whole utterances, once the channel goes quiet or
    the chat closes."""
    import asyncio
    import time

    from egomem.chat import UTTERANCE_GAP_S, _printer

    class Session:  # the ChatSession fields the printer reads, filled as the client fills them
        closed, events, errors, text = False, [], [], ""

    s = Session()

    async def feed():
        task = asyncio.create_task(_printer(s, time.monotonic()))
        for piece in ("Hel", "lo ", "Ada"):
            s.text += piece
            await asyncio.sleep(0.08)
        await asyncio.sleep(UTTERANCE_GAP_S + 0.3)
        s.text += "Bye"
        await asyncio.sleep(0.15)
        s.closed = True
        await task

    asyncio.run(feed())
    said = [ln.split("model: ")[1] for ln in capsys.readouterr().out.splitlines() if "model: " in ln]
    assert said == ["'Hello Ada'", "'Bye'"]
