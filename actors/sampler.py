"""The sampler actor: tasks in, G rollouts per task out, each tagged with the policy version
that generated it.

    rl.<run>.task.<domain> --(rollout server /generate, n=G)--> rl.<run>.rollout.<domain>
    rl.<run>.weights (WeightsPublished | Rollback) --> /update_weights_from_disk

Backends (`backend`): "embedded" starts `reinforge serve` (or uses `url`), "sglang" starts
`python -m sglang.launch_server` (or uses `url`); both speak the same SGLang API subset and
are driven by the same `RolloutClient`.

Invariants:
  * a rollout's `policy_version` is the server's `meta_info.weight_version` for that sample,
    never the sampler's guess;
  * a weights change waits on `GenerationGate`: new generations are held, running ones
    finish (with the version they started on), then the server loads the checkpoint, then
    generation resumes -- so no rollout is lost or mislabelled. A multi-turn episode holds
    the gate one turn at a time, so an update lands between its turns instead of waiting
    for the episode: each turn (`Turn`) records the version that generated it, and the
    rollout's `policy_version` is the oldest of them (a partial rollout);
  * every replica sees every version: the weights input is a core subscription without a
    queue group, the newest stored version is read at start-up, and `main()` re-reads it every
    `weights_poll_s` in case a core message was missed;
  * rollout ids are deterministic (`{task_id}:{i}:{attempt}`): a redelivered task re-publishes
    the same ids and the stream deduplicates them.

Multi-turn domains: the episode runs here (`reinforge/rl/episodes.py`). A tool domain
(terminal, python_tool) presents its tools through the chat template, the policy calls
them in its own format, and the episode's transcript is the completion; other multi-turn
domains act one line per turn. Token-wise, output_ids are the whole continuation after the
prompt; environment tokens carry logprob 0.0 and mask 0 in `loss_mask`, the policy's tokens
their behaviour logprobs and mask 1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Any

import msgspec
import trio

from reinforge.rollout.client import (
    RolloutClient,
    RolloutRequestError,
    RolloutServerUnavailable,
    Sample,
    parse_weight_version,
)
from reinforge.rl.episodes import EpisodeTrace, domain_tools, run_episode
from reinforge.rl.prompts import task_prompt_ids
from reinforge.rollout.server import BACKENDS, ServerProcess, ServerSpec
from reinforge.envs.sandbox.owned import hold_sandbox_runner, sandbox_labels
from reinforge.core import paths, policy_version, subjects
from reinforge.core.policy_version import PolicyVersion
from reinforge.core.weights import (
    FetchStats,
    WeightsUnavailable,
    fetched_weights_dir,
    local_weights,
)
from reinforge.core.cluster import RUN_DEFAULTS
from reinforge.engine.tokenizer import load_tokenizer
from reinforge.core.actor import Actor, Input, Reject, Retry
from reinforge.core.messages import (
    Rollback,
    Rollout,
    Task,
    Timings,
    WeightsPublished,
    decode,
    rollout_id,
)


class GateStatistics(msgspec.Struct, frozen=True, kw_only=True):
    active: int
    """Generations running now."""
    held: int
    """Generations waiting for a weights update to end."""
    updating: bool
    drain_s: float = 0.0
    """Seconds updates (finished ones) spent waiting for running generations to end: the
    rollout server's batch only shrinks meanwhile."""
    closed_s: float = 0.0
    """Seconds the gate was closed to new generations (finished updates: drain + load)."""


class GenerationGate:
    """Many generations, or one weights update, never both.

    `async with gate.generation():` waits while an update is pending or running;
    `async with gate.update():` stops new generations at once, waits for running ones to
    finish, and holds the gate until its body is done. Updates run one at a time.
    """

    def __init__(self) -> None:
        self._active = 0
        self._held = 0
        self._updating = False
        self._changed = trio.Event()
        self._update_lock = trio.Lock()
        self._drain_s = 0.0
        self._closed_s = 0.0

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    @contextlib.asynccontextmanager
    async def generation(self):
        while self._updating:
            self._held += 1
            try:
                await self._changed.wait()
            finally:
                self._held -= 1
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            self._notify()

    @contextlib.asynccontextmanager
    async def update(self):
        async with self._update_lock:
            self._updating = True
            closed = trio.current_time()
            try:
                while self._active:
                    await self._changed.wait()
                self._drain_s += trio.current_time() - closed
                yield
            finally:
                self._updating = False
                self._closed_s += trio.current_time() - closed
                self._notify()

    def statistics(self) -> GateStatistics:
        return GateStatistics(
            active=self._active,
            held=self._held,
            updating=self._updating,
            drain_s=self._drain_s,
            closed_s=self._closed_s,
        )


