"""The JSON request bodies of the rollout server (SGLang's names and defaults), as msgspec Structs.

`decode` turns a body into its Struct. Bad JSON, a wrong type, a value out of bounds, a broken
cross-field rule or an unknown `sampling_params` key raise msgspec's DecodeError or
ValidationError, whose message ends with the path of the field at fault, e.g.
"Expected `float`, got `str` - at `$.sampling_params.temperature`"; the server answers 400 with
it. Keys a Struct does not name are ignored, except in `sampling_params`, where SGLang's strict
contract rejects them. `null` means the default for every key.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta
from reinforge.engine.sampling import SamplingParams

T = TypeVar("T")


def decode(body: bytes, kind: type[T]) -> T:
    """`body` (JSON; empty means `{}`) as a `kind`.

    Raises msgspec.DecodeError (bad JSON) or its subclass msgspec.ValidationError (bad value).
    """
    return msgspec.convert(_without_nulls(msgspec.json.decode(body or b"{}")), kind)


def _without_nulls(value: Any) -> Any:
    """The objects in `value` without their null keys, so that the defaults apply (a client
    that serializes a request class sends its unset keys as null)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) if isinstance(v, dict) else v for v in value]
    return value


class SamplingParamsJSON(SamplingParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A request's `sampling_params` object: SamplingParams plus the SGLang keys accepted but
    unused here. An unknown key is refused (naming it), as SGLang refuses it."""

    frequency_penalty: float = 0.0
    """The penalties are accepted at their neutral value (the default) only."""
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stream_interval: Any = None
    """Ignored, like `logit_bias` and `custom_params`."""
    logit_bias: Any = None
    custom_params: Any = None
    seed: Any = None
    """Refused with a pointer to `sampling_seed`, SGLang's only seed key, so that a sampler
    that works here works against SGLang."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seed is not None:
            raise ValueError("unknown field `seed`: use `sampling_seed` (SGLang's name)")
        for name, neutral in _NEUTRAL_PENALTIES.items():
            if getattr(self, name) != neutral:
                raise ValueError(f"{name} is not supported by the embedded server (only {neutral})")


_NEUTRAL_PENALTIES = {
    f.name: f.default
    for f in msgspec.structs.fields(SamplingParamsJSON)
    if f.name.endswith("_penalty")
}


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A /generate body: SGLang's GenerateReqInput, the keys this server implements.

    One prompt (`text` a string, `input_ids` a list of ints) or a batch (a list of them);
    `input_ids` wins when both are given. Each per-prompt key (`sampling_params`,
    `return_logprob`, `logprob_start_len`, `rid`) takes one value for every prompt or a list
    of one per prompt.
    """

    text: str | Annotated[list[str], Meta(min_length=1)] | None = None
    input_ids: list[int | list[int]] | None = None
    """msgspec allows one list type per field, so a prompt and a batch share this one; the
    entries must be all ints or all lists (`__post_init__`)."""
    sampling_params: SamplingParamsJSON | list[SamplingParamsJSON] = SamplingParamsJSON()
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    """None: random ids; one string for a batch: `<rid>_<i>`."""

    def __post_init__(self) -> None:
        if self.input_ids is None and self.text is None:
            raise ValueError("either text or input_ids must be provided")
        if self.input_ids and len({isinstance(x, list) for x in self.input_ids}) > 1:
            raise ValueError("input_ids must be a list of integers or a list of such lists")
        for name in ("sampling_params", "return_logprob", "logprob_start_len", "rid"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != self.size:
                raise ValueError(f"{name} has {len(value)} entries for a batch of {self.size}")
        if any(p.n != self.n for p in self.per_prompt(self.sampling_params)):
            raise ValueError("every item of a batch must have the same sampling_params.n")
        if self.n > 1 and (
            isinstance(self.return_logprob, list) or isinstance(self.logprob_start_len, list)
        ):
            raise ValueError(
                "list-valued return_logprob/logprob_start_len are not allowed with n > 1"
            )

    @property
    def batched(self) -> bool:
        """Whether the prompts came as a list."""
        if self.input_ids is not None:
            return bool(self.input_ids) and isinstance(self.input_ids[0], list)
        return isinstance(self.text, list)

    @property
    def size(self) -> int:
        """How many prompts."""
        if not self.batched:
            return 1
        return len(self.input_ids) if self.input_ids is not None else len(self.text or ())

    @property
    def n(self) -> int:
        """Samples per prompt (the same for every prompt)."""
        return self.per_prompt(self.sampling_params)[0].n

    def per_prompt(self, value: T | list[T]) -> list[T]:
        """A per-prompt key's values: its list, or its one value for every prompt."""
        return value if isinstance(value, list) else [value] * self.size

    def prompts(self, tokenizer: Any) -> list[list[int]]:
        """The prompts as token ids (`text` encoded by `tokenizer`)."""
        if self.input_ids is not None:
            return self.input_ids if self.batched else [self.input_ids]
        texts = self.text if isinstance(self.text, list) else [self.text]
        return [tokenizer.encode(t) for t in texts]


class AbortRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An /abort_request body: abort the requests whose rid starts with `rid`, or all."""

    rid: str = ""
    abort_all: bool = False


class UpdateWeightsRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An /update_weights_from_disk body."""

    model_path: Annotated[str, Meta(min_length=1)]
    weight_version: str | None = None
    """None keeps the served version's name."""
    abort_all_requests: bool = False
    """Abort running requests instead of letting them finish first."""


class PauseRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A /pause_generation body."""

    mode: str = "abort"
    """SGLang's "abort", "retract" or "in_place"; the embedded server does "abort" only."""
