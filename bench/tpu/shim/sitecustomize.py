"""Python 3.11 + JAX 0.10.2 shims for MaxText 0.2.5 on the TPU machine (bench/tpu/install.sh).

MaxText 0.2.5 declares Python >= 3.12 and JAX >= 0.11; the code paths loraflow uses run on the TPU
machine's Python 3.11.7 and JAX 0.10.2 once a few names exist. Python imports this module at start-up
when its folder is on PYTHONPATH (put it FIRST: another ``sitecustomize`` earlier on the path would
hide this one; this one runs the next one it finds, so nothing of the machine's is lost). Nothing
heavy is imported here: JAX modules are patched when the program itself first imports them.

- ``typing.override`` (3.12): what ``typing_extensions.override`` does (marks the method, returns it).
- ``jax.experimental.xla_metadata.must_fuse_call`` (JAX 0.11): a pass-through decorator factory.
  It only asks XLA to fuse the wrapped call (a performance hint, same numbers); MaxText uses it in
  ``kernels/attention/jax_flash_attention.py``, reached only with ``use_jax_splash`` or DeepSeek's
  sparse indexer, never on loraflow's Llama path.

``LORAFLOW_TPU_SHIM_VERBOSE=1`` prints each shim as it is applied.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import typing
from types import ModuleType
from typing import Any

_VERBOSE = os.environ.get("LORAFLOW_TPU_SHIM_VERBOSE") == "1"


def _say(msg: str) -> None:
    if _VERBOSE:
        print(f"[loraflow tpu shim] {msg}", file=sys.stderr)


# --------------------------------------------------------------------------- typing.override (3.12)

if not hasattr(typing, "override"):

    def _override(method: Any) -> Any:  # what typing_extensions.override does
        try:
            method.__override__ = True
        except (AttributeError, TypeError):
            pass
        return method

    typing.override = _override  # type: ignore[attr-defined]
    _say("typing.override added")


# --------------------------------------------------------------------------- JAX >= 0.11 names


def _patch_xla_metadata(module: ModuleType) -> None:
    if hasattr(module, "must_fuse_call"):
        return

    def must_fuse_call(identifier: str) -> Any:
        del identifier

        def wrap(fn: Any) -> Any:
            return fn

        return wrap

    module.must_fuse_call = must_fuse_call  # type: ignore[attr-defined]
    _say("jax.experimental.xla_metadata.must_fuse_call added (pass-through)")


_PATCHES = {"jax.experimental.xla_metadata": _patch_xla_metadata}


class _PatchingLoader(importlib.abc.Loader):
    """The real loader, then the patch."""

    def __init__(self, loader: Any, patch: Any) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self._loader, name)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


for _name, _patch in _PATCHES.items():
    if _name in sys.modules:  # already imported (unlikely this early): patch it now
        _patch(sys.modules[_name])
sys.meta_path.insert(0, _PatchingFinder())


# --------------------------------------------------------------------------- the next sitecustomize


def _run_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        if folder == here:
            continue
        candidate = os.path.join(folder, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", candidate)
            if spec is None or spec.loader is None:
                return
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as exc:  # as Python itself does for a failing sitecustomize
                print(
                    f"Error in sitecustomize ({candidate}); set PYTHONVERBOSE for traceback: {exc!r}", file=sys.stderr
                )
            _say(f"ran {candidate}")
            return


_run_next_sitecustomize()
