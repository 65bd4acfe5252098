"""The sampler actor and its SGLang-API client, against the embedded rollout server."""

from __future__ import annotations

import functools
import random
import shutil
import sys
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing
from transformers import AutoTokenizer
from reinforge.rollout.client import (
    RolloutClient,
    RolloutRequestError,
    RolloutServerUnavailable,
    parse_sample,
    parse_weight_version,
)
from reinforge.rl.prompts import task_prompt_ids
from reinforge.actors.sampler import GenerationGate, SamplerActor, SamplerConfig
from reinforge.rollout.server import server_command
from reinforge.rl.sft import Demo, encode_demo
from reinforge.core import messages as m
from reinforge.core import subjects
from reinforge.core.actor import RuntimeConfig, run_actor
from reinforge.core.bus import open_bus


def perturbed_copy(model_dir: Path, out: Path, seed: int) -> Path:
    """A copy of the policy with noisy weights: a new version whose greedy outputs differ."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    noisy = {
        k: (v + 0.5 * v.std() * torch.randn(v.shape, generator=gen, dtype=v.dtype)).contiguous()
        if v.is_floating_point() and v.numel() > 1 else v
        for k, v in weights.items()
    }
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ----------------------------------------------------------------------------- pure parts


def test_weight_versions_are_read_as_ints_and_default_means_the_initial_version():
    assert parse_weight_version("3") == 3
    assert parse_weight_version("default", default_version=5) == 5
    with pytest.raises(ValueError, match="'v3' which is not an integer|'v3', which is not"):
        parse_weight_version("v3")


def test_a_generate_item_becomes_a_sample_with_one_logprob_per_output_token():
    item = {
        "text": "ab",
        "output_ids": [7, 8],
        "meta_info": {
            "finish_reason": {"type": "length", "length": 2},
            "weight_version": "4",
            "prompt_tokens": 3,
            "output_token_logprobs": [[-0.1, 7, None], [-2.0, 8, None]],
            "e2e_latency": 0.5,
        },
    }
    s = parse_sample(item)
    assert (s.output_ids, s.logprobs, s.finish_reason, s.weight_version) == (
        [7, 8], [-0.1, -2.0], "length", "4")
    item["meta_info"]["output_token_logprobs"] = [[-0.1, 7, None]]
    with pytest.raises(RolloutServerUnavailable, match="1 output_token_logprobs for 2"):
        parse_sample(item)


def test_a_sampler_config_needs_a_server_or_a_model_and_a_known_backend():
    with pytest.raises(ValueError, match="url.*model_path"):
        SamplerConfig()
    with pytest.raises(ValueError, match="backend"):
        SamplerConfig(url="http://x", backend="vllm")
    cmd = server_command(SamplerConfig(model_path="/m", initial_version=3).server_spec(), "/tmp/p")
    assert cmd[1:5] == ["-P", "-m", "reinforge", "serve"]
    assert cmd[cmd.index("--weight-version") + 1] == "3"
    sg = server_command(SamplerConfig(model_path="/m", backend="sglang").server_spec(), "/tmp/p")
    assert sg[1:3] == ["-m", "sglang.launch_server"] and "--model-path" in sg


def test_a_weights_update_waits_for_running_generations_and_holds_new_ones():
    async def main():
        gate = GenerationGate()
        log: list[str] = []
        release_first = trio.Event()

        async def generation(name: str, until: trio.Event | None = None):
            async with gate.generation():
                log.append(f"{name} start")
                if until is not None:
                    await until.wait()
                log.append(f"{name} end")

        async def update():
            async with gate.update():
                log.append("update")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generation, "g1", release_first)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(update)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(generation, "g2")
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["g1 start"]  # the update waits for g1; g2 waits for the update
            assert gate.statistics() == type(gate.statistics())(active=1, held=1, updating=True)
            release_first.set()
        assert log == ["g1 start", "g1 end", "update", "g2 start", "g2 end"]
        assert gate.statistics().active == 0 and not gate.statistics().updating

    trio.run(main)


def test_the_gate_counts_the_time_updates_drained_and_kept_it_closed():
    async def main():
        gate = GenerationGate()

        async def generation(seconds: float):
            async with gate.generation():
                await trio.sleep(seconds)

        async def update(load_s: float):
            async with gate.update():
                await trio.sleep(load_s)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generation, 2.0)
            nursery.start_soon(generation, 0.5)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(update, 1.0)  # drains until the 2 s generation ends
        stats = gate.statistics()
        assert (stats.drain_s, stats.closed_s) == (2.0, 3.0)
        async with gate.update():  # nothing runs: no drain, closed only while loading
            await trio.sleep(0.25)
        assert (gate.statistics().drain_s, gate.statistics().closed_s) == (2.0, 3.25)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_without_an_update_generations_run_side_by_side():
    async def main():
        gate = GenerationGate()
        inside = 0
        peak = 0

        async def generation():
            nonlocal inside, peak
            async with gate.generation():
                inside += 1
                peak = max(peak, inside)
                await trio.sleep(0.01)
                inside -= 1

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(generation)
        assert peak == 5

    trio.run(main)


# ----------------------------------------------------------------------------- the client


def fake_server(routes: dict[str, tuple[int, object]]):
    import httpx

    def handle(request: httpx.Request) -> httpx.Response:
        status, body = routes.get(request.url.path, (404, {"detail": "Not Found"}))
        return httpx.Response(status, json=body)

    return httpx.MockTransport(handle)


def test_the_client_falls_back_to_get_model_info_on_servers_that_lack_model_info():
    async def main():
        old = fake_server({"/get_model_info": (200, {"weight_version": "12"})})
        async with RolloutClient("http://sglang", transport=old) as client:
            assert await client.weight_version() == "12"
        new = fake_server({"/model_info": (200, {"weight_version": "default"})})
        async with RolloutClient("http://sglang", transport=new) as client:
            assert await client.weight_version() == "default"

    trio.run(main)


def test_server_faults_are_unavailable_and_refusals_are_request_errors():
    async def main():
        transport = fake_server({
            "/generate": (503, {"error": {"message": "overloaded"}}),
            "/update_weights_from_disk": (200, {"success": False, "message": "bad shard"}),
        })
        async with RolloutClient("http://srv", transport=transport) as client:
            with pytest.raises(RolloutServerUnavailable, match="HTTP 503"):
                await client.generate(input_ids=[1], sampling_params={})
            with pytest.raises(RolloutRequestError, match="loading weights /ckpt failed"):
                await client.update_weights_from_disk("/ckpt", weight_version="2")
            with pytest.raises(ValueError, match="exactly one of input_ids and text"):
                await client.generate(input_ids=[1], text="x", sampling_params={})

    trio.run(main)


@pytest.mark.slow
def test_the_client_samples_a_group_with_token_ids_logprobs_and_the_served_version(server_url):
    async def main():
        async with RolloutClient(server_url, timeout_s=60) as client:
            assert await client.health()
            samples = await client.generate(
                input_ids=[5, 6, 7, 8],
                sampling_params={"n": 3, "temperature": 1.0, "max_new_tokens": 6},
            )
            assert len(samples) == 3
            for s in samples:
                assert 1 <= len(s.output_ids) <= 6
                assert len(s.logprobs) == len(s.output_ids)
                assert all(lp <= 0.0 for lp in s.logprobs)
                assert s.weight_version == "0"
                assert s.finish_reason in ("stop", "length")
            by_text = await client.generate(text="hello", sampling_params={"max_new_tokens": 2})
            assert len(by_text) == 1 and by_text[0].prompt_tokens > 0
            assert await client.weight_version() == "0"

    trio.run(main)


@pytest.mark.slow
def test_the_client_loads_weights_from_disk_and_the_server_reports_the_new_version(
    server_url, tiny_model_dir, tmp_path
):
    copy = shutil.copytree(tiny_model_dir, tmp_path / "v9")

    async def main():
        async with RolloutClient(server_url, timeout_s=60) as client:
            await client.update_weights_from_disk(str(copy), weight_version="9")
            assert await client.weight_version() == "9"
            (s,) = await client.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})
            assert s.weight_version == "9"
            with pytest.raises(RolloutRequestError, match="loading weights"):
                await client.update_weights_from_disk(str(tmp_path / "nope"), weight_version="10")
            await client.update_weights_from_disk(str(tiny_model_dir), weight_version="0")

    trio.run(main)


@pytest.mark.slow
def test_the_client_tells_a_refused_request_from_an_unreachable_server(server_url):
    async def main():
        async with RolloutClient(server_url, timeout_s=60) as client:
            with pytest.raises(RolloutRequestError, match="HTTP 400"):
                await client.generate(input_ids=[1], sampling_params={"max_tokens": 3})
        async with RolloutClient("http://127.0.0.1:1", timeout_s=5) as dead:
            assert not await dead.health()
            with pytest.raises(RolloutServerUnavailable, match="127.0.0.1:1/generate"):
                await dead.generate(input_ids=[1], sampling_params={})

    trio.run(main)


# ----------------------------------------------------------------------------- in a cluster


async def wait_for_figure(bus, run: str, name: str, value: float, timeout_s: float,
                          at_least: bool = False) -> None:
    """Until a sampler's heartbeat shows figure `name` at `value` (or above, `at_least`)."""
    async with bus.subscribe(subjects.heartbeat(run, "*")) as sub:
        with trio.fail_after(timeout_s):
            async for batch in sub:
                for raw in batch:
                    hb = m.decode(raw.data)
                    got = hb.figures.get(name, float("nan"))
                    if hb.actor_type == "sampler" and (got >= value if at_least else got == value):
                        return


