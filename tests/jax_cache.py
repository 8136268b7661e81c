"""The test session's persistent JAX compilation cache (``tests/conftest.py`` sets it up).

Every compilation of a test run is kept in a folder of the run's own, empty at its start (never the
user's ``~/jax_cache``, where MaxText puts it by default): the tiny model's programs are compiled once per
run and read back by every later training, conversion and step program of the run, in this process or
in the processes it starts (the step programs pass the folder on to MaxText:
``loraflow.trainer.argv.compile_cache_args``). What is kept is keyed by the program, its compile options
and the JAX/XLA version, so a changed program compiles again; a test that checks what a compilation
takes or makes compiles inside :func:`compiled_afresh`; one whose program must meet no persistent cache at
all (as ``plan --fit`` runs) inside :func:`uncached`.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
# JAX keeps only compilations of a second or more by default; the tiny model's take less, and dozens of
# them make up most of a training's set-up and first step.
MIN_SECONDS_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def point_at(folder: Path) -> None:
    """This process's compilations and the processes it starts from now on: kept in ``folder``, every one."""
    os.environ[DIR_ENV] = str(folder)
    os.environ[MIN_SECONDS_ENV] = "0"
    if "jax" in sys.modules:  # imported already (collecting a module): its config read the environment then
        import jax
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", str(folder))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        compilation_cache.reset_cache()  # JAX opens the cache once, at its first compilation


@contextmanager
def compiled_afresh(scratch: Path) -> Iterator[None]:
    """Inside, every compilation of this process really compiles: none is read from the session's cache (for
    a test that checks what compiling takes or what the compiled program needs). What was compiled is
    added to the session's cache afterwards, for the tests after it."""
    session = Path(os.environ[DIR_ENV])
    point_at(scratch)
    try:
        yield
    finally:
        point_at(session)
        shutil.copytree(scratch, session, dirs_exist_ok=True)


@contextmanager
def uncached() -> Iterator[None]:
    """Inside, this process neither reads nor keeps any compilation (``plan --fit`` compiles for chips that are
    not here with no persistent cache: ``loraflow.trainer.fit``); the session's cache again afterwards."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()
