"""What `reinforge up` reads: a TOML cluster config, decoded into typed Structs.

    nats_url = ""                       # "" = start an embedded nats-server
    stream_replicas = 1                 # 3 on a three-node NATS cluster (docs/multihost.md)
    [run]                               # what every actor of the run must agree on
    name = "smoke"                      # default run name (--run overrides)
    group_size = 8
    groups_per_version = 4
    max_staleness = 2
    temperature = 1.0
    heldout = { tasks_per_tier = 4 }
    [rollout_server]                    # optional: `reinforge serve` as a supervised child
    enabled = true
    model = ".reinforge/models/tiny"
    [[actors]]
    spec = "reinforge.actors.echo:EchoActor"
    replicas = 2
    config = { delay_s = 0.1 }
    [supervisor]
    max_restarts = 5
    [log]                               # the message log: bounds on acknowledged messages
    max_age_s = 604800
    max_bytes = 2147483648

Unknown keys are errors that name the key; `--set actors.0.replicas=3` style overrides
are applied before decoding. `run = "smoke"` (a name only) is read as `[run] name = "smoke"`.

The `[run]` section is the one place for the settings actors must agree on (`RUN_SHARED`):
each actor whose Config has such a field gets the run's value, so no actor keeps a default
of its own. An actor's `config` may repeat a value; if it says something else, or two actors
disagree while `[run]` is silent, `reinforge up` stops before starting anything and names
each contradiction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from reinforge.core import config as cfg
from reinforge.core import subjects
from reinforge.core.retention import LogRetention


class ActorSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    spec: str
    """`pkg.module:Class`, `path/to/file.py:Class` or an entry-point name."""
    replicas: int = 1
    """How many processes of this actor to run."""
    config: dict[str, Any] = {}
    """Fields of the actor's own Config (checked against it before anything starts)."""

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas of {self.spec} must be >= 0")


class RolloutServerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    enabled: bool = False
    """Start the embedded rollout server (`reinforge serve`) as a supervised child."""
    model: str = ""
    """Hugging Face-format model directory to serve."""
    port: int = 0
    """0 = a free port, published to actors as REINFORGE_ROLLOUT_URL."""
    kv_cache_dtype: str = "int8"
    extra_args: list[str] = []
    """More `reinforge serve` arguments."""


class SupervisorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_restarts: int = 5
    """Restarts of one child allowed within `restart_window_s`; past it the run stops loudly."""
    restart_window_s: float = 60.0
    backoff_initial_s: float = 0.5
    """First restart delay; doubles per restart within the window, up to backoff_max_s."""
    backoff_max_s: float = 10.0
    crash_loop_exits: int = 3
    """Exits of one child, none of which reported healthy, within `crash_loop_window_s`
    that stop the run at once, naming the child and showing its log's last lines: an actor
    that cannot start (a bad import, a wrong path) fails the run in seconds, not after
    `healthy_timeout_s`. 0 turns this off."""
    crash_loop_window_s: float = 60.0
    heartbeat_timeout_s: float = 8.0
    """The watchdog flags an actor whose newest heartbeat is older than this."""
    healthy_timeout_s: float = 120.0
    """How long `up --detach` waits for every actor to report running."""
    drain_timeout_s: float = 20.0
    """On `down`, how long children get to finish in-flight work before SIGKILL."""


class RunSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[run]`: the run's name and what its actors must agree on."""

    name: str = "default"
    group_size: int = 8
    """Samples per task (one GRPO group): the sampler draws them, the learner groups them."""
    groups_per_version: int = 4
    """Groups with signal per learner step (one step = one policy version); the scheduler's
    budget is counted in them."""
    max_staleness: int = 2
    """How many versions behind the learner a sample's policy may be: the scheduler issues
    no further ahead, the learner drops older samples."""
    temperature: float = 1.0
    """Sampling temperature: the sampler samples at it, the learner's logprobs (its
    importance ratio) are computed at it."""
    heldout: dict[str, Any] = {}
    """The held-out sets (HeldOutConfig fields): the scheduler never trains on them, the
    evaluator scores them."""

    def __post_init__(self) -> None:
        for name in ("group_size", "groups_per_version"):
            if getattr(self, name) < 1:
                raise ValueError(f"[run] {name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"[run] max_staleness must be >= 0, got {self.max_staleness}")
        if self.temperature < 0:
            raise ValueError(f"[run] temperature must be >= 0, got {self.temperature}")


RUN_DEFAULTS = RunSettings()
"""Where an actor's Config takes its default for a shared field from: one default each."""

RUN_SHARED = ("group_size", "groups_per_version", "max_staleness", "temperature", "heldout")
"""The `[run]` fields an actor's Config may have: each gets the run's value."""


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    run: RunSettings = RunSettings()
    nats_url: str = ""
    """An existing NATS server to join instead of starting one (then `nats_creds` too)."""
    nats_creds: str = ""
    """Credentials file for `nats_url` (JSON: url, user, password)."""
    stream_replicas: int = 1
    """Copies of the run's stream the NATS servers keep (and of the weights the learner
    puts in the object store): 3 on a three-node cluster, so the run outlives a node.
    Only with `nats_url`; an existing stream is never scaled down."""
    rollout_server: RolloutServerSpec = RolloutServerSpec()
    actors: list[ActorSpec] = []
    supervisor: SupervisorConfig = SupervisorConfig()
    log: LogRetention = LogRetention()
    """How much of the message log the run keeps (acknowledged messages only)."""

    def __post_init__(self) -> None:
        if not 1 <= self.stream_replicas <= 5:
            raise ValueError(f"stream_replicas must be 1..5 (JetStream's limit), got "
                             f"{self.stream_replicas}")
        if self.stream_replicas > 1 and not self.nats_url:
            raise ValueError("stream_replicas > 1 needs a NATS cluster: set nats_url and "
                             "nats_creds (the embedded nats-server is one node)")


def load_cluster_config(
    path: str | Path | None, overrides: list[str] = (), run: str | None = None
) -> ClusterConfig:
    """Read and check a cluster config; raise ConfigError naming what is wrong."""
    data: dict[str, Any] = cfg.load_toml(path) if path else {}
    if isinstance(data.get("run"), str):
        data["run"] = {"name": data["run"]}
    data = _apply_overrides(data, cfg.parse_overrides(list(overrides)))
    if run:
        data["run"] = {**data.get("run", {}), "name": run}
    where = str(path) if path else "config"
    try:
        config = msgspec.convert(data, ClusterConfig, strict=False)
    except (msgspec.ValidationError, ValueError) as exc:
        raise cfg.ConfigError(f"{where}: {exc}") from None
    try:
        subjects.check_token(config.run.name, "run name")
    except ValueError as exc:
        raise cfg.ConfigError(f"{where}: {exc}") from None
    config = with_run_settings(config, set(data.get("run", {})), where)
    check_actor_configs(config, where)
    return config


def with_run_settings(config: ClusterConfig, stated: set[str], where: str) -> ClusterConfig:
    """Every actor's config with the run's value of each `RUN_SHARED` field its Config has.

    A value is the one `[run]` states (the keys in `stated`), else the one the actors that
    set it agree on, else `[run]`'s default. Raises ConfigError naming every contradiction."""
    from reinforge.core.registry import SpecError, resolve

    fields: list[set[str]] = []
    for i, actor in enumerate(config.actors):
        try:
            cls = resolve(actor.spec)
        except SpecError as exc:
            raise cfg.ConfigError(f"{where}: actors[{i}]: {exc}") from None
        fields.append({f.name for f in msgspec.structs.fields(cls.Config)} & set(RUN_SHARED))
    values, problems = {}, []
    for name in RUN_SHARED:
        said = [(f"actors[{i}] ({a.spec})", _run_value(name, a.config[name], where))
                for i, a in enumerate(config.actors) if name in a.config and name in fields[i]]
        if name in stated:
            said.insert(0, ("[run]", getattr(config.run, name)))
        if len({msgspec.json.encode(v) for _, v in said}) > 1:
            problems.append(f"{name}: " + ", ".join(f"{who} says {v!r}" for who, v in said)
                            + " (set it once, in [run])")
        values[name] = said[0][1] if said else getattr(config.run, name)
    if problems:
        raise cfg.ConfigError(f"{where}: the actors disagree on run settings:\n  "
                              + "\n  ".join(problems))
    run = msgspec.structs.replace(config.run, **values)
    actors = [msgspec.structs.replace(a, config={**a.config, **{n: values[n] for n in fields[i]}})
              for i, a in enumerate(config.actors)]
    return msgspec.structs.replace(config, run=run, actors=actors)


def actor_in_run(run: RunSettings, actor: ActorSpec, where: str = "attach") -> ActorSpec:
    """An actor joining a running run: its config with the run's shared values (what the
    run stated is final: a different value is a ConfigError)."""
    joined = ClusterConfig(run=run, actors=[actor])
    return with_run_settings(joined, set(RUN_SHARED), where).actors[0]


def run_settings_path(run_dir: Path) -> Path:
    return run_dir / "run.json"


def read_run_settings(run_dir: Path) -> RunSettings:
    """The settings `reinforge up` wrote for this run (defaults named after the run's folder
    when it wrote none: actors started by hand)."""
    path = run_settings_path(run_dir)
    if not path.exists():
        return RunSettings(name=run_dir.name)
    try:
        return msgspec.json.decode(path.read_bytes(), type=RunSettings)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise cfg.ConfigError(f"{path} is unreadable: {exc}") from None


async def publish_run_settings(bus: Any, run: str, settings: RunSettings, host: str) -> None:
    """Store the run's settings in its stream, for actors attached on other machines."""
    import hashlib

    from reinforge.core.messages import RunSettingsPublished

    msg = RunSettingsPublished(settings=msgspec.to_builtins(settings), host=host)
    digest = hashlib.sha256(msgspec.json.encode(msg)).hexdigest()[:32]
    await bus.publish_durable(subjects.settings(run), msg, msg_id=f"settings:{digest}")


async def published_run_settings(bus: Any, run: str) -> RunSettings | None:
    """The settings `reinforge up` stored for `run` (the newest), or None."""
    from reinforge.core.messages import MessageError, RunSettingsPublished, decode

    last = await bus.last_message(subjects.stream_name(run), subjects.settings(run))
    if last is None:
        return None
    try:
        msg = decode(last.data)
    except MessageError as exc:
        raise cfg.ConfigError(f"the settings stored for run {run!r} are unreadable: {exc}"
                              ) from None
    if not isinstance(msg, RunSettingsPublished):
        raise cfg.ConfigError(f"{subjects.settings(run)} holds a {type(msg).__name__}, not the "
                              "run's settings")
    try:
        return msgspec.convert(msg.settings, RunSettings)
    except msgspec.ValidationError as exc:
        raise cfg.ConfigError(f"the settings stored for run {run!r} are unreadable: {exc}"
                              ) from None


def _run_value(name: str, value: Any, where: str) -> Any:
    """`value` as `[run]`'s `name` field types it (an override arrives as a string)."""
    try:
        return getattr(msgspec.convert({name: value}, RunSettings, strict=False), name)
    except (msgspec.ValidationError, ValueError) as exc:
        raise cfg.ConfigError(f"{where}: {exc}") from None


def _apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Like cfg.merge, but `actors.0.replicas` indexes into the actors list."""
    out = dict(data)
    for key, value in overrides.items():
        if key == "actors" and isinstance(value, dict):
            actors = [dict(a) for a in out.get("actors", [])]
            for index, fields in value.items():
                if not str(index).isdigit() or int(index) >= len(actors):
                    raise cfg.ConfigError(f"override actors.{index}: no such actor entry")
                actors[int(index)] = cfg.merge(actors[int(index)], fields)
            out["actors"] = actors
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = cfg.merge(out[key], value)
        else:
            out[key] = value
    return out


def check_actor_configs(config: ClusterConfig, where: str) -> None:
    """Resolve every actor class and decode its config now, before any process starts."""
    from reinforge.core.registry import SpecError, resolve

    for i, actor in enumerate(config.actors):
        try:
            cls = resolve(actor.spec)
        except SpecError as exc:
            raise cfg.ConfigError(f"{where}: actors[{i}]: {exc}") from None
        cfg.convert(actor.config, cls.Config, where=f"{where}: actors[{i}].config ({actor.spec})")


def config_to_overrides(config: dict[str, Any], prefix: str = "") -> list[str]:
    """The inverse of parse_overrides, for passing an actor's config on its command line."""
    out = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += config_to_overrides(value, prefix=f"{name}.")
        else:
            out.append(f"{name}={_toml_value(value)}")
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise cfg.ConfigError(f"cannot pass {value!r} as an override")
