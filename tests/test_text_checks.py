"""The one edge check of request texts (deploy/text_checks.py) that both encoderkit's routes and the
OpenAI-compatible ones call."""

from encoderkit.deploy.text_checks import text_problem


def test_text_problem_finds_the_first_problem_and_names_the_text():
    assert text_problem("texts", ["fine", "also fine"], 4, 100) is None
    assert text_problem("texts", [], 4, 100).code == "empty_input"
    assert text_problem("texts", [], 4, 100, allow_empty_list=True) is None
    assert text_problem("texts", ["a"] * 5, 4, 100).code == "too_many_texts"
    p = text_problem("input", ["ok", "  ", "x" * 500], 4, 100)
    assert (p.code, p.param) == ("empty_text", "input[1]")  # the first problem, in text order
    p = text_problem("input", ["ok", "bad \ud800 half"], 4, 100)
    assert (p.code, p.param) == ("invalid_text", "input[1]") and "(U+D800) at character 4" in p.message
    assert text_problem("texts", ["x" * 101], 4, 100).code == "text_too_long"