# ----------------------------------------------------------------------------- server process


class SamplerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    backend: str = "embedded"
    """"embedded" (`reinforge serve`) or "sglang" (`python -m sglang.launch_server`)."""
    url: str = ""
    """Rollout server to use; "" = start one (needs `model_path`)."""
    model_path: str = ""
    """Model directory (Hugging Face format) to serve, and the default tokenizer."""
    tokenizer_path: str = ""
    """Tokenizer directory; "" = model_path, else the server's /model_info tokenizer_path."""
    initial_version: int = 0
    """Policy version of `model_path` (the server is started with --weight-version N);
    a server that reports "default" is taken to serve this version."""
    server_args: list[str] = []
    """Extra command-line arguments for the server this sampler starts."""
    server_start_timeout_s: float = 300.0
    """How long a started server may take to answer /health."""
    domains: list[str] = []
    """Task domains to take, by name or glob (`gym-*`); [] = all (one input on task.*)."""
    extra_domains: list[str] = []
    """More domains as `NAME=MODULE:CLASS` specs (added to the built-ins and entry points)."""
    concurrency: int = 4
    """Tasks (groups) being sampled at once."""
    temperature: float = RUN_DEFAULTS.temperature
    """`[run]`: the learner computes its logprobs at the same temperature."""
    top_p: float = 1.0
    max_new_tokens: int = 128
    """Per sample (single-turn) or per turn (multi-turn)."""
    stop: list[str] = []
    """Stop strings (single-turn)."""
    chat_template: bool = True
    """Wrap the task prompt in the tokenizer's chat template (when it has one)."""
    request_timeout_s: float = 300.0
    """One /generate call, all G samples."""
    ack_wait_s: float = 600.0
    """Lease on a task: generation plus a possible weights reload."""
    sandbox: bool = True
    """Open a sandbox pool for multi-turn domains that need one (terminal)."""
    sandbox_pool_size: int = 1
    weights_poll_s: float = 10.0
    """Re-read the newest stored weights message this often (a missed core message)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"SamplerConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.url and not self.model_path:
            raise ValueError("SamplerConfig: set `url` (a running server) or `model_path`")
        if self.concurrency < 1 or self.max_new_tokens < 1:
            raise ValueError("SamplerConfig.concurrency and max_new_tokens must be >= 1")

    def server_spec(self) -> ServerSpec:
        """The rollout server this sampler starts when it has no `url`."""
        return ServerSpec(backend=self.backend, model_path=self.model_path,
                          initial_version=self.initial_version, server_args=self.server_args)


class SamplerActor(Actor):
    actor_type = "sampler"
    Config = SamplerConfig

    def __init__(self, ctx: Any, config: SamplerConfig) -> None:
        super().__init__(ctx, config)
        from reinforge.envs.domain import DomainRegistry

        self.registry = DomainRegistry.default(config.extra_domains)
        self.domain_names = self.registry.resolve(config.domains, where="SamplerConfig.domains")
        self.gate = GenerationGate()
        self.client: RolloutClient | None = None
        self.server: ServerProcess | None = None
        self.tokenizer: Any = None
        self.version = config.initial_version
        """The version the server serves (after the last successful load)."""
        self.policy = PolicyVersion(version=config.initial_version)
        """The policy the weights messages name (`core/policy_version.py`)."""
        self.domains: dict[str, Any] = {}
        self.domains_ready = trio.Event()
        self.samples = 0
        self.tasks_done = 0
        self.tasks_outlived = 0  # asked for a version a rollback ended (see on_task)
        self.reloads = 0
        self.tool_calls = 0
        self.tool_call_errors = 0
        self.weight_load_errors = 0
        self.weights_gone = 0  # announced versions pruned before this host had them
        self.last_weight_error = ""
        self.started = time.monotonic()
        self._fetched = fetched_weights_dir("sampler")
        self.fetch_stats = FetchStats()

    # -- lifecycle ----------------------------------------------------------------------

    def inputs(self) -> list[Input]:
        cfg: SamplerConfig = self.config
        names = self.domain_names
        one = names[0] if len(names) == 1 else "*"
        tasks = Input(  # one intake for every domain: `concurrency` is the sampler's, not each's
            subject=subjects.task(self.ctx.run, one),
            filters=tuple(subjects.task(self.ctx.run, d) for d in names
                          ) if len(names) > 1 else (),
            handler=self.on_task,
            accepts=(Task,),
            concurrency=cfg.concurrency,
            batch=cfg.concurrency,
            ack_wait_s=cfg.ack_wait_s,
        )
        weights = Input(
            subject=subjects.weights(self.ctx.run),
            handler=self.on_weights,
            accepts=(WeightsPublished, Rollback),
            durable=False,
        )
        return [tasks, weights]

    def capabilities(self) -> list[str]:
        cfg: SamplerConfig = self.config
        return [f"sampler ({cfg.backend}) for domains {','.join(self.domain_names) or '*'}"]

    def figures(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        gate = self.gate.statistics()
        return {
            "policy_version": float(self.version),
            "samples": float(self.samples),
            "samples_per_s": self.samples / elapsed,
            "tasks_done": float(self.tasks_done),
            "tasks_outlived": float(self.tasks_outlived),
            "weight_reloads": float(self.reloads),
            "weight_load_errors": float(self.weight_load_errors),
            "weights_gone": float(self.weights_gone),
            "generations_active": float(gate.active),
            "generations_held": float(gate.held),
            "weights_drain_s": gate.drain_s,
            "weights_gate_closed_s": gate.closed_s,
            "tool_calls": float(self.tool_calls),
            "tool_call_errors": float(self.tool_call_errors),
            **self.fetch_stats.figures(),
        }

    async def setup(self) -> None:
        try:
            await self._setup()
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._close()
            raise

    async def _setup(self) -> None:
        cfg: SamplerConfig = self.config
        # The run's own rollout server (`[rollout_server]` in a cluster config) when no url
        # is given; else the sampler starts one of its own.
        url = cfg.url or os.environ.get("REINFORGE_ROLLOUT_URL", "")
        if not url:
            self.server = ServerProcess(cfg.server_spec(),
                                        paths.actor_server_log(self.ctx.run, self.ctx.actor_id))
            self.server.start()
            with self.ctx.waiting("rollout server start", deadline_s=cfg.server_start_timeout_s):
                url = await self.server.wait_url(cfg.server_start_timeout_s)
        self.client = RolloutClient(url, timeout_s=cfg.request_timeout_s)
        with self.ctx.waiting("HTTP reply from rollout server", deadline_s=60):
            served = await self.client.weight_version()
        self.version = parse_weight_version(served, default_version=cfg.initial_version)
        self.policy = PolicyVersion(version=self.version)
        tok_path = cfg.tokenizer_path or cfg.model_path
        if not tok_path:
            with self.ctx.waiting("HTTP reply from rollout server", deadline_s=60):
                tok_path = str((await self.client.model_info()).get("tokenizer_path") or "")
        if not tok_path:
            raise ValueError("SamplerConfig: no tokenizer_path, model_path, or server tokenizer")
        self.tokenizer = await trio.to_thread.run_sync(load_tokenizer, tok_path)
        await self.catch_up_weights()

    async def teardown(self) -> None:
        await self._close()  # idempotent; main() closes too when cancelled outright

    async def main(self) -> None:
        """Own the sandbox pool of multi-turn domains; re-read the newest weights now and then."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._poll_weights)
                await self._hold_domains()
        finally:  # also when the actor is cancelled outright (teardown then never runs)
            with trio.CancelScope(shield=True):
                with trio.move_on_after(15):  # running generations finish first
                    while self.gate.statistics().active:
                        await trio.sleep(0.05)
                await self._close()

    async def _close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.server is not None:
            await trio.to_thread.run_sync(self.server.stop)
        shutil.rmtree(self._fetched, ignore_errors=True)

    async def _poll_weights(self) -> None:
        while True:
            try:
                await self.catch_up_weights()  # first run closes the setup/subscribe window
            except (RolloutRequestError, RolloutServerUnavailable, RuntimeError) as exc:
                self.weight_load_errors += 1  # shown in figures; the next poll tries again
                self.last_weight_error = str(exc)
            await trio.sleep(self.config.weights_poll_s)

    async def _hold_domains(self) -> None:
        cfg: SamplerConfig = self.config
        names = self.domain_names or self.registry.names()
        multi = [n for n in names if n in self.registry and self.registry.get(n).multi_turn]

        def attach(runner: Any, error: str) -> None:
            for n in multi:  # without a runner, episodes observe "[sandbox unavailable: ...]"
                d = self.registry.get(n)
                self.domains[n] = d.with_runner(runner) if runner is not None else d
            self.domains_ready.set()

        if cfg.sandbox and any(self.registry.get(n).resource == "sandbox" for n in multi):
            await hold_sandbox_runner(
                cfg.sandbox_pool_size, attach, lambda: self.gate.statistics().active,
                labels=sandbox_labels(self.ctx),
            )
        else:
            attach(None, "")

    # -- weights ------------------------------------------------------------------------

    async def catch_up_weights(self) -> None:
        """Load the newest stored weights message if it is newer than what is served."""
        last = await self.ctx.bus.last_message(self.ctx.stream, subjects.weights(self.ctx.run))
        if last is None:
            return
        msg = decode(last.data)
        if isinstance(msg, (WeightsPublished, Rollback)):
            await self.on_weights(msg)

    async def on_weights(self, msg: WeightsPublished | Rollback) -> None:
        path = msg.path
        store = msg.store or subjects.weights_bucket(self.ctx.run)

        def policy() -> PolicyVersion | None:
            """The policy to serve after `msg`, None when it is the one served or older."""
            new = policy_version.after(self.policy, msg)
            if new is not None and new.version == self.version:
                self.policy = new  # e.g. a new epoch's announcement of the version served
                return None
            return new

        if policy() is None:  # checked before closing the gate: a no-op must not stall
            return
        async with self.gate.update():
            if (new := policy()) is None:
                return
            version = new.version
            assert self.client is not None
            with self.ctx.waiting(f"fetching weights v{version}", deadline_s=600):
                # this host may not have the learner's disk: then from the object store
                try:
                    path = await local_weights(self.ctx.bus, path, store, version,
                                               self._fetched, self.fetch_stats)
                except WeightsUnavailable as exc:
                    # pruned (a slow fetch, a late message): a newer version is out, and
                    # its message or the next poll brings it; this one is served meanwhile
                    self.weights_gone += 1
                    self.last_weight_error = str(exc)
                    return
            with self.ctx.waiting(f"rollout server loading weights v{version}", deadline_s=600):
                await self.client.update_weights_from_disk(path, weight_version=str(version))
                served = await self.client.weight_version()
            self.version = parse_weight_version(served, default_version=self.config.initial_version)
            if self.version != version:
                raise RuntimeError(
                    f"rollout server reports weight_version {served!r} after loading v{version}"
                )
            self.policy = new
            self.reloads += 1

    # -- tasks --------------------------------------------------------------------------

    def _sampling_params(self, n: int, **extra: Any) -> dict[str, Any]:
        cfg: SamplerConfig = self.config
        params: dict[str, Any] = {
            "n": n,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "max_new_tokens": cfg.max_new_tokens,
        }
        if cfg.stop:
            params["stop"] = list(cfg.stop)
        params.update(extra)
        return params

    async def _generate(self, ids: list[int], params: dict[str, Any]) -> list[Sample]:
        assert self.client is not None
        try:
            with self.ctx.waiting(
                "HTTP reply from rollout server", deadline_s=self.config.request_timeout_s
            ):
                return await self.client.generate(input_ids=ids, sampling_params=params)
        except RolloutServerUnavailable as exc:
            raise Retry(f"rollout server unavailable: {exc}", delay_s=2.0) from None
        except RolloutRequestError as exc:
            raise Reject(f"rollout server refused the task: {exc}") from None

    @contextlib.asynccontextmanager
    async def _generation(self, msg: Task):
        """Hold the gate for one generation (a weights update waits for it to finish) on a
        version the task accepts."""
        with self.ctx.waiting("weights update to finish", deadline_s=600):
            gen = self.gate.generation()
            await gen.__aenter__()
        try:
            if self.version < msg.min_version:
                raise Retry(
                    f"task {msg.task_id} needs policy v{msg.min_version}, serving v{self.version}",
                    delay_s=5.0,
                )
            yield
        finally:
            await gen.__aexit__(None, None, None)

    async def on_task(self, msg: Task) -> None:
        if msg.group_size < 1:
            raise Reject(f"task {msg.task_id}: group_size must be >= 1, got {msg.group_size}")
        if msg.domain not in self.registry:
            raise Reject(f"task {msg.task_id}: unknown domain {msg.domain!r}")
        if policy_version.outlived(msg.min_version, msg.epoch, self.policy):
            # retried, it would wait for a version that will not come until max_deliver;
            # the scheduler ended its lease at the rollback and issues it again
            self.tasks_outlived += 1
            return
        queued_s = max(0.0, time.time() - msg.sent_at)
        prompt_ids = task_prompt_ids(self.tokenizer, msg.prompt,
                                     chat_template=self.config.chat_template,
                                     tools=domain_tools(self.registry.get(msg.domain)))
        if self.registry.get(msg.domain).multi_turn:
            rollouts = await self._episodes(msg, prompt_ids, queued_s)
        else:
            async with self._generation(msg):
                t0 = time.monotonic()
                samples = await self._generate(prompt_ids, self._sampling_params(msg.group_size))
            gen_s = time.monotonic() - t0
            rollouts = [
                self._rollout(msg, i, prompt_ids, s.text, s.output_ids, s.logprobs,
                              s.finish_reason, s.weight_version, queued_s, gen_s)
                for i, s in enumerate(samples)
            ]
        served = [r.versions()[-1] for r in rollouts]
        if served and max(served) < self.version:
            # The rollout server restarted on its start-up weights: load the newest again.
            # (These rollouts carry the version that made them; the learner judges them.)
            self.version = min(served)
            self.policy = PolicyVersion(version=self.version, epoch=self.policy.epoch)
            await self.catch_up_weights()
        subject = subjects.rollout(self.ctx.run, msg.domain)
        await self.ctx.publish_durable_many([(subject, r, r.rollout_id) for r in rollouts])
        self.samples += len(rollouts)
        self.tasks_done += 1

    def _rollout(
        self, msg: Task, i: int, prompt_ids: list[int], text: str, output_ids: list[int],
        logprobs: list[float], finish_reason: str, weight_version: str, queued_s: float,
        generate_s: float, **multi_turn: Any,
    ) -> Rollout:
        """`multi_turn`: an episode's loss_mask, turns and tool-call counts."""
        return Rollout(
            rollout_id=rollout_id(msg.task_id, i, msg.attempt),
            task_id=msg.task_id,
            sample_index=i,
            domain=msg.domain,
            tier=msg.tier,
            prompt=msg.prompt,
            completion=text,
            prompt_ids=list(prompt_ids),
            output_ids=list(output_ids),
            logprobs=list(logprobs),
            policy_version=self._version_of(weight_version),
            finish_reason=finish_reason,
            spec=dict(msg.spec),
            group_size=msg.group_size,
            timings=Timings(queued_s=queued_s, generate_s=generate_s),
            purpose=msg.purpose,
            **multi_turn,
        )

    def _version_of(self, weight_version: str) -> int:
        return parse_weight_version(weight_version, default_version=self.config.initial_version)

    # -- multi-turn ---------------------------------------------------------------------

    async def _episodes(self, msg: Task, prompt_ids: list[int], queued_s: float) -> list[Rollout]:
        with self.ctx.waiting("sandbox pool start", deadline_s=120):
            await self.domains_ready.wait()
        domain = self.domains[msg.domain]
        out: list[Rollout | None] = [None] * msg.group_size

        async def one(i: int) -> None:
            t0 = time.monotonic()
            ep = await self._episode(domain, msg, prompt_ids)
            # A partial rollout (turns on several versions) is labelled with its oldest turn;
            # each turn keeps its own version and each token its own behaviour logprob.
            versions = ([t.policy_version for t in ep.turns]
                        or [self._version_of(v) for v in ep.weight_versions] or [self.version])
            out[i] = self._rollout(
                msg, i, prompt_ids, ep.completion, ep.output_ids, ep.logprobs, ep.finish_reason,
                str(min(versions)), queued_s, time.monotonic() - t0, loss_mask=ep.loss_mask,
                turns=ep.turns, tool_calls=ep.tool_calls, tool_call_errors=ep.tool_call_errors,
            )
            self.tool_calls += ep.tool_calls
            self.tool_call_errors += ep.tool_call_errors

        async with trio.open_nursery() as nursery:
            for i in range(msg.group_size):
                nursery.start_soon(one, i)
        return [r for r in out if r is not None]

    async def _episode(self, domain: Any, msg: Task, prompt_ids: list[int]) -> EpisodeTrace:
        from reinforge.envs.domain import TaskSpec

        task = TaskSpec(
            task_id=msg.task_id, domain=msg.domain, tier=msg.tier, prompt=msg.prompt,
            spec=dict(msg.spec),
        )

        async def generate(ids: list[int], stop: list[str]) -> Sample | None:
            try:  # the gate is held per turn: a weights update lands between turns
                async with self._generation(msg):
                    (s,) = await self._generate(ids, self._sampling_params(1, stop=stop))
            except Reject:
                if len(ids) == len(prompt_ids):
                    raise
                return None  # the transcript outgrew the server's context: end it here
            return s

        return await run_episode(
            domain, task, prompt_ids, tokenizer=self.tokenizer, generate=generate,
            version_of=self._version_of, chat_template=self.config.chat_template,
            step_context=lambda: self.ctx.waiting(f"{msg.domain} step of {msg.task_id}",
                                                  deadline_s=300))
