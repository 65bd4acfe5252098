"""`reinforge up`, `reinforge down` and `reinforge attach`: start, stop and extend a run."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from reinforge.cli import reinforge_argv

RUN_ENV = "REINFORGE_RUN"


def register(subparsers: Any) -> None:
    up = subparsers.add_parser("up", help="start a run's cluster (bus, rollout server, actors)")
    up.add_argument("config", nargs="?", help="cluster config (TOML), e.g. examples/echo.toml")
    up.add_argument("--run", help="run name (default: the config's `run`)")
    up.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. actors.0.replicas=3 (repeatable)")
    up.add_argument("--detach", action="store_true",
                    help="run in the background; return once every actor is healthy")
    up.add_argument("--json", action="store_true", help="with --detach: print a JSON summary")
    up.set_defaults(func=cmd_up)

    down = subparsers.add_parser("down", help="drain and stop everything a run started")
    down.add_argument("--run", default="default")
    down.add_argument("--timeout-s", type=float, default=60.0)
    down.set_defaults(func=cmd_down)

    attach = subparsers.add_parser(
        "attach", help="start a new actor type against a RUNNING cluster"
    )
    attach.add_argument("spec", help="pkg.module:Class | path/to/file.py:Class | entry-point name")
    attach.add_argument("--run", default="default")
    attach.add_argument("--replicas", type=int, default=1)
    attach.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE")
    attach.add_argument("--creds", help="NATS credentials file (default: the run's nats.json)")
    attach.add_argument("--via-supervisor", action="store_true",
                        help="ask the run's supervisor to start and supervise them on its host")
    attach.add_argument("--detach", action="store_true",
                        help="supervise them in the background; return once they are healthy")
    attach.set_defaults(func=cmd_attach)


# --------------------------------------------------------------------------- up


def cmd_up(args: argparse.Namespace) -> int:
    from reinforge.cli import UserError
    from reinforge.core import paths
    from reinforge.core.cluster import load_cluster_config
    from reinforge.core.config import ConfigError

    try:
        config = load_cluster_config(args.config, args.overrides, args.run)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    run = config.run.name
    run_dir = paths.run_dir(run)
    pid = live_pid(run_dir / "supervisor.json")
    if pid:
        raise UserError(f"run {run!r} is already up (supervisor pid {pid}); "
                        f"`reinforge down --run {run}` first")
    if args.detach:
        return up_detached(args, config)
    return up_foreground(config)


def up_foreground(config: Any) -> int:
    import trio

    from reinforge.core import paths
    from reinforge.core.natsd import EmbeddedNats, NatsCredentials
    from reinforge.core.atomic import write_json_atomic
    from reinforge.core.cluster import run_settings_path
    from reinforge.core.supervisor import RunStopped, Supervisor, write_pidfile

    run = config.run.name
    run_dir = paths.run_dir(run)
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ[RUN_ENV] = run  # inherited by nats-server too, so `down` can find it
    os.environ["REINFORGE_HOME"] = str(paths.home())
    creds_file = run_dir / "nats.json"
    nats = None
    if config.nats_url:
        creds = (NatsCredentials.read(Path(config.nats_creds)) if config.nats_creds
                 else NatsCredentials(url=config.nats_url))
    else:
        nats = EmbeddedNats(data_dir=run_dir / "nats").start()
        creds = nats.credentials
    creds.write(creds_file)
    write_json_atomic(run_settings_path(run_dir), config.run)  # what `attach` joins
    write_pidfile(run_dir / "supervisor.json", run=run)
    supervisor = Supervisor(config, run=run, creds=creds, creds_file=creds_file, nats=nats)
    code = 0
    try:
        trio.run(supervisor.run_forever)
    except RunStopped as exc:  # the supervisor's alert above said why, in full
        print(f"reinforge up: the run stopped: {str(exc).splitlines()[0]}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        pass
    finally:
        if nats:
            nats.stop()
        (run_dir / "supervisor.json").unlink(missing_ok=True)
    return code


def up_detached(args: argparse.Namespace, config: Any) -> int:
    from reinforge.cli import UserError
    from reinforge.core import paths
    from reinforge.core.supervisor import log_tail

    run = config.run.name
    run_dir = paths.run_dir(run)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "nats.json").unlink(missing_ok=True)
    argv = reinforge_argv("up", "--run", run)
    if args.config:
        argv.append(args.config)
    for override in args.overrides:
        argv += ["--set", override]
    log_path = run_dir / "logs" / "supervisor.log"
    env = dict(os.environ, **{RUN_ENV: run, "REINFORGE_HOME": str(paths.home())})
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    expected = sum(a.replicas for a in config.actors)
    try:
        report = wait_healthy(run, expected, proc, config.supervisor.healthy_timeout_s)
    except UserError as exc:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        if proc.poll() is None:  # let it drain, so its log ends with why it stopped
            try:
                proc.wait(timeout=config.supervisor.drain_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise UserError(f"{exc}\n--- {log_path} (tail) ---\n{log_tail(log_path, 60)}") from None
    from reinforge.cli.status import report_to_json

    summary = report_to_json(report)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"run {run!r} is up: supervisor pid {proc.pid}, {len(report.actors)} actors "
              f"healthy; logs in {run_dir / 'logs'}")
    return 0


def wait_healthy(run: str, expected: int, proc: subprocess.Popen | None, timeout_s: float) -> Any:
    """Poll the run's status until `expected` actors report `running`."""
    from reinforge.cli import UserError
    from reinforge.core import paths
    from reinforge.cli.status import fetch_status
    from reinforge.core.natsd import NatsCredentials

    deadline = time.monotonic() + timeout_s
    creds_file = paths.run_dir(run) / "nats.json"
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise UserError(f"the supervisor exited with {proc.returncode} before the run was up")
        if creds_file.exists():
            try:
                last = fetch_status(NatsCredentials.read(creds_file), run, listen_s=0)
            except Exception:  # noqa: BLE001 - not reachable yet: keep polling
                last = None
            if last is not None:
                running = [a for a in last.actors if a.heartbeat.state == "running"]
                if len(running) >= expected:
                    return last
        time.sleep(0.5)
    seen = len(last.actors) if last else 0
    raise UserError(f"run {run!r} not healthy within {timeout_s:.0f} s "
                    f"({seen} of {expected} actors reported running)")


