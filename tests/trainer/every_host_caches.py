"""``python every_host_caches.py MODULE ARGS...``: runs the step program ``MODULE`` (``python -m MODULE ARGS...``,
unchanged) as one host of a test's multi-host job, its compilations kept in the session's persistent
compilation cache whatever its process id.

JAX writes that cache from process 0 alone (``jax._src.compiler._cache_write``), and on CPU it keys a
program by the process's own view of the topology, so without this every other host of every job in
``test_multihost_sft.py`` compiled every program again (docs/architecture.md): process 1 of a 2-host job
compiled the model's set-up and train step in each of the module's six 2-host jobs while process 0,
reading them back, waited for it in the first collective. With this, process 1 compiles them in the
first job and reads them back in the next five, as process 0 does. Production keeps JAX's rule (each
host's own cache in its container, written by process 0 alone). A JAX whose ``_cache_write`` has another
signature keeps its own rule: its hosts compile again, slower but the same runs.
"""

from __future__ import annotations

import inspect
import os
import runpy
import sys
import warnings
from typing import Any

_SIGNATURE = ["cache_key", "compile_time_secs", "module_name", "backend", "executable"]


def applies() -> bool:
    """Whether this JAX's cache writer is the one replaced here (JAX 0.12's)."""
    from jax._src import compiler

    return list(inspect.signature(compiler._cache_write).parameters) == _SIGNATURE


def write_from_every_process() -> bool:
    """JAX's persistent cache written from this process too; False where this JAX's writer is another one."""
    from jax._src import compilation_cache, compiler, config

    if not applies():
        return False

    def cache_write(cache_key: str, compile_time_secs: float, module_name: str, backend: Any, executable: Any) -> None:
        if compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
            return
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        except Exception as exc:  # as JAX's own writer: a cache it cannot write is a warning
            warnings.warn(
                f"Error writing persistent compilation cache entry for {module_name!r}: {exc!r}", stacklevel=1
            )

    compiler._cache_write = cache_write
    return True


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # not this folder: the step program's path as under ``python -m``
    write_from_every_process()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
