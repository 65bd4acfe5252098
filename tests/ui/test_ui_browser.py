"""`reinforge ui` as a real process serving a recorded run: a token is needed, the rollout
browser filters (by reward too), a rollout shows its checks, its program's output and its
episode's turns, a problem's groups line up across versions, dead letters show their
reasons, and a completion holding HTML and script renders as text under a policy that
forbids scripts."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from ui_runs import EVIL, serving_ui

from reinforge.core import messages as m
from reinforge.core.msglog import LogRecord, LogWriter
from reinforge.envs.tools import TranscriptTurn, encode_transcript


def scored(task: str, i: int, version: int, reward: float, completion: str, *,
           domain: str = "math", checks: tuple[m.Check, ...] = (), at: float = 0.0,
           tier: int = 1, output: str = "", prompt: str = "") -> m.ScoredRollout:
    r = m.Rollout(rollout_id=f"{task}:{i}:1", task_id=task, sample_index=i, domain=domain,
                  tier=tier, prompt=prompt or f"prompt of {task}", completion=completion,
                  output_ids=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3], policy_version=version)
    return m.ScoredRollout(rollout=r, reward=reward,
                           outcome=m.Outcome.PASS if reward else m.Outcome.FAIL,
                           reason="checked", checks=list(checks), sent_at=at, output=output)


@pytest.fixture
def recorded_run(tmp_path) -> Path:
    episode = encode_transcript([TranscriptTurn(text="<tool_call>ls</tool_call>",
                                                observation="a.txt"),
                                 TranscriptTurn(text="Done.")])
    msgs = [scored("t1", 0, 1, 1.0, "#### 5", checks=(m.Check(name="answer", passed=True),),
                   at=1000.0, tier=0),
            m.WeightsPublished(version=1, path="/ckpt/1"),
            m.WeightsPublished(version=2, path="/ckpt/2"),
            m.Rollback(to_version=1, path="/ckpt/1", reason="math fell below 0.3"),
            scored("t1", 1, 3, 0.0, EVIL, at=1030.0, output=f"printed {EVIL}"),
            scored("t2", 0, 2, 1.0, episode, domain="terminal", at=1060.0),
            scored("t3", 0, 5, 0.5, "#### 5", at=1060.0, prompt="PROMPT  of T1"),  # t1 again
            m.DeadLetter(subject="rl.demo.rollout.math", reason="bad payload: no field x",
                         actor_id="verifier-0", deliveries=5)]
    path = tmp_path / "run.log"
    with LogWriter(path) as w:
        for i, msg in enumerate(msgs):
            w.write(LogRecord(subject="rl.demo.x", stream_seq=i + 1, payload=m.encode(msg)))
        w.write(LogRecord(subject="rl.demo.x", stream_seq=9, payload=b"\x01garbage"))
    return path


@pytest.fixture
def ui(recorded_run, tmp_path):
    with serving_ui(["--log", str(recorded_run)], tmp_path) as served:
        yield served.url, served.token


def test_every_page_needs_the_token_and_nothing_can_be_changed(ui):
    url, token = ui
    with httpx.Client(base_url=url) as c:
        assert c.get("/").status_code == 403
        assert c.get("/", params={"token": "wrong"}).status_code == 403
        ok = c.get("/", params={"token": token})
        assert ok.status_code == 200 and "math" in ok.text and "terminal" in ok.text
        assert c.get("/rollouts").status_code == 200  # the cookie from the first visit
        assert c.post("/rollouts").status_code == 405
    assert "1 records that did not decode" in ok.text


def test_the_overview_has_the_runs_pace_tier_mix_versions_and_rollbacks(ui):
    url, token = ui
    with httpx.Client(base_url=url, params={"token": token}) as c:
        overview = c.get("/").text
    assert "3.0 rollouts scored per minute" in overview  # 4 scored over 60 s
    assert "<td>t0 33% · t1 67%</td>" in overview  # math: one rollout at tier 0, two at 1
    assert "2 versions published; 1 rollbacks:" in overview
    assert "<li>to v1: math fell below 0.3</li>" in overview


def test_the_browser_filters_and_shows_a_rollout_its_task_and_the_dead_letters(ui):
    url, token = ui
    with httpx.Client(base_url=url, params={"token": token}) as c:
        failed = c.get("/rollouts", params={"outcome": "fail"}).text
        assert "t1:1:1" in failed and "t1:0:1" not in failed and "1 of 4" in failed
        one = c.get("/rollout", params={"id": "t1:0:1"}).text
        assert "#### 5" in one and "answer" in one and "-0.100, -0.200, -0.300" in one
        assert "<h2>program output</h2><p>none recorded</p>" in one
        printed = c.get("/rollout", params={"id": "t1:1:1"}).text
        assert "<pre>printed &lt;script&gt;" in printed
        episode = c.get("/rollout", params={"id": "t2:0:1"}).text
        assert "&lt;tool_call&gt;ls&lt;/tool_call&gt;" in episode
        assert "<pre class='env'>a.txt</pre>" in episode  # the observation, greyed
        dlq = c.get("/dlq").text
        assert "bad payload: no field x" in dlq and "verifier-0" in dlq


def test_rewards_filter_between_bounds_and_a_bad_bound_is_refused_by_name(ui):
    url, token = ui
    with httpx.Client(base_url=url, params={"token": token}) as c:
        def shown(**bounds):
            page = c.get("/rollouts", params=bounds).text
            return sorted(i for i in ("t1:0:1", "t1:1:1", "t2:0:1", "t3:0:1") if f">{i}<" in page)

        assert shown(min_reward="0.5") == ["t1:0:1", "t2:0:1", "t3:0:1"]
        assert shown(max_reward="0.5") == ["t1:1:1", "t3:0:1"]
        assert shown(min_reward="0.2", max_reward="0.8") == ["t3:0:1"]
        bad = c.get("/rollouts", params={"max_reward": "lots"})
        assert (bad.status_code, "max_reward: a number, got &#x27;lots&#x27;" in bad.text) == (
            400, True)


def test_a_problem_drawn_again_under_another_id_lines_up_with_its_first_groups(ui):
    url, token = ui
    with httpx.Client(base_url=url, params={"token": token}) as c:
        history = c.get("/task", params={"id": "t3"}).text  # any of its ids opens it
        assert history == c.get("/task", params={"id": "t1"}).text
        assert c.get("/task", params={"id": "nope"}).text.count("not in this run") == 1
    assert "2 groups of this problem (math, tier 0)" in history
    # by version: t1's groups at v1 and v3 (one row per group), then t3's at v5
    assert history.index(">t1:0:1<") < history.index(">t1:1:1<") < history.index(">t3:0:1<")
    assert "<tr><td>t1</td><td>v1</td><td>2</td><td>1</td><td>0.500</td></tr>" in history


def test_a_completion_holding_html_and_script_renders_as_text(ui):
    url, token = ui
    with httpx.Client(base_url=url, params={"token": token}) as c:
        r = c.get("/rollout", params={"id": "t1:1:1"})
    assert "<script" not in r.text.lower() and "<img" not in r.text.lower()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in r.text
    assert "&lt;b&gt;bold&lt;/b&gt;" in r.text
    assert "script-src" not in r.headers["content-security-policy"]  # none: default-src 'none'
    assert r.headers["content-security-policy"].startswith("default-src 'none'")
