"""Fixtures the end-to-end modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loraflow.dev import local_postgres


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A throwaway PostgreSQL on 127.0.0.1 for one module's Airflow (``loraflow.dev.local_postgres``);
    yields its SQLAlchemy URL."""
    with local_postgres.running() as url:
        yield url
