"""Fixtures the end-to-end modules share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loraflow.dev import local_postgres
from loraflow.dev.db_template import DB_TEMPLATE_ENV


@pytest.fixture(scope="session", autouse=True)
def airflow_db_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's template metadata database (``loraflow.dev.db_template``): the first stack on SQLite
    migrates it, every later one (a demo the test starts too) copies it instead of migrating its own."""
    folder = tmp_path_factory.mktemp("airflow-db-template")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(DB_TEMPLATE_ENV, str(folder))
        yield folder


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A throwaway PostgreSQL on 127.0.0.1 for one module's Airflow (``loraflow.dev.local_postgres``);
    yields its SQLAlchemy URL."""
    with local_postgres.running() as url:
        yield url
