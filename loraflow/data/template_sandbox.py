"""Chat templates compiled and rendered outside this process, bounded in time and memory.

Jinja runs a template's code while it compiles it (constant folding: ``{{ 9 ** (9 ** 9) }}`` never
finishes compiling, ``{{ 'x' * 2**34 }}`` asks for 16 GiB) and while it renders it, and Python
cannot stop a computation of its own thread. So loraflow never compiles or renders a template in
the process that asks (the DAG processor validating a spec, a step program rendering a dataset):
a child process does (loraflow/data/template_worker.py, jinja2 and the standard library only),
with its address space capped, while this side waits at most :data:`TIME_LIMIT_S` for each answer
and kills the child when it runs over. The next request starts a fresh child.

One child per process, started on first use and kept (one start costs ~0.1 s; a request then
costs tens of microseconds); a process that was forked gets its own. Every failure is a
:class:`SandboxError` whose message says what the template did and the fix.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from loraflow.errors import LoraflowError

# Each compile or rendering of one conversation may take this long (the child is killed after it).
TIME_LIMIT_S = 5.0
# The child's start-up (the interpreter and jinja2) is not the template's time.
START_LIMIT_S = 60.0
_WORKER = Path(__file__).with_name("template_worker.py")
_HEADER = struct.Struct(">I")

# The child's error kinds, as sentences that end in the fix.
_MESSAGES = {
    "refused": "{detail}",
    "large": "the chat template computes {detail}; a chat template writes the turns it is given, "
    "not large values or loops of its own",
    "syntax": "the chat template is not valid Jinja ({detail}); fix its syntax",
    "unsafe": "the chat template tried an unsafe operation ({detail}); it is refused",
    "memory": "the chat template needs more memory than a chat template may use ({limit} MiB) for one "
    "conversation; a chat template writes the turns it is given, not large values of its own",
    "depth": "the chat template nests too deeply (expressions, loops or macros within one another); flatten it",
    "compile": "the chat template cannot be compiled ({detail}); fix it",
    "render": "the chat template failed to render ({detail}); check it against a row of the dataset",
}


# The failures that say the template is hostile or broken whatever conversation it is given.
BOUNDS = frozenset({"large", "memory", "time", "ended", "depth"})


class SandboxError(LoraflowError):
    """A template that cannot be compiled or rendered within the bounds; the message says the fix."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind  # "time", "ended" or one of the child's error kinds (_MESSAGES)


class _Child:
    def __init__(self) -> None:
        self.pid = os.getpid()  # the process that started it: a forked copy must not share its pipes
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(_WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={},  # it needs nothing of this process's environment
        )
        self.started = False
        self.killed = False  # by :meth:`stop`, on the time bound

    def alive(self) -> bool:
        return self.pid == os.getpid() and self.proc.poll() is None

    def ask(self, request: dict[str, Any], limit_s: float) -> dict[str, Any] | None:
        """The child's answer; None when it ended first, or did not answer within ``limit_s`` (then it is killed)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        data = json.dumps(request).encode("ascii")  # ASCII JSON: any str crosses, lone surrogates too
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
        except OSError:  # it ended
            self.stop(kill=False)
            return None
        if not self.started:  # the first answer also waits for the interpreter and jinja2 to start
            limit_s += START_LIMIT_S
            self.started = True
        deadline = time.monotonic() + limit_s
        header = _read(self.proc.stdout, _HEADER.size, deadline)
        if header is not None and len(header) == _HEADER.size:
            size = _HEADER.unpack(header)[0]
            body = _read(self.proc.stdout, size, deadline)
            if body is not None and len(body) == size:
                answer: dict[str, Any] = json.loads(body.decode("ascii"))
                return answer
            header = body
        self.stop(kill=header is None)
        return None

    def stop(self, *, kill: bool) -> None:
        """End the child: at once (``kill``: it ran over its time), else by closing its input."""
        if kill:
            self.proc.kill()
            self.killed = True
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        try:
            self.proc.wait(timeout=START_LIMIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _read(stream: IO[bytes], size: int, deadline: float) -> bytes | None:
    """``size`` bytes from the child's pipe, fewer when it ends first, None when the deadline passes."""
    fd, out = stream.fileno(), bytearray()
    while len(out) < size:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, size - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


_lock = threading.Lock()
_child: _Child | None = None


def _ask(request: dict[str, Any], what: str, limit_s: float) -> dict[str, Any]:
    global _child
    with _lock:
        if _child is None or not _child.alive():
            _child = _Child()
        child = _child
        answer = child.ask(request, limit_s)
        if answer is None:
            _child = None
    if answer is None and child.killed:
        raise SandboxError(
            f"the chat template took more than {TIME_LIMIT_S:g} s to {what}; a chat template writes "
            "the turns it is given, not loops or computations of its own",
            "time",
        )
    if answer is None:
        raise SandboxError(
            f"the chat template ended the process rendering it (exit {child.proc.returncode}) when asked to {what}; "
            "a chat template writes the turns it is given: simplify it",
            "ended",
        )
    if "error" in answer:
        from loraflow.data import template_worker

        kind = str(answer["error"])
        message = _MESSAGES[kind].format(detail=answer["detail"], limit=template_worker.MEMORY_HEADROOM // 2**20)
        raise SandboxError(message, kind)
    return answer


def compile_check(source: str, max_chars: int) -> None:
    """Nothing when ``source`` compiles as a chat template; else SandboxError."""
    _ask({"op": "compile", "source": source, "max_chars": max_chars}, "compile", TIME_LIMIT_S)


def time_limit(conversations: int) -> float:
    """Seconds one exchange rendering this many conversations may take (each gets :data:`TIME_LIMIT_S`)."""
    return TIME_LIMIT_S * max(1, conversations)


def render_many(
    source: str,
    specials: Mapping[str, str],
    conversations: Sequence[tuple[Sequence[Mapping[str, str]], bool]],
    max_chars: int,
) -> list[str]:
    """Each (messages, add_generation_prompt) rendered by ``source`` with the special tokens ``specials``, in one
    exchange with the child (each conversation given :data:`TIME_LIMIT_S`); SandboxError on the first failure."""
    request = {
        "op": "render",
        "source": source,
        "specials": dict(specials),
        "conversations": [[list(messages), bool(prompt)] for messages, prompt in conversations],
        "max_chars": max_chars,
    }
    answer = _ask(request, "render one conversation", time_limit(len(conversations)))
    return [str(text) for text in answer["texts"]]
