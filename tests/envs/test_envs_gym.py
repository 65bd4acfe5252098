"""reasoning-gym's task families as domains (`gym-<dataset>`): every one samples and scores."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from reinforge.envs.domain import DomainRegistry, Outcome, TaskSpec
from reinforge.envs.domains import gym

# Families whose items have many valid answers and no canonical one: no SFT reference.
WITHOUT_REFERENCE = {"gym-boxnet", "gym-graph_color", "gym-propositional_logic",
                     "gym-rubiks_cube", "gym-rush_hour"}


@pytest.fixture(scope="module")
def gym_domains():
    registry = DomainRegistry.default()
    return {n: registry.get(n) for n in registry.names(families=True)
            if n.startswith(gym.PREFIX)}


@pytest.fixture(scope="module")
def verdicts(gym_domains):
    """Per domain: a seeded tier-0 task and the verdicts of its reference, of a completion
    without the answer tag, and of a wrong answer."""

    async def judge():
        out = {}
        for name, domain in gym_domains.items():
            task = domain.sample_task(random.Random(f"test:{name}"), 0)
            out[name] = (task, {
                "reference": task.reference and await domain.verify(task, task.reference),
                "untagged": await domain.verify(task, "I do not know."),
                "wrong": await domain.verify(task, "<answer>no such answer 42</answer>"),
            })
        return out

    return trio.run(judge)


def test_over_a_hundred_families_are_domains(gym_domains):
    assert len(gym_domains) >= 100
    assert all(len(d.tiers) >= 1 for d in gym_domains.values())
    assert "gym-basic_arithmetic" in gym_domains and "gym-composite" not in gym_domains


def test_every_reference_scores_one_and_the_families_without_one_are_known(verdicts):
    without = {n for n, (task, _) in verdicts.items() if task.reference is None}
    assert without == WITHOUT_REFERENCE
    scored = {n: v["reference"] for n, (_, v) in verdicts.items() if n not in without}
    assert {n for n, v in scored.items() if (v.reward, v.outcome) != (1.0, Outcome.PASS)} == set()


def test_no_answer_scores_zero_and_no_wrong_answer_passes_anywhere(verdicts):
    assert {n for n, (_, v) in verdicts.items() if v["untagged"].reward != 0.0} == set()
    # before game_of_life_halting was left out, its scorer passed this answer
    assert {n for n, (_, v) in verdicts.items() if v["wrong"].outcome == Outcome.PASS} == set()


def test_a_scorer_that_raises_is_an_error_verdict_that_names_it(verdicts):
    wrong = verdicts["gym-prime_factorization"][1]["wrong"]
    assert (wrong.outcome, wrong.reward) == (Outcome.ERROR, 0.0)
    assert wrong.reason.startswith("the prime_factorization scorer raised ValueError")


def test_tasks_are_deterministic_by_seed_and_travel_as_plain_data(gym_domains):
    domain = gym_domains["gym-basic_arithmetic"]
    a, b = (domain.sample_task(random.Random(7), 2) for _ in range(2))
    assert a == b and a.tier == 2 and a.spec["dataset"] == "basic_arithmetic"
    import msgspec

    assert msgspec.msgpack.decode(msgspec.msgpack.encode(a), type=TaskSpec) == a


def test_tiers_follow_the_curriculum_and_a_level_the_dataset_rejects_is_left_out():
    arithmetic = gym.tier_configs("basic_arithmetic")
    assert [c["max_terms"] for c in arithmetic] == [2, 3, 4, 5, 6]
    # knight_swap's curriculum keeps min_nodes at 4, below the 6 its own config demands:
    # every level is refused, and the dataset's defaults are its one tier
    assert gym.tier_configs("knight_swap") == [{}]


def test_a_level_whose_items_take_minutes_to_make_is_not_a_tier(tmp_path):
    from reinforge.rl.evalsets import HeldOutConfig, build_heldout

    assert gym.TIER_CAPS["number_sequence"][0] == 3
    assert len(gym.tier_configs("number_sequence")) == 3  # its curriculum has 4 levels
    # every tier's held-out set is made (at level 3 one of these items ran for minutes)
    sets = build_heldout(DomainRegistry.default(), ["gym-number_sequence"],
                         HeldOutConfig(tasks_per_tier=20), cache=tmp_path)  # drawn here
    assert sorted({t.tier for t in sets["gym-number_sequence"]}) == [0, 1, 2]


def test_a_jsonl_row_names_an_item_by_tier_and_seed(gym_domains, tmp_path):
    domain = gym_domains["gym-basic_arithmetic"]
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"seed": 11, "tier": 1}) + "\n" + json.dumps({"tier": 0}) + "\n")
    with pytest.raises(ValueError, match=r"tasks.jsonl:2"):
        domain.load_tasks(path)
    path.write_text(json.dumps({"seed": 11, "tier": 1, "task_id": "mine"}) + "\n")
    (task,) = domain.load_tasks(path)
    assert (task.task_id, task.tier, task.spec["seed"], task.source) == ("mine", 1, 11, "jsonl")


def test_the_built_in_domains_load_without_importing_reasoning_gym():
    code = ("import sys\nfrom reinforge.envs.domain import DomainRegistry\n"
            "r = DomainRegistry.default(); r.get('math'); assert 'docqa' in r\n"
            "print('reasoning_gym' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_envs_list_shows_the_gym_domains():
    out = subprocess.run([sys.executable, "-m", "reinforge", "envs", "list", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    names = [d["name"] for d in json.loads(out.stdout)["domains"]]
    assert len([n for n in names if n.startswith("gym-")]) >= 100


def test_every_domain_means_the_singular_ones_unless_a_family_is_asked_for():
    registry = DomainRegistry.default()
    singular = registry.names()
    assert "math" in singular and not any(n.startswith(gym.PREFIX) for n in singular)
    assert "gym-basic_arithmetic" in registry  # asking for one brings its family in
    assert len(registry.names()) >= len(singular) + 100


def test_the_glob_gym_star_selects_the_whole_family():
    registry = DomainRegistry.default()
    every = DomainRegistry.default().names(families=True)
    family = registry.resolve(["gym-*"])
    assert family == [n for n in every if n.startswith(gym.PREFIX)] and len(family) >= 100
    assert registry.resolve(["gym-*_arithmetic"]) == [
        "gym-basic_arithmetic", "gym-bitwise_arithmetic", "gym-calendar_arithmetic",
        "gym-complex_arithmetic", "gym-decimal_arithmetic"]


def test_a_chatty_generator_prints_nothing_to_our_stdout(gym_domains, capsys):
    # bf's compiler prints a dot per optimisation pass; before, the dots landed in front of
    # `reinforge eval --json`'s JSON line, and the demo could not read it
    domain = gym_domains["gym-bf"]
    task = domain.sample_task(random.Random(3), 0)
    trio.run(domain.verify, task, task.reference)
    assert capsys.readouterr().out == ""


SAMPLE_EVERY_DOMAIN = """
import json, random, sys
from reinforge.envs.domain import DomainRegistry
r = DomainRegistry.default()
json.dump({n: [r.get(n).sample_task(random.Random(n), 0).prompt, r.get(n).generator_version]
           for n in r.names(families=True) if n.startswith("gym-")}, sys.stdout)
