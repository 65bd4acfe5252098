"""The verifier actor: rollouts in, scored rollouts out, one typed outcome each.

    rl.<run>.rollout.<domain>  --(domain.verify, bounded per resource)-->  rl.<run>.scored.<domain>

Outcomes (core.messages.Outcome): `pass`/`fail`/`timeout`/`error` are the candidate's own
results and carry its reward; `infra_error` means our side failed (sandbox or judge down, a
broken task spec) even after `infra_attempts` tries inside the handler: it is published with
reward 0.0 and a reason, and the learner masks it out -- never a silent 0.

Delivery: the input is a JetStream durable with manual acks; the ack comes after the scored
rollout was stored, which is deduplicated by msg_id `scored:<rollout_id>`. A verifier killed
mid-check leaves the rollout unacked, so it is redelivered and scored exactly once in the
stream. Long checks keep their lease with `in_progress()` pings. A verifier that is stopping
never publishes an infra_error caused by its own shutdown: it naks the rollout instead.

Concurrency: at most `concurrency` rollouts in the handler, and `ResourceLimits` bound the
checks per scarce resource (sandbox slots, judge calls, cpu). Sandbox domains run on one
Podman pool (`envs.sandbox.runner.sandbox_runner`) owned by `main()`.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import trio

from reinforge.envs.sandbox.owned import hold_sandbox_runner, sandbox_labels
from reinforge.core import subjects
from reinforge.core.actor import Actor, Input, Reject, Retry, Ticket
from reinforge.core.messages import Outcome, Rollout, ScoredRollout
from reinforge.rl.samples import scored_from_verdict, task_spec_of


class VerifierConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    domains: list[str] = []
    """Domains this verifier serves, by name or glob (`gym-*`); [] = every registered domain
    (one input on rollout.*)."""
    extra_domains: list[str] = []
    """More domains as `NAME=MODULE:CLASS` specs (added to the built-ins and entry points)."""
    concurrency: int = 32
    """Rollouts in the handler at once (all domains together). Wider than any one resource
    limit, so rollouts of a cheap domain are not held behind a queue of sandbox checks."""
    resource_limits: dict[str, int] = msgspec.field(
        default_factory=lambda: {"judge": 4, "cpu": 4}
    )
    """Checks at once per scarce resource (a domain names its resource). `sandbox` defaults
    to what the pool can take at once: `sandbox_pool_size` x the pool's batch (its batching
    only forms when more checks wait than there are sandboxes)."""
    sandbox: bool = True
    """Open a Podman sandbox pool for sandbox domains (code, terminal); without one they
    verify to infra_error."""
    sandbox_pool_size: int = 2
    """Warm sandboxes in the pool."""
    judge_url: str = ""
    """SGLang-compatible judge server for the judge domain; "" = env REINFORGE_JUDGE_URL,
    else the rule judge."""
    reward_model: str | list[str] = ""
    """A reward model directory (`reinforge rm train`) or the URL of a server of one
    (`reinforge serve --is-embedding`, SGLang's `/classify`), or several (an ensemble):
    attaches the rm-synthetic domain (`envs/domains/reward_model.py`) scored by it."""
    reward_model_spread_penalty: float = 1.0
    """An ensemble's reward is sigmoid(mean - this x std) of its models' scores."""
    infra_attempts: int = 3
    """Verifications of one rollout while the outcome is infra_error, before it is published."""
    infra_retry_delay_s: float = 1.0
    """Pause before the second try (doubles each try)."""
    ack_wait_s: float = 60.0
    """Lease on a rollout; kept alive by in_progress pings while the check runs."""
    max_deliver: int = 5
    """Deliveries of one rollout before the runtime dead-letters it (verifier crashes)."""
    check_deadline_s: float = 300.0
    """Deadline shown by `status` for one check (the watchdog flags it when overdue)."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"VerifierConfig.concurrency must be >= 1, got {self.concurrency}")
        if self.infra_attempts < 1:
            raise ValueError(
                f"VerifierConfig.infra_attempts must be >= 1, got {self.infra_attempts}"
            )
        if self.ack_wait_s < 3:
            raise ValueError(f"VerifierConfig.ack_wait_s must be >= 3 s, got {self.ack_wait_s}")
        for name, n in self.resource_limits.items():
            if n < 1:
                raise ValueError(f"VerifierConfig.resource_limits[{name!r}] must be >= 1, got {n}")
        if self.reward_model_spread_penalty < 0:
            raise ValueError("VerifierConfig.reward_model_spread_penalty must be >= 0, got "
                             f"{self.reward_model_spread_penalty}")


def resource_limits(config: VerifierConfig) -> dict[str, int]:
    """The configured limits, with `sandbox` defaulting to what the pool takes at once."""
    from reinforge.envs.sandbox.pool import PoolConfig

    return {"sandbox": config.sandbox_pool_size * PoolConfig().max_batch,
            **config.resource_limits}


class VerifierActor(Actor):
    actor_type = "verifier"
    Config = VerifierConfig

    def __init__(self, ctx: Any, config: VerifierConfig) -> None:
        super().__init__(ctx, config)
        from reinforge.envs.domain import DomainRegistry, ResourceLimits

        self.registry = DomainRegistry.default(config.extra_domains)
        if config.judge_url:
            from reinforge.envs.domains.judge import JudgeConfig, JudgeDomain

            self.registry.attach(JudgeDomain(config=JudgeConfig(judge_url=config.judge_url)))
        if config.reward_model:
            from reinforge.envs.domains.reward_model import attach_reward_model

            attach_reward_model(self.registry, config.reward_model,
                                config.reward_model_spread_penalty)
        self.named_domains = self.registry.resolve(config.domains, where="VerifierConfig.domains")
        self.domain_names = self.named_domains or self.registry.names()
        self.limits = ResourceLimits(resource_limits(config))
        self.domains: dict[str, Any] = {}
        self.ready = trio.Event()
        self.in_flight = 0
        self.sandbox_error = ""
        self.runner: Any = None  # the Podman pool runner once main() opened it
        self.outcomes: dict[str, int] = {o.value: 0 for o in Outcome}

    def inputs(self) -> list[Input]:
        cfg: VerifierConfig = self.config
        named = self.named_domains
        return [Input(  # one intake for every domain: `concurrency` is the verifier's
            subject=subjects.rollout(self.ctx.run, named[0] if len(named) == 1 else "*"),
            filters=tuple(subjects.rollout(self.ctx.run, d) for d in self.domain_names
                          ) if len(named) > 1 else (),
            handler=self.on_rollout,
            accepts=(Rollout,),
            concurrency=cfg.concurrency,
            batch=cfg.concurrency,
            ack_wait_s=cfg.ack_wait_s,
            max_deliver=cfg.max_deliver,
            manual_ack=True,
        )]

    def capabilities(self) -> list[str]:
        return [f"verifier for domain {d}" for d in self.domain_names]

    def figures(self) -> dict[str, float]:
        out: dict[str, float] = {f"outcome_{k}": float(v) for k, v in self.outcomes.items()}
        out["in_flight"] = float(self.in_flight)
        out["sandbox_up"] = 0.0 if self.sandbox_error else 1.0
        for res, s in self.limits.statistics().items():
            out[f"{res}_busy"] = float(s["borrowed"])
            out[f"{res}_waiting"] = float(s["waiting"])
        if self.runner is not None:
            pool = self.runner.statistics()
            out.update({
                "sandbox_jobs": float(pool.jobs), "sandbox_execs": float(pool.batches),
                # Podman's exec cost is paid once per exec: more jobs per exec, less CPU each
                "sandbox_jobs_per_exec": pool.batched_jobs / max(1, pool.batches),
                "sandbox_checks": float(pool.checks),  # by zygotes: a fork each, no exec
                "sandbox_cache_hits": float(pool.cache_hits),
                "sandbox_replaced": float(pool.sandboxes_replaced),
                "sandbox_latency_p50_s": pool.latency_p50_s,
            })
        return out

    async def main(self) -> None:
        """Own the sandbox pool (its nursery lives here) for as long as the actor runs."""
        cfg: VerifierConfig = self.config
        needs_sandbox = any(
            self.registry.get(n).resource == "sandbox" for n in self.domain_names
        )
        if not (cfg.sandbox and needs_sandbox):
            self._attach_domains(None, "")
            return
        await hold_sandbox_runner(
            cfg.sandbox_pool_size, self._attach_domains, lambda: self.in_flight,
            labels=sandbox_labels(self.ctx),
        )

    def _attach_domains(self, runner: Any, error: str) -> None:
        self.sandbox_error = error  # sandbox domains verify to infra_error without a runner
        self.runner = runner
        for name in self.domain_names:
            domain = self.registry.get(name)
            if runner is not None and domain.resource == "sandbox":
                domain = domain.with_runner(runner)
            self.domains[name] = domain
        self.ready.set()

    async def on_rollout(self, msg: Rollout, ticket: Ticket) -> None:
        if msg.domain not in self.domain_names:
            raise Reject(f"this verifier does not serve domain {msg.domain!r}")
        self.in_flight += 1
        try:
            with self.ctx.waiting("sandbox pool start", deadline_s=120):
                await self.ready.wait()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keep_lease, ticket)
                scored = await self._score(msg)
                nursery.cancel_scope.cancel()
            if scored.outcome == Outcome.INFRA_ERROR and self.ctx.state == "draining":
                raise Retry("verifier stopping: the rollout goes to another verifier", 0.0)
            await self.ctx.publish_durable(
                subjects.scored(self.ctx.run, msg.domain), scored, msg_id=f"scored:{msg.rollout_id}"
            )
            self.outcomes[scored.outcome.value] += 1
            await ticket.ack()
        finally:
            self.in_flight -= 1

    async def _keep_lease(self, ticket: Ticket) -> None:
        while True:
            await trio.sleep(self.config.ack_wait_s / 3)
            await ticket.in_progress()

    async def _score(self, msg: Rollout) -> ScoredRollout:
        from reinforge.envs.domain import infra_error

        cfg: VerifierConfig = self.config
        domain = self.domains[msg.domain]
        t0 = time.monotonic()
        attempts = 0
        verdict = None
        delay_s = cfg.infra_retry_delay_s
        while attempts < cfg.infra_attempts:
            attempts += 1
            async with self.limits.hold(domain.resource):
                with self.ctx.waiting(
                    f"{msg.domain} check of {msg.rollout_id}", deadline_s=cfg.check_deadline_s
                ):
                    try:
                        verdict = await domain.verify(task_spec_of(msg), msg.completion)
                    except Exception as exc:  # noqa: BLE001 - a domain bug is not the candidate's
                        verdict = infra_error(
                            f"domain {msg.domain!r} raised {type(exc).__name__}: {exc}"
                        )
            if verdict.outcome != "infra_error" or self.ctx.state == "draining":
                break
            if attempts < cfg.infra_attempts:
                with self.ctx.waiting("pause before retrying an infra_error", deadline_s=60):
                    await trio.sleep(delay_s)
                delay_s *= 2
        assert verdict is not None
        return scored_from_verdict(
            msg,
            verdict,
            verifier_id=self.ctx.actor_id,
            verify_s=time.monotonic() - t0,
            attempts=attempts,
        )
