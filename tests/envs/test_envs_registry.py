"""The domain interface and registry: built-ins, runtime attachment, wire format, limits."""

import random

import msgspec
import pytest
import trio
import trio.testing
from reinforge.envs.domain import (
    BUILTIN_DOMAINS,
    Check,
    Domain,
    DomainRegistry,
    ResourceLimits,
    TaskSpec,
    Tier,
    Verdict,
    describe,
)


class EchoDomain:
    """A minimal third-party domain: the answer is the prompt itself."""

    name = "echo"
    description = "repeat the prompt"
    resource = "cpu"
    multi_turn = False
    tiers = (Tier(level=0, name="word", description="one word"),)

    def sample_task(self, rng, tier):
        word = rng.choice(["a", "b"])
        return TaskSpec(
            task_id=word, domain="echo", tier=tier, prompt=word, spec={"w": word}, reference=word
        )

    def load_tasks(self, path):
        return []

    def task_from_row(self, row, *, where):
        return TaskSpec(task_id="x", domain="echo", tier=0, prompt=row["w"], spec=row)

    def prompt(self, task):
        return task.prompt

    async def verify(self, task, completion):
        ok = completion == task.spec["w"]
        return Verdict(reward=float(ok), outcome="pass" if ok else "fail", reason="")


def test_the_default_registry_has_the_five_builtin_domains_with_tiers():
    reg = DomainRegistry.default(entry_points=False)
    assert {"math", "code", "docqa", "terminal", "judge"} <= set(reg.names())
    for name, _ in BUILTIN_DOMAINS:
        domain = reg.get(name)
        assert isinstance(domain, Domain)
        assert [t.level for t in domain.tiers] == list(range(len(domain.tiers)))
        assert len(domain.tiers) >= 4
        assert describe(domain)["tiers"][0]["level"] == 0


@pytest.mark.parametrize("name", [n for n, _ in BUILTIN_DOMAINS])
def test_every_generated_task_survives_the_msgpack_round_trip(name):
    domain = DomainRegistry.default(entry_points=False).get(name)
    for tier in range(len(domain.tiers)):
        task = domain.sample_task(random.Random(tier), tier)
        wire = msgspec.msgpack.encode(task)
        assert msgspec.msgpack.decode(wire, type=TaskSpec) == task
        assert task.domain == name and task.tier == tier and task.reference


@pytest.mark.parametrize("name", [n for n, _ in BUILTIN_DOMAINS])
def test_tier_zero_prompts_and_references_are_short(name):
    domain = DomainRegistry.default(entry_points=False).get(name)
    for seed in range(10):
        task = domain.sample_task(random.Random(seed), 0)
        assert len(task.prompt.split()) <= 60, task.prompt
        assert len(task.reference.split()) <= 12, task.reference


def test_domains_attach_at_runtime_by_instance_or_spec():
    reg = DomainRegistry.default(entry_points=False)
    reg.attach(EchoDomain())
    assert reg.get("echo").name == "echo"
    reg2 = DomainRegistry()
    assert reg2.attach_spec(f"{__name__}:EchoDomain") == "echo"
    assert reg2.attach_spec(f"other={__name__}:EchoDomain") == "other"
    assert reg2.names() == ["echo", "other"]
    v = trio.run(
        reg2.get("other").verify,
        TaskSpec(task_id="t", domain="echo", tier=0, prompt="a", spec={"w": "a"}),
        "a",
    )
    assert v.outcome == "pass"


def test_bad_specs_and_unknown_names_say_what_is_wrong():
    reg = DomainRegistry()
    with pytest.raises(ValueError, match="expected MODULE:CLASS"):
        reg.attach_spec("nonsense")
    with pytest.raises(ValueError, match="has no attribute"):
        reg.attach_spec("random:NoSuchThing")
    with pytest.raises(TypeError, match="does not build a Domain"):
        reg.attach_spec("random:Random")
    with pytest.raises(KeyError, match="no domain named 'nope'"):
        reg.get("nope")


def test_registries_share_no_state():
    a, b = DomainRegistry(), DomainRegistry()
    a.attach(EchoDomain())
    assert "echo" in a and "echo" not in b


def test_verdicts_refuse_rewards_outside_the_unit_interval_and_unknown_outcomes():
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        Verdict(reward=1.5, outcome="pass")
    with pytest.raises(ValueError, match="outcome must be one of"):
        Verdict(reward=0.0, outcome="crashed")
    with pytest.raises(ValueError, match="infra_error verdict carries no reward"):
        Verdict(reward=1.0, outcome="infra_error")
    v = Verdict(reward=0.5, outcome="fail", checks=[Check(name="a", passed=True)], reason="r")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(v), type=Verdict) == v


def test_unknown_tiers_are_refused_by_every_domain():
    reg = DomainRegistry.default(entry_points=False)
    for name, _ in BUILTIN_DOMAINS:
        domain = reg.get(name)
        with pytest.raises(ValueError, match="tier"):
            domain.sample_task(random.Random(0), len(domain.tiers))


