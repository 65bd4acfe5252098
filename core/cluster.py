"""What `reinforge up` reads: a TOML cluster config, decoded into typed Structs.

    run = "smoke"                       # default run name (--run overrides)
    nats_url = ""                       # "" = start an embedded nats-server
    [rollout_server]                    # optional: `reinforge serve` as a supervised child
    enabled = true
    model = ".reinforge/models/tiny"
    [[actors]]
    spec = "reinforge.actors.echo:EchoActor"
    replicas = 2
    config = { delay_s = 0.1 }
    [supervisor]
    max_restarts = 5

Unknown keys are errors that name the key; `--set actors.0.replicas=3` style overrides
are applied before decoding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from reinforge.core import config as cfg
from reinforge.core import subjects


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


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    run: str = "default"
    nats_url: str = ""
    """An existing NATS server to join instead of starting one (then `nats_creds` too)."""
    nats_creds: str = ""
    """Credentials file for `nats_url` (JSON: url, user, password)."""
    rollout_server: RolloutServerSpec = RolloutServerSpec()
    actors: list[ActorSpec] = []
    supervisor: SupervisorConfig = SupervisorConfig()


def load_cluster_config(
    path: str | Path | None, overrides: list[str] = (), run: str | None = None
) -> ClusterConfig:
    """Read and check a cluster config; raise ConfigError naming what is wrong."""
    data: dict[str, Any] = cfg.load_toml(path) if path else {}
    data = _apply_overrides(data, cfg.parse_overrides(list(overrides)))
    if run:
        data["run"] = run
    where = str(path) if path else "config"
    try:
        config = msgspec.convert(data, ClusterConfig, strict=False)
    except (msgspec.ValidationError, ValueError) as exc:
        raise cfg.ConfigError(f"{where}: {exc}") from None
    try:
        subjects.check_token(config.run, "run name")
    except ValueError as exc:
        raise cfg.ConfigError(f"{where}: {exc}") from None
    check_actor_configs(config, where)
    return config


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