"""


def test_every_item_is_the_same_in_another_process_so_the_verifier_scores_what_was_shown():
    # The scheduler samples a task and a verifier (another process, another string-hash
    # seed) regenerates it from its seed; four datasets depend on set order and are left out.
    # The generator's version, under which held-out sets are kept on disk, is the same too.
    def prompts(hash_seed: str) -> dict[str, list[str]]:
        out = subprocess.run([sys.executable, "-c", SAMPLE_EVERY_DOMAIN], text=True,
                             capture_output=True, timeout=300,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)

    first, second = prompts("1"), prompts("2")
    assert len(first) >= 100
    assert [n for n in first if first[n] != second[n]] == []


def test_an_item_is_made_once_for_a_groups_samples(gym_domains, monkeypatch):
    # group_anagrams reads a word list of 150,000 lines whenever its dataset is made: before,
    # each verification made it again (0.2 s), four times for a group of four samples
    domain = gym_domains["gym-group_anagrams"]
    made = []
    create = gym._gym().create_dataset
    monkeypatch.setattr(gym._gym(), "create_dataset",
                        lambda *a, **kw: made.append(a) or create(*a, **kw))
    task = domain.sample_task(random.Random("one group"), 0)
    spec = gym.GymSpec(**task.spec)
    items = [domain.item(spec) for _ in range(4)]
    assert len(made) == 1
    assert all(entry == items[0][1] for _, entry in items)


def test_an_answer_that_makes_the_scorer_compute_for_minutes_is_an_error_in_seconds(
        gym_domains, monkeypatch):
    # simple_integration's scorer hands the answer to sympy's parser, which evaluates it:
    # 9**9**9 is a power of 370 million digits. Before, verification computed it in-line
    # (an evaluation grew to 12 GB and never returned)
    from reinforge.envs.domains import gym_scorer

    scorer = gym_scorer.ScorerWorker(timeout_s=3.0)
    monkeypatch.setattr(gym_scorer, "_worker", scorer)
    domain = gym_domains["gym-simple_integration"]
    task = domain.sample_task(random.Random("hostile"), 0)
    try:
        assert trio.run(domain.verify, task, task.reference).outcome == Outcome.PASS
        hostile = trio.run(domain.verify, task, "<answer>x**(9**9**9)</answer>")
        assert hostile.outcome == Outcome.ERROR and hostile.reward == 0.0
        assert "simple_integration scorer ran past 3 s" in hostile.reason
        assert scorer.restarts == 1
        # a fresh worker scores the next answer
        assert trio.run(domain.verify, task, task.reference).outcome == Outcome.PASS
        # and it runs under its address-space limit
        limits = Path(f"/proc/{scorer._proc.pid}/limits").read_text()
        assert f"Max address space         {gym_scorer.WORKER_MEMORY_BYTES}" in limits
    finally:
        scorer.close()
