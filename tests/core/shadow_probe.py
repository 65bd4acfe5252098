"""An actor whose module imports transformers' Qwen2 and Llama models, as the learner's does.

`test_core_shadowing.py` starts it from the repository root through every way the project
runs code. From there the folder `kernels/` would shadow Hugging Face's `kernels`
distribution, which transformers imports: the model imports below would fail.

Not collected by the suite (no `test_` prefix): the shadowing test runs it with a nested
`python -m pytest`, as `make test` does.
"""

import os
import sys
from pathlib import Path

import msgspec
import trio
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

from reinforge.core.actor import Actor, run_actor
from reinforge.core.natsd import NatsCredentials


class ProbeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    started_file: str = ""
    """Written at start: where the `kernels` module came from."""


class ModelImportingActor(Actor):
    actor_type = "model-probe"
    Config = ProbeConfig

    def capabilities(self) -> list[str]:
        return [f"imports {Qwen2ForCausalLM.__name__} and {LlamaForCausalLM.__name__}"]

    async def setup(self) -> None:
        if self.config.started_file:
            Path(self.config.started_file).write_text(kernels_origin())


def kernels_origin() -> str:
    """The file the `kernels` module was loaded from ("" if transformers did not import it)."""
    module = sys.modules.get("kernels")
    return getattr(module, "__file__", None) or ""


def test_the_probe_actor_starts_beside_transformers_models():
    creds = NatsCredentials.read(Path(os.environ["PROBE_NATS_CREDS"]))
    started = os.environ["PROBE_STARTED_FILE"]

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: run_actor(
                ModelImportingActor, creds=creds, run=os.environ["PROBE_RUN"],
                config=ProbeConfig(started_file=started), task_status=task_status))
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert Path(started).read_text() == kernels_origin()