async def collect_rollouts(bus, run: str, ids: set[str], *, timeout_s: float, group: str):
    stream = await bus.ensure_run_stream(run)
    got: dict[str, m.Rollout] = {}
    durable = subjects.durable_name(run, group, subjects.rollout(run))
    async with bus.pull_consumer(
        stream=stream, durable=durable, filter_subject=subjects.rollout(run)
    ) as consumer:
        with trio.fail_after(timeout_s):
            while not ids <= set(got):
                batch = await consumer.fetch(64, timeout_s=0.5)
                for d in batch:
                    r = m.decode(d.data)
                    got[r.rollout_id] = r
                await consumer.ack(batch)
    return got


def math_tasks(prefix: str, n: int, group_size: int) -> list[m.Task]:
    prompts = ("What is 2 + 3?", "Add 7 and 9.")  # two prompts, many tasks each
    return [
        m.Task(task_id=f"{prefix}{i}", domain="math", tier=0, prompt=prompts[i % 2],
               spec={"answer": "5" if i % 2 == 0 else "16"}, group_size=group_size)
        for i in range(n)
    ]


@pytest.mark.nats
@pytest.mark.slow
def test_a_sampler_in_a_cluster_reloads_every_version_and_labels_each_rollout_with_it(
    creds, run_name, tiny_model_dir, tmp_path
):
    v1 = perturbed_copy(tiny_model_dir, tmp_path / "v1", seed=1)
    v2 = perturbed_copy(tiny_model_dir, tmp_path / "v2", seed=2)
    g = 2
    batches = {"a": math_tasks("a", 6, g), "b": math_tasks("b", 6, g), "c": math_tasks("c", 6, g)}
    cfg = SamplerConfig(model_path=str(tiny_model_dir), temperature=0.0, max_new_tokens=8,
                        concurrency=3, server_args=["--max-total-tokens", "8192"],
                        weights_poll_s=30.0)

    async def publish_tasks(bus, tasks):
        for t in tasks:
            await bus.publish_durable(subjects.task(run_name, t.domain), t, msg_id=t.task_id)

    async def publish_weights(bus, version, path):
        await bus.publish_durable(subjects.weights(run_name),
                                  m.WeightsPublished(version=version, path=str(path)),
                                  msg_id=f"weights:{version}")

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            await bus.ensure_run_stream(run_name)
            await nursery.start(functools.partial(
                run_actor, SamplerActor, creds=creds, run=run_name, config=cfg,
                runtime=RuntimeConfig(heartbeat_s=0.3)))
            await publish_tasks(bus, batches["a"])
            await publish_weights(bus, 1, v1)  # while batch a is being sampled
            await wait_for_figure(bus, run_name, "policy_version", 1.0, 120)
            await publish_tasks(bus, batches["b"])
            await publish_weights(bus, 2, v2)
            await wait_for_figure(bus, run_name, "policy_version", 2.0, 120)
            await publish_tasks(bus, batches["c"])
            ids = {f"{t.task_id}:{i}:1" for ts in batches.values() for t in ts for i in range(g)}
            got = await collect_rollouts(bus, run_name, ids, timeout_s=240, group="watch")
            nursery.cancel_scope.cancel()
        assert set(got) == ids
        for r in got.values():  # what the learner needs, exactly
            assert r.rollout_id == f"{r.task_id}:{r.sample_index}:1"
            assert r.group_size == g and 0 <= r.sample_index < g
            assert r.prompt_ids and r.output_ids and len(r.logprobs) == len(r.output_ids)
            assert all(lp <= 0.0 for lp in r.logprobs)
            assert r.timings.generate_s > 0
        # the prompt the policy saw is the one SFT trains and the evaluator measures
        tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
        for r in got.values():
            sft_ids, mask = encode_demo(tok, Demo(prompt=r.prompt, response="x"))
            n_prompt = mask.index(1)
            assert list(r.prompt_ids) == sft_ids[:n_prompt] == task_prompt_ids(tok, r.prompt)
        assert all(got[f"c{i}:0:1"].policy_version == 2 for i in range(6))
        assert all(got[f"b{i}:0:1"].policy_version >= 1 for i in range(6))
        assert {r.policy_version for r in got.values()} >= {1, 2}
        # greedy sampling: one output per (prompt, version). A rollout labelled with a version
        # that did not generate it would break this (the versions' weights differ).
        outputs: dict[tuple[str, int], set[tuple[int, ...]]] = {}
        for r in got.values():
            outputs.setdefault((r.prompt, r.policy_version), set()).add(tuple(r.output_ids))
        assert all(len(v) == 1 for v in outputs.values()), outputs
        for prompt in ("What is 2 + 3?", "Add 7 and 9."):
            assert outputs[(prompt, 1)] != outputs[(prompt, 2)]

    trio.run(main)


