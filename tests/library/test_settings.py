"""popcontract.settings: one way to read a setting, one kind of error for a bad value."""

from __future__ import annotations

import math

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


def test_given_is_the_value_even_empty_and_none_when_unset() -> None:
    assert settings.passed("X", "d", env={"X": ""}) == "" and settings.passed("X", "d", env={}) == "d"
    assert settings.given("X", env={"X": ""}) == "" and settings.given("X", env={"X": "0"}) == "0"
    assert settings.given("X", env={}) is None


@pytest.mark.parametrize("raw, expect", [(None, "d"), ("", "d"), (" a b ", " a b "), ("/p", "/p")])
def test_text_is_the_value_as_set_and_the_default_when_unset_or_empty(raw: str | None, expect: str) -> None:
    assert settings.text("X", "d", env={} if raw is None else {"X": raw}) == expect
    assert settings.text("X", env={}) == ""


@pytest.mark.parametrize("raw, default, expect", [(None, True, True), (None, False, False), ("", True, True),
                                                  ("", False, False), ("0", True, False), (" 1 ", False, True)])
def test_flag_is_0_or_1(raw: str | None, default: bool, expect: bool) -> None:
    assert settings.flag("F", default, env={} if raw is None else {"F": raw}) is expect


@pytest.mark.parametrize("raw", ["2", "yes", "true", "-1"])
def test_anything_else_is_no_flag(raw: str) -> None:
    with pytest.raises(PopdistEnvError) as info:
        settings.flag("F", False, env={"F": raw})
    assert str(info.value) == f"F={raw!r} must be 0 or 1"


@pytest.mark.parametrize("raw, expect", [(None, 9.0), (" ", 9.0), ("1.5", 1.5), (" 2 ", 2.0), ("1e-3", 0.001),
                                         ("inf", math.inf)])
def test_seconds_are_positive_or_infinite(raw: str | None, expect: float) -> None:
    assert settings.seconds("T", 9.0, env={} if raw is None else {"T": raw}) == expect


@pytest.mark.parametrize("raw, message", [
    ("x", "T='x' is not a number of seconds (use a positive number or inf)"),
    (" 0 ", "T='0' must be a positive number of seconds (or inf)"),
    ("-2", "T='-2' must be a positive number of seconds (or inf)"),
    ("nan", "T='nan' must be a positive number of seconds (or inf)"),
    ("-inf", "T='-inf' must be a positive number of seconds (or inf)"),
])
def test_other_seconds_name_the_variable_the_value_and_what_is_valid(raw: str, message: str) -> None:
    with pytest.raises(PopdistEnvError) as info:
        settings.seconds("T", 9.0, env={"T": raw})
    assert str(info.value) == message


def test_an_argument_in_seconds_follows_the_same_rule() -> None:
    assert settings.positive_seconds("timeout", 2) == 2.0
    for wrong, says in [(True, "is not a number"), (None, "is not a number"), ("x", "is not a number"),
                        (0, "must be a positive"), (float("nan"), "must be a positive")]:
        with pytest.raises(ValueError, match=f"^timeout={wrong!r} {says}"):
            settings.positive_seconds("timeout", wrong)
