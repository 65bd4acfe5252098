"""The monitor: its bookkeeping alone, its Prometheus text, and the actor on a real bus."""

from __future__ import annotations

import functools
import io
import json
import re
from pathlib import Path

import httpx
import pytest
import trio
from reinforge.metrics import writers as mx
from reinforge.actors.monitor import (
    Monitor,
    MonitorConfig,
    MonitorState,
    Snapshot,
    prometheus_samples,
    read_endpoint,
    read_snapshot,
    render_line,
    render_rich,
    tensorboard_scalars,
)
from reinforge.core import messages as m
from reinforge.core import subjects
from reinforge.core.actor import run_actor
from reinforge.core.bus import open_bus


def scored(domain: str, i: int, *, tier: int = 0, reward: float = 1.0,
           outcome: m.Outcome = m.Outcome.PASS, version: int = 0, tokens: int = 4,
           task: str = "t") -> m.ScoredRollout:
    rollout = m.Rollout(
        rollout_id=f"{task}{i}:0:1", task_id=f"{task}{i}", sample_index=0, domain=domain,
        tier=tier, prompt="p", completion="c", output_ids=list(range(tokens)),
        policy_version=version,
    )
    return m.ScoredRollout(rollout=rollout, reward=reward, outcome=outcome)


def heartbeat(actor_id: str, actor_type: str, *, cpu: float, rss: int,
              figures: dict[str, float] | None = None) -> m.Heartbeat:
    return m.Heartbeat(actor_id=actor_id, actor_type=actor_type, host="h", pid=42,
                       started_at=0.0, process=m.ProcessFigures(cpu_percent=cpu, rss_bytes=rss),
                       figures=figures or {})


# ----------------------------------------------------------------------------- state alone


def test_the_window_gives_reward_pass_rate_tier_mix_and_staleness_per_domain():
    st = MonitorState("r", window_s=10.0, started_at=100.0)
    st.on_weights(m.WeightsPublished(version=5, path="/w5"), now=100.0)
    st.on_scored(scored("math", 0, tier=1, reward=1.0, version=5), now=101.0)
    st.on_scored(scored("math", 1, tier=1, reward=0.0, outcome=m.Outcome.FAIL, version=3),
                 now=102.0)
    st.on_scored(scored("math", 2, tier=2, reward=0.0, outcome=m.Outcome.INFRA_ERROR,
                        version=4, tokens=10), now=103.0)
    st.on_scored(scored("code", 0, tier=0, reward=0.5, outcome=m.Outcome.FAIL, version=5),
                 now=104.0)
    snap = st.snapshot(now=105.0)
    assert snap.policy_version == 5 and snap.samples_total == 4
    assert snap.samples_per_s == pytest.approx(4 / 5.0)  # 5 s since start < window
    assert snap.tokens_per_s == pytest.approx((4 + 4 + 10 + 4) / 5.0)
    assert snap.staleness_mean == pytest.approx((0 + 2 + 1 + 0) / 4)
    assert snap.staleness_max == 2
    math_ = next(d for d in snap.domains if d.domain == "math")
    assert math_.reward_mean == pytest.approx(0.5)  # the infra error is masked
    assert math_.pass_rate == pytest.approx(0.5)
    assert math_.infra_errors == 1 and math_.tokens == 18
    assert math_.tier_mix == {"1": pytest.approx(2 / 3), "2": pytest.approx(1 / 3)}
    assert [d.domain for d in snap.domains] == ["code", "math"]
    # the window slides: at t=112.5 only the samples after t=102.5 remain
    later = st.snapshot(now=112.5)
    math_ = next(d for d in later.domains if d.domain == "math")
    assert math_.samples == 3 and math_.reward_mean is None and math_.tier_mix == {"2": 1.0}
    assert later.samples_per_s == pytest.approx(2 / 10.0)


