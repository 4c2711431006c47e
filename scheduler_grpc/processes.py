"""Child processes that do not outlive their parent.

The kernel's PR_SET_PDEATHSIG sends a signal to a process when the thread that started it exits,
so a parent killed with SIGKILL (or by the OOM killer), which runs no clean-up, still takes its
children with it: the embedded servers, the roles under `up`, and `shell.command` programs.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys

# Runs in the child before the command: ask the kernel for `sig` when the parent dies, then become
# the command. A tiny exec'd launcher instead of a preexec_fn: preexec_fn runs Python code between
# fork and exec, which is unsafe once the parent has threads (gRPC's), and crashed there.
_LAUNCHER = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, int(sys.argv[1]), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    sys.exit(1)  # the parent died before the request took effect\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n"
)


def die_with_parent(sig: signal.Signals, argv: list[str]) -> list[str]:
    """`argv` wrapped so that the kernel sends `sig` to the process when its parent dies.

    util-linux's `setpriv --pdeathsig` where present (it also works after a switch to another user,
    who may not be able to run our Python); otherwise a tiny Python launcher. Either execs the
    command in place: it keeps the process id (and so its process group) of the wrapper.

    Args:
        sig: The signal (SIGTERM for most servers, SIGINT for PostgreSQL's fast shutdown).
        argv: The command; argv[0] must be a path.
    """
    setpriv = shutil.which("setpriv")
    if setpriv:
        return [setpriv, f"--pdeathsig={sig.name.removeprefix('SIG')}", "--", *argv]
    return [sys.executable, "-c", _LAUNCHER, str(int(sig)), str(os.getpid()), *argv]