@pytest.mark.nats
@pytest.mark.slow
def test_a_sampler_started_late_loads_the_newest_stored_version_and_follows_a_rollback(
    creds, run_name, tiny_model_dir, tmp_path
):
    v3 = perturbed_copy(tiny_model_dir, tmp_path / "v3", seed=3)
    cfg = SamplerConfig(model_path=str(tiny_model_dir), temperature=0.0, max_new_tokens=4,
                        server_args=["--max-total-tokens", "8192"])
    runtime = RuntimeConfig(heartbeat_s=0.3)

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            await bus.ensure_run_stream(run_name)
            await bus.publish_durable(subjects.weights(run_name),
                                      m.WeightsPublished(version=3, path=str(v3)), "weights:3")
            (task,) = math_tasks("late", 1, 2)
            await bus.publish_durable(subjects.task(run_name, "math"), task, msg_id="late")
            await nursery.start(functools.partial(
                run_actor, SamplerActor, creds=creds, run=run_name, config=cfg, runtime=runtime))
            got = await collect_rollouts(bus, run_name, {"late0:0:1", "late0:1:1"},
                                         timeout_s=120, group="late")
            assert {r.policy_version for r in got.values()} == {3}
            # a rollback goes back to an older version, and is loaded like a new one
            await bus.publish_durable(
                subjects.weights(run_name),
                m.Rollback(to_version=0, path=str(tiny_model_dir), reason="regression"),
                "rollback:0",
            )
            await wait_for_figure(bus, run_name, "policy_version", 0.0, 60)
            # a task issued before the rollback, asking for v3 of the epoch it ended, can
            # never be served: skipped at once (the scheduler issues it again), not retried
            (outlived,) = math_tasks("outlived", 1, 1)
            await bus.publish_durable(subjects.task(run_name, "math"), msgspec.structs.replace(
                outlived, min_version=3, epoch=0), msg_id="outlived")
            await wait_for_figure(bus, run_name, "tasks_outlived", 1.0, 60)
            (again,) = math_tasks("again", 1, 1)
            await bus.publish_durable(subjects.task(run_name, "math"), again, msg_id="again")
            got = await collect_rollouts(bus, run_name, {"again0:0:1"}, timeout_s=120,
                                         group="again")
            nursery.cancel_scope.cancel()
        assert got["again0:0:1"].policy_version == 0

    trio.run(main)