def test_stats_seen_on_two_subjects_are_recorded_once_and_evals_keep_first_and_last():
    st = MonitorState("r")
    ev = functools.partial(m.EvalStats, domain="math", pass_at_k=0.9, k=4, n_tasks=8)
    assert st.on_stats(ev(version=2, pass_at_1=0.5), 1.0)["kind"] == "eval"
    assert st.on_stats(ev(version=2, pass_at_1=0.5), 1.1) is None
    st.on_stats(ev(version=0, pass_at_1=0.2), 1.2)
    st.on_stats(ev(version=4, pass_at_1=0.7), 1.3)
    train = m.TrainStats(version=3, step=7, loss=0.25, figures={"kl": 0.01})
    assert st.on_stats(train, 2.0) == {"t": 2.0, "kind": "train", "epoch": 0, "version": 3,
                                       "step": 7, "loss": 0.25, "figures": {"kl": 0.01}}
    assert st.on_stats(train, 2.1) is None
    assert st.on_stats(m.Echo(seq=1), 2.2) is None and st.unknown_stats == 1
    d = st.snapshot(3.0).domains[0]
    assert (d.eval_first_version, d.eval_first_pass_at_1) == (0, 0.2)
    assert (d.eval_version, d.eval_pass_at_1, d.eval_pass_at_k) == (4, 0.7, 0.9)
    assert st.snapshot(3.0).train_figures == {"kl": 0.01}


def test_a_version_number_evaluated_again_after_a_rollback_is_recorded_and_is_the_latest():
    """After a rollback to v2 the learner's numbers restart: v4 and step 7 come back in
    epoch 1. They are other weights, so their stats are new records, and the latest."""
    st = MonitorState("r")
    ev = functools.partial(m.EvalStats, domain="math", version=4, pass_at_k=0.9, k=4,
                           n_tasks=8)
    train = functools.partial(m.TrainStats, version=4, step=7, loss=0.25)
    st.on_stats(ev(pass_at_1=0.7), 1.0)
    st.on_stats(train(figures={"kl": 0.01}), 1.1)
    again = st.on_stats(ev(pass_at_1=0.3, epoch=1), 2.0)
    assert (again["epoch"], again["version"], again["pass_at_1"]) == (1, 4, 0.3)
    assert st.on_stats(train(figures={"kl": 0.02}, epoch=1), 2.1)["epoch"] == 1
    assert st.on_stats(ev(pass_at_1=0.3, epoch=1), 2.2) is None  # its second subject
    snap = st.snapshot(3.0)
    assert (snap.domains[0].eval_version, snap.domains[0].eval_pass_at_1) == (4, 0.3)
    assert (snap.domains[0].eval_first_version, snap.domains[0].eval_first_pass_at_1) == (4, 0.7)
    assert snap.train_figures == {"kl": 0.02}


def test_a_rollback_sets_the_version_back_and_is_counted():
    st = MonitorState("r")
    st.on_weights(m.WeightsPublished(version=6, path="/w6"), 1.0)
    rec = st.on_weights(m.Rollback(to_version=4, path="/w4", reason="math fell"), 2.0)
    assert rec == {"t": 2.0, "kind": "rollback", "to_version": 4, "reason": "math fell"}
    snap = st.snapshot(3.0)
    assert (snap.policy_version, snap.rollbacks) == (4, 1)


def test_the_eta_extrapolates_the_rate_of_new_versions_to_the_target():
    st = MonitorState("r", target_version=10, started_at=0.0)
    assert st.snapshot(1.0).eta_s is None  # no version seen yet
    st.on_weights(m.WeightsPublished(version=0, path="/0"), 0.0)
    st.on_weights(m.WeightsPublished(version=2, path="/2"), 20.0)  # 10 s per version
    assert st.snapshot(20.0).eta_s == pytest.approx(80.0)
    assert st.snapshot(25.0).eta_s == pytest.approx(75.0)
    st.on_weights(m.WeightsPublished(version=10, path="/10"), 30.0)
    assert st.snapshot(31.0).eta_s == 0.0


