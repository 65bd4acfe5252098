"""The task-domain interface: tasks, verdicts, the `Domain` protocol and the registry.

A domain is one kind of verifiable task. It can

- sample a task, seeded, at a difficulty tier (`sample_task(rng, tier)`), with a
  known-good reference completion so SFT demonstrations can be made from it;
- read users' own tasks from a JSONL file (`load_tasks(path)`), refusing a
  malformed line with its line number;
- build the prompt (`prompt(task)`);
- verify a completion into a `Verdict` (`await verify(task, completion)`), a
  reward in [0, 1] with per-check details and a reason. `verify` never raises
  for the candidate's mistakes; infrastructure faults (sandbox or judge
  unreachable) come back as `outcome="infra_error"`, never as a reward of 0
  that would look like a real one.

Multi-turn domains also implement `start_episode(task)`, returning an
`Episode` whose `step(action)` answers `(observation, done)` and whose
`finish()` gives the verdict.

A domain whose prompts are one template with a few slots (two tasks differ in a file name
or two) sets `templated_prompts = True` (optional; default False). Every n-gram of such a
generated held-out prompt turns up somewhere among the training prompts, so the evaluator's
n-gram test would call all of them contaminated: for these it counts only an exact copy. A
held-out set read from a file (people's own prompts) still gets the n-gram test.

Wire format: `TaskSpec` and `Verdict` travel in NATS messages (msgpack). The
domain-specific part of a task is `TaskSpec.spec`, a plain mapping that each
domain converts to its own typed Struct (`msgspec.convert`). Evolve these
Structs by msgspec's schema-evolution rules: new fields go last with defaults,
no field is renamed or retyped.

Concurrency: each domain names the scarce `resource` its verification uses
("cpu", "sandbox", "judge"); the verifier actor bounds concurrency per
resource with `ResourceLimits`.

Selection: a run names its domains by name or by fnmatch glob (`gym-*`, `gym-*_arithmetic`);
`DomainRegistry.resolve` and `resolve_weights` are the one place globs become names.

Invariant: no module-level mutable state. The registry is an object.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.metadata
import random
import re
from collections.abc import Iterable, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec
from reinforge.core.messages import Check, Outcome


TaskSource = Literal["generated", "jsonl"]

ENTRY_POINT_GROUP = "reinforge.domains"
"""Where installed plug-ins declare their domains: `NAME = "MODULE:CLASS"`."""
LEGACY_ENTRY_POINT_GROUP = "reinforge.envs"
"""Read too, before ENTRY_POINT_GROUP (which wins a name both declare): the group the
registry read before, so plug-ins declared there keep working."""
GLOB_CHARS = "*?["


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """The result of verifying one completion."""

    reward: float
    """In [0, 1]."""
    outcome: Outcome
    checks: list[Check] = []
    reason: str = ""
    """One line: why this reward."""
    output: str = ""
    """What the candidate printed (a sandboxed program's stdout and stderr, their end; at
    most `OUTPUT_CHARS`), for people reading the rollout. Never part of the reward."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"Verdict.reward must be in [0, 1], got {self.reward!r}")
        try:  # a domain may name the outcome by its value ("pass"): store the enum
            msgspec.structs.force_setattr(self, "outcome", Outcome(self.outcome))
        except ValueError:
            known = [o.value for o in Outcome]
            raise ValueError(f"Verdict.outcome must be one of {known}, got {self.outcome!r}") from None
        if self.outcome is Outcome.INFRA_ERROR and self.reward != 0.0:
            raise ValueError("an infra_error verdict carries no reward (0.0)")


GOLD_CHECK = "gold"
"""The name of a check that is a gold signal: a rule the reward only approximates (a learned
reward model's domain), reported and never rewarded. The evaluator follows it next to the
reward, and rolls back a version whose reward rose while its gold fell."""


def gold_of(verdict: Verdict) -> bool | None:
    """The verdict's gold check, when its domain has one."""
    return next((c.passed for c in verdict.checks if c.name == GOLD_CHECK), None)


OUTPUT_CHARS = 2000


def output_tail(raw: bytes | str) -> str:
    """The end of a candidate's output, as a Verdict carries it."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    return text[-OUTPUT_CHARS:]


def infra_error(reason: str, checks: Iterable[Check] = ()) -> Verdict:
    """A verdict for an infrastructure fault: not the candidate's doing."""
    return Verdict(reward=0.0, outcome="infra_error", checks=list(checks), reason=reason)


