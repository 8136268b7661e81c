"""Fixtures shared by every environment's tests (imports only the light loraflow core)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraflow.dev import local_gcs


@pytest.fixture(scope="session", autouse=True)
def spec_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's own spec cache (loraflow/spec/cache.py), empty at start, never the user's; every
    DAG parse of the session, in process or in an Airflow it starts, uses it."""
    folder = tmp_path_factory.mktemp("spec-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAFLOW_SPEC_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(scope="session", autouse=True)
def jax_compilation_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's own persistent JAX compilation cache, empty at start, never the user's ~/jax_cache
    (tests/jax_cache.py): every process of the session (step programs, the hosts of a multi-host job,
    Airflow's workers) compiles each program once and reads it back after."""
    from tests import jax_cache

    folder = tmp_path_factory.mktemp("jax-cache")
    with pytest.MonkeyPatch.context() as mp:
        for name in (jax_cache.DIR_ENV, jax_cache.MIN_SECONDS_ENV):
            mp.setenv(name, os.environ.get(name, ""))  # restored at the end of the session
        jax_cache.point_at(folder)
        yield folder


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[local_gcs.Emulator]:
    """A GCS emulator on 127.0.0.1 for the whole session; the client library is pointed at it."""
    emulator = local_gcs.start("loraflow-test")
    saved = {k: os.environ.get(k) for k in emulator.env()}
    os.environ.update(emulator.env())
    from loraflow.storage import gcs

    gcs.client.cache_clear()
    yield emulator
    emulator.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    gcs.client.cache_clear()


@pytest.fixture
def gcs_bucket(gcs_emulator: local_gcs.Emulator) -> str:
    """A fresh ``gs://`` prefix per test, in the session's emulator bucket."""
    return f"gs://{gcs_emulator.bucket}/t-{uuid.uuid4().hex[:8]}"