def test_processes_and_queue_figures_come_from_fresh_heartbeats_only():
    st = MonitorState("r", process_timeout_s=5.0)
    st.on_heartbeat(heartbeat("s1", "sampler", cpu=150.0, rss=300 << 20,
                              figures={"samples_per_s": 2.0, "generations_held": 3.0}), 10.0)
    st.on_heartbeat(heartbeat("s2", "sampler", cpu=50.0, rss=200 << 20,
                              figures={"generations_held": 1.0}), 10.0)
    st.on_heartbeat(heartbeat("old", "learner", cpu=99.0, rss=1, figures={"queue": 9.0}), 1.0)
    st.set_consumer_queues({"sampler-task_any.pending": 12.0})
    snap = st.snapshot(11.0)
    assert [p.actor_id for p in snap.processes] == ["s1", "s2"]
    assert snap.processes[0].cpu_percent == 150.0 and snap.processes[0].rss_bytes == 300 << 20
    assert snap.queues == {"sampler.generations_held": 4.0, "sampler-task_any.pending": 12.0}


# ----------------------------------------------------------------------------- prometheus


def test_prometheus_text_has_one_help_and_type_per_family_and_escaped_labels():
    text = mx.prometheus_text([
        mx.Sample(name="rf_reward", value=0.5, labels={"domain": 'ma"th'}, help="Mean\nreward"),
        mx.Sample(name="rf_reward", value=1, labels={"domain": "code"}),
        mx.Sample(name="rf_seen_total", value=3, kind="counter"),
        mx.Sample(name="samples/s", value=float("nan"), labels={"0bad-name": "x\\y"}),
    ])
    assert text == (
        "# HELP rf_reward Mean\\nreward\n"
        "# TYPE rf_reward gauge\n"
        'rf_reward{domain="ma\\"th"} 0.5\n'
        'rf_reward{domain="code"} 1\n'
        "# TYPE rf_seen_total counter\n"
        "rf_seen_total 3\n"
        "# TYPE samples_s gauge\n"
        'samples_s{_0bad_name="x\\\\y"} NaN\n'
    )


def test_prometheus_text_refuses_an_unknown_metric_kind():
    with pytest.raises(ValueError, match="rf_x: kind must be 'gauge' or 'counter'"):
        mx.prometheus_text([mx.Sample(name="rf_x", value=1, kind="histogram")])


def test_jsonl_reader_skips_a_torn_last_line_but_not_a_corrupt_middle(tmp_path):
    path = tmp_path / "m.jsonl"
    w = mx.JsonlWriter(path)
    w.write({"t": 1.0, "kind": "a", "x": float("inf")})
    w.write({"t": 2.0, "kind": "b"})
    w.close()
    with open(path, "a") as f:
        f.write('{"t": 3.0, "ki')
    assert [r["kind"] for r in mx.read_jsonl(path)] == ["a", "b"]
    assert next(mx.read_jsonl(path))["x"] is None  # inf is not JSON: written as null
    path.write_text('{"t":1,"kind":"a"}\nnot json\n{"t":2,"kind":"b"}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2: not a JSON object"):
        list(mx.read_jsonl(path))


def test_a_bad_monitor_config_is_refused_with_the_field_named():
    with pytest.raises(ValueError, match="snapshot_interval_s must be > 0"):
        MonitorConfig(snapshot_interval_s=0)
    with pytest.raises(ValueError, match="port must be -1..65535"):
        MonitorConfig(port=70000)


# ----------------------------------------------------------------------------- rendering


def _snapshot() -> tuple[MonitorState, Snapshot]:
    st = MonitorState("demo", target_version=4, started_at=0.0)
    st.on_weights(m.WeightsPublished(version=1, path="/1"), 0.0)
    st.on_weights(m.WeightsPublished(version=2, path="/2"), 10.0)
    st.on_scored(scored("math", 0, tier=1, version=1), 11.0)
    st.on_stats(m.EvalStats(version=2, domain="math", pass_at_1=0.6, pass_at_k=0.8, k=4,
                            n_tasks=5), 11.0)
    st.on_heartbeat(heartbeat("sampler-1", "sampler", cpu=80.0, rss=100 << 20), 11.0)
    st.set_consumer_queues({"sampler-task_any.pending": 7.0})
    return st, st.snapshot(12.0)


def test_the_plain_line_shows_version_rate_domains_queues_and_eta():
    line = render_line(_snapshot()[1])
    assert line.startswith("[demo 0m12s] | v2 | ")
    assert "math: r 1.00 pass 1.00 tier 1.0 [t1:100%] eval@1 0.60" in line
    assert "queues sampler-task_any.pending=7" in line
    assert "ETA 0m18s" in line  # 2 versions left at 10 s each, 2 s already spent
    assert "\n" not in line


def test_the_rich_view_renders_domains_queues_and_processes():
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(render_rich(_snapshot()[1]))
    text = out.getvalue()
    for words in ("policy v2", "math", "0.60→0.60 (v2)", "sampler-task_any.pending",
                  "sampler-1", "t1:100%"):
        assert words in text, words


def test_prometheus_samples_of_a_state_parse_as_valid_exposition_lines():
    st, snap = _snapshot()
    text = mx.prometheus_text(prometheus_samples(st, snap))
    assert 'reinforge_policy_version{run="demo"} 2' in text
    assert 'reinforge_scored_total{domain="math",outcome="pass",run="demo"} 1' in text
    assert 'reinforge_eval_pass_at_1{domain="math",run="demo"} 0.6' in text
    assert 'reinforge_queue_depth{queue="sampler-task_any.pending",run="demo"} 7' in text
    check_exposition(text)


def check_exposition(text: str) -> None:
    """Every line is a comment (HELP/TYPE) or `name{labels} number`; TYPE precedes samples."""
    import re

    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*"'
                        r'(,[a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*")*)\})? (\S+)$')
    typed: set[str] = set()
    for line in text.rstrip("\n").split("\n"):
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind in ("gauge", "counter") and name not in typed, line
            typed.add(name)
        elif line.startswith("# HELP "):
            continue
        else:
            match = sample.match(line)
            assert match, f"not an exposition line: {line!r}"
            assert match.group(1) in typed, f"sample before its TYPE: {line!r}"
            float(match.group(7).replace("Inf", "inf"))


