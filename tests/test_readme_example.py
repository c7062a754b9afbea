"""The README's chat example, exactly as it is printed, through the served stack: tritonserver,
the orchestrator on loopback, the memory worker with the shipped episodic trigger, and
`egomem chat` (the CLI entry point) streaming a real speaker's audio and photo. Afterwards the REST
API lists a user named Ada whose profile mentions tennis and Lisbon, and her session's transcript
holds what she said (the client's line is sent at step 0, before the trigger's session starts)."""

from __future__ import annotations

import json
import shlex
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from egomem.cli import main as egomem_main
from egomem.config import to_toml
from egomem.memory.worker import run_worker
from tests.conftest import DATA, test_config
from tests.orchestrator_harness import ADMIN_TOKEN, IDENTIFY_MODELS, OrchestratorThread, orchestrator_config

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_chat_command() -> list[str]:
    """The README's `egomem chat --audio me.wav --image me.jpg --say ...` line, split as a shell would."""
    line = next(ln.strip() for ln in README.read_text().splitlines()
                if ln.strip().startswith("egomem chat --audio me.wav --image me.jpg --say"))
    return shlex.split(line)


def rest(url: str, path: str) -> dict:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture()
def served(triton, tmp_path):
    for m in IDENTIFY_MODELS:
        triton.load(m)
    cfg = orchestrator_config(test_config(tmp_path), tmp_path, triton.grpc_url, retrieval=False)
    cfg.memory.extractor = "rules"  # no LLM key in tests: the offline rule extractor
    cfg.memory.worker_poll_s = 0.2
    (tmp_path / "egomem.toml").write_text(to_toml(cfg))
    stop = threading.Event()
    worker = threading.Thread(target=run_worker, args=(cfg, stop), daemon=True)  # the shipped trigger
    worker.start()
    try:
        with OrchestratorThread(cfg) as orch:
            yield orch, tmp_path
    finally:
        stop.set()
        worker.join(120)


def test_the_readme_chat_example_ends_with_ada_who_loves_tennis_and_lives_in_lisbon(served, capsys):
    orch, d = served
    speech = [DATA / "identity" / f for f in ("1998-15444-0007.flac", "1998-15444-0008.flac")]  # one speaker
    sr = sf.info(str(speech[0])).samplerate
    sf.write(d / "me.wav", np.concatenate([sf.read(str(p), dtype="float32")[0] for p in speech]), sr)
    (d / "me.jpg").write_bytes((DATA / "identity" / "img1.jpg").read_bytes())

    argv = [str(d / a) if a in ("me.wav", "me.jpg") else a for a in readme_chat_command()]
    assert argv[0] == "egomem" and "Lisbon" in argv[-1]
    assert egomem_main(argv[1:] + ["--config", str(d / "egomem.toml")]) == 0, capsys.readouterr().err[-2000:]

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        jobs = rest(orch.url, "/api/jobs")["jobs"]
        if jobs and all(j["status"] in ("done", "dead") for j in jobs):
            break
        time.sleep(1.0)
    assert jobs and all(j["status"] == "done" for j in jobs), jobs

    users = rest(orch.url, "/api/users")["users"]
    assert [u["name"] for u in users] == ["Ada"], users
    profile = rest(orch.url, f"/api/users/{users[0]['user_id']}")
    assert "tennis" in profile["rendered"] and "Lisbon" in profile["rendered"], profile["rendered"]
    sessions = rest(orch.url, "/api/sessions")["sessions"]
    assert any("I love tennis and I live in Lisbon" in s["transcript"] for s in sessions), sessions
