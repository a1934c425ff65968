"""``specfit generate`` with a draft head: every method's greedy output equals AR's token for token
(float32), and every cycle's decision is labelled by what it did."""

import json

import pytest

from specfit.cli import main
from specfit.models.proxy import paths as proxy_paths

PROMPT = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"
METHODS = ["eagle3-vanilla", "eagle3", "eagle3-scan", "specfit", "oracle"]


def run_json(capsys, *argv) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
@pytest.mark.parametrize("slots,methods", [
    ("32", ["specfit"]),  # the transfer regime: specfit's first cycles are shadows
    ("all", METHODS),  # every expert resident: every method drafts from its first cycle
])
def test_every_method_equals_ar_token_for_token(capsys, slots, methods):
    strong = str(proxy_paths()["eagle3"])
    common = ["--draft", strong, "--prompt", PROMPT, "--max-new-tokens", "12", "--cache-slots", slots]
    ar = run_json(capsys, *common, "--method", "ar")
    assert ar["method"] == "ar" and len(set(ar["output_ids"])) > 1
    assert {c["decision"] for c in ar["cycles"]} == {"ar"} and ar["tau"] == 1.0  # an AR step is labelled one
    for method in methods:
        out = run_json(capsys, *common, "--method", method)
        assert out["method"] == method
        assert out["output_ids"] == ar["output_ids"], method
        assert out["text"] == ar["text"]
        committed = [c["committed"] for c in out["cycles"]]  # the last cycle's tokens past the limit are cut
        assert sum(committed[:-1]) < len(out["output_ids"]) <= sum(committed)
        drafted = [c for c in out["cycles"] if c["decision"] in ("draft", "explore")]
        assert all(c["levels"] > 0 for c in drafted), method  # "draft" only on cycles that drafted
        assert all(c["committed"] == 1 for c in out["cycles"] if c["decision"] in ("ar", "shadow")), method
        if method != "specfit" and method != "oracle":
            assert {c["decision"] for c in out["cycles"]} == {"draft"}, method
    if slots == "all":  # every expert resident: specfit drafts from its first cycle and commits > 1 token a cycle
        spec = run_json(capsys, *common)  # the default method with a draft is specfit
        assert spec["method"] == "specfit" and spec["tau"] > 1.0


def test_generate_text_output_names_tau_and_decisions(capsys):
    target = str(proxy_paths()["target"])
    assert main(["generate", "--model", target, "--prompt-ids", "1,2,3", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "method      ar: τ 1.00 tokens per cycle over 3 cycles (3 ar)" in out
    assert "ar:1 ar:1 ar:1" in out


def test_generate_text_output_starts_with_the_text_not_a_blank_line(capsys):
    """The proxy continues the README's prompt with a line break ("\\nAnswer: ..."): the printed text
    starts at its first non-blank line; the ids and --json keep the line break."""
    target = str(proxy_paths()["target"])
    argv = ["--model", target, "--prompt", "Question: 2 + 3 = ?", "--max-new-tokens", "2"]
    rep = run_json(capsys, *argv)
    assert rep["text"].startswith("\n") and rep["text"].strip()  # what the test is about: a leading line break
    assert main(["generate", *argv]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert lines[0] == rep["text"].lstrip("\n").split("\n")[0] != ""
    assert lines[1] == f"output_ids  {rep['output_ids']}"


@pytest.mark.parametrize("argv,needle", [
    (["--method", "specfit"], "--method: 'specfit' drafts: it needs a head, add --draft"),
    (["--method", "foo"], "--method: unknown method 'foo'; known: ar, ar+lookahead,"),
    (["--profile", "qwen3-30b-a3b-h200"], "--profile: prices the selection of draft trees: it needs --draft"),
    (["--draft", "/nonexistent/head"], "--draft: no EAGLE-3 head (config.json) in /nonexistent/head"),
])
def test_generate_draft_errors_name_the_flag(capsys, argv, needle):
    assert main(["generate", "--prompt-ids", "1,2", "--max-new-tokens", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
