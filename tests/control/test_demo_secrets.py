"""The demo's Airflow secrets (admin password, its passwords file, the JWT secret) are readable by
their owner only, from the moment they exist, whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraflow.dev.demo import LocalAirflow


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)  # the most permissive: a mode given at creation is all that protects the file
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_secret_files_are_created_owner_only(tmp_path: Path, open_umask: None) -> None:
    airflow = LocalAirflow(tmp_path / "home", {})
    for name in ("admin_password", "passwords.json", "jwt_secret"):
        assert mode(tmp_path / "home" / name) == 0o600, name
    assert airflow.password in (tmp_path / "home" / "passwords.json").read_text()
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["admin_password", "jwt_secret", "passwords.json"]


def test_a_world_readable_passwords_file_of_an_older_demo_is_replaced_owner_only(
    tmp_path: Path, open_umask: None
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "passwords.json").write_text('{"admin": "old"}')
    (home / "passwords.json").chmod(0o644)
    airflow = LocalAirflow(home, {})
    assert mode(home / "passwords.json") == 0o600
    assert airflow.password in (home / "passwords.json").read_text()