# ----------------------------------------------------------------------------- on the bus


@pytest.mark.nats
@pytest.mark.filterwarnings("ignore::DeprecationWarning:tensorboard.*")
def test_the_monitor_turns_bus_messages_into_jsonl_prometheus_and_tensorboard(
    creds, run_name, tmp_path
):
    run_dir = tmp_path / "run"
    cfg = MonitorConfig(run_dir=str(run_dir), snapshot_interval_s=0.2, window_s=600.0)

    def get(url: str) -> httpx.Response:
        return httpx.get(url, timeout=5.0)

    async def main():
        async with open_bus(creds) as bus:
            stream = await bus.ensure_run_stream(run_name)
            # weights published BEFORE the monitor starts: it reads the newest at start-up
            await bus.publish_durable(subjects.weights(run_name),
                                      m.WeightsPublished(version=3, path="/w3"), "weights:3")
            # a task queue with 5 tasks, 2 of them taken by a sampler and not yet acked
            for i in range(5):
                task = m.Task(task_id=f"q{i}", domain="math", tier=0, prompt="p")
                await bus.publish_durable(subjects.task(run_name, "math"), task, f"task:q{i}:1")
            async with bus.pull_consumer(stream=stream, durable="sampler-task_any",
                                         filter_subject=subjects.task(run_name, "*")) as c:
                taken = []
                with trio.fail_after(20):
                    while len(taken) < 2:
                        taken += await c.fetch(2 - len(taken), timeout_s=1.0)
                async with trio.open_nursery() as nursery:
                    done = trio.Event()

                    async def monitor():
                        await run_actor(Monitor, creds=creds, run=run_name, config=cfg)
                        done.set()

                    await nursery.start(_started, monitor, run_dir)
                    await feed_run(bus, run_name)
                    endpoint = read_endpoint(run_dir)
                    assert endpoint is not None and endpoint["port"] > 0
                    url = f"http://127.0.0.1:{endpoint['port']}"
                    with trio.fail_after(30):
                        while True:
                            snap = json.loads((await trio.to_thread.run_sync(
                                get, f"{url}/snapshot.json")).text)
                            queues = snap["queues"]
                            if (snap["samples_total"] == 6 and snap["train_step"] == 11
                                    and len(snap["domains"]) == 2
                                    and snap["domains"][1]["eval_pass_at_1"] is not None
                                    and queues.get("sampler-task_any.in_flight") == 2.0
                                    and any(p["actor_type"] == "sampler"
                                            for p in snap["processes"])):
                                break
                            await trio.sleep(0.1)
                    jsonl = run_dir / "metrics" / "metrics.jsonl"
                    with trio.fail_after(30):
                        while not {"decision", "review"} <= {r["kind"] for r in
                                                             mx.read_jsonl(jsonl)}:
                            await trio.sleep(0.1)
                    resp = await trio.to_thread.run_sync(get, f"{url}/metrics")
                    missing = await trio.to_thread.run_sync(get, f"{url}/nothing")
                    await bus.publish(subjects.stop(run_name), m.Stop(reason="test over"))
                    with trio.fail_after(30):
                        await done.wait()
        return snap, resp, missing

    snap, resp, missing = trio.run(main)

    # the live snapshot
    assert snap["policy_version"] == 3  # from the stored weights message
    assert snap["queues"]["sampler-task_any.pending"] == 3.0
    assert snap["queues"]["sampler.generations_held"] == 2.0
    math_ = next(d for d in snap["domains"] if d["domain"] == "math")
    assert math_["samples"] == 4 and math_["pass_rate"] == pytest.approx(2 / 3)
    assert (math_["eval_first_pass_at_1"], math_["eval_pass_at_1"]) == (0.25, 0.5)

    # Prometheus
    assert resp.status_code == 200
    assert resp.headers["content-type"] == mx.PROMETHEUS_CONTENT_TYPE
    check_exposition(resp.text)
    assert f'reinforge_scored_total{{domain="math",outcome="pass",run="{run_name}"}} 2' \
        in resp.text
    assert f'reinforge_train_figure{{figure="kl",run="{run_name}"}} 0.02' in resp.text
    assert 'figure="samples_per_s"' in resp.text and "reinforge_process_rss_bytes{" in resp.text
    assert missing.status_code == 404 and "/metrics" in missing.text

    # JSONL: every kind, stats recorded once although sent twice, the unknown skipped
    records = list(mx.read_jsonl(run_dir / "metrics" / "metrics.jsonl"))
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "start"
    assert kinds.count("scored") == 6 and kinds.count("weights") == 1
    assert kinds.count("train") == 2 and kinds.count("eval") == 3
    assert kinds.count("rollback") == 0 and kinds.count("snapshot") >= 2
    assert kinds[-1] == "snapshot"  # the final one, written at teardown
    first_scored = next(r for r in records if r["kind"] == "scored")
    assert set(first_scored) >= {"t", "domain", "tier", "version", "reward", "outcome",
                                 "tokens", "staleness"}
    assert read_snapshot(run_dir).samples_total == 6
    [decision] = [r for r in records if r["kind"] == "decision"]
    assert {k: decision[k] for k in ("domain", "task_id", "fate", "version")} == {
        "domain": "math", "task_id": "math-1", "fate": "trained", "version": 2}

    # TensorBoard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = run_dir / "metrics" / "tb"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/kl", "eval/pass_at_1/math", "reward/math",
            "throughput/samples_per_s"} <= tags
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([0.5, 0.25])

    # and the report reads what the monitor wrote
    from reinforge.metrics.report import build_report

    report = build_report(run_dir / "metrics" / "metrics.jsonl", run_dir / "report")
    assert report.run == run_name
    assert {"reward_pass_rate.png", "eval.png", "processes.png"} <= set(report.plots)
    assert report.figures["samples_scored"] == 6 and report.figures["train_steps"] == 2
    assert report.domains["math"]["eval_pass_at_1_last"] == 0.5
    # the review mark, counted per domain, on the page
    assert report.figures["review_marks"] == 1
    assert {k: report.domains["math"][k] for k in (
        "review_marks", "marked_wrong_reward", "marked_exploit", "review_correction_mean")} == {
        "review_marks": 1, "marked_wrong_reward": 1, "marked_exploit": 0,
        "review_correction_mean": -0.75}
    assert report.domains["code"]["review_marks"] == 0
    assert "| math | 1 | 1 | 1 | 0 | -0.75 |" in Path(report.page).read_text()


