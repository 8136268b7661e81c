"""The child process every chat template is compiled and rendered in (loraflow/data/template_sandbox.py).

A chat template comes from outside (a spec author's inline template, a tokenizer's files), and
Jinja runs code while it *compiles* (it folds constant expressions such as ``9 ** (9 ** 9)``) as
well as while it renders, so neither may run in the process that asked: the DAG processor, a
step program. This program does both, one request at a time, in a process whose address space is
capped (:data:`MEMORY_HEADROOM` above what it holds after start-up) and which dies with its parent;
the parent bounds each request's time and kills the process when it runs over.

Run as ``python -I template_worker.py`` (isolated: no PYTHONPATH, no user site, no current
directory), so it imports the standard library and jinja2 only, never loraflow.

Protocol, on stdin / stdout: each message is a 4-byte big-endian length and that many bytes of
JSON in ASCII (escaped: any Python str crosses, lone surrogates included). Requests: ``{"op": "compile", "source", "max_chars"}`` and ``{"op": "render", "source", "specials",
"conversations": [[messages, add_generation_prompt], ...], "max_chars"}``; answers: ``{"ok": true}``,
``{"texts": [...]}`` or
``{"error": kind, "detail": ...}`` where kind is one of the keys of the parent's messages.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import struct
import sys
from typing import Any

# What a template may allocate beyond the interpreter and jinja2 (a conversation is far smaller).
MEMORY_HEADROOM = 256 * 2**20
# Cap on the compiled templates kept (a process renders with one or two).
CACHE_SIZE = 16
# A number a template computes may have at most this many bits (a power or a product of numbers).
MAX_NUMBER_BITS = 4096
_HEADER = struct.Struct(">I")


class TemplateRefused(Exception):
    """The template's own ``raise_exception`` (its message is the error's detail)."""


class TemplateTooLarge(Exception):
    """A value or output larger than any chat template needs (what it is: the error's detail)."""


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (a template busy in a loop never reads EOF)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's kill on its time bound remains
        pass
    if os.getppid() == 1:  # the parent is already gone
        sys.exit(0)


def cap_memory(headroom: int = MEMORY_HEADROOM) -> None:
    """Cap this process's address space at what it maps now plus ``headroom``."""
    with open("/proc/self/statm", encoding="ascii") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _bits(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int):
        return 0.0
    return float(abs(value).bit_length())


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple) else 0


def bounded_binop(op: str, left: Any, right: Any, max_chars: int) -> None:
    """Refuse (TemplateTooLarge), before it is computed, a power or product whose result no chat template needs."""
    if op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if right * math.log2(abs(left)) > MAX_NUMBER_BITS:
            raise TemplateTooLarge(f"{left} ** {right}, a number of more than {MAX_NUMBER_BITS} bits")
    if op == "*":
        times = right if _size(left) else left
        if isinstance(times, int) and max(_size(left), _size(right)) * times > max_chars:
            raise TemplateTooLarge(f"a repetition of more than {max_chars} items")
        if _bits(left) + _bits(right) > MAX_NUMBER_BITS:
            raise TemplateTooLarge(f"a product of more than {MAX_NUMBER_BITS} bits")


def environment(max_chars: int) -> Any:
    """Sandboxed as Hugging Face runs chat templates, trimmed as it compiles them, with ``{% generation %}``;
    ``**`` and ``*`` are intercepted, which also keeps Jinja from folding them while it compiles."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # marks the assistant's answer in HF templates; renders its body as is
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"**", "*"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            bounded_binop(operator, left, right, max_chars)
            return super().call_binop(context, operator, left, right)

    def raise_exception(message: str) -> None:
        raise TemplateRefused(f"the chat template refused the conversation: {message}")

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


class Worker:
    """Compiles and renders templates; every failure becomes an error answer, never an exception."""

    def __init__(self) -> None:
        self.compiled: dict[tuple[str, int], Any] = {}

    def template(self, source: str, max_chars: int) -> Any:
        key = (source, max_chars)
        if key not in self.compiled:
            if len(self.compiled) >= CACHE_SIZE:
                self.compiled.clear()
            self.compiled[key] = environment(max_chars).from_string(source)
        return self.compiled[key]

    def render(self, template: Any, conversation: list[Any], max_chars: int, specials: dict[str, str]) -> str:
        messages, add_generation_prompt = conversation
        chunks = template.generate(messages=messages, add_generation_prompt=bool(add_generation_prompt), **specials)
        parts, size = [], 0
        for chunk in chunks:
            size += len(chunk)
            if size > max_chars:
                raise TemplateTooLarge(f"more than {max_chars} characters of text for one conversation")
            parts.append(chunk)
        return "".join(parts)

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        from jinja2 import TemplateSyntaxError
        from jinja2.exceptions import SecurityError

        op = request.get("op")
        try:
            if op not in ("compile", "render"):
                raise ValueError(f"unknown request {op!r}")
            max_chars = int(request["max_chars"])
            template = self.template(request["source"], max_chars)
            if op == "compile":
                return {"ok": True}
            specials = dict(request["specials"])
            return {"texts": [self.render(template, c, max_chars, specials) for c in request["conversations"]]}
        except TemplateRefused as exc:
            return {"error": "refused", "detail": str(exc)}
        except TemplateTooLarge as exc:
            return {"error": "large", "detail": str(exc)}
        except TemplateSyntaxError as exc:
            return {"error": "syntax", "detail": str(exc)}
        except SecurityError as exc:
            return {"error": "unsafe", "detail": str(exc)}
        except MemoryError:
            self.compiled.clear()
            return {"error": "memory", "detail": ""}
        except RecursionError:
            return {"error": "depth", "detail": ""}
        except Exception as exc:  # whatever else a template raises is the template's failure
            kind = "compile" if op == "compile" else "render"
            return {"error": kind, "detail": f"{type(exc).__name__}: {exc}"[:500]}


def read_message(stream: Any) -> dict[str, Any] | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    message: dict[str, Any] = json.loads(stream.read(size).decode("ascii"))
    return message


def write_message(stream: Any, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode("ascii")
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def main() -> None:
    die_with_parent()
    import jinja2.sandbox  # noqa: F401  (imported before the cap: its modules are not the template's memory)

    environment(1)  # builds every class the first request needs, under no cap
    cap_memory()
    sys.setrecursionlimit(2000)
    worker = Worker()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (request := read_message(stdin)) is not None:
        try:
            response = worker.answer(request)
            write_message(stdout, response)
        except MemoryError:  # the answer itself did not fit
            worker.compiled.clear()
            write_message(stdout, {"error": "memory", "detail": ""})


if __name__ == "__main__":
    main()
