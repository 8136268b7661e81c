"""The model_overrides allow-list against MaxText itself (issue 29, item 4): every allowed key is a
setting of MaxText's base.yml whose default is of the kind the list says, and of base.yml's settings
only the allowed ones pass (654 of 786 passed the word-based deny rule before)."""

from __future__ import annotations

from importlib import resources
from typing import Any

import pytest
import yaml

pytest.importorskip("maxtext")

from loraflow.spec import override_rules


def base_config() -> dict[str, Any]:
    return yaml.safe_load((resources.files("maxtext") / "configs" / "base.yml").read_text())


def test_every_allowed_override_is_a_maxtext_setting_of_its_kind() -> None:
    base = base_config()
    for key, allowed in override_rules.ALLOWED.items():
        assert key in base, key
        default = base[key]
        if allowed.kind is str:
            assert default in allowed.choices, (key, default)
        else:
            assert type(default) is allowed.kind, (key, default)


def test_of_maxtexts_settings_only_the_allowed_pass() -> None:
    base = base_config()
    passing = {key for key, value in base.items() if override_rules.problem(key, value) is None}
    assert set(override_rules.ALLOWED) <= set(base)
    # Every allowed key passes with its default, but Gemma 3's window: base.yml's 0 (none) is no model's shape.
    assert passing == set(override_rules.ALLOWED) - {"sliding_window_size"}
    assert len(base) > 700 and len(passing) < 40