@pytest.mark.nats
@pytest.mark.slow
def test_a_sampler_without_the_checkpoint_on_its_disk_fetches_the_version_from_the_store(
    creds, run_name, tiny_model_dir, tmp_path, monkeypatch
):
    """v1 was pruned from the store before this host fetched it (a slow host): the sampler
    counts it gone and keeps serving; v2 it fetches and serves."""
    import tempfile

    from reinforge.core.weights import delete_versions, put_version

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    def fetched() -> list[str]:
        return sorted(str(p.relative_to(scratch)) for p in scratch.glob("rf-sampler-*/*"))

    v1 = perturbed_copy(tiny_model_dir, tmp_path / "v1", seed=1)
    v2 = perturbed_copy(tiny_model_dir, tmp_path / "v2", seed=2)
    cfg = SamplerConfig(model_path=str(tiny_model_dir), temperature=0.0, max_new_tokens=4,
                        server_args=["--max-total-tokens", "8192"], weights_poll_s=30.0)

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            await bus.ensure_run_stream(run_name)
            bucket = await put_version(bus, run_name, 1, v1)
            await put_version(bus, run_name, 2, v2)
            await delete_versions(bus, bucket, keep={2})
            shutil.rmtree(v1)  # the learner's disk is not this host's
            shutil.rmtree(v2)
            await nursery.start(functools.partial(
                run_actor, SamplerActor, creds=creds, run=run_name, config=cfg,
                runtime=RuntimeConfig(heartbeat_s=0.3)))
            nothing_fetched_yet = sorted(scratch.glob("rf-sampler-*"))  # not even a folder
            await bus.publish_durable(subjects.weights(run_name), m.WeightsPublished(
                version=1, path=str(v1), store=bucket), msg_id="weights:1")
            # (the message, and maybe a poll of the newest stored one, count it)
            await wait_for_figure(bus, run_name, "weights_gone", 1.0, 120, at_least=True)
            await bus.publish_durable(subjects.weights(run_name), m.WeightsPublished(
                version=2, path=str(v2), store=bucket), msg_id="weights:2")
            await wait_for_figure(bus, run_name, "policy_version", 2.0, 120)
            fetched_while_running = fetched()
            (task,) = math_tasks("far", 1, 1)
            await bus.publish_durable(subjects.task(run_name, "math"), task, msg_id="far")
            got = await collect_rollouts(bus, run_name, {"far0:0:1"}, timeout_s=120,
                                         group="far")
            dead = [d async for d in bus.read_stream(await bus.ensure_run_stream(run_name),
                                                     filter_subject=subjects.dlq(run_name))]
            nursery.cancel_scope.cancel()
        return got, nothing_fetched_yet, fetched_while_running, dead

    got, before, during, dead = trio.run(main)
    assert got["far0:0:1"].policy_version == 2
    assert dead == []  # the gone version was counted, not dead-lettered
    # the folder for fetched versions exists only once one is fetched, and goes on close
    assert before == [] and len(during) == 1 and during[0].endswith("/v2")
    assert fetched() == []


