"""popcontract.settings: one way to read a setting, one kind of error for a bad value."""

from __future__ import annotations

import pytest

from popcontract import settings
from popcontract.settings import PopdistEnvError


@pytest.mark.parametrize("raw, expect", [(None, 7), ("", 7), ("  ", 7), ("3", 3), (" 4 ", 4), ("0", 0)])
def test_integer_reads_whole_numbers_and_defaults_when_unset(raw: str | None, expect: int) -> None:
    env = {} if raw is None else {"X": raw}
    assert settings.integer("X", 7, env=env) == expect
    assert settings.optional_integer("X", env=env) == (None if expect == 7 else expect)


@pytest.mark.parametrize("raw, message", [
    ("x", "X='x' is not an integer (use a whole number >= 1)"),
    ("1.5", "X='1.5' is not an integer (use a whole number >= 1)"),
    ("0", "X='0' must be >= 1"),
    ("-2", "X='-2' must be >= 1"),
])
def test_integer_names_the_variable_the_value_and_what_is_valid(raw: str, message: str) -> None:
    with pytest.raises(PopdistEnvError) as info:
        settings.integer("X", 1, minimum=1, env={"X": raw})
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_integer_reads_the_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POPDIST_TEST_SETTING", "5")
    assert settings.integer("POPDIST_TEST_SETTING", 1) == 5


def test_choice_ignores_case_and_spaces_and_names_the_choices() -> None:
    assert settings.choice("E", ("auto", "threads"), "auto", env={}) == "auto"
    assert settings.choice("E", ("auto", "threads"), "auto", env={"E": " Threads "}) == "threads"
    with pytest.raises(PopdistEnvError) as info:
        settings.choice("E", ("auto", "threads"), "auto", env={"E": "fast"})
    assert str(info.value) == "E='fast' is not one of auto, threads"