def test_resource_limits_bound_concurrency_per_resource():
    limits = ResourceLimits({"sandbox": 2}, default_limit=1)
    peak = {"sandbox": 0, "judge": 0}
    live = {"sandbox": 0, "judge": 0}

    async def work(resource):
        async with limits.hold(resource):
            live[resource] += 1
            peak[resource] = max(peak[resource], live[resource])
            await trio.sleep(1)
            live[resource] -= 1

    async def main():
        async with trio.open_nursery() as n:
            for _ in range(5):
                n.start_soon(work, "sandbox")
                n.start_soon(work, "judge")

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert peak == {"sandbox": 2, "judge": 1}
    assert limits.statistics()["sandbox"]["total"] == 2


def test_entry_points_in_the_reinforge_envs_group_are_registered(monkeypatch):
    import importlib.metadata

    ep = importlib.metadata.EntryPoint(
        name="echo", value=f"{__name__}:EchoDomain", group="reinforge.envs"
    )

    def fake_entry_points(*, group):
        return [ep] if group == "reinforge.envs" else []

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    reg = DomainRegistry.default()
    assert "echo" in reg.names() and reg.get("echo").description == "repeat the prompt"


class OtherEchoDomain(EchoDomain):
    description = "repeat the prompt, again"


def test_the_reinforge_domains_group_wins_a_name_the_older_reinforge_envs_group_declares(
    monkeypatch,
):
    import importlib.metadata

    declared = {group: [importlib.metadata.EntryPoint(name="echo", value=value, group=group)]
                for group, value in (("reinforge.domains", f"{__name__}:OtherEchoDomain"),
                                     ("reinforge.envs", f"{__name__}:EchoDomain"))}
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda *, group: declared.get(group, []))
    assert DomainRegistry.default().get("echo").description == "repeat the prompt, again"


def toy_family():
    """A family of three domains, `toy-a`, `toy-b`, `toy-c` (listed on first need)."""
    return {f"toy-{w}": EchoDomain for w in "abc"}


def toy_registry() -> DomainRegistry:
    reg = DomainRegistry()
    for name in ("echo", "math"):
        reg.attach(EchoDomain(), name=name)
    reg.add_family("toy-", f"{__name__}:toy_family")
    return reg


def test_a_glob_selects_every_domain_it_matches_and_names_keep_their_place():
    reg = toy_registry()
    assert reg.resolve(["math", "toy-*", "echo", "toy-b"]) == [
        "math", "toy-a", "toy-b", "toy-c", "echo"]  # a glob's matches sorted, each name once
    assert reg.resolve(["toy-[ab]", "e?ho"]) == ["toy-a", "toy-b", "echo"]
    assert reg.resolve(["math"]) == ["math"] and reg.resolve([]) == []


def test_a_glob_loads_only_the_families_it_may_match():
    reg = toy_registry()
    assert reg.resolve(["ma*"]) == ["math"]
    assert reg.names() == ["echo", "math"]  # the toy family was not listed for it
    assert reg.resolve(["*"]) == ["echo", "math", "toy-a", "toy-b", "toy-c"]


def test_a_globs_weight_goes_to_each_match_and_a_named_domain_keeps_its_own():
    reg = toy_registry()
    weights = reg.resolve_weights({"toy-*": 1.0, "math": 2.0, "toy-b": 0.0})
    assert list(weights.items()) == [("toy-a", 1.0), ("toy-b", 0.0), ("toy-c", 1.0),
                                     ("math", 2.0)]
    # the name wins whichever comes first; globs that agree may overlap
    assert reg.resolve_weights({"toy-b": 5.0, "toy-*": 1.0, "toy-[ab]": 1.0}) == {
        "toy-a": 1.0, "toy-b": 5.0, "toy-c": 1.0}


def test_overlapping_globs_with_different_weights_are_refused_unless_a_name_settles_it():
    reg = toy_registry()
    with pytest.raises(ValueError, match=r"'toy-a' matches 'toy-\*' \(weight 1.0\) and "
                                         r"'toy-\[ab\]' \(weight 2.0\)"):
        reg.resolve_weights({"toy-*": 1.0, "toy-[ab]": 2.0})
    assert reg.resolve_weights({"toy-*": 1.0, "toy-[ab]": 2.0, "toy-a": 3.0, "toy-b": 3.0}) == {
        "toy-a": 3.0, "toy-b": 3.0, "toy-c": 1.0}


def test_a_pattern_that_selects_nothing_is_an_error_naming_it_and_known_domains():
    reg = toy_registry()
    with pytest.raises(ValueError, match=r"^no domain matches 'tyo-\*'; known: echo, math, toy-\*"):
        reg.resolve(["math", "tyo-*"])
    with pytest.raises(ValueError, match=r"^VerifierConfig.domains: no domain named 'nope'; "
                                         r"known: echo, math, toy-\*"):
        reg.resolve(["nope"], where="VerifierConfig.domains")
    with pytest.raises(ValueError, match=r"^SchedulerConfig.domains: no domain matches 'x\?'"):
        reg.resolve_weights({"x?": 1.0}, where="SchedulerConfig.domains")


def test_a_verdict_holds_the_bus_outcome_and_check_so_a_scored_rollout_takes_them_as_they_are():
    from reinforge.core import messages as m

    v = Verdict(reward=1.0, outcome="pass", checks=[Check(name="answer_matches", passed=True)])
    assert v.outcome is m.Outcome.PASS
    assert Check is m.Check