async def _started(monitor, run_dir: Path, task_status=trio.TASK_STATUS_IGNORED):
    """Start the monitor and report once its HTTP endpoint file exists."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(monitor)
        with trio.fail_after(30):
            while read_endpoint(run_dir) is None:
                await trio.sleep(0.05)
        task_status.started()


async def feed_run(bus, run: str) -> None:
    """Typed messages as the other actors would send them."""
    S = m.Outcome
    rows = [("math", S.PASS, 1.0, 0), ("math", S.FAIL, 0.0, 1), ("math", S.PASS, 1.0, 1),
            ("math", S.INFRA_ERROR, 0.0, 2), ("code", S.FAIL, 0.0, 0), ("code", S.PASS, 1.0, 0)]
    for i, (domain, outcome, reward, tier) in enumerate(rows):
        s = scored(domain, i, tier=tier, reward=reward, outcome=outcome, version=2)
        await bus.publish_durable(subjects.scored(run, domain), s, f"scored:{i}")
    for step, loss in ((10, 0.5), (11, 0.25)):
        await bus.publish(subjects.stats(run, "learner"),
                          m.TrainStats(version=step - 8, step=step, loss=loss,
                                       figures={"kl": 0.02, "staleness": 1.0}))
    for version, p in ((1, 0.25), (3, 0.5)):
        ev = m.EvalStats(version=version, domain="math", pass_at_1=p, pass_at_k=p + 0.25, k=4,
                         n_tasks=8)
        await bus.publish(subjects.stats(run, "evaluator"), ev)
        await bus.publish_durable(subjects.stats(run, "eval"), ev, f"eval:{version}:math")
    await bus.publish(subjects.stats(run, "evaluator"),
                      m.EvalStats(version=3, domain="code", pass_at_1=0.0, pass_at_k=0.0, k=4,
                                  n_tasks=8))
    await bus.publish_raw(subjects.stats(run, "mystery"), b"\x81\xa4type\xa9mystery/9")
    await bus.publish_durable(subjects.decision(run, "math"), m.GroupDecision(
        task_id="math-1", domain="math", fate=m.Fate.TRAINED, version=2), "decision:math-1")
    await bus.publish(subjects.heartbeat(run, "sampler-x"),
                      heartbeat("sampler-x", "sampler", cpu=120.0, rss=256 << 20,
                                figures={"samples_per_s": 1.5, "generations_held": 2.0}))
    await bus.publish_durable(subjects.review(run, "math"), m.ReviewMark(
        rollout_id="math-1:0:1", task_id="math-1", domain="math", kind=m.Review.WRONG_REWARD,
        recorded_reward=1.0, corrected_reward=0.25), "review:math-1:0:1")


def test_a_hundred_domains_keep_series_for_the_busiest_and_one_other_for_the_rest():
    st = MonitorState("many", window_s=60.0, started_at=0.0)
    for d in range(100):  # domain dNN gets NN + 1 samples, half of them passing
        for i in range(d + 1):
            st.on_scored(scored(f"d{d:02d}", i, reward=float(i % 2),
                                outcome=m.Outcome.PASS if i % 2 else m.Outcome.FAIL,
                                task=f"d{d}-"), now=1.0)
    snap = st.snapshot(now=2.0)
    text = mx.prometheus_text(prometheus_samples(st, snap, max_domains=5))
    check_exposition(text)
    labels = set(re.findall(r'domain="([^"]+)"', text))
    assert labels == {"d95", "d96", "d97", "d98", "d99", "_other"}
    other = sum(d + 1 for d in range(95))  # every sample of the 95 others, once
    scored_other = re.findall(r'reinforge_scored_total\{domain="_other",outcome="(\w+)"[^}]*\} '
                              r'(\d+)', text)
    assert sum(int(n) for _, n in scored_other) == other
    tags = tensorboard_scalars(snap, max_domains=5)
    assert {t.split("/", 1)[1] for t in tags if t.startswith("reward/")} == labels
    assert tags["reward/_other"] == pytest.approx(
        sum((d + 1) // 2 for d in range(95)) / other)  # weighted by samples, not by domain