class Tier(msgspec.Struct, frozen=True, kw_only=True):
    """One difficulty tier of a domain's generator; tiers are ordered from 0 (easiest)."""

    level: int
    name: str
    description: str
    max_heldout: int = 0
    """At most this many distinct prompts of the tier are held out (0: no cap). A tier
    drawn from a small bank (code's functions) would otherwise lose its whole bank to the
    held-out set, and training could never reach it."""


class TaskSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One task, as it travels on the bus."""

    task_id: str
    domain: str
    tier: int
    """Difficulty tier; tasks loaded from JSONL carry the tier the file gives, else 0."""
    prompt: str
    """The full prompt shown to the policy."""
    spec: dict[str, Any]
    """Domain-specific, msgpack-serialisable; the domain converts it to its own Struct."""
    reference: str | None = None
    """A known-good completion (for SFT demonstrations and self-tests), when known."""
    source: TaskSource = "generated"


@runtime_checkable
class Episode(Protocol):
    """A live multi-turn episode (terminal-style domains)."""

    async def step(self, action: str) -> tuple[str, bool]:
        """Apply one action; return (observation, done)."""
        ...

    async def finish(self) -> Verdict:
        """Check the final state and release resources. Safe to call once."""
        ...

    async def aclose(self) -> None:
        """Release resources without verifying (idempotent)."""
        ...


@runtime_checkable
class Domain(Protocol):
    """What every task domain provides."""

    name: str
    description: str
    tiers: tuple[Tier, ...]
    resource: str
    """The scarce resource verification uses: "cpu", "sandbox" or "judge"."""
    multi_turn: bool

    def sample_task(self, rng: random.Random, tier: int) -> TaskSpec: ...

    def load_tasks(self, path: str | Path) -> list[TaskSpec]: ...

    def task_from_row(self, row: Mapping[str, Any], *, where: str) -> TaskSpec:
        """Build a task from one decoded JSONL row; `where` ("FILE:LINE") goes in errors."""
        ...

    def prompt(self, task: TaskSpec) -> str: ...

    async def verify(self, task: TaskSpec, completion: str) -> Verdict: ...


def templated_prompts(domain: Domain) -> bool:
    """Whether only an exact copy of one of `domain`'s held-out prompts is contamination
    (see the module docstring)."""
    return bool(getattr(domain, "templated_prompts", False))


def check_tier(domain: Domain, tier: int) -> None:
    """Raise ValueError unless `tier` is one of the domain's tiers."""
    if not 0 <= tier < len(domain.tiers):
        raise ValueError(
            f"domain {domain.name!r} has tiers 0..{len(domain.tiers) - 1}, got tier {tier}"
        )


def describe(domain: Domain) -> dict[str, Any]:
    """A JSON-ready description of a domain (for `reinforge envs list --json`)."""
    return {
        "name": domain.name,
        "description": domain.description,
        "resource": domain.resource,
        "multi_turn": domain.multi_turn,
        "tiers": [msgspec.to_builtins(t) for t in domain.tiers],
    }


class ResourceLimits:
    """Bounded verification concurrency per resource, for trio callers.

    `async with limits.hold(domain.resource): verdict = await domain.verify(...)`.
    A resource not configured gets `default_limit`.
    """

    def __init__(self, limits: Mapping[str, int] | None = None, *, default_limit: int = 4):
        import trio

        if default_limit < 1:
            raise ValueError(f"default_limit must be >= 1, got {default_limit}")
        self._trio = trio
        self._default_limit = default_limit
        self._limiters: dict[str, Any] = {}
        for name, n in (limits or {}).items():
            if n < 1:
                raise ValueError(f"limit for resource {name!r} must be >= 1, got {n}")
            self._limiters[name] = trio.CapacityLimiter(n)

    def limiter(self, resource: str):
        if resource not in self._limiters:
            self._limiters[resource] = self._trio.CapacityLimiter(self._default_limit)
        return self._limiters[resource]

    @asynccontextmanager
    async def hold(self, resource: str):
        async with self.limiter(resource):
            yield

    def statistics(self) -> dict[str, dict[str, int]]:
        out = {}
        for name, lim in self._limiters.items():
            s = lim.statistics()
            out[name] = {
                "borrowed": s.borrowed_tokens,
                "total": int(s.total_tokens),
                "waiting": s.tasks_waiting,
            }
        return out


