"""Keeps a step program tied to the process that launched it: when that process dies, the step dies.

    python -I -S step_supervisor.py FD -- STEP_ARGV...

The local launcher (``loraflow.launchers.local.LocalLauncher``) starts this script as the leader of a new
process group, holding the write end of a pipe whose read end is ``FD``; the step program runs as
this script's child in the same group. The launcher never writes to the pipe: the read sees end of
file exactly when no process holds the write end any more, i.e. when the launching process is gone,
whether it exited, raised, or was killed by any signal, SIGKILL included (a lost worker, the OOM
killer). Then this script kills its whole process group (the step, everything the step started, and
itself) with SIGKILL.

Why a pipe and not ``prctl(PR_SET_PDEATHSIG)``: the death signal fires when the *thread* that
created the child exits, not the process, so a step launched from a short-lived thread (a thread
pool, a helper thread of the task) would be killed while its task is alive and well; it also reaches
only the direct child, never the step's own children. A file descriptor belongs to the
process, closes when the process dies however it dies, and the kernel does the bookkeeping.

Otherwise this script is transparent: the step inherits its stdout and stderr; a SIGTERM sent to the
group (the operator's ``on_kill``) reaches the step, and this script waits for it; it exits with the
step's status, and when the step was killed by a signal it kills itself with the same signal, so the
launcher reports "killed by signal N" as before.

Limits: a child that leaves the process group (``setsid``) escapes the SIGKILL; a process that
forks the launching process without exec (``multiprocessing``'s fork start method) holds the write
end too, and the step lives until that fork exits as well.

Standard library only: it runs with ``-I -S`` under the launching process's Python, whatever the
step's environment is.
"""

import contextlib
import os
import resource
import signal
import subprocess
import sys
import threading


def kill_group_when_launcher_dies(fd: int) -> None:
    while os.read(fd, 512):  # the launcher writes nothing; b"" is end of file
        pass
    os.killpg(0, signal.SIGKILL)


def exit_like(status: int) -> None:
    """Exit as the step did: with its exit status, or killed by its signal (without a core file)."""
    if status >= 0:
        sys.exit(status)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP take no handler
        signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
    sys.exit(128 - status)  # a signal whose default action is not to terminate


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        sys.exit(f"usage: {argv[0]} FD -- STEP_ARGV... (started by loraflow.launchers.local.LocalLauncher)")
    fd, step = int(argv[1]), argv[3:]
    threading.Thread(target=kill_group_when_launcher_dies, args=(fd,), daemon=True).start()
    # The group's SIGTERM/SIGINT is for the step; this script outlives it to report how the step ended.
    # A handler, not SIG_IGN: an ignored signal would stay ignored in the step after exec.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    try:
        proc = subprocess.Popen(step)  # close_fds: the step does not inherit FD
    except OSError as exc:
        print(f"ERROR: cannot start the step program {step[0]!r}: {exc}", file=sys.stderr, flush=True)
        sys.exit(127)
    exit_like(proc.wait())


if __name__ == "__main__":
    main(sys.argv)
