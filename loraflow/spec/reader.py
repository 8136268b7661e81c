"""Reading a spec file without trusting it: a size cap, regular files only, YAML with bounded aliases.

A spec may come from someone who is not a DAG author; reading it must cost bounded time and memory
and fail with a ``SpecError`` (never another exception) whatever the file holds. ``read_spec_file``
reads at most ``MAX_SPEC_BYTES`` of a regular file (a FIFO or a device is refused before it is
read). ``load_yaml`` parses with the safe loader and measures the document as it would be once
every alias were expanded: more than ``MAX_YAML_NODES`` nodes (a "billion laughs" alias bomb),
deeper than ``MAX_YAML_DEPTH``, or an alias inside its own anchor is refused before anything is
constructed, so no later dump (JSON, the spec cache, the trigger form) can blow up. Anchors and
aliases themselves stay allowed: a shipped spec shares one compute section between two stages.

The document must also be plain data (``check_plain``): a key given twice in one mapping (YAML keeps
the last, so a second ``training:`` silently replaced the first) is refused naming both lines, and so
is any value whose tag is not one of JSON's types (``!!binary``, ``!!set``, ``!!omap``, a date read
from an unquoted ``2026-01-01``, a custom ``!tag``): the spec holds strings, numbers, booleans, null,
lists and mappings only. Merge keys (``<<: *base``) stay allowed.

YAML is imported when a spec is parsed, not with this module (the spec cache reads files on
every DAG parse and needs no YAML on a hit).
"""

from __future__ import annotations

import os
import stat
from functools import cache
from pathlib import Path
from typing import Any

from loraflow.errors import SpecError

MAX_SPEC_BYTES = 1024 * 1024  # a production spec is about 3 KiB
MAX_YAML_NODES = 100_000  # after expanding aliases; a production spec has a few hundred
MAX_YAML_DEPTH = 64  # a spec nests about 6 levels deep


