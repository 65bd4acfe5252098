"""The explicit answer-extraction rules of reinforge.envs.domains.answers, one by one."""

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from reinforge.envs.domains.answers import (
    answers_match,
    boxed_contents,
    extract_final_answer,
    normalize_answer,
    parse_number,
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