# Built-in domains, by import spec, imported lazily so `envs list` stays cheap.
BUILTIN_DOMAINS: tuple[tuple[str, str], ...] = (
    ("math", "reinforge.envs.domains.math:MathDomain"),
    ("code", "reinforge.envs.domains.code:CodeDomain"),
    ("docqa", "reinforge.envs.domains.docqa:DocQADomain"),
    ("terminal", "reinforge.envs.domains.terminal:TerminalDomain"),
    ("python_tool", "reinforge.envs.domains.python_tool:PythonToolDomain"),
    ("judge", "reinforge.envs.domains.judge:JudgeDomain"),
)

BUILTIN_FAMILIES: tuple[tuple[str, str], ...] = (
    ("gym-", "reinforge.envs.domains.gym:gym_domains"),
    ("rm-", "reinforge.envs.domains.reward_model:rm_domains"),
)
"""Families of domains named by a prefix, loaded only when a name of theirs is asked for
(or every name is): `MODULE:FUNCTION` returns {name: domain or factory}."""


def load_object(spec: str) -> Any:
    """Import `MODULE:ATTR` (ATTR may be dotted)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:CLASS, got {spec!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(
                f"{spec!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    return obj


def is_glob(pattern: str) -> bool:
    """Whether a domain pattern is an fnmatch glob (`gym-*`) rather than a plain name."""
    return any(c in pattern for c in GLOB_CHARS)


def _family_may_hold(prefix: str, pattern: str) -> bool:
    """Whether a family's names (`prefix...`) may match `pattern`: a name must start with
    the prefix; a glob's literal head (before its first wildcard) must agree with it, so
    `gym-*` or `*` loads the gym family and `ma*` does not."""
    if not is_glob(pattern):
        return pattern.startswith(prefix)
    head = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    return head.startswith(prefix) or prefix.startswith(head)


@contextmanager
def _about(where: str):
    """A ValueError inside says which config field it is about (`where`, when given)."""
    try:
        yield
    except ValueError as exc:
        if not where:
            raise
        raise ValueError(f"{where}: {exc}") from None


def _build(obj: Any) -> Any:
    """A class or factory function is called with no arguments; an instance is kept."""
    if isinstance(obj, type) or (callable(obj) and not isinstance(obj, Domain)):
        return obj()
    return obj


class DomainRegistry:
    """Named domains: the built-ins, the `reinforge.domains` entry points, explicit specs.

    Factories are kept until a domain is first asked for, so listing names imports nothing.
    A factory is a zero-argument callable (usually the domain class) or a ready instance.
    """

    def __init__(self) -> None:
        self._factories: dict[str, Any] = {}
        self._instances: dict[str, Domain] = {}
        self._families: dict[str, str] = {}
        """Families not loaded yet: prefix -> spec."""
        self._family_prefixes: list[str] = []

    @classmethod
    def default(cls, extra_specs: Iterable[str] = (), *, entry_points: bool = True):
        """Built-ins, then entry points (which may override), then `NAME=MODULE:CLASS` specs."""
        reg = cls()
        for name, spec in BUILTIN_DOMAINS:
            reg.add_spec(name, spec)
        for prefix, spec in BUILTIN_FAMILIES:
            reg.add_family(prefix, spec)
        if entry_points:
            for group in (LEGACY_ENTRY_POINT_GROUP, ENTRY_POINT_GROUP):
                for ep in importlib.metadata.entry_points(group=group):
                    reg.add_spec(ep.name, ep.value)
        for item in extra_specs:
            reg.attach_spec(item)
        return reg

    def add_spec(self, name: str, spec: str) -> None:
        self._factories[name] = spec
        self._instances.pop(name, None)

    def attach_spec(self, item: str) -> str:
        """Attach `NAME=MODULE:CLASS` or `MODULE:CLASS` (the name is then the class's `name`)."""
        name, eq, spec = item.partition("=")
        if not eq:
            spec, name = item, ""
        domain = _build(load_object(spec))
        if not isinstance(domain, Domain):
            raise TypeError(f"{spec!r} does not build a Domain (protocol attributes missing)")
        name = name or domain.name
        self.attach(domain, name=name)
        return name

    def attach(self, domain: Domain, *, name: str | None = None) -> None:
        """Attach a ready domain instance at runtime."""
        name = name or domain.name
        self._factories[name] = domain
        self._instances[name] = domain

    def add_family(self, prefix: str, spec: str) -> None:
        """Domains named `prefix...`, listed by `spec` (MODULE:FUNCTION) on first need."""
        self._families[prefix] = spec
        self._family_prefixes.append(prefix)

    def _load_families(self, pattern: str | None = None) -> None:
        """Load the families `pattern` (a name or a glob) may select (every family when None);
        their names join, an explicit spec of the same name keeps precedence."""
        for prefix in [p for p in self._families
                       if pattern is None or _family_may_hold(p, pattern)]:
            members = load_object(self._families.pop(prefix))()
            for member, factory in members.items():
                self._factories.setdefault(member, factory)

    def names(self, *, families: bool = False) -> list[str]:
        """The registered names; a family's (e.g. the hundred `gym-*`) only with `families`
        or once one of them was asked for: "every domain" means the singular ones."""
        if families:
            self._load_families()
        return sorted(self._factories)

    def resolve(self, patterns: Iterable[str], *, where: str = "") -> list[str]:
        """The domain names `patterns` select, each once, in the patterns' order: a name
        selects itself, a glob (fnmatch, case-sensitive) every registered name it matches,
        sorted. A pattern that selects nothing is a ValueError naming it (and `where`, the
        config field it came from)."""
        selected: dict[str, None] = {}
        with _about(where):
            for pattern in patterns:
                selected.update(dict.fromkeys(self._select(pattern)))
        return list(selected)

    def resolve_weights(self, weights: Mapping[str, float], *,
                        where: str = "") -> dict[str, float]:
        """`weights` (name or glob -> weight) per name, in `resolve`'s order: each name a glob
        matches gets the glob's weight, a name given explicitly its own (`{"gym-*": 1.0,
        "gym-gcd": 0.0}` leaves gym-gcd out). Two globs giving one name different weights
        are a ValueError: no order of keys should decide it silently."""
        names = self.resolve(weights, where=where)
        explicit = {p: w for p, w in weights.items() if not is_glob(p)}
        from_glob: dict[str, tuple[str, float]] = {}
        with _about(where):
            for pattern, weight in weights.items():
                for name in self._select(pattern) if is_glob(pattern) else ():
                    first, first_weight = from_glob.setdefault(name, (pattern, weight))
                    if name not in explicit and first_weight != weight:
                        raise ValueError(
                            f"domain {name!r} matches {first!r} (weight {first_weight}) and "
                            f"{pattern!r} (weight {weight}): give it a weight of its own")
        return {n: explicit[n] if n in explicit else from_glob[n][1] for n in names}

    def _select(self, pattern: str) -> list[str]:
        """The names one pattern selects; none is a ValueError."""
        if not is_glob(pattern):
            if pattern not in self:
                raise ValueError(f"no domain named {pattern!r}; known: {self._known()}")
            return [pattern]
        self._load_families(pattern)
        matches = sorted(n for n in self._factories if fnmatch.fnmatchcase(n, pattern))
        if not matches:
            raise ValueError(f"no domain matches {pattern!r}; known: {self._known()}")
        return matches

    def _known(self, limit: int = 8) -> str:
        """A few known names for an error message, a family as `prefix*`."""
        singular = [n for n in sorted(self._factories)
                    if not any(n.startswith(p) for p in self._family_prefixes)]
        shown = singular[:limit] + [f"{p}*" for p in self._family_prefixes]
        more = f" and {len(singular) - limit} more" if len(singular) > limit else ""
        return f"{', '.join(shown)}{more} (`reinforge envs list` lists them all)"

    def __contains__(self, name: str) -> bool:
        self._load_families(name)
        return name in self._factories

    def get(self, name: str) -> Domain:
        if name in self._instances:
            return self._instances[name]
        self._load_families(name)
        if name not in self._factories:
            raise KeyError(f"no domain named {name!r}; known: {', '.join(self.names())}")
        factory = self._factories[name]
        domain = _build(load_object(factory) if isinstance(factory, str) else factory)
        if not isinstance(domain, Domain):
            raise TypeError(f"domain {name!r} ({factory!r}) does not satisfy the Domain protocol")
        self._instances[name] = domain
        return domain
