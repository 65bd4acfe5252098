"""Helpers of the engine tests: an engine on the tiny policy, driven step by step."""

from __future__ import annotations

from reinforge.engine.engine import Engine, EngineConfig, Group, Sequence, SeqUpdate, make_generator
from reinforge.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def make_engine(model, **kw) -> Engine:
    """A float32-cache engine; without the prefix cache unless asked (most tests count pages
    and compare with one request alone, and cached pages outlive requests)."""
    kw.setdefault("prefix_cache", False)
    kw.setdefault("kv_cache_dtype", "float32")
    kw.setdefault("max_total_tokens", 4096)
    return Engine(model, EngineConfig(**kw))


class Collector:
    def __init__(self) -> None:
        self.finals: dict[str, SeqUpdate] = {}
        self.updates: list[SeqUpdate] = []

    def __call__(self, u: SeqUpdate) -> None:
        self.updates.append(u)
        if u.finish_reason is not None:
            self.finals[u.rid] = u


def submit(
    engine: Engine,
    sink: Collector,
    rid: str,
    prompt: list[int],
    params: SamplingParams = GREEDY,
    **kw,
) -> None:
    seqs = [
        Sequence(
            rid=f"{rid}" if params.n == 1 else f"{rid}-{j}",
            index=j,
            prompt_ids=prompt,
            params=params,
            sink=sink,
            generator=make_generator(params.sampling_seed, j),
            **kw,
        )
        for j in range(params.n)
    ]
    engine.submit(Group(prompt_ids=prompt, seqs=seqs))