@pytest.mark.nats
@pytest.mark.podman
@pytest.mark.slow
def test_a_terminal_task_runs_as_a_multi_turn_episode_in_the_sandbox(
    creds, run_name, tiny_model_dir, podman_url
):
    from reinforge.envs.domain import DomainRegistry
    from reinforge.envs.tools import decode_transcript

    spec = DomainRegistry.default().get("terminal").sample_task(random.Random(0), 0)
    task = m.Task(task_id="term0", domain="terminal", tier=0, prompt=spec.prompt,
                  spec=spec.spec, group_size=2)
    cfg = SamplerConfig(model_path=str(tiny_model_dir), temperature=1.0, max_new_tokens=6,
                        server_args=["--max-total-tokens", "8192"])

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            await bus.ensure_run_stream(run_name)
            await nursery.start(functools.partial(
                run_actor, SamplerActor, creds=creds, run=run_name, config=cfg))
            await bus.publish_durable(subjects.task(run_name, "terminal"), task, msg_id="term0")
            got = await collect_rollouts(bus, run_name, {"term0:0:1", "term0:1:1"},
                                         timeout_s=240, group="term")
            nursery.cancel_scope.cancel()
        max_turns = spec.spec["max_turns"]
        tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
        for r in got.values():
            record = decode_transcript(r.completion)  # a tool episode's transcript
            assert 1 <= len(record) <= max_turns
            assert len(r.logprobs) == len(r.output_ids) == len(r.loss_mask)
            assert "[sandbox unavailable" not in r.completion
            assert r.policy_version == 0
            # one turn per policy turn, each from version 0, each followed by its observation
            assert len(r.turns) == len(record)
            assert [t.policy_version for t in r.turns] == [0] * len(record)
            assert [tok.decode(r.output_ids[t.start:t.end], skip_special_tokens=True)
                    for t in r.turns] == [t.text for t in record]
            assert r.tool_calls + r.tool_call_errors <= len(record)
            # the prompt presents the bash tool through the chat template
            assert '"name": "bash"' in tok.decode(r.prompt_ids)

    trio.run(main)


