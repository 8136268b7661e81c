"""The one way a name that came from GCS becomes a local path.

Object names under a source prefix, file names in a ``_MANIFEST.json`` and in a checkpoint's
completion marker are written by whoever can write the bucket. Joined to a local folder unchecked,
``/etc/x`` or ``../../dags/x`` would write wherever the worker can. Every caller that turns such a
name into a local path goes through :func:`safe_join` (one name) or :func:`local_paths` (a whole
listing, checked before anything is downloaded, so a refused listing writes nothing).

A name is accepted when it is a relative path of plain segments separated by ``/``: not empty, not
absolute, no empty, ``.`` or ``..`` segment, no backslash, no NUL, and it still lies inside the
folder once every symlink already there is followed.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from loraflow.errors import ArtifactError


class UnsafeNameError(ArtifactError):
    """A name from a bucket (an object, a manifest's file) that would land outside its local folder."""


RULE = (
    "a name must be a relative path of plain segments separated by '/' "
    "(not absolute, no empty, '.' or '..' segment, no backslash, no NUL)"
)


def name_problem(name: object) -> str | None:
    """Why ``name`` may not become a local path (without looking at any folder), or None if it may."""
    if not isinstance(name, str):
        return f"it is a {type(name).__name__}, not a string"
    if not name:
        return "it is empty"
    if "\x00" in name:
        return "it holds a NUL character"
    if "\\" in name:
        return "it holds a backslash"
    if name.startswith("/"):
        return "it is absolute"
    segments = name.split("/")
    if "" in segments:
        return "it has an empty segment ('//' or a trailing '/')"
    if "." in segments or ".." in segments:
        return "it has a '.' or '..' segment"
    return None


DOWNLOAD_FIX = "Nothing was downloaded. Remove or rename that object (or re-run the stage that wrote the listing)"


def _refuse(name: object, problem: str, origin: str, fix: str = DOWNLOAD_FIX) -> UnsafeNameError:
    return UnsafeNameError(f"{origin} names {name!r}, which may not become a local file: {problem}; {RULE}. {fix}")


def check_name(name: object, *, what: str, fix: str = DOWNLOAD_FIX) -> str:
    """``name`` if it may become a local path under any folder; else :class:`UnsafeNameError` naming
    ``what`` (where the name came from) and ``fix`` (what to do)."""
    problem = name_problem(name)
    if problem is not None:
        raise _refuse(name, problem, what, fix)
    assert isinstance(name, str)
    return name


def _path_problem(root: Path, name: object) -> tuple[Path | None, str | None]:
    """``(root / name, None)``, or ``(None, why not)``."""
    problem = name_problem(name)
    if problem is not None:
        return None, problem
    assert isinstance(name, str)
    path = root.joinpath(*name.split("/"))
    inside = root.resolve()
    if not path.resolve().is_relative_to(inside):
        return None, f"it resolves to {path.resolve()}, outside {inside} (through a symlink there)"
    return path, None


def safe_join(root: Path, name: str, *, what: str) -> Path:
    """``root / name``, refused (``UnsafeNameError``) unless it stays inside ``root``.

    ``what`` says where the name came from (``"manifest gs://b/p/_MANIFEST.json"``,
    ``"source gs://b/data/"``): the error repeats it, with the name and the rule it broke.
    """
    path, problem = _path_problem(root, name)
    if path is None:
        raise _refuse(name, str(problem), what)
    return path


def local_paths(root: Path, names: Iterable[str], *, what: str) -> dict[str, Path]:
    """Every name of a listing as a path under ``root``, all checked before the caller writes any.

    Besides :func:`safe_join`'s rules, refuses a listing where one name is a folder of another
    (``a`` and ``a/b``): both cannot be files.
    """
    paths: dict[str, Path] = {}
    problems: list[tuple[str, str]] = []
    for name in names:
        path, problem = _path_problem(root, name)
        if path is None:
            problems.append((name, str(problem)))
        else:
            paths[name] = path
    folders = {"/".join(n.split("/")[:i]) for n in paths for i in range(1, n.count("/") + 1)}
    problems += [(n, "another listed name puts files inside it, so it cannot be a file") for n in paths if n in folders]
    if problems:
        name, problem = problems[0]
        if len(problems) > 1:
            others = ", ".join(repr(n) for n, _ in problems[1:6])
            problem += f" (and {len(problems) - 1} more name(s) are refused: {others})"
        raise _refuse(name, problem, what)
    return paths
