"""Review marks that flow back into training: `reinforge ui --run R --review` as a real process
against the session's nats-server and a run stream of scored rollouts. A mark sent from the
page is stored in the run's log (`reinforge log export` has it), shows on its rollout, is
counted per domain, and `reinforge log reviews` turns the marks into a set that the
reward-model trainer and SFT read. The page also follows the run: a rollout scored after it
opened appears."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from ui_runs import EVIL, publish, scored

from reinforge.envs.domain import DomainRegistry
from reinforge.rl.evalsets import HeldOutConfig, build_heldout
from reinforge.rl.reward_model import Graded, load_rows
from reinforge.rl.sft import Demo, demos_from_jsonl

pytestmark = pytest.mark.nats


def reinforge(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "reinforge", *args], capture_output=True,
                          text=True, timeout=120, **kw)


@pytest.fixture
def page(live_ui):
    with httpx.Client(base_url=live_ui.url, params={"token": live_ui.token}) as c:
        yield c, live_ui.token


def wait_for_text(c: httpx.Client, path: str, params: dict, text: str) -> str:
    """The page once it shows `text` (the UI reads the run's stream every 2 s)."""
    deadline = time.monotonic() + 30
    while True:
        page = c.get(path, params=params).text
        if text in page:
            return page
        assert time.monotonic() < deadline, f"{text!r} never appeared on {path}"
        time.sleep(0.2)


def test_a_mark_sent_from_the_page_is_stored_in_the_log_and_exported_as_a_review_set(
        page, creds_file, run_name, tmp_path):
    c, token = page
    page = c.get("/rollout", params={"id": "2+2:0:1"}).text
    assert "action='/review'" in page and f"value='{token}'" in page
    form = {"token": token, "rollout_id": "2+2:0:1", "kind": "wrong_reward",
            "corrected_reward": "0", "note": "2+2 is 4, not 5"}
    sent = c.post("/review", data=form, follow_redirects=False)
    assert sent.status_code == 303 and "sent=1" in sent.headers["location"]
    assert c.post("/review", data=form, follow_redirects=False).status_code == 303  # stored once
    good = {"token": token, "rollout_id": "3+3:0:1", "kind": "wrong_reward",
            "corrected_reward": "1", "note": "right"}
    exploit = {"token": token, "rollout_id": "doc:0:1", "kind": "exploit", "note": "empty {}"}
    for f in (good, exploit):
        assert c.post("/review", data=f, follow_redirects=False).status_code == 303

    shown = wait_for_text(c, "/rollout", {"id": "2+2:0:1"}, "2+2 is 4, not 5")
    assert "wrong_reward" in shown and "ann" in shown
    wait_for_text(c, "/rollout", {"id": "doc:0:1"}, "empty {}")  # the last mark sent
    rows = c.get("/").text.split("<tr>")
    marks_on = {d: next(r for r in rows if f">{d}</a>" in r).split("</tr>")[0].rsplit("<td>")[-1]
                for d in ("math", "docqa")}
    assert marks_on == {"math": "2</td>", "docqa": "1</td>"}  # the last column: review marks

    log = tmp_path / "run.log"
    out = reinforge("log", "export", "--run", run_name, "--creds", str(creds_file), "-o", str(log))
    assert out.returncode == 0, out.stderr
    marks = [json.loads(line) for line in reinforge("log", "show", str(log), "--json",
                                                    "--type", "ReviewMark").stdout.splitlines()]
    assert len(marks) == 3  # the repeated post was deduplicated by its message id

    every = tmp_path / "reviews.jsonl"
    out = reinforge("log", "reviews", str(log), "-o", str(every))
    assert out.returncode == 0 and "wrote 3 reviewed rollouts" in out.stdout, out.stderr
    assert load_rows(every) == [Graded("what is 2+2?", "#### 5", 0.0),
                                Graded("what is 3+3?", "#### 6", 1.0),
                                Graded("what is doc?", EVIL, 0.0)]
    imitate = tmp_path / "sft.jsonl"
    assert reinforge("log", "reviews", str(log), "-o", str(imitate), "--min-score", "1"
                     ).returncode == 0
    assert demos_from_jsonl(imitate) == [Demo("what is 3+3?", "#### 6")]

    # the reviewed problems join the held-out sets, as tasks their domain verifies
    registry = DomainRegistry.default()
    sets = build_heldout(registry, ["math"], HeldOutConfig(tasks_per_tier=1, tiers=[1],
                                                           review_sets=[str(every)]))
    reviewed = [t for t in sets["math"] if t.task_id.startswith("reviewed-")]
    assert [(t.task_id, t.tier, t.prompt) for t in reviewed] == [
        ("reviewed-2+2", 1, "what is 2+2?"), ("reviewed-3+3", 1, "what is 3+3?")]
    assert len(sets["math"]) == 3  # and the one generated task of tier 1
    math = registry.get("math")
    assert [math.score(t, "#### 4").reward for t in reviewed] == [1.0, 0.0]


def test_a_bad_review_form_is_refused_naming_what_is_wrong(page):
    c, token = page
    base = {"token": token, "rollout_id": "2+2:0:1", "kind": "wrong_reward",
            "corrected_reward": "0.5"}
    for change, status, says in [({"token": "stolen"}, 403, "token"),
                                 ({"corrected_reward": "lots"}, 400, "corrected_reward"),
                                 ({"corrected_reward": "2"}, 400, "corrected_reward"),
                                 ({"kind": "meh"}, 400, "kind"),
                                 ({"rollout_id": "nope"}, 400, "rollout_id")]:
        r = c.post("/review", data={**base, **change}, follow_redirects=False)
        assert (r.status_code, says in r.text) == (status, True), (change, r.text)
    assert c.get("/review").status_code == 405


def test_the_page_follows_the_run(page, creds, run_name):
    c, _ = page
    assert "late:0:1" not in c.get("/rollouts").text
    publish(creds, run_name, [scored("late", 1.0, "#### 7")])
    assert "4 of 4" in wait_for_text(c, "/rollouts", {}, "late:0:1")


def test_a_problems_groups_issued_at_different_versions_line_up_on_its_page(
        page, creds, run_name):
    c, _ = page
    publish(creds, run_name, [scored("7*6@40", 1.0, "#### 42", version=9),
                              scored("7*6@3", 0.0, "#### 36", version=1)])
    wait_for_text(c, "/rollouts", {}, "7*6@40:0:1")
    history = c.get("/task", params={"id": "7*6@3"}).text  # either issue's id opens it
    assert "2 groups of this problem" in history
    assert history.index(">7*6@3:0:1<") < history.index(">7*6@40:0:1<")  # by version: v1, v9


def test_review_marks_need_a_run(tmp_path):
    out = reinforge("ui", "--log", str(tmp_path / "x.log"), "--review")
    assert out.returncode == 2 and "--review needs --run" in out.stderr
