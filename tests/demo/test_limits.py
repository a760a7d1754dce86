"""Input bounds of the demo: every mistake is a one-line DemoInputError that says what is allowed."""

import pytest

from flowrl.demo.limits import (
    DemoInputError,
    Limits,
    check_choice,
    check_float,
    check_int,
    parse_prompt_list,
    parse_seed_list,
)

LIMITS = Limits()


def test_prompts_one_per_line_blank_lines_skipped_whitespace_collapsed():
    assert parse_prompt_list("a red circle\n\n  two   blue squares \n", LIMITS) == ["a red circle", "two blue squares"]


@pytest.mark.parametrize("text, message", [
    ("", "enter a prompt"),
    ("  \n \n", "enter a prompt"),
    ("\n".join(f"p{i}" for i in range(LIMITS.max_prompts + 1)), f"at most {LIMITS.max_prompts} per request"),
    ("x" * (LIMITS.max_prompt_chars + 1), f"at most {LIMITS.max_prompt_chars}"),
])
def test_bad_prompts(text, message):
    with pytest.raises(DemoInputError, match=message):
        parse_prompt_list(text, LIMITS)


@pytest.mark.parametrize("text, seeds", [("4", [4]), ("0-3", [0, 1, 2, 3]), ("0,3,5", [0, 3, 5]),
                                         ("0-2, 7", [0, 1, 2, 7]), (5, [5])])
def test_seed_forms(text, seeds):
    assert parse_seed_list(text, LIMITS) == seeds


@pytest.mark.parametrize("text, message", [
    ("", "no seeds"), ("a", "bad seeds"), ("-3", "bad seed"), ("5-2", "bad seed range"), ("1,,2", "bad seeds"),
    ("0-8", "more than 8 seeds"), ("0-999999999999", "too large"), ("0-99999999", "more than 8 seeds"),
    ("1,1", "repeat a seed"),
])
def test_bad_seeds(text, message):
    with pytest.raises(DemoInputError, match=message):
        parse_seed_list(text, LIMITS)


def test_numbers_and_choices():
    assert check_int(20.0, "steps", 1, 100) == 20
    assert check_float("1.5", "guidance", 0, 30) == 1.5
    for bad in (0, 101, 2.5, "x", None, float("nan")):
        with pytest.raises(DemoInputError, match=r"steps must be a whole number in \[1, 100\]"):
            check_int(bad, "steps", 1, 100)
    for bad in (-1, 31, float("inf"), "x"):
        with pytest.raises(DemoInputError, match=r"guidance must be a number in \[0, 30\]"):
            check_float(bad, "guidance", 0, 30)
    with pytest.raises(DemoInputError, match="sampler must be one of ode, flow_sde"):
        check_choice("euler", "sampler", ("ode", "flow_sde"))
