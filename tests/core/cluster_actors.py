"""Actor classes used by the cluster tests (attached by file path, as a user would)."""

import random

import msgspec

from reinforge.actors.echo import EchoActor
from reinforge.core import subjects
from reinforge.core.actor import Actor, Input
from reinforge.core.messages import Echo


class ListenerConfig(msgspec.Struct, frozen=True, kw_only=True):
    source: str = "out"


class EchoListener(Actor):
    """A type the config does not name: it joins a running run and consumes its outputs."""

    actor_type = "echo-listener"
    Config = ListenerConfig

    def inputs(self):
        return [Input(subject=subjects.echo(self.ctx.run, self.config.source),
                      handler=self.on_echo, accepts=(Echo,), group="listener")]

    def capabilities(self):
        return [f"listener on echo.{self.config.source}"]

    async def on_echo(self, msg: Echo) -> None:
        pass


class NoisyEcho(EchoActor):
    """Deliberately non-deterministic: the same input gives a different body each run."""

    async def on_echo(self, msg: Echo) -> None:
        await self.ctx.publish_durable(
            subjects.echo(self.ctx.run, self.config.sink),
            Echo(seq=msg.seq, body=f"{msg.body} #{random.random():.6f}"),
            msg_id=f"{self.ctx.run}:echo:{self.config.sink}:{msg.seq}",
        )


class CrashingActor(Actor):
    """Fails at every start, as an actor with a broken import or a wrong path would: a
    planted crash loop."""

    actor_type = "crasher"

    async def setup(self) -> None:
        raise RuntimeError("planted failure: this actor cannot start")
