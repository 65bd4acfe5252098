"""Bus throughput and latency: reinforge actors against plain asyncio nats-py, in one run.

    python bench/bus.py --json [--n 50000] [--js-n 5000] [--rr-n 2000]

Every figure comes from separate publisher and consumer processes on one embedded
nats-server. The payload is the same msgspec `Echo` (~200 bytes) both ways, and both
consumers decode every message. Throughput is measured at the consumer, from its first
message to its N-th. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from reinforge.core import subjects
from reinforge.core.actor import Actor, Input
from reinforge.core.messages import Echo, decode, encode

BODY = "x" * 170
WINDOW = 256  # durable publishes in flight at once, the same for both sides


def payload(seq: int) -> bytes:
    return encode(Echo(seq=seq, body=BODY))


# --------------------------------------------------------------------------- raw nats-py


async def raw_pub(url: str, subject: str, n: int) -> None:
    import nats

    nc = await nats.connect(url)
    for i in range(n):
        await nc.publish(subject, payload(i))
    await nc.flush()
    await nc.close()


async def raw_sub(url: str, subject: str, n: int, ready: Path, out: Path) -> None:
    import nats

    nc = await nats.connect(url)
    done = asyncio.Event()
    state = {"count": 0, "t0": 0.0, "t1": 0.0}

    async def on_msg(msg) -> None:
        decode(msg.data)
        if state["count"] == 0:
            state["t0"] = time.perf_counter()
        state["count"] += 1
        if state["count"] == n:
            state["t1"] = time.perf_counter()
            done.set()

    await nc.subscribe(subject, cb=on_msg, pending_msgs_limit=n + 10)
    await nc.flush()
    ready.touch()
    await done.wait()
    out.write_text(json.dumps({"count": n, "seconds": state["t1"] - state["t0"]}))
    await nc.close()


async def raw_js_pub(url: str, subject: str, n: int, id_prefix: str) -> None:
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    for start in range(0, n, WINDOW):
        await asyncio.gather(*(
            js.publish(subject, payload(i), headers={"Nats-Msg-Id": f"{id_prefix}{i}"})
            for i in range(start, min(n, start + WINDOW))
        ))
    await nc.close()


async def raw_js_sub(url: str, stream: str, subject: str, n: int, ready: Path, out: Path) -> None:
    import nats
    import nats.errors
    from nats.js.api import AckPolicy, ConsumerConfig

    nc = await nats.connect(url)
    js = nc.jetstream()
    psub = await js.pull_subscribe(
        subject, durable="raw-js", stream=stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=4 * WINDOW),
    )
    ready.touch()
    count, t0 = 0, 0.0
    while count < n:
        try:
            msgs = await psub.fetch(WINDOW, timeout=1)
        except nats.errors.TimeoutError:
            continue
        for m in msgs:
            decode(m.data)
            if count == 0:
                t0 = time.perf_counter()
            count += 1
            await m.ack()
    t1 = time.perf_counter()
    out.write_text(json.dumps({"count": count, "seconds": t1 - t0}))
    await nc.close()


async def raw_responder(url: str, subject: str, ready: Path) -> None:
    import nats

    nc = await nats.connect(url)

    async def on_req(msg) -> None:
        req = decode(msg.data)
        await msg.respond(encode(Echo(seq=req.seq, body=req.body)))

    await nc.subscribe(subject, cb=on_req)
    await nc.flush()
    ready.touch()
    await asyncio.sleep(3600)


async def raw_requester(url: str, subject: str, n: int, out: Path) -> None:
    import nats

    nc = await nats.connect(url)
    lat = []
    for i in range(n):
        t = time.perf_counter()
        reply = await nc.request(subject, payload(i), timeout=5)
        decode(reply.data)
        lat.append(time.perf_counter() - t)
    out.write_text(json.dumps({"latencies_s": lat}))
    await nc.close()


# --------------------------------------------------------------------------- reinforge actors


class SinkConfig(msgspec.Struct, frozen=True, kw_only=True):
    n: int = 1000
    out: str = ""
    durable: bool = False
    name: str = "bench"


class BenchSink(Actor):
    """Counts `n` Echo messages and writes how long they took from first to last."""

    actor_type = "bench-sink"
    Config = SinkConfig

    async def setup(self) -> None:
        self.count, self.t0 = 0, 0.0

    def inputs(self) -> list[Input]:
        cfg = self.config
        return [Input(
            subject=subjects.echo(self.ctx.run, cfg.name),
            handler=self.on_echo,
            accepts=(Echo,),
            durable=cfg.durable,
            concurrency=WINDOW if cfg.durable else 1,
            batch=WINDOW,
        )]

    async def on_echo(self, msg: Echo) -> None:
        if self.count == 0:
            self.t0 = time.perf_counter()
        self.count += 1
        if self.count == self.config.n:
            seconds = time.perf_counter() - self.t0
            Path(self.config.out).write_text(json.dumps({"count": self.count, "seconds": seconds}))


class SourceConfig(msgspec.Struct, frozen=True, kw_only=True):
    n: int = 1000
    durable: bool = False
    name: str = "bench"


class BenchSource(Actor):
    """Publishes `n` Echo messages as fast as the bus takes them, then idles."""

    actor_type = "bench-source"
    Config = SourceConfig

    async def main(self) -> None:
        import trio

        cfg = self.config
        subject = subjects.echo(self.ctx.run, cfg.name)
        if not cfg.durable:
            for i in range(cfg.n):
                await self.ctx.publish(subject, Echo(seq=i, body=BODY))
            await self.ctx.bus.flush()
            return
        for start in range(0, cfg.n, WINDOW):
            async with trio.open_nursery() as nursery:
                for i in range(start, min(cfg.n, start + WINDOW)):
                    nursery.start_soon(
                        self.ctx.publish_durable, subject, Echo(seq=i, body=BODY), f"rf-js-{i}"
                    )


async def reinforge_requests(creds_file: str, subject: str, n: int, out: Path) -> None:
    from reinforge.core.bus import open_bus
    from reinforge.core.natsd import NatsCredentials

    async with open_bus(NatsCredentials.read(Path(creds_file))) as bus:
        lat = []
        for i in range(n):
            t = time.perf_counter()
            decode(await bus.request(subject, Echo(seq=i, body=BODY)))
            lat.append(time.perf_counter() - t)
    out.write_text(json.dumps({"latencies_s": lat}))


async def reinforge_responder(creds_file: str, subject: str, ready: Path) -> None:
    from reinforge.core.bus import open_bus
    from reinforge.core.natsd import NatsCredentials

    async with open_bus(NatsCredentials.read(Path(creds_file))) as bus:
        async with bus.subscribe(subject) as sub:
            ready.touch()
            async for batch in sub:
                for raw in batch:
                    req = decode(raw.data)
                    await bus.respond(raw.reply, Echo(seq=req.seq, body=req.body))


# --------------------------------------------------------------------------- orchestration


def role_main(args: argparse.Namespace) -> None:
    """Entry point of the child processes."""
    import trio
    import trio_asyncio  # noqa: F401 - imported so both sides pay the same import cost

    r = args.role
    out, ready = Path(args.out or "/dev/null"), Path(args.ready or "/dev/null")
    if r == "raw-pub":
        asyncio.run(raw_pub(args.url, args.subject, args.n))
    elif r == "raw-sub":
        asyncio.run(raw_sub(args.url, args.subject, args.n, ready, out))
    elif r == "raw-js-pub":
        asyncio.run(raw_js_pub(args.url, args.subject, args.n, "raw-"))
    elif r == "raw-js-sub":
        asyncio.run(raw_js_sub(args.url, args.stream, args.subject, args.n, ready, out))
    elif r == "raw-responder":
        asyncio.run(raw_responder(args.url, args.subject, ready))
    elif r == "raw-requester":
        asyncio.run(raw_requester(args.url, args.subject, args.n, out))
    elif r == "rf-responder":
        trio.run(reinforge_responder, args.creds, args.subject, ready)
    elif r == "rf-requester":
        trio.run(reinforge_requests, args.creds, args.subject, args.n, out)


class Bench:
    def __init__(self, workdir: Path) -> None:
        from reinforge.core.natsd import EmbeddedNats

        self.dir = workdir
        self.server = EmbeddedNats(data_dir=workdir / "nats").start()
        self.creds = workdir / "nats.json"
        self.server.credentials.write(self.creds)
        self.url = self.server.credentials.with_auth_url()
        self.procs: list[subprocess.Popen] = []

    def spawn(self, *argv: str) -> subprocess.Popen:
        log = open(self.dir / f"p{len(self.procs)}.log", "wb")  # noqa: SIM115
        p = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def role(self, role: str, **kw: object) -> subprocess.Popen:
        argv = [__file__, "--role", role, "--url", self.url, "--creds", str(self.creds)]
        for k, v in kw.items():
            argv += [f"--{k}", str(v)]
        return self.spawn(*argv)

    def actor(self, cls: str, run: str, **sets: object) -> subprocess.Popen:
        argv = ["-m", "reinforge", "actor", "run", f"{__file__}:{cls}", "--run", run,
                "--creds", str(self.creds)]
        for k, v in sets.items():
            argv += ["--set", f"{k}={v}"]
        return self.spawn(*argv)

    def wait_file(self, path: Path, timeout_s: float = 300, parse: bool = True) -> dict:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"bench: timed out waiting for {path}")
            for p in self.procs:
                if p.poll() not in (None, 0):
                    logs = "\n".join(f.read_text()[-1500:] for f in self.dir.glob("p*.log"))
                    raise SystemExit(f"bench: a child failed:\n{logs}")
            time.sleep(0.05)
        if not parse:
            return {}
        while True:  # the writer may not have finished
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs.clear()

    def rate(self, result: dict) -> float:
        return (result["count"] - 1) / result["seconds"]

    def raw_core(self, n: int, tag: str) -> float:
        ready, out = self.dir / f"ready-{tag}", self.dir / f"out-{tag}"
        self.role("raw-sub", subject=f"bench.{tag}", n=n, ready=ready, out=out)
        self.wait_file(ready, parse=False)
        self.role("raw-pub", subject=f"bench.{tag}", n=n)
        res = self.wait_file(out)
        self.stop_all()
        return self.rate(res)

    def reinforge_core(self, n: int, tag: str) -> float:
        out = self.dir / f"out-{tag}"
        run = f"b{tag}"
        self.actor("BenchSink", run, n=n, out=out)
        self.wait_announce(run, "bench-sink")
        self.actor("BenchSource", run, n=n)
        res = self.wait_file(out)
        self.stop_all()
        return self.rate(res)

    def raw_js(self, n: int, tag: str) -> float:
        run = f"r{tag}"
        stream = self.make_stream(run)
        ready, out = self.dir / f"ready-{tag}", self.dir / f"out-{tag}"
        subject = subjects.echo(run, "bench")
        self.role("raw-js-sub", stream=stream, subject=subject, n=n, ready=ready, out=out)
        self.wait_file(ready, parse=False)
        self.role("raw-js-pub", subject=subject, n=n)
        res = self.wait_file(out)
        self.stop_all()
        return self.rate(res)

    def reinforge_js(self, n: int, tag: str) -> float:
        run = f"j{tag}"
        out = self.dir / f"out-{tag}"
        self.actor("BenchSink", run, n=n, out=out, durable="true")
        self.wait_announce(run, "bench-sink")
        self.actor("BenchSource", run, n=n, durable="true")
        res = self.wait_file(out)
        self.stop_all()
        return self.rate(res)

    def rr(self, n: int, tag: str, kind: str) -> tuple[float, float]:
        ready, out = self.dir / f"ready-{tag}", self.dir / f"out-{tag}"
        self.role(f"{kind}-responder", subject=f"bench.rr.{tag}", ready=ready)
        self.wait_file(ready, parse=False)
        self.role(f"{kind}-requester", subject=f"bench.rr.{tag}", n=n, out=out)
        lat = sorted(self.wait_file(out)["latencies_s"][n // 10:])  # drop warm-up
        self.stop_all()
        return lat[len(lat) // 2] * 1e6, lat[int(len(lat) * 0.99)] * 1e6

    def make_stream(self, run: str) -> str:
        import trio

        from reinforge.core.bus import open_bus

        async def go() -> str:
            async with open_bus(self.server.credentials) as bus:
                return await bus.ensure_run_stream(run)

        return trio.run(go)

    def wait_announce(self, run: str, actor_type: str, timeout_s: float = 60) -> None:
        import trio

        from reinforge.core.bus import open_bus
        from reinforge.core.messages import Heartbeat

        async def go() -> None:
            async with open_bus(self.server.credentials) as bus:
                async with bus.subscribe(subjects.heartbeat(run)) as sub:
                    with trio.fail_after(timeout_s):
                        async for batch in sub:
                            for raw in batch:
                                hb = decode(raw.data)
                                if isinstance(hb, Heartbeat) and hb.actor_type == actor_type \
                                        and hb.state == "running":
                                    return

        trio.run(go)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    ap.add_argument("--n", type=int, default=50000, help="core messages per trial")
    ap.add_argument("--js-n", type=int, default=5000, help="JetStream messages per trial")
    ap.add_argument("--rr-n", type=int, default=2000, help="requests per latency trial")
    ap.add_argument("--trials", type=int, default=3, help="trials per figure (median reported)")
    for hidden in ("role", "url", "creds", "subject", "stream", "out", "ready"):
        ap.add_argument(f"--{hidden}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        role_main(args)
        return

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(Path(tmp))
        try:
            raw, rf, js_raw, js_rf = [], [], [], []
            for t in range(args.trials):  # interleaved, so drift hits both sides alike
                raw.append(bench.raw_core(args.n, f"rc{t}"))
                rf.append(bench.reinforge_core(args.n, f"fc{t}"))
                js_raw.append(bench.raw_js(args.js_n, f"rs{t}"))
                js_rf.append(bench.reinforge_js(args.js_n, f"fs{t}"))
                say(f"trial {t}: core raw {raw[-1]:,.0f}/s reinforge {rf[-1]:,.0f}/s | "
                    f"js raw {js_raw[-1]:,.0f}/s reinforge {js_rf[-1]:,.0f}/s")
            rr_raw = bench.rr(args.rr_n, "rr0", "raw")
            rr_rf = bench.rr(args.rr_n, "rr1", "rf")
        finally:
            bench.stop_all()
            bench.server.stop()
    med = statistics.median
    result = {
        "n": args.n,
        "js_n": args.js_n,
        "trials": args.trials,
        "payload_bytes": len(payload(0)),
        "raw_msgs_per_s": round(med(raw)),
        "reinforge_msgs_per_s": round(med(rf)),
        "ratio": round(med(rf) / med(raw), 3),
        "js_raw_msgs_per_s": round(med(js_raw)),
        "js_reinforge_msgs_per_s": round(med(js_rf)),
        "js_ratio": round(med(js_rf) / med(js_raw), 3),
        "rr_p50_us": {"raw": round(rr_raw[0], 1), "reinforge": round(rr_rf[0], 1)},
        "rr_p99_us": {"raw": round(rr_raw[1], 1), "reinforge": round(rr_rf[1], 1)},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
