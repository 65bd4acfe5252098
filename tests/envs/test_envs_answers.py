"""The explicit answer-extraction rules of reinforge.envs.domains.answers, one by one."""

from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from reinforge.envs.domains.answers import (
    SYMBOLIC_MAX_CHARS,
    agreement,
    answers_match,
    boxed_contents,
    extract_final_answer,
    judge_math,
    normalize_answer,
    parse_number,
    symbolically_equal,
)


def test_boxed_contents_respect_nested_braces():
    assert boxed_contents(r"so \boxed{\frac{1}{2}} and \fbox{3}") == [r"\frac{1}{2}", "3"]


def test_unclosed_box_is_not_an_answer():
    assert boxed_contents(r"\boxed{12") == []


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("2 + 3 = 5\n#### 5", "5"),
        (r"The result is \boxed{42}.", "42"),
        ("#### 5\nand again \\boxed{5.0}", "5.0"),  # consistent markers agree (boxed first)
        ("42", "42"),  # a bare number is its own answer
        ("-3/4", "-3/4"),
    ],
)
def test_marked_or_bare_answers_are_extracted(completion, answer):
    assert extract_final_answer(completion).answer == answer


def test_different_marked_answers_are_hedging_and_give_no_answer():
    ex = extract_final_answer("#### 3 #### 4")
    assert ex.answer is None and ex.rule == "ambiguous"
    assert extract_final_answer(r"\boxed{3} or maybe \boxed{4}").answer is None


def test_unmarked_prose_has_no_answer_even_with_numbers():
    ex = extract_final_answer("I think it is 12, or the last number 13")
    assert ex.answer is None and ex.rule == "missing"


@pytest.mark.parametrize(
    "raw, norm",
    [
        ("$42$", "42"),
        (r"\text{42}", "42"),
        ("1,234,567", "1234567"),
        ("x = 7", "7"),
        ("12.", "12"),
        (r"\$5", "5"),
        (r"\left(3\right)", "(3)"),
    ],
)
def test_normalisation_strips_formatting_only(raw, norm):
    assert normalize_answer(raw) == norm


@pytest.mark.parametrize(
    "s, value",
    [
        ("42", Fraction(42)),
        ("-0.5", Fraction(-1, 2)),
        ("3/4", Fraction(3, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"\dfrac{3}{4}", Fraction(3, 4)),
        (r"\frac12", Fraction(1, 2)),
        (r"-\frac{1}{2}", Fraction(-1, 2)),
        ("1.5e3", Fraction(1500)),
        ("50%", Fraction(50)),
        ("(7)", Fraction(7)),
    ],
)
def test_numbers_parse_exactly(s, value):
    assert parse_number(s) == value


@pytest.mark.parametrize("s", ["1 2", "3 or 4", "12abc", "1/0", "", "forty"])
def test_non_numbers_do_not_parse(s):
    assert parse_number(s) is None


@pytest.mark.parametrize(
    "got, expected",
    [
        ("0.5", "1/2"),
        (r"\frac{1}{2}", "0.5"),
        ("1,000", "1000"),
        ("42.0", "42"),
        ("PARIS", "paris"),
    ],
)
def test_equivalent_forms_match(got, expected):
    assert answers_match(got, expected)


@pytest.mark.parametrize(
    "got, expected",
    [("42.01", "42"), ("0.33", "1/3"), ("-42", "42"), ("4", "42"), ("42 43", "42"), ("", "42")],
)
def test_near_misses_do_not_match(got, expected):
    assert not answers_match(got, expected)


def test_tolerance_is_relative_to_the_expected_value():
    assert answers_match("100.4", "100", rel_tol=0.005)
    assert not answers_match("100.6", "100", rel_tol=0.005)
    assert answers_match("0.04", "0", abs_tol=0.05)


@given(
    num=st.integers(min_value=-(10**6), max_value=10**6),
    den=st.integers(min_value=1, max_value=10**4),
)
def test_every_written_form_of_a_rational_matches_and_its_neighbours_do_not(num, den):
    x = Fraction(num, den)
    expected = f"{x.numerator}/{x.denominator}"
    forms = [expected, rf"\frac{{{x.numerator}}}{{{x.denominator}}}", f"#### {expected}"]
    if x.denominator == 1:
        forms += [str(x.numerator), f"{x.numerator:,}", f"{x.numerator}.0"]
    for form in forms:
        got = extract_final_answer(form).answer
        assert got is not None and answers_match(got, expected), form
    for near in (x + Fraction(1, 10**6), x - Fraction(1, den + 1)):
        assert not answers_match(f"{near.numerator}/{near.denominator}", expected)


# -- graders' rules (6-8) and math-verify, as the math domain judges ---------------------

CASES = Path(__file__).with_name("data") / "math_equivalence.jsonl"


def test_the_math_judge_agrees_with_the_labelled_cases_and_never_passes_a_wrong_one():
    figures = agreement(str(CASES))
    assert figures["cases"] >= 150 and figures["false_positives"] == 0
    assert figures["agreement"] >= 0.95


@pytest.mark.parametrize("completion, expected", [
    (r"Answer \[ 9 \]", "9"), ("The answer is 9.", "9"), ("1 000", "1000"), ("1,22", "1.22"),
    (r"$\frac{1}{3} \text{meters}$", "1/3"), (r"$\sqrt3$", r"\sqrt{3}"), ("$[0,1)$", "[0,1)"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1"), ("2^{10}", "1024"),
])
def test_answers_graders_accept_are_accepted(completion, expected):
    assert judge_math(completion, expected).ok


@pytest.mark.parametrize("completion, expected, rule", [
    ("The answer is 3, or maybe 2", "2", "ambiguous"),   # two numbers: a hedge
    (r"$x=4$ or $x=-4$", "4", "ambiguous"),               # two spans: a hedge
    (r"\boxed{12} or \boxed{13}", "12", "ambiguous"),
    ("0.33", "1/3", "bare"),                               # plain numbers stay exact
    ("$[0,1]$", "[0,1)", "span"),
])
def test_hedges_and_near_misses_still_fail(completion, expected, rule):
    judged = judge_math(completion, expected)
    assert (judged.ok, judged.rule) == (False, rule)


def test_an_answer_too_long_for_sympy_is_not_tried():
    short, long = "+".join(["x"] * 3), "+".join(["x"] * 300)
    assert symbolically_equal(short, "3x")
    assert len(long) > SYMBOLIC_MAX_CHARS and not symbolically_equal(long, long)
