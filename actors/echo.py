"""Trivial actors for smoke tests, examples/echo.toml and benchmarks.

`EchoSource` publishes numbered `Echo` messages into the run's stream;
`EchoActor` consumes them and publishes each one back out. Both use only the
runtime's public surface, so they double as the smallest example of an actor.
"""

from __future__ import annotations

import msgspec
import trio

from reinforge.core import subjects
from reinforge.core.actor import Actor, Input
from reinforge.core.messages import Echo


class EchoSourceConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    count: int = 100
    """How many messages to publish (0: keep going until stopped)."""
    rate_per_s: float = 50.0
    """Publishing rate; 0 means as fast as the bus acknowledges."""
    name: str = "in"
    """The echo subject suffix to publish on."""


class EchoSource(Actor):
    actor_type = "echo-source"
    Config = EchoSourceConfig

    async def main(self) -> None:
        cfg: EchoSourceConfig = self.config
        subject = subjects.echo(self.ctx.run, cfg.name)
        seq = 0
        while cfg.count == 0 or seq < cfg.count:
            msg = Echo(seq=seq, body=f"echo {seq}")
            await self.ctx.publish_durable(subject, msg, msg_id=f"{self.ctx.run}:echo-src:{seq}")
            seq += 1
            if cfg.rate_per_s > 0:
                await trio.sleep(1.0 / cfg.rate_per_s)


class EchoConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    delay_s: float = 0.0
    """Pretend work per message (to exercise in-flight redelivery)."""
    concurrency: int = 4
    """Messages handled at once."""
    source: str = "in"
    sink: str = "out"


class EchoActor(Actor):
    actor_type = "echo"
    Config = EchoConfig

    def inputs(self) -> list[Input]:
        cfg: EchoConfig = self.config
        return [
            Input(
                subject=subjects.echo(self.ctx.run, cfg.source),
                handler=self.on_echo,
                accepts=(Echo,),
                concurrency=cfg.concurrency,
                ack_wait_s=5.0,
            )
        ]

    def capabilities(self) -> list[str]:
        return [f"echo {self.config.source}->{self.config.sink}"]

    async def on_echo(self, msg: Echo) -> None:
        if self.config.delay_s:
            with self.ctx.waiting("pretend work", deadline_s=self.config.delay_s * 10 + 5):
                await trio.sleep(self.config.delay_s)
        out = Echo(seq=msg.seq, body=msg.body)
        await self.ctx.publish_durable(
            subjects.echo(self.ctx.run, self.config.sink),
            out,
            msg_id=f"{self.ctx.run}:echo:{self.config.sink}:{msg.seq}",
        )
