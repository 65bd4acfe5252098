"""`[run]`: one place for what a run's actors must agree on, checked once by `reinforge up`."""

import msgspec
import pytest
from reinforge.core.cluster import (
    RUN_SHARED,
    ActorSpec,
    RunSettings,
    actor_in_run,
    load_cluster_config,
)
from reinforge.core.config import ConfigError

SCHEDULER = "reinforge.actors.scheduler:Scheduler"
LEARNER = "reinforge.actors.learner:Learner"
SAMPLER = "reinforge.actors.sampler:SamplerActor"
EVALUATOR = "reinforge.actors.evaluator:Evaluator"


def write(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def actors_toml(scheduler: str = "", learner: str = "") -> str:
    return f"""
[[actors]]
spec = "{SCHEDULER}"
config = {{ domains = {{ math = 1.0 }} {scheduler} }}
[[actors]]
spec = "{LEARNER}"
config = {{ model = "m" {learner} }}
[[actors]]
spec = "{SAMPLER}"
config = {{ model_path = "m" }}
[[actors]]
spec = "{EVALUATOR}"
config = {{ }}
"""


def test_every_actor_gets_the_runs_values_for_the_fields_its_config_has(tmp_path):
    config = load_cluster_config(write(tmp_path, """
[run]
name = "r1"
group_size = 6
groups_per_version = 3
max_staleness = 1
temperature = 0.7
heldout = { tasks_per_tier = 5 }
""" + actors_toml()))
    scheduler, learner, sampler, evaluator = (a.config for a in config.actors)
    assert config.run.name == "r1"
    assert {k: scheduler[k] for k in ("group_size", "groups_per_version", "max_staleness")} == {
        "group_size": 6, "groups_per_version": 3, "max_staleness": 1}
    assert (learner["group_size"], learner["groups_per_version"], learner["max_staleness"],
            learner["temperature"]) == (6, 3, 1, 0.7)
    assert sampler["temperature"] == 0.7 and "group_size" not in sampler
    assert scheduler["heldout"] == evaluator["heldout"] == {"tasks_per_tier": 5}
    assert "temperature" not in evaluator  # the evaluator samples at its own eval_temperature


def test_two_actors_that_disagree_stop_up_naming_both(tmp_path):
    path = write(tmp_path, actors_toml(scheduler=", max_staleness = 2",
                                       learner=", max_staleness = 4"))
    with pytest.raises(ConfigError) as err:
        load_cluster_config(path)
    text = str(err.value)
    assert "max_staleness" in text and f"({SCHEDULER}) says 2" in text
    assert f"({LEARNER}) says 4" in text


def test_an_actor_that_contradicts_run_is_refused_and_one_that_repeats_it_is_not(tmp_path):
    with pytest.raises(ConfigError, match=r"group_size: \[run\] says 4, actors\[1\]"):
        load_cluster_config(write(tmp_path, "[run]\ngroup_size = 4\n"
                                  + actors_toml(learner=", group_size = 8")))
    config = load_cluster_config(write(tmp_path, "[run]\ngroup_size = 4\n" + actors_toml()),
                                 overrides=["actors.1.config.group_size=4"])  # a string
    assert config.actors[1].config["group_size"] == 4


def test_a_run_name_alone_and_the_run_flag_still_name_the_run(tmp_path):
    assert load_cluster_config(write(tmp_path, 'run = "legacy"\n')).run.name == "legacy"
    assert load_cluster_config(write(tmp_path, 'run = "legacy"\n'), run="flag").run.name == "flag"


def test_the_actors_defaults_for_shared_fields_are_the_runs_defaults():
    """Without a config, a scheduler and a learner must not disagree (they once said 2 and 4)."""
    from reinforge.actors.evaluator import EvaluatorConfig
    from reinforge.actors.learner import LearnerConfig
    from reinforge.actors.sampler import SamplerConfig
    from reinforge.actors.scheduler import SchedulerConfig

    run = msgspec.to_builtins(RunSettings())
    for config in (SchedulerConfig(), LearnerConfig(model="m"), SamplerConfig(model_path="m"),
                   EvaluatorConfig()):
        shared = {n: v for n, v in msgspec.to_builtins(config).items() if n in RUN_SHARED}
        assert shared and all(v == run[n] or n == "heldout" for n, v in shared.items()), config


def test_an_attached_actor_joins_the_runs_settings_or_is_refused():
    run = RunSettings(name="r", max_staleness=1)
    joined = actor_in_run(run, ActorSpec(spec=LEARNER, config={"model": "m"}))
    assert joined.config["max_staleness"] == 1
    with pytest.raises(ConfigError, match="max_staleness"):
        actor_in_run(run, ActorSpec(spec=LEARNER, config={"model": "m", "max_staleness": 3}))


def test_stream_replicas_above_one_needs_a_nats_cluster_to_join(tmp_path):
    with pytest.raises(ConfigError, match="stream_replicas > 1 needs a NATS cluster"):
        load_cluster_config(write(tmp_path, "stream_replicas = 3\n" + actors_toml()))
    with pytest.raises(ConfigError, match="stream_replicas must be 1..5"):
        load_cluster_config(write(tmp_path, 'nats_url = "nats://h:4222"\nstream_replicas = 7\n'))
    config = load_cluster_config(write(tmp_path, 'nats_url = "nats://h:4222"\n'
                                       'stream_replicas = 3\n' + actors_toml()))
    assert config.stream_replicas == 3


@pytest.mark.nats
def test_an_attach_on_another_machine_joins_the_settings_up_stored_in_the_stream(
        creds, run_name, tmp_path, monkeypatch):
    """`reinforge up` stores `[run]` in the run's stream; an attach whose machine has no
    run.json (another machine) joins with those settings, not with the defaults."""
    import trio
    from reinforge.cli.up import joined_run_settings
    from reinforge.core.bus import open_bus
    from reinforge.core.cluster import publish_run_settings, published_run_settings

    monkeypatch.setenv("REINFORGE_HOME", str(tmp_path / "another-machine"))
    stated = RunSettings(name=run_name, group_size=4, groups_per_version=1, max_staleness=3,
                         heldout={"tasks_per_tier": 2})

    async def before_and_after_up():
        async with open_bus(creds) as bus:
            await bus.ensure_run_stream(run_name)
            before = await published_run_settings(bus, run_name)
            await publish_run_settings(bus, run_name, RunSettings(name=run_name), "h1")
            await publish_run_settings(bus, run_name, stated, "h1")  # up again: newest stands
            return before

    assert trio.run(before_and_after_up) is None
    joined = joined_run_settings(run_name, creds)
    assert joined == stated
    learner = actor_in_run(joined, ActorSpec(spec=LEARNER, config={"model": "m"}))
    assert (learner.config["group_size"], learner.config["max_staleness"]) == (4, 3)
    assert not (tmp_path / "another-machine").exists()  # nothing read from, or written to, disk


@pytest.mark.nats
def test_settings_stored_in_a_bad_shape_are_a_clear_error(creds, run_name):
    import trio
    from reinforge.core import messages as m
    from reinforge.core import subjects
    from reinforge.core.bus import open_bus
    from reinforge.core.cluster import published_run_settings

    async def read_after(data: bytes, msg_id: str):
        async with open_bus(creds) as bus:
            await bus.ensure_run_stream(run_name)
            await bus.publish_durable_raw(subjects.settings(run_name), data, msg_id=msg_id)
            with pytest.raises(ConfigError) as err:
                await published_run_settings(bus, run_name)
            return str(err.value)

    garbage = trio.run(read_after, b"\xff not msgpack", "garbage")
    assert f"the settings stored for run {run_name!r} are unreadable" in garbage
    wrong = trio.run(read_after, m.encode(m.Stop(reason="x")), "stop")
    assert "holds a Stop, not the run's settings" in wrong
    bad_field = trio.run(read_after, m.encode(m.RunSettingsPublished(
        settings={"group_size": "many"})), "bad-field")
    assert "are unreadable" in bad_field and "group_size" in bad_field
