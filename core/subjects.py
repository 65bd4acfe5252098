"""Subject names, namespaced by run. The only place that spells them.

Data plane (kept in the run's JetStream stream, which is also the message log):
    rl.<run>.task.<domain>      rl.<run>.rollout.<domain>   rl.<run>.scored.<domain>
    rl.<run>.weights            rl.<run>.stats.<actor>      rl.<run>.dlq
    rl.<run>.decision.<domain>  rl.<run>.review.<domain>    (a person's marks: `reinforge ui`)
    rl.<run>.echo.<name>        (smoke tests and benchmarks)
Control plane (core NATS, not stored): ctl.<run>.>  (announce, heartbeat, attach, stop).
"""

from __future__ import annotations

import hashlib
import re

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def check_token(value: str, what: str) -> str:
    """A subject token: letters, digits, `_` and `-` (no dots, spaces or wildcards)."""
    if not _TOKEN.match(value):
        raise ValueError(
            f"{what} {value!r} is not a valid subject token: use letters, digits, '_' and '-'"
        )
    return value


def stream_name(run: str) -> str:
    return f"RL_{check_token(run, 'run name')}"


def weights_bucket(run: str) -> str:
    """The JetStream object store a run's weights travel in when no disk is shared."""
    return f"RL_{check_token(run, 'run name')}_weights"


def data_wildcard(run: str) -> str:
    return f"rl.{run}.>"


def task(run: str, domain: str = "*") -> str:
    return f"rl.{run}.task.{domain}"


def rollout(run: str, domain: str = "*") -> str:
    return f"rl.{run}.rollout.{domain}"


def scored(run: str, domain: str = "*") -> str:
    return f"rl.{run}.scored.{domain}"


def decision(run: str, domain: str = "*") -> str:
    return f"rl.{run}.decision.{domain}"


def review(run: str, domain: str = "*") -> str:
    return f"rl.{run}.review.{domain}"


def weights(run: str) -> str:
    return f"rl.{run}.weights"


def keep(run: str) -> str:
    return f"rl.{run}.keep"


def settings(run: str) -> str:
    return f"rl.{run}.settings"


def stats(run: str, actor: str = "*") -> str:
    return f"rl.{run}.stats.{actor}"


def dlq(run: str) -> str:
    return f"rl.{run}.dlq"


def echo(run: str, name: str = "*") -> str:
    return f"rl.{run}.echo.{name}"


def control(run: str, kind: str = ">") -> str:
    return f"ctl.{run}.{kind}"


def heartbeat(run: str, actor_id: str = "*") -> str:
    return f"ctl.{run}.heartbeat.{actor_id}"


def announce(run: str) -> str:
    return f"ctl.{run}.announce"


def attach(run: str) -> str:
    return f"ctl.{run}.attach"


def stop(run: str, actor_id: str = "") -> str:
    return f"ctl.{run}.stop" + (f".{actor_id}" if actor_id else "")


def durable_name(run: str, group: str, subject: str, filters: tuple[str, ...] = ()) -> str:
    """A durable consumer name for an actor group on a subject filter (stable across restarts).
    A consumer of several `filters` gets a digest of them in its name: a server keeps the
    filters a durable was made with, so another set must be another consumer."""
    filt = subject.removeprefix(f"rl.{run}.").replace("*", "any").replace(">", "all")
    name = f"{group}-{filt.replace('.', '_')}"
    if filters:
        name += "-" + hashlib.sha1("\n".join(sorted(filters)).encode()).hexdigest()[:10]
    return check_token(name, "durable name")
