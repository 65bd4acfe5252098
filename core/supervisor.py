"""The run's supervisor: starts the bus, the rollout server and every actor as child
processes, restarts crashed children with backoff, watches heartbeats, and stops it all.

Restarts are bounded (OTP-style intensity): more than `max_restarts` of one child within
`restart_window_s` stops the whole run loudly instead of crash-looping. The watchdog
flags, by name and reason, an actor whose heartbeat stopped or whose declared wait ran
past its deadline: a run never hangs silently.

Every child carries REINFORGE_RUN and REINFORGE_HOME in its environment, so `down` can
find (and, as a last resort, kill) anything of the run left on this host.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from reinforge.cli import reinforge_argv
from reinforge.rollout.command import serve_argv
from reinforge.core import paths, subjects
from reinforge.core.atomic import write_json_atomic
from reinforge.core.bus import Bus, open_bus
from reinforge.core.cluster import (
    ActorSpec,
    ClusterConfig,
    actor_in_run,
    config_to_overrides,
    publish_run_settings,
)
from reinforge.core.messages import (
    ActorStatus,
    Announce,
    AttachRequest,
    CommandReply,
    Heartbeat,
    MessageError,
    StatusReport,
    Stop,
    decode,
)
from reinforge.core.natsd import EmbeddedNats, NatsCredentials
from reinforge.core.retention import keep_log_bounded, trim_log_path


@dataclass
class Child:
    """One supervised process (an actor replica or the rollout server)."""

    name: str
    argv: list[str]
    log_path: Path
    proc: trio.Process | None = None
    restarts: list[float] = field(default_factory=list)
    total_restarts: int = 0
    ready_file: Path | None = None
    """A file the child writes once it serves (the rollout server's port file), for a child
    that sends no heartbeats."""
    spawned_at: float = 0.0
    log_offset: int = 0
    """Where this process's output starts in the log (earlier processes' output precedes)."""
    healthy: bool = False
    """This process (not an earlier one of the child) reported running."""
    unhealthy_exits: list[float] = field(default_factory=list)
    """When processes of this child exited without ever reporting running."""

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0


class RunStopped(Exception):
    """The supervisor gave up (restart limit) — the run stops, loudly."""


class Supervisor:
    def __init__(
        self,
        config: ClusterConfig,
        *,
        run: str,
        creds: NatsCredentials,
        creds_file: Path,
        nats: EmbeddedNats | None = None,
        role: str = "up",
    ) -> None:
        self.config = config
        self.sup = config.supervisor
        self.run = run
        self.creds = creds
        self.creds_file = creds_file
        self.nats = nats
        self.role = role  # "up": owns the run; "attach": extra actors joining it
        self.run_dir = paths.run_dir(run)
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.table: dict[str, ActorStatus] = {}
        self.alerts: list[str] = []
        self.stopping = False
        self.stop_event = trio.Event()
        self.fatal: str = ""
        self._nursery: trio.Nursery | None = None
        self._bus: Bus | None = None
        self.rollout_url = ""

    # -- process plumbing --------------------------------------------------------------------

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            REINFORGE_RUN=self.run,
            REINFORGE_HOME=str(paths.home()),
            REINFORGE_NATS_CREDS=str(self.creds_file),
            PYTHONUNBUFFERED="1",
        )
        if self.rollout_url:
            env["REINFORGE_ROLLOUT_URL"] = self.rollout_url
        return env

    def actor_children(self, actor: ActorSpec, start_index: int = 0) -> list[Child]:
        from reinforge.core.registry import resolve

        actor_type = resolve(actor.spec).actor_type
        base = reinforge_argv("actor", "run", actor.spec, "--run", self.run)
        for override in config_to_overrides(actor.config):
            base += ["--set", override]
        out = []
        for i in range(start_index, start_index + actor.replicas):
            name = f"{actor_type}-{i}"
            out.append(Child(name, base + ["--id", f"{actor_type}-{self.run}-{i}"],
                             self.log_dir / f"{name}.log"))
        return out

    async def _spawn(self, child: Child) -> None:
        log = open(child.log_path, "ab")  # noqa: SIM115 - handed to the child
        child.log_offset = log.tell()
        try:
            child.proc = await trio.lowlevel.open_process(
                child.argv, stdout=log, stderr=subprocess_stdout(), env=self.child_env(),
                stdin=subprocess_devnull(), start_new_session=True,
            )
        finally:
            log.close()
        child.healthy = False
        child.spawned_at = time.time()

    async def supervise(self, child: Child) -> None:
        """Keep one child running; restart it with backoff; give up past the limit."""
        delay = self.sup.backoff_initial_s
        while not self.stopping:
            await self._spawn(child)
            assert child.proc is not None
            code = await child.proc.wait()
            if self.stopping:
                return
            now = time.time()
            child.restarts = [t for t in child.restarts if now - t < self.sup.restart_window_s]
            child.restarts.append(now)
            child.total_restarts += 1
            if self.crash_looping(child, now):
                return self.stop_loudly(
                    f"{child.name} is crash-looping: it exited {len(child.unhealthy_exits)} "
                    f"times within {self.sup.crash_loop_window_s:.0f} s without ever reporting "
                    f"healthy (last exit code {code}). The end of its log, {child.log_path}:\n"
                    f"{log_tail(child.log_path, start=child.log_offset)}"
                )
            self.alert(f"{child.name} (pid {child.pid}) exited with {code}; restarting")
            if len(child.restarts) > self.sup.max_restarts:
                return self.stop_loudly(
                    f"{child.name} exited {len(child.restarts)} times within "
                    f"{self.sup.restart_window_s:.0f} s (last exit code {code}); "
                    f"see {child.log_path}"
                )
            await trio.sleep(delay)
            delay = min(delay * 2, self.sup.backoff_max_s)

    def crash_looping(self, child: Child, now: float) -> bool:
        """Count an exit of a process that never reported healthy; True once there were
        `crash_loop_exits` of them within the window (a healthy process resets the count)."""
        ready = child.ready_file
        if ready is not None and ready.exists() and ready.stat().st_mtime >= child.spawned_at:
            child.healthy = True
        if child.healthy:
            child.unhealthy_exits.clear()
            return False
        window = self.sup.crash_loop_window_s
        child.unhealthy_exits = [t for t in child.unhealthy_exits if now - t < window] + [now]
        return 0 < self.sup.crash_loop_exits <= len(child.unhealthy_exits)

    def add_children(self, children: list[Child]) -> None:
        assert self._nursery is not None
        for child in children:
            self.children.append(child)
            self._nursery.start_soon(self.supervise, child)

    def alert(self, text: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}"
        self.alerts = (self.alerts + [line])[-50:]
        print(f"[supervisor {self.run}] {text}", file=sys.stderr, flush=True)
        with open(self.run_dir / "watchdog.log", "a") as f:
            f.write(line + "\n")

    def stop_loudly(self, why: str) -> None:
        self.fatal = why
        self.alert(f"STOPPING THE RUN: {why}")
        self.request_stop()

    def request_stop(self) -> None:
        self.stop_event.set()

    # -- the run ----------------------------------------------------------------------------

    async def run_forever(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with open_bus(self.creds, name=f"supervisor-{self.run}") as bus:
            self._bus = bus
            if self.role == "up":
                await bus.ensure_run_stream(self.run, replicas=self.config.stream_replicas)
                await publish_run_settings(bus, self.run, self.config.run,
                                           socket.gethostname())
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._watch_heartbeats, bus)
                nursery.start_soon(self._watchdog)
                if self.nats is not None:
                    nursery.start_soon(self._keep_nats_up)
                if self.role == "up":
                    await nursery.start(self._serve_control, bus)
                    nursery.start_soon(keep_log_bounded, bus, self.run, self.config.log,
                                       trim_log_path(self.run_dir))
                if self.config.rollout_server.enabled and self.role == "up":
                    await self._start_rollout_server()
                for actor in self.config.actors:
                    self.add_children(self.actor_children(actor))
                nursery.start_soon(self._listen_for_signals)
                nursery.start_soon(self._listen_for_run_stop, bus)
                task_status.started()
                await self.stop_event.wait()
                await self._drain(bus)
                nursery.cancel_scope.cancel()
        if self.fatal:
            raise RunStopped(self.fatal)

    async def _drain(self, bus: Bus) -> None:
        self.stopping = True
        if self.role == "up":  # every actor of the run, ours or attached from elsewhere
            await bus.publish(subjects.stop(self.run), Stop(reason="run stopping"))
            await bus.flush()
        procs = [c.proc for c in self.children if c.proc and c.proc.returncode is None]
        for proc in procs:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        with trio.move_on_after(self.sup.drain_timeout_s):
            for proc in procs:
                await proc.wait()
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def _keep_nats_up(self) -> None:
        """Restart the embedded nats-server if it dies: same port, credentials and store, so
        every client reconnects and JetStream resumes where its files left off."""
        assert self.nats is not None
        while not self.stopping:
            await trio.sleep(0.5)
            proc = self.nats.proc
            if self.stopping or proc is None or proc.poll() is None:
                continue
            self.alert(f"nats-server (pid {proc.pid}) exited with {proc.returncode}; restarting")
            try:
                await trio.to_thread.run_sync(self.nats.start)
            except Exception as exc:  # noqa: BLE001 - said loudly, tried again
                self.alert(f"nats-server restart failed: {exc}")
                await trio.sleep(2.0)

    async def _start_rollout_server(self) -> None:
        spec = self.config.rollout_server
        port_file = self.run_dir / "rollout_server.port"
        port_file.unlink(missing_ok=True)
        argv = serve_argv(spec.model, port=spec.port, port_file=str(port_file),
                          kv_cache_dtype=spec.kv_cache_dtype, extra=spec.extra_args)
        child = Child("rollout-server", argv, self.log_dir / "rollout-server.log",
                      ready_file=port_file)
        self.add_children([child])
        with trio.fail_after(300):
            while not port_file.exists() or not port_file.read_text().strip():
                if self.stop_event.is_set():
                    return
                await trio.sleep(0.1)
        port = int(port_file.read_text().strip())
        # A restart must come back where the samplers look for it: pin the chosen port.
        child.argv[child.argv.index("--port") + 1] = str(port)
        self.rollout_url = f"http://127.0.0.1:{port}"
        write_json_atomic(self.run_dir / "rollout_server.json", {"url": self.rollout_url})

    async def _listen_for_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                self.request_stop()

    async def _listen_for_run_stop(self, bus: Bus) -> None:
        async with bus.subscribe(subjects.stop(self.run)) as sub:
            async for msg in sub.typed(Stop):
                if not msg.actor_id:
                    self.request_stop()

    # -- heartbeats, status and the watchdog -------------------------------------------------

    async def _watch_heartbeats(self, bus: Bus) -> None:
        async with bus.subscribe(subjects.heartbeat(self.run)) as beats, \
                bus.subscribe(subjects.announce(self.run)) as announces:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._consume_beats, beats)
                nursery.start_soon(self._consume_announces, announces)

    async def _consume_beats(self, sub: Any) -> None:
        async for hb in sub.typed(Heartbeat):
            child = self._child_for_pid(hb.pid, hb.host)
            if child is not None and hb.state == "running":
                child.healthy = True
            self.table[hb.actor_id] = ActorStatus(
                heartbeat=hb, last_seen=time.time(), supervised=child is not None,
                restarts=child.total_restarts if child else 0,
            )

    async def _consume_announces(self, sub: Any) -> None:
        async for msg in sub.typed(Announce):
            if msg.event == "left":
                self.table.pop(msg.actor_id, None)

    def _child_for_pid(self, pid: int, host: str) -> Child | None:
        if host != socket.gethostname():
            return None
        return next((c for c in self.children if c.pid == pid), None)

    def flags_for(self, status: ActorStatus, now: float) -> list[str]:
        flags = []
        hb = status.heartbeat
        silent_s = now - status.last_seen
        if silent_s > self.sup.heartbeat_timeout_s:
            flags.append(f"no heartbeat for {silent_s:.0f} s")
        if hb.wait_deadline_s > 0 and hb.waiting_on:
            waited = now - hb.waiting_since
            if waited > hb.wait_deadline_s:
                flags.append(
                    f"waiting on {hb.waiting_on} for {waited:.0f} s "
                    f"(deadline {hb.wait_deadline_s:.0f} s)"
                )
        return flags

    async def _watchdog(self) -> None:
        flagged: dict[str, str] = {}
        while True:
            await trio.sleep(1.0)
            now = time.time()
            for actor_id, status in list(self.table.items()):
                flags = self.flags_for(status, now)
                text = "; ".join(flags)
                if flags and flagged.get(actor_id) != text.split(" for ")[0]:
                    self.alert(f"watchdog: {status.heartbeat.actor_type} {actor_id}: {text}")
                    flagged[actor_id] = text.split(" for ")[0]
                if not flags:
                    flagged.pop(actor_id, None)
                if now - status.last_seen > 60:  # long gone: forget it
                    self.table.pop(actor_id, None)

    def report(self) -> StatusReport:
        now = time.time()
        actors = []
        for status in self.table.values():
            child = self._child_for_pid(status.heartbeat.pid, status.heartbeat.host)
            actors.append(ActorStatus(
                heartbeat=status.heartbeat, last_seen=status.last_seen,
                supervised=child is not None,
                restarts=child.total_restarts if child else status.restarts,
                flags=self.flags_for(status, now),
            ))
        actors.sort(key=lambda a: (a.heartbeat.actor_type, a.heartbeat.actor_id))
        return StatusReport(
            run=self.run, supervisor_pid=os.getpid(), actors=actors, alerts=self.alerts[-10:]
        )

    async def _serve_control(self, bus: Bus, task_status: trio.TaskStatus[None]) -> None:
        async with bus.subscribe(subjects.control(self.run, "status")) as status_q, \
                bus.subscribe(subjects.attach(self.run)) as attach_q:
            task_status.started()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._answer_status, bus, status_q)
                nursery.start_soon(self._answer_attach, bus, attach_q)

    async def _answer_status(self, bus: Bus, sub: Any) -> None:
        async for batch in sub:
            for raw in batch:
                if raw.reply:
                    await bus.respond(raw.reply, self.report())

    async def _answer_attach(self, bus: Bus, sub: Any) -> None:
        from reinforge.core import config as cfg
        from reinforge.core.registry import SpecError, resolve

        async for batch in sub:
            for raw in batch:
                try:
                    req = decode(raw.data)
                    if not isinstance(req, AttachRequest):
                        raise MessageError(f"expected an attach request, got {type(req).__name__}")
                    cls = resolve(req.spec)
                    overrides = [f"{k}={v}" for k, v in req.overrides.items()]
                    cfg.convert(cfg.parse_overrides(overrides), cls.Config, where=req.spec)
                    asked = ActorSpec(spec=req.spec, replicas=req.replicas,
                                      config=cfg.parse_overrides(overrides))
                    spec = actor_in_run(self.config.run, asked)
                    existing = sum(1 for c in self.children
                                   if c.name.startswith(f"{cls.actor_type}-"))
                    self.add_children(self.actor_children(spec, start_index=existing))
                    reply = CommandReply(ok=True, text=f"started {req.replicas} x {cls.actor_type}")
                except (MessageError, SpecError, cfg.ConfigError, ValueError) as exc:
                    reply = CommandReply(ok=False, text=str(exc))
                self.alert(f"attach {req_text(raw.data)}: {reply.text}")
                if raw.reply:
                    await bus.respond(raw.reply, reply)


def log_tail(path: Path, lines: int = 40, start: int = 0) -> str:
    """The last lines of a log from byte `start` on (a crashed child's traceback)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(start, f.seek(0, os.SEEK_END) - 64_000))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(cannot read the log: {exc})"
    return "\n".join(text.splitlines()[-lines:]) or "(the log is empty)"


def req_text(data: bytes) -> str:
    try:
        msg = decode(data)
    except MessageError:
        return "(malformed request)"
    return getattr(msg, "spec", type(msg).__name__)


def subprocess_stdout() -> int:
    import subprocess

    return subprocess.STDOUT


def subprocess_devnull() -> int:
    import subprocess

    return subprocess.DEVNULL


def write_pidfile(path: Path, **extra: Any) -> None:
    write_json_atomic(path, {"pid": os.getpid(), "started_at": time.time(), **extra})