def live_pid(pidfile: Path) -> int:
    try:
        pid = int(json.loads(pidfile.read_text())["pid"])
    except (FileNotFoundError, ValueError, KeyError, json.JSONDecodeError):
        return 0
    import psutil

    return pid if psutil.pid_exists(pid) else 0


# --------------------------------------------------------------------------- down


def cmd_down(args: argparse.Namespace) -> int:
    import psutil

    from reinforge.core import paths, subjects
    from reinforge.core.natsd import NatsCredentials, NatsServerError

    run = subjects.check_token(args.run, "run name")
    run_dir = paths.run_dir(run)
    supervisor_pid = live_pid(run_dir / "supervisor.json")
    try:
        creds = NatsCredentials.read(run_dir / "nats.json")
        broadcast_stop(creds, run)  # reaches actors that joined from other hosts too
    except (NatsServerError, OSError):
        pass
    except Exception as exc:  # noqa: BLE001 - the bus may be gone already: go on with signals
        print(f"reinforge down: could not broadcast stop ({exc}); using signals", file=sys.stderr)
    if supervisor_pid:
        try:
            os.kill(supervisor_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            psutil.Process(supervisor_pid).wait(timeout=args.timeout_s)
        except psutil.NoSuchProcess:
            pass
        except psutil.TimeoutExpired:
            print(f"reinforge down: supervisor {supervisor_pid} did not stop in "
                  f"{args.timeout_s:.0f} s; killing what is left", file=sys.stderr)
    leftovers = kill_run_processes(run, str(paths.home()))
    (run_dir / "supervisor.json").unlink(missing_ok=True)
    note = f" (killed {leftovers} leftover process(es))" if leftovers else ""
    print(f"run {run!r} is down{note}")
    return 0


def broadcast_stop(creds: Any, run: str) -> None:
    import trio

    from reinforge.core import subjects
    from reinforge.core.bus import open_bus
    from reinforge.core.messages import Stop

    async def go() -> None:
        async with open_bus(creds, name="reinforge-down", connect_timeout_s=3) as bus:
            await bus.publish(subjects.stop(run), Stop(reason="reinforge down"))
            await bus.flush()

    trio.run(go)


def run_processes(run: str, home: str) -> list[Any]:
    """Processes on this host that belong to the run (by their environment markers)."""
    import psutil

    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
            continue
        if env.get(RUN_ENV) == run and env.get("REINFORGE_HOME", home) == home:
            found.append(proc)
    return found


def kill_run_processes(run: str, home: str, grace_s: float = 5.0) -> int:
    import psutil

    procs = run_processes(run, home)
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return len(procs)


# --------------------------------------------------------------------------- attach


def cmd_attach(args: argparse.Namespace) -> int:
    import trio

    from reinforge.cli import UserError
    from reinforge.core import paths, subjects
    from reinforge.cli.actor import build_actor, load_creds
    from reinforge.core.cluster import ActorSpec, ClusterConfig, actor_in_run
    from reinforge.core.config import ConfigError, parse_overrides

    run = subjects.check_token(args.run, "run name")
    if args.replicas < 1:
        raise UserError("--replicas must be >= 1")
    cls, _ = build_actor(args.spec, args.overrides)  # check it before touching the run
    creds = load_creds(run, args.creds)
    if args.via_supervisor:
        return attach_via_supervisor(creds, run, args)
    if args.detach:
        argv = [a for a in sys.argv[1:] if a != "--detach"]
        env = dict(os.environ, **{RUN_ENV: run, "REINFORGE_HOME": str(paths.home())})
        log = paths.run_dir(run) / "logs" / f"attach-{cls.actor_type}-{os.getpid()}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            proc = subprocess.Popen(reinforge_argv(*argv), stdout=f,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env)
        wait_attached(creds, run, cls.actor_type, args.replicas, proc)
        print(f"attached {args.replicas} x {cls.actor_type} to run {run!r} (pid {proc.pid})")
        return 0
    from reinforge.core.supervisor import Supervisor

    os.environ[RUN_ENV] = run
    try:
        settings = joined_run_settings(run, creds)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    try:
        actor = actor_in_run(settings, ActorSpec(spec=args.spec, replicas=args.replicas,
                                                 config=parse_overrides(args.overrides)))
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    config = ClusterConfig(run=settings, actors=[actor])
    creds_file = paths.creds_path(run) if not args.creds or "://" in args.creds \
        else Path(args.creds)
    supervisor = Supervisor(config, run=run, creds=creds, creds_file=creds_file, role="attach")
    trio.run(supervisor.run_forever)
    return 0


def joined_run_settings(run: str, creds: Any) -> Any:
    """The settings of the run an attach joins: those `reinforge up` stored in the run's
    stream (so another machine gets them too), else this machine's run.json, else the
    defaults (a run of actors started by hand)."""
    import trio

    from reinforge.core import paths
    from reinforge.core.bus import open_bus
    from reinforge.core.cluster import published_run_settings, read_run_settings

    async def stored() -> Any:
        async with open_bus(creds, name=f"attach-{run}") as bus:
            return await published_run_settings(bus, run)

    return trio.run(stored) or read_run_settings(paths.run_dir(run))


def attach_via_supervisor(creds: Any, run: str, args: argparse.Namespace) -> int:
    import trio

    from reinforge.cli import UserError
    from reinforge.core import subjects
    from reinforge.core.bus import BusError, open_bus
    from reinforge.core.messages import AttachRequest, CommandReply, decode

    async def go() -> CommandReply:
        async with open_bus(creds, name="reinforge-attach") as bus:
            req = AttachRequest(spec=args.spec, replicas=args.replicas,
                                overrides=dict(o.split("=", 1) for o in args.overrides))
            return decode(await bus.request(subjects.attach(run), req, timeout_s=10))

    try:
        reply = trio.run(go)
    except BusError as exc:
        raise UserError(f"no supervisor answered for run {run!r}: {exc}") from None
    if not reply.ok:
        raise UserError(f"the supervisor refused: {reply.text}")
    print(reply.text)
    return 0


def wait_attached(creds: Any, run: str, actor_type: str, replicas: int,
                  proc: subprocess.Popen, timeout_s: float = 120) -> None:
    from reinforge.cli import UserError
    from reinforge.cli.status import fetch_status

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UserError(f"attach exited with {proc.returncode}")
        report = fetch_status(creds, run, listen_s=2.5)
        running = [a for a in report.actors
                   if a.heartbeat.actor_type == actor_type and a.heartbeat.state == "running"]
        if len(running) >= replicas:
            return
        time.sleep(0.5)
    raise UserError(f"{actor_type} did not report running within {timeout_s:.0f} s")
