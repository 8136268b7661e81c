"""Fixtures shared by every environment's tests (imports only the light loraflow core)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from loraflow import local_gcs


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[local_gcs.Emulator]:
    """A GCS emulator on 127.0.0.1 for the whole session; the client library is pointed at it."""
    emulator = local_gcs.start("loraflow-test")
    saved = {k: os.environ.get(k) for k in emulator.env()}
    os.environ.update(emulator.env())
    from loraflow import gcs

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
