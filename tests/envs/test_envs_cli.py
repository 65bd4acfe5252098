"""`reinforge envs list` and `reinforge verify`, end to end through the CLI."""

import json
from pathlib import Path

import pytest

from reinforge.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_envs_list_json_lists_the_five_domains_with_tiers(capsys):
    code, out, _ = run_cli(capsys, "envs", "list", "--json")
    assert code == 0
    domains = {d["name"]: d for d in json.loads(out)["domains"]}
    assert {"math", "code", "docqa", "terminal", "judge"} <= set(domains)
    for d in domains.values():
        assert "error" not in d, d
        assert d["tiers"][0]["level"] == 0 and d["tiers"][0]["description"]


def test_envs_sample_prints_tasks_with_references(capsys):
    code, out, _ = run_cli(capsys, "envs", "sample", "--domain", "math", "-n", "3", "--seed", "1")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(rows) == 3 and all(r["reference"] for r in rows)


@pytest.mark.parametrize(
    "domain, expected",
    [
        ("math", {"n": 5, "passed": 3, "failed": 2, "errors": 0}),
        ("docqa", {"n": 3, "passed": 1, "failed": 2, "errors": 0}),
        ("judge", {"n": 4, "passed": 2, "failed": 2, "errors": 0}),
    ],
)
def test_verify_scores_the_example_sets_and_ends_with_a_json_summary(capsys, domain, expected):
    code, out, err = run_cli(
        capsys, "verify", "--domain", domain, str(EXAMPLES / f"{domain}_sample.jsonl"), "--json"
    )
    assert code == 0
    lines = out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert {k: summary[k] for k in expected} == expected
    assert summary["per_s"] > 0
    assert len(lines) == expected["n"] + 1
    assert "verify:" in err


def test_verify_code_humaneval_jsonl(capsys, runner_kind):
    sandbox = "podman" if runner_kind == "podman" else "unsafe-local"
    code, out, _ = run_cli(
        capsys,
        "verify",
        "--domain",
        "code",
        "--sandbox",
        sandbox,
        "--jobs",
        "2",
        str(EXAMPLES / "code_humaneval_sample.jsonl"),
        "--json",
    )
    assert code == 0
    rows = [json.loads(line) for line in out.strip().splitlines()]
    summary = rows.pop()
    assert (summary["n"], summary["passed"], summary["failed"], summary["errors"]) == (9, 4, 4, 1)
    by_id = {r["task_id"]: r["outcome"] for r in rows}
    assert by_id["Example/2-print"] == "fail" and by_id["Example/2-exit"] == "fail"
    assert by_id["Example/2-loop"] == "timeout" and by_id["2"] == "pass"


def test_verify_refuses_a_malformed_file_naming_the_line(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"question": "1+1?", "answer": "2", "completion": "#### 2"}\n'
        '{"question": "2+2?", "answer": "4"}\n'
    )
    code, out, err = run_cli(capsys, "verify", "--domain", "math", str(path))
    assert code == 2 and "bad.jsonl:2: needs a string `completion`" in err and out == ""


def test_verify_refuses_an_unknown_domain(capsys, tmp_path):
    code, _, err = run_cli(capsys, "verify", "--domain", "chess", str(tmp_path / "x.jsonl"))
    assert code == 2 and "unknown; known domains:" in err


def test_verify_terminal_transcripts(capsys, runner_kind):
    sandbox = "podman" if runner_kind == "podman" else "unsafe-local"
    code, out, _ = run_cli(
        capsys,
        "verify",
        "--domain",
        "terminal",
        "--sandbox",
        sandbox,
        str(EXAMPLES / "terminal_sample.jsonl"),
        "--json",
    )
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and (summary["n"], summary["passed"], summary["failed"]) == (4, 2, 2)
