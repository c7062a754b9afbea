"""Exec a service program so that it dies with the process that started it (Linux `PR_SET_PDEATHSIG`).

    python egomem/serving/child_exec.py SIGNUM PARENT_PID PROGRAM [ARGS...]

sets this process's parent-death signal, sends itself that signal if PARENT_PID is already gone, then
execs PROGRAM in this same process (its pid is what the launcher records). The launcher starts its
children through this file, run as a script (stdlib only, no package import), instead of a
`preexec_fn`: Python code between fork and exec in a child of a multi-threaded process can deadlock
before exec, and the parent's `Popen` then waits for it forever (the subprocess docs' warning; a test
run hung that way). Here the signal is set by a fresh interpreter that holds no one else's locks.
"""

from __future__ import annotations

import ctypes
import os
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        sys.exit("usage: child_exec.py SIGNUM PARENT_PID PROGRAM [ARGS...]")
    sig, parent, program = int(argv[0]), int(argv[1]), argv[2:]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the launcher's pid file still finds strays
        pass
    if os.getppid() != parent:  # the parent died before prctl: act as if the signal came
        os.kill(os.getpid(), sig)
    try:
        os.execvp(program[0], program)
    except OSError as e:
        sys.exit(f"child_exec: cannot run {program[0]}: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
