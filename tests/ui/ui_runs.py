"""A live run for the UI tests: scored rollouts in a run stream on the session's nats-server,
and `reinforge ui --run R --review` serving it as a real process."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import trio

from reinforge.core import messages as m
from reinforge.core import subjects
from reinforge.core.bus import open_bus


EVIL = "<script>alert('x')</script><img src=x onerror=alert(1)><b>bold</b>"


def scored(task: str, reward: float, completion: str, domain: str = "math",
           version: int = 2, answer: str = "?") -> m.ScoredRollout:
    question = f"what is {task.split('@')[0]}?"
    r = m.Rollout(rollout_id=f"{task}:0:1", task_id=task, sample_index=0, domain=domain,
                  tier=1, prompt=question, completion=completion,
                  spec={"question": question, "answer": answer},
                  output_ids=[5, 6], logprobs=[-0.1, -0.2], policy_version=version)
    return m.ScoredRollout(rollout=r, reward=reward,
                           outcome=m.Outcome.PASS if reward else m.Outcome.FAIL, reason="checked")


def publish(creds, run: str, msgs: list[m.ScoredRollout]) -> None:
    async def main():
        async with open_bus(creds) as bus:
            await bus.ensure_run_stream(run)
            for s in msgs:
                await bus.publish_durable(subjects.scored(run, s.rollout.domain), s,
                                          msg_id=f"scored:{s.rollout.rollout_id}")

    trio.run(main)


def stored_marks(creds, run: str) -> list[m.ReviewMark]:
    """The review marks in the run's stream, read back from the server."""
    async def main():
        async with open_bus(creds) as bus:
            return [m.decode(d.data) async for d in bus.read_stream(
                subjects.stream_name(run), filter_subject=subjects.review(run, ">"))]

    return trio.run(main)


@dataclass
class LiveUI:
    url: str
    token: str


@contextlib.contextmanager
def serving_ui(args: list[str], tmp_path: Path) -> Iterator[LiveUI]:
    """`reinforge ui ARGS` as a real process on a free port, until the block ends."""
    port_file = tmp_path / "ui.port"
    proc = subprocess.Popen([sys.executable, "-P", "-m", "reinforge", "ui", *args,
                             "--port", "0", "--port-file", str(port_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "reinforge ui did not start"
            time.sleep(0.1)
        port, token = port_file.read_text().split()
        yield LiveUI(f"http://127.0.0.1:{port}", token)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


def serving(run: str, creds_file: Path, tmp_path: Path) -> contextlib.AbstractContextManager:
    """The UI over the live run `run`, review marks on, signed "ann"."""
    return serving_ui(["--run", run, "--creds", str(creds_file), "--review",
                       "--reviewer", "ann"], tmp_path)
