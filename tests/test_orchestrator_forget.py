"""Forget through the running service while another user's stream is open: the store redacts the
forgotten person's name from that user's memories, and the open stream's Level-1 MemChunk is
reloaded from the redacted profile (no stale copy of the name stays in the model's context)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from egomem.client import EgoMemClient, stream_audio
from egomem.demo import load_voice
from egomem.memory import open_store
from egomem.memory.redact import MARKER
from tests.orchestrator_harness import ADMIN_TOKEN, IDENTIFY_MODELS, STREAM_TOKEN, run, served_orchestrator

DATA = Path(__file__).parent / "data" / "identity"


@pytest.fixture(scope="module")
def orch(triton, tmp_path_factory):
    d = tmp_path_factory.mktemp("orch_forget")
    with served_orchestrator(triton, d, IDENTIFY_MODELS, dialog={"new_person": "swap"}, retrieval=False,
                             poll_interval_s=1.0) as o:
        yield triton, o


def _face_key(triton, image_path: Path) -> tuple[str, np.ndarray]:
    import tritonclient.grpc as grpcclient

    image = np.asarray(Image.open(image_path).convert("RGB"))
    inp = grpcclient.InferInput("IMAGE", list(image.shape), "UINT8")
    inp.set_data_from_numpy(image)
    r = triton.client().infer("face_encoder", [inp])
    return r.as_numpy("MODEL_ID")[0].decode(), r.as_numpy("EMBEDDINGS")[int(r.as_numpy("SPEAKER")[0])]


def _seen_user(store, triton, name: str, fact: str):
    """A person the camera will recognise (img1.jpg's face; the chats send img2.jpg, another photo) with a fact."""
    user = store.create_user(name)
    store.add_key(user.user_id, "face", *_face_key(triton, DATA / "img1.jpg"))
    store.add_fact(user.user_id, fact)
    return user


def test_forget_redacts_and_reloads_an_open_stream_of_another_user(orch):
    triton, o = orch
    store = open_store(o.cfg.memory)
    try:
        jane = _seen_user(store, triton, "Jane Roe", "works with Max Moe on radar")
        max_ = store.create_user("Max Moe")
        store.add_fact(max_.user_id, "sails on weekends")
        store.add_relation(jane.user_id, max_.user_id, "colleague")
    finally:
        store.close()
    face = (DATA / "img2.jpg").read_bytes()  # another photo of Jane
    voice = load_voice(DATA / "1998-15444-0007.flac")

    async def go():
        async with EgoMemClient(o.url, STREAM_TOKEN) as c, EgoMemClient(o.url, ADMIN_TOKEN) as admin:
            chat = await c.open_chat()

            async def camera():
                while not chat.closed:
                    await chat.send_video(face)
                    await asyncio.sleep(0.5)

            cam = asyncio.create_task(camera())
            talk = asyncio.create_task(stream_audio(chat, np.concatenate([voice] * 4)))
            await chat.wait_event("user_recognised", timeout=60, user_id=jane.user_id)
            before = await chat.wait_event("memchunk_refreshed", timeout=60, level=1, user_id=jane.user_id)
            n = len(chat.events)
            res = await admin.forget(max_.user_id)
            after = await chat.wait_event("memchunk_refreshed", timeout=60, after=n, level=1)
            talk.cancel()
            cam.cancel()
            await chat.close()
            return before, res, after

    before, res, after = run(go())
    # new_person = "swap" (the paper's; "auto" restarts for the shipped model): the profile enters the running
    # conversation, no restart
    assert before["restarted"] is False and before["dialog_step"] > 1
    assert "Max Moe (colleague)" in before["text"] and "works with Max Moe on radar" in before["text"]
    assert res["verified_leftovers"] == [] and res["receipt"]["leftovers"] == []
    assert res["receipt"]["redacted"]["memory_items.text"] == 1
    assert after["user_id"] == jane.user_id and after["text"].startswith("name: Jane Roe")
    assert "Max Moe" not in after["text"] and f"works with {MARKER} on radar" in after["text"]
    assert "colleague" not in after["text"]  # the relation went with him


@pytest.fixture(scope="module")
def orch_restart(triton, tmp_path_factory):
    d = tmp_path_factory.mktemp("orch_restart")
    with served_orchestrator(triton, d, IDENTIFY_MODELS, dialog={"new_person": "restart"}, retrieval=False,
                             poll_interval_s=1.0) as o:
        yield triton, o


def test_new_person_restart_opens_a_fresh_dialog_with_the_profile(orch_restart):
    """[dialog] new_person = "restart" (a model fine-tuned with --context dialog): the stream's dialog starts
    afresh with the recognised person's L1 (dialog_lm's step counts from 1 again), the chat goes on."""
    triton, o = orch_restart
    store = open_store(o.cfg.memory)
    try:
        ann = _seen_user(store, triton, "Ann Lee", "plays the cello")
    finally:
        store.close()
    face = (DATA / "img2.jpg").read_bytes()
    voice = load_voice(DATA / "1998-15444-0007.flac")

    async def go():
        async with EgoMemClient(o.url, STREAM_TOKEN) as c:
            chat = await c.open_chat()
            talk = asyncio.create_task(stream_audio(chat, np.concatenate([voice] * 4)))
            await asyncio.sleep(1.5)  # the conversation runs a while before anyone is seen
            await chat.send_video(face)
            refreshed = await chat.wait_event("memchunk_refreshed", timeout=60, level=1, user_id=ann.user_id)
            heard = len(chat.audio_chunks)
            await asyncio.sleep(1.5)  # the restarted dialog goes on speaking
            talk.cancel()
            await chat.close()
            return refreshed, len(chat.audio_chunks) - heard, chat.errors

    refreshed, audio_after, errors = run(go())
    assert refreshed["restarted"] is True and refreshed["dialog_step"] == 1
    assert audio_after > 0 and errors == []
    assert refreshed["text"].startswith("name: Ann Lee") and "plays the cello" in refreshed["text"]
