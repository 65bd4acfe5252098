"""`reinforge up/status/attach/down` and `log export` + `replay`, as a user runs them."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.nats, pytest.mark.slow]

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


@pytest.fixture
def cli(tmp_path):
    env = dict(os.environ, REINFORGE_HOME=str(tmp_path / "home"))
    env.pop("REINFORGE_NATS_CREDS", None)

    def run(*args, check=True, timeout=180):
        proc = subprocess.run([sys.executable, "-m", "reinforge", *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"reinforge {' '.join(args)} -> {proc.returncode}\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    run.env = env
    run.home = tmp_path / "home"
    yield run
    for name in ("smoke", "rec", "crash"):
        run("down", "--run", name, check=False)


def status(cli, run):
    return json.loads(cli("status", "--run", run, "--json").stdout)


def wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_up_status_restart_attach_down_leaves_no_process(cli, tmp_path):
    # [log] bounds small enough that the supervisor's log keeper trims within seconds
    up = cli("up", "examples/echo.toml", "--run", "smoke", "--detach", "--json",
             "--set", "log.max_bytes=4096", "--set", "log.every_s=0.5")
    summary = json.loads(up.stdout.strip().splitlines()[-1])
    supervisor_pid = summary["supervisor_pid"]
    actors = status(cli, "smoke")["actors"]
    assert sorted(a["type"] for a in actors) == ["echo", "echo", "echo-source"]
    for a in actors:
        assert a["pid"] > 0 and a["rss_bytes"] > 10_000_000 and a["cpu_percent"] >= 0
        assert a["supervised"] and a["state"] == "running"
    victim = next(a for a in actors if a["type"] == "echo")
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()

    def replaced():
        for a in status(cli, "smoke")["actors"]:
            if a["id"] == victim["id"] and a["pid"] != victim["pid"] and a["state"] == "running":
                return a
        return None

    back = wait_for(replaced, 10, "the killed actor to come back")
    assert time.monotonic() - killed_at < 5.0 + 2.5  # back within 5 s (+ one status poll)
    assert back["restarts"] == 1

    attach = subprocess.Popen(
        [sys.executable, "-m", "reinforge", "attach", f"{HERE / 'cluster_actors.py'}:EchoListener",
         "--run", "smoke"], env=cli.env, cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        listener = wait_for(
            lambda: next((a for a in status(cli, "smoke")["actors"]
                          if a["type"] == "echo-listener" and a["msgs_in"] > 0), None),
            60, "the attached actor to appear and receive messages",
        )
        assert listener["capabilities"] == ["listener on echo.out"]
        assert not listener["supervised"]  # it joined from elsewhere

        def export_after_a_trim():
            said = cli("log", "export", "--run", "smoke", "-o", str(tmp_path / "s.log")).stdout
            return said if "trimmed by the run's [log] bounds (bytes)" in said else None

        assert "acknowledged messages" in wait_for(export_after_a_trim, 30,
                                                   "the log keeper's first trim")
        pids = {a["pid"] for a in status(cli, "smoke")["actors"]} | {supervisor_pid}
        cli("down", "--run", "smoke")
        assert attach.wait(timeout=30) == 0  # the attached actor obeyed the run's stop
    finally:
        if attach.poll() is None:
            attach.kill()
    time.sleep(0.5)
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    leftovers = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("REINFORGE_RUN") == "smoke" and \
                    proc.environ().get("REINFORGE_HOME") == str(cli.home):
                leftovers.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    assert leftovers == []


def test_a_crash_looping_actor_stops_up_at_once_naming_it_with_its_traceback(cli, tmp_path):
    crasher = HERE / "cluster_actors.py"
    config = tmp_path / "crash.toml"
    config.write_text(  # the health timeout is long: only the crash-loop rule can stop it
        '[supervisor]\nhealthy_timeout_s = 900\n'
        '[[actors]]\nspec = "reinforge.actors.echo:EchoActor"\n'
        f'[[actors]]\nspec = "{crasher}:CrashingActor"\n')
    for mode, code in (("--detach", 2), ("--foreground", 1)):
        args = ["up", str(config), "--run", "crash"] + ([mode] if mode == "--detach" else [])
        t0 = time.monotonic()
        out = cli(*args, check=False, timeout=300)
        print(f"{mode}: exit {out.returncode} after {time.monotonic() - t0:.1f} s")
        assert out.returncode == code, out.stderr[-3000:]
        assert "crasher-0 is crash-looping: it exited 3 times within 60 s" in out.stderr
        assert "Traceback (most recent call last)" in out.stderr
        assert "RuntimeError: planted failure: this actor cannot start" in out.stderr
        assert "not healthy within" not in out.stderr


def test_an_unknown_config_key_is_refused_with_its_name(cli, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[actors]]\nspec = "reinforge.actors.echo:EchoActor"\nreplicaz = 2\n')
    out = cli("up", str(bad), "--run", "smoke", "--detach", check=False)
    assert out.returncode == 2
    assert "replicaz" in out.stderr and "Traceback" not in out.stderr
    bad.write_text('[[actors]]\nspec = "reinforge.actors.echo:EchoActor"\n'
                   'config = { delay_s = "slow" }\n')
    out = cli("up", str(bad), "--run", "smoke", "--detach", check=False)
    assert out.returncode == 2 and "delay_s" in out.stderr


def test_a_recorded_run_replays_identically_and_a_noisy_actor_shows_its_diff(cli, tmp_path):
    cli("up", "examples/echo.toml", "--run", "rec", "--detach",
        "--set", "actors.0.config.count=30", "--set", "actors.0.config.rate_per_s=0")

    def outputs():
        log = tmp_path / "probe.log"
        cli("log", "export", "--run", "rec", "--subject", "rl.rec.echo.out", "-o", str(log))
        return int(cli("log", "show", str(log), "--json").stdout.count("\n")) >= 30

    wait_for(outputs, 60, "30 echoed messages")
    log = tmp_path / "rec.log"
    cli("log", "export", "--run", "rec", "-o", str(log))
    cli("down", "--run", "rec")
    shown = cli("log", "show", str(log), "--type", "echo").stdout
    assert "rl.rec.echo.in" in shown and "rl.rec.echo.out" in shown

    same = cli("replay", str(log), "--actor", "reinforge.actors.echo:EchoActor", "--idle-s", "1")
    assert same.returncode == 0 and "identical" in same.stdout
    assert "inputs replayed: 30; outputs recorded: 30, replayed: 30" in same.stdout

    noisy = cli("replay", str(log), "--actor", f"{HERE / 'cluster_actors.py'}:NoisyEcho",
                "--idle-s", "1", check=False)
    assert noisy.returncode == 1, noisy.stdout + noisy.stderr
    assert "DIFFERENT" in noisy.stdout
    assert "$.body: recorded 'echo 0' != replayed 'echo 0 #" in noisy.stdout
