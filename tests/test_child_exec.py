"""Service children (`launcher.start_child`): started through `egomem/serving/child_exec.py` instead of a
`preexec_fn` (Python code between fork and exec can deadlock a child of a threaded process, and `Popen`
then waits forever), they still die with the process that started them and write owner-only files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from egomem.serving.launcher import child_argv


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie has died; reaping is its new parent's business


def test_a_service_child_is_its_program_writes_owner_only_files_and_dies_with_its_parent(tmp_path):
    marker = tmp_path / "written"
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        from egomem.serving.launcher import start_child
        program = [sys.executable, "-c",
                   "import pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text('x'); time.sleep(120)",
                   {str(marker)!r}]
        child = start_child(program, sys.stderr)
        print(child.pid, flush=True)
        time.sleep(120)
    """))
    proc = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    try:
        child = int(proc.stdout.readline())
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert time.monotonic() < deadline, "the child never wrote its file"
            time.sleep(0.05)
        assert marker.stat().st_mode & 0o077 == 0  # owner-only
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        assert b"-c" in cmdline and not any(b"child_exec" in part for part in cmdline)  # exec'd: the same pid
        proc.kill()  # -9: no handler of the parent runs; the kernel sends the child its death signal
        proc.wait()
        deadline = time.monotonic() + 10
        while not _gone(child):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()


def test_children_of_other_threads_and_without_a_signal_start_as_given():
    argv = ["tritonserver", "--model-repository=/x"]
    assert child_argv(argv)[-2:] == argv and child_argv(argv)[1].endswith("child_exec.py")
    assert child_argv(argv)[2:4] == [str(int(signal.SIGTERM)), str(os.getpid())]
    assert child_argv(argv, deathsig=None) == argv
    seen = []
    t = threading.Thread(target=lambda: seen.append(child_argv(argv)))
    t.start()
    t.join()
    assert seen == [argv]  # the kernel would signal when that thread ends, not this process
