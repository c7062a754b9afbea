"""`egomem demo`: a scripted, reproducible two-day scenario, end to end on CPU.

Day 1: two people (LibriSpeech voices, face photos) meet the system, one per stream, and say who
they are; the second names the first as a colleague. The memory worker enrols them and stores what
they said. Day 2: each comes back with a *different* photo and recording; the polling loop
recognises them, their profile lands in the Level-1 MemChunk; the first then asks, aloud, what her colleague
does, and the relation query the model writes on its text channel lands the colleague's facts in the Level-2
MemChunk. Finally the first person is forgotten.

The offline dialog model is the shipped fine-tuned tiny model (README, "What the tiny model reached"):
once a person is recognised on day 2 it greets them from their profile, and the timeline shows what it
said (`says to <name>`: its text channel from the Level-1 refresh on; each day-2 visit keeps streaming
`TAIL_S` of silence after the recording, so the model has time to speak). Nothing is injected: the day-2
question is spoken (eSpeak NG in a voice no training stream used, since the model learnt to listen to eSpeak
voices) and whatever query the model writes, right or wrong or none, is what the timeline shows
(`run_scenario(inject_query=True)` puts the query on the text channel instead, through the test-only
`orchestrator.accept_model_text` switch). The memory worker cuts the recorded streams
into sessions with the shipped episodic trigger (trained on the shipped codec's codes), as `egomem
serve` does.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from egomem.client import ChatSession, EgoMemClient, stream_audio
from egomem.config import REPO_ROOT, with_overrides

if TYPE_CHECKING:
    from egomem.training.tts import Voice

DEFAULT_DATA = REPO_ROOT / "tests" / "data" / "identity"  # LibriSpeech + face photos (ATTRIBUTION.md there)
ASKED_RELATION = "colleague"  # the day-2 question's relation: Filippo is Sonja's colleague
QUERY = f"<retr>:\n{ASKED_RELATION}\nwork<answer>"  # what `inject_query` writes on the text channel (tests)
QUESTION = f"What does my {ASKED_RELATION} do for work?"  # spoken on day 2 by the first person (a corpus sentence)
TAIL_S = 4.0  # silence streamed after a day-2 recording: the model's greeting runs ~1 byte per 80 ms tick
ANSWER_S = 10.0  # silence after the spoken question: the query (~2-4 s), the retrieval, then the answer


@dataclass(frozen=True)
class Person:
    name: str
    voice_day1: str
    voice_day2: str
    face_day1: str
    face_day2: str
    says_day1: str


PEOPLE = (
    Person("Sonja", "1998-15444-0007.flac", "1998-15444-0008.flac", "img1.jpg", "img2.jpg",
           "Hello, my name is Sonja. I live in Paris. I like tennis."),
    Person("Filippo", "2033-164914-0004.flac", "2033-164914-0005.flac", "img3.jpg", "img12.jpg",
           "Hi, my name is Filippo. I work as an engineer. My colleague is called Sonja."),
)


def load_voice(path: Path, seconds: float | None = None) -> np.ndarray:
    """A speech file as float32 mono 24 kHz (the stream's rate)."""
    import soundfile as sf
    from scipy.signal import resample_poly

    pcm, sr = sf.read(str(path), dtype="float32", always_2d=True)
    pcm = pcm.mean(axis=1)
    if sr != 24000:
        g = np.gcd(24000, sr)
        pcm = resample_poly(pcm, 24000 // g, sr // g).astype(np.float32)
    return pcm[: int(seconds * 24000)] if seconds else pcm


@dataclass
class Timeline:
    t0: float = field(default_factory=time.monotonic)
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, day: int, who: str, what: str, **detail: Any) -> None:
        row = {"t": round(time.monotonic() - self.t0, 2), "day": day, "who": who, "what": what, **detail}
        self.rows.append(row)
        extra = "  ".join(f"{k}={v}" for k, v in detail.items() if k != "text")
        text = detail.get("text")
        print(f"[{row['t']:7.2f}s] day {day}  {who:<8} {what:<20} {extra}", flush=True)
        if text:
            for line in str(text).splitlines()[:6]:
                print(f"{'':>40}| {line}", flush=True)


def question_audio(voice: Voice | None = None) -> np.ndarray:
    """The day-2 question spoken by eSpeak NG in `voice` (default: the first held-out voice), float32 mono 24 kHz."""
    from egomem.training.tts import HELDOUT_VOICES, synthesize

    return synthesize(QUESTION, voice or HELDOUT_VOICES[0])


async def _visit(client: EgoMemClient, p: Person, day: int, data: Path, tl: Timeline, seconds: float,
                 poll_s: float, ask: bool, inject: bool) -> tuple[ChatSession, str, float | None]:
    """One person's stream: video frames + real-time audio (+ their words on day 1; + on day 2, when `ask`,
    a spoken question, or with `inject` a query written on the model's text channel); the session, what the
    model said from the L1 refresh on (day 2) and how many seconds after recognition it said their name."""
    face = (data / (p.face_day1 if day == 1 else p.face_day2)).read_bytes()
    voice = load_voice(data / (p.voice_day1 if day == 1 else p.voice_day2), seconds)
    if day == 2:
        voice = np.concatenate([voice, np.zeros(int(TAIL_S * 24000), np.float32)])
    question = None
    if ask and not inject:
        question = np.concatenate([question_audio(), np.zeros(int(ANSWER_S * 24000), np.float32)])
    chat = await client.open_chat()
    chat.stream_id = (await chat.wait_event("stream_open"))["stream_id"]
    opened = time.monotonic()
    tl.add(day, p.name, "stream opened")
    if day == 1:
        await chat.send_transcript(p.says_day1)
        tl.add(day, p.name, "says", text=p.says_day1)

    async def video():
        while not chat.closed:
            await chat.send_video(face)
            await asyncio.sleep(min(1.0, poll_s / 2))

    async def audio():
        await stream_audio(chat, voice)
        if question is not None:
            tl.add(day, p.name, "asks (spoken)", voice="eSpeak held-out", text=QUESTION)
            await stream_audio(chat, question)

    video_task = asyncio.create_task(video())
    audio_task = asyncio.create_task(audio())
    heard_from, name_after = 0, None
    if day == 2:
        ev = await chat.wait_event("user_recognised", timeout=max(60.0, 10 * poll_s))
        tl.add(day, p.name, "recognised", as_name=ev["name"], by=ev["decided_by"], poll=ev.get("poll"),
               after_s=round(ev["_t"] - opened, 2), latency_ms=ev["latency_ms"])
        ref = await chat.wait_event("memchunk_refreshed", timeout=60, level=1)
        heard_from = len(chat.text)  # the model's text channel from the L1 refresh on: what it says to them
        tl.add(day, p.name, "L1 MemChunk", latency_ms=ref["latency_ms"], text=ref["text"])
        n = len(chat.events)
        try:  # the greeting: their name on the model's own text channel
            await chat.wait_for(lambda c: p.name in c.text[heard_from:], timeout=TAIL_S + seconds)
        except TimeoutError:
            tl.add(day, "model", f"did not say {p.name}")
        else:
            name_after = round(time.monotonic() - ev["_t"], 2)
            tl.add(day, "model", f"said {p.name}", after_recognised_s=name_after)
        if ask:
            if inject:
                await asyncio.sleep(TAIL_S / 2)  # its greeting first
                await chat.send_model_text(QUERY)
                tl.add(day, p.name, "memory query", injected=True, text=QUERY.replace("\n", " | "))
            # asked aloud, the visit's audio bounds the wait: a model that writes no query by its end (+ 3 s) wrote none
            wait_s = 60.0 if question is None else opened + (len(voice) + len(question)) / 24000 + 3.0 - time.monotonic()
            wait_s = max(wait_s, 3.0)  # a greeting wait that outlasted the audio still leaves the query a moment
            try:
                r = await chat.wait_event("retrieval", timeout=wait_s, after=n)
            except TimeoutError:
                tl.add(day, "model", "wrote no memory query")
            else:
                tl.add(day, "model", "memory query", injected=inject, relations=r["query"]["relations"],
                       keywords=r["query"]["keywords"])
                tl.add(day, p.name, "retrieval", latency_ms=r["latency_ms"], text="\n".join(r["results"]) or "(nothing)")
                ref2 = await chat.wait_event("memchunk_refreshed", timeout=60, after=n, level=2)
                tl.add(day, p.name, "L2 MemChunk", latency_ms=ref2["latency_ms"], text=ref2["text"])
    await audio_task
    video_task.cancel()
    await chat.close()
    said = ""
    if day == 2:
        said = chat.text[heard_from:]
        if inject:
            said = said.replace(QUERY, "")  # less the injected query
        tl.add(day, "model", f"says to {p.name}", text=said.strip() or "(nothing)")
    tl.add(day, p.name, "stream closed", ticks_text_chars=len(chat.text))
    return chat, said, name_after


async def run_scenario(url: str, stream_token: str, admin_token: str, data: Path = DEFAULT_DATA,
                       seconds: float = 6.0, poll_s: float = 2.0, job_timeout_s: float = 300.0,
                       inject_query: bool = False) -> dict[str, Any]:
    """The two-day scenario against a running stack; returns what happened (for the test and the plot).
    `inject_query` writes the day-2 query on the model's text channel instead of asking aloud (needs
    `orchestrator.accept_model_text`)."""
    tl = Timeline()
    out: dict[str, Any] = {"timeline": tl.rows}
    async with EgoMemClient(url, stream_token) as streamer, EgoMemClient(url, admin_token) as admin:
        await admin.wait_ready(120)
        for p in PEOPLE:  # day 1, one after the other: Filippo names Sonja, so she must exist first
            chat, _, _ = await _visit(streamer, p, 1, data, tl, seconds, poll_s, ask=False, inject=False)
            await admin.wait_jobs_done(job_timeout_s, chat.stream_id)
            tl.add(1, "memory", "job done", users=[u["name"] for u in await admin.users()])
        users = {u["name"]: u["user_id"] for u in await admin.users()}
        out["day1_users"] = sorted(users)
        out["day1_profiles"] = {n: (await admin.user(uid))["rendered"] for n, uid in users.items()}
        for n, text in out["day1_profiles"].items():
            tl.add(1, "memory", f"profile of {n}", text=text)
        out["day2"] = {}
        for p in PEOPLE:
            chat, said, name_after = await _visit(streamer, p, 2, data, tl, seconds, poll_s, ask=p is PEOPLE[0],
                                      inject=inject_query)
            out["day2"][p.name] = {
                "recognised": [(e["name"], e["user_id"], e.get("poll")) for e in chat.find("user_recognised")],
                "l1": [e["text"] for e in chat.find("memchunk_refreshed", level=1)],
                "l2": [e["text"] for e in chat.find("memchunk_refreshed", level=2)],
                "retrieval": [e["results"] for e in chat.find("retrieval")],
                "queries": [e["query"] for e in chat.find("retrieval")],
                "model_said": said,  # its own words after the L1 refresh
                "name_after_s": name_after,  # seconds from recognition to their name on its text channel
            }
            await admin.wait_jobs_done(job_timeout_s, chat.stream_id)
        victim = users.get(PEOPLE[0].name)
        if victim:
            res = await admin.forget(victim)
            tl.add(2, "admin", f"forget {PEOPLE[0].name}", leftovers=res["verified_leftovers"])
            out["forget"] = res
        out["after_forget_users"] = sorted(u["name"] for u in await admin.users())
        out["user_ids"] = users
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["timeline"]
    whos = list(dict.fromkeys(r["who"] for r in rows))
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.7 * len(whos)))
    for i, r in enumerate(rows):
        y = whos.index(r["who"])
        ax.plot(r["t"], y, "o", color="C0" if r["day"] == 1 else "C1")
        ax.annotate(r["what"], (r["t"], y), textcoords="offset points", xytext=(2, 6 + 9 * (i % 3)), fontsize=7,
                    rotation=20)  # staggered: events of one person often land within a second
    ax.set_yticks(range(len(whos)), whos)
    ax.set_xlabel("seconds since the demo started (blue: day 1, orange: day 2)")
    ax.set_title("EgoMem demo: recognition, memory and what the model said")
    ax.set_ylim(-0.5, len(whos) - 0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def scenario_config(cfg, out_dir: Path):
    """`cfg` for a private stack playing the scenario: a fresh SQLite store and chunks under `out_dir` (an old
    store there is removed), the rule extractor unless one is configured (no LLM key offline)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.glob("memory.sqlite3*"):
        f.unlink()
    return with_overrides(cfg, {
        "memory": {"database": out_dir / "memory.sqlite3", "chunk_dir": out_dir / "chunks",
                   "extractor": "rules" if cfg.memory.extractor == "auto" else cfg.memory.extractor}},
        source="demo")


def main(cfg, data: Path | None = None, out_dir: Path | None = None, seconds: float = 6.0) -> int:
    """Start a private stack (fresh store under <run_dir>/demo), run the scenario, print and plot it."""
    from egomem.stack import Stack

    out_dir = Path(out_dir or Path(cfg.server.run_dir) / "demo")
    cfg = scenario_config(cfg, out_dir)
    print("EgoMem demo. The dialog model is the shipped fine-tuned tiny model (offline default): on day 2 it\n"
          "greets the people it recognises from their profile; asked aloud about a colleague, the memory query\n"
          "it writes on its text channel (nothing is injected) drives the Level-2 retrieval.\n", flush=True)
    with Stack(cfg) as stack:
        result = asyncio.run(run_scenario(stack.url, stack.tokens["stream"], stack.tokens["admin"],
                                          data or DEFAULT_DATA, seconds, cfg.orchestrator.poll_interval_s))
    (out_dir / "demo_timeline.json").write_text(json.dumps(result, indent=1, default=str))
    plot(result, out_dir / "demo_timeline.png")
    print(f"\ntimeline: {out_dir / 'demo_timeline.json'}  plot: {out_dir / 'demo_timeline.png'}")
    return 0