def read_spec_file(path: Path) -> bytes:
    """The bytes of the spec file at ``path``: a regular file of at most ``MAX_SPEC_BYTES``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the DAG parse
    except FileNotFoundError:
        raise SpecError(str(path), [("(file)", "does not exist")]) from None
    except OSError as exc:
        raise SpecError(str(path), [("(file)", f"cannot be read ({exc.strerror}); check its permissions")]) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise SpecError(str(path), [("(file)", "is not a regular file; a spec is a YAML file")])
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_SPEC_BYTES + 1)  # never more, whatever the file claims or grows to
    if len(data) > MAX_SPEC_BYTES:
        size_check(max(info.st_size, len(data)), str(path))
    return data


def size_check(size: int, source: str) -> None:
    if size > MAX_SPEC_BYTES:
        raise SpecError(
            source,
            [
                (
                    "(file)",
                    f"is {size} bytes, over the cap of {MAX_SPEC_BYTES} bytes (1 MiB) for a pipeline spec; "
                    "a spec holds settings, not data: move large content to GCS and refer to it by gs:// URI",
                )
            ],
        )


def load_yaml(text: bytes | str, source: str) -> Any:
    """The YAML document in ``text`` as plain data; ``SpecError`` naming the line (or the limit) if
    it is not valid YAML, not UTF-8, too large or too deep once its aliases are expanded."""
    import yaml

    size_check(len(text.encode() if isinstance(text, str) else text), source)
    try:
        return yaml.load(text, Loader=_loader())
    except _TooLarge as exc:
        raise SpecError(source, [("(yaml)", str(exc))]) from None
    except _NotPlain as exc:
        raise SpecError(source, exc.problems) from None
    except yaml.reader.ReaderError as exc:  # bytes that are not UTF-8 (or UTF-16 with a BOM) text
        raise SpecError(
            source, [(f"byte {exc.position}", f"not valid YAML: not UTF-8 text ({exc.reason}); save the spec as UTF-8")]
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(yaml)"
        problem = getattr(exc, "problem", None) or exc
        raise SpecError(source, [(where, f"not valid YAML: {problem}; a spec is UTF-8 YAML")]) from None
    except RecursionError:  # the pure-Python parser (no libyaml) composes recursively
        raise SpecError(source, [("(yaml)", _too_deep())]) from None


class _TooLarge(Exception):
    pass


def _too_deep() -> str:
    return f"nests deeper than {MAX_YAML_DEPTH} levels; a pipeline spec nests a handful: flatten it"


def check_expansion(root: Any) -> None:
    """Raise ``_TooLarge`` if the YAML node graph under ``root``, every alias expanded, has more
    than ``MAX_YAML_NODES`` nodes, nests deeper than ``MAX_YAML_DEPTH`` or refers to itself.

    Iterative and linear in the number of distinct nodes: shared (aliased) nodes are measured once.
    """
    from yaml import MappingNode, SequenceNode

    def children(node: Any) -> list[Any]:
        if isinstance(node, SequenceNode):
            return list(node.value)
        if isinstance(node, MappingNode):
            return [n for pair in node.value for n in pair]
        return []

    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        kids = children(node)
        if children_done:
            open_nodes.discard(key)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            if size[key] > MAX_YAML_NODES:
                raise _TooLarge(
                    f"expands to more than {MAX_YAML_NODES} YAML nodes once its aliases (*name) are expanded; "
                    "a pipeline spec has a few hundred: remove the repeated aliases"
                )
            if depth[key] > MAX_YAML_DEPTH:
                raise _TooLarge(_too_deep())
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise _TooLarge("an alias (*name) refers to its own anchor (&name), which never ends; remove it")
        open_nodes.add(key)
        if len(open_nodes) > MAX_YAML_DEPTH:
            raise _TooLarge(_too_deep())
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)


class _NotPlain(Exception):
    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__(problems)
        self.problems = problems


_YAML = "tag:yaml.org,2002:"
# The tags of JSON's types, and the merge key: a spec is plain data.
_PLAIN_TAGS = {_YAML + t for t in ("str", "int", "float", "bool", "null", "seq", "map", "merge")}


def _line(node: Any) -> int:
    return int(node.start_mark.line) + 1


def _shown(tag: str) -> str:
    return "!!" + tag.removeprefix(_YAML) if tag.startswith(_YAML) else tag


def _key(node: Any) -> Any:
    """What a scalar mapping key means once constructed (``on`` and ``true`` are one key), or None."""
    from yaml import ScalarNode
    from yaml.constructor import ConstructorError, SafeConstructor

    if not isinstance(node, ScalarNode) or node.tag not in _PLAIN_TAGS:
        return None
    if node.tag == _YAML + "str":
        return node.value
    try:
        return SafeConstructor().construct_object(node)
    except (ConstructorError, ValueError):
        return None


def check_plain(root: Any) -> None:
    """Raise ``_NotPlain`` naming every key given twice in one mapping (with both lines) and every
    node tagged other than as a JSON type, under ``root`` (each distinct node once)."""
    from yaml import MappingNode, SequenceNode

    problems: list[tuple[str, str]] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.tag not in _PLAIN_TAGS:
            if node.tag == _YAML + "timestamp" and not getattr(node, "style", None):
                why = f"{node.value} is read as a date; quote it ('{node.value}') if it is text"
            else:
                why = (
                    f"not valid YAML for a spec: the tag {_shown(node.tag)} is not allowed; a spec holds strings, "
                    "numbers, booleans, null, lists and mappings only: remove the tag"
                )
            problems.append((f"line {_line(node)}", why))
            continue  # its content is no spec data
        if isinstance(node, MappingNode):
            first: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = _key(key_node)
                if key is None or key_node.tag == _YAML + "merge":
                    continue
                earlier = first.setdefault(key, key_node)  # scalars: hashable
                if earlier is not key_node:
                    problems.append(
                        (
                            f"line {_line(key_node)}",
                            f"duplicate key {key!r} (first at line {_line(earlier)}): YAML keeps only the last one, "
                            "so the first would be ignored without a word; merge the two into one",
                        )
                    )
            stack.extend(n for pair in reversed(node.value) for n in reversed(pair))
        elif isinstance(node, SequenceNode):
            stack.extend(reversed(node.value))
    if problems:
        problems.sort(key=lambda p: int(p[0].split()[1]))
        raise _NotPlain(problems)


@cache
def _loader() -> type:
    """libyaml's safe loader where present (about 8x faster: DAG parsing reads every spec), else
    Python's; either measures the composed document before constructing it."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class BoundedSafeLoader(base):  # type: ignore[valid-type, misc]
        def construct_document(self, node: Any) -> Any:
            check_expansion(node)
            check_plain(node)
            return super().construct_document(node)

    return BoundedSafeLoader
