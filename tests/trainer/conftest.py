"""Fixtures the trainer modules share."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny Llama made, its chat dataset written (train and eval, as validate_data writes them) and
    the model converted for MaxText, once per run: every module that trains it reads these files and
    writes only under folders of its own."""
    from test_trainer_steps import _tiny_base

    return _tiny_base(tmp_path_factory.mktemp("trainer"))