class PacedDomain:
    """Test domain: three-turn episodes whose second step waits until a file named `release`
    appears in the task's `dir` (after writing `reached` there), so a test can publish new
    weights while an episode is in the middle of its turns."""

    name = "paced"
    description = "three turns; the second waits for the test"
    resource = "cpu"
    multi_turn = True

    def __init__(self) -> None:
        from reinforge.envs.domain import Tier

        self.tiers = (Tier(level=0, name="only", description="three turns"),)

    def sample_task(self, rng, tier):
        raise NotImplementedError("tasks come from the test")

    def load_tasks(self, path):
        raise NotImplementedError

    def task_from_row(self, row, *, where):
        raise NotImplementedError

    def prompt(self, task):
        return task.prompt

    async def verify(self, task, completion):
        from reinforge.envs.domain import Verdict

        return Verdict(reward=1.0, outcome="pass")

    def start_episode(self, task):
        return PacedEpisode(Path(task.spec["dir"]))


class PacedEpisode:
    def __init__(self, where: Path) -> None:
        self.where, self.steps = where, 0

    async def step(self, action: str) -> tuple[str, bool]:
        self.steps += 1
        if self.steps == 2:
            (self.where / "reached").touch()
            while not (self.where / "release").exists():
                await trio.sleep(0.05)
        return f"step {self.steps} done", self.steps >= 3

    async def finish(self):
        return await PacedDomain().verify(None, "")

    async def aclose(self) -> None:
        pass


async def wait_for_file(path: Path, timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while not path.exists():
            await trio.sleep(0.05)


@pytest.mark.nats
@pytest.mark.slow
def test_a_weights_update_lands_between_an_episodes_turns_and_each_turn_keeps_its_version(
    creds, run_name, tiny_model_dir, tmp_path
):
    v1 = perturbed_copy(tiny_model_dir, tmp_path / "v1", seed=1)
    pace = tmp_path / "pace"
    pace.mkdir()
    task = m.Task(task_id="paced0", domain="paced", tier=0, prompt="Say something.",
                  spec={"dir": str(pace)}, group_size=1)
    cfg = SamplerConfig(model_path=str(tiny_model_dir), temperature=0.0, max_new_tokens=6,
                        domains=["paced"], extra_domains=["paced=test_actors_sampler:PacedDomain"],
                        server_args=["--max-total-tokens", "8192"], weights_poll_s=30.0)

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            await bus.ensure_run_stream(run_name)
            await nursery.start(functools.partial(
                run_actor, SamplerActor, creds=creds, run=run_name, config=cfg,
                runtime=RuntimeConfig(heartbeat_s=0.3)))
            await bus.publish_durable(subjects.task(run_name, "paced"), task, msg_id="paced0")
            await wait_for_file(pace / "reached", 120)  # the episode is between turns 2 and 3
            await bus.publish_durable(subjects.weights(run_name),
                                      m.WeightsPublished(version=1, path=str(v1)), "weights:1")
            # the update does not wait for the episode (it would wait forever: the episode
            # waits for the release below)
            await wait_for_figure(bus, run_name, "policy_version", 1.0, 120)
            (pace / "release").touch()
            got = await collect_rollouts(bus, run_name, {"paced0:0:1"}, timeout_s=120,
                                         group="paced")
            nursery.cancel_scope.cancel()
        r = got["paced0:0:1"]
        assert [t.policy_version for t in r.turns] == [0, 0, 1]
        assert r.policy_version == 0 and r.versions() == [0, 0, 1]
        assert len(r.logprobs) == len(r.loss_mask) == len(r.output_ids)
        assert sum(t.end - t.start for t in r.turns) == sum(r.loss_mask)
        assert [ln for ln in r.completion.splitlines() if ln.startswith("| ")] == [
            f"| step {i} done" for i in (1, 2, 3)]

    trio.run(main)


def test_the_module_runs_under_the_same_python():
    assert server_command(SamplerConfig(model_path="/m").server_spec(), "/p")[0] == sys.executable
