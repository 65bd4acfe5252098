"""Data-parallel training: `replicas` copies of the policy train one batch together.

Every replica holds the whole policy and its own optimizer. In each optimizer step, replica
r trains on its share of the step's samples (consecutive runs, `split_evenly`), with the
loss normalised by the token count of the whole step; the replicas then sum their
gradients (an all-reduce), so each one steps with the gradient one replica would have had
on the whole step, and they stay equal. The figures are summed (or maxed) the same way.

Rank 0 is the learner's own `Trainer`, inside `ReplicaGroup`, which the learner uses as
it would a `Trainer`. Ranks 1..N-1 are worker processes (`python -m reinforge.rl.replicas`),
each with a `Trainer` of its own, that follow rank 0's commands (train a batch, restore a
checkpoint, stop) broadcast over torch.distributed: gloo, the CPU backend, on loopback.
Rank 0 alone writes checkpoints and publishes; the others' weights are the same.

A replica that dies fails the others' next collective: the learner's step raises, the
learner restarts from its last checkpoint, as after any crash, with a new group.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

EXIT_SHOWS_S = 10.0
"""How long a failed collective waits for a dead worker's exit to be visible (CI saw the
peer's reset before `poll` saw the exit)."""

COLLECTIVE_TIMEOUT_S = 600.0
"""How long a replica waits for the others in one collective (a step of a big model on a
CPU included) before it gives up."""


@dataclass(frozen=True)
class Replica:
    """This process's place among the replicas; torch.distributed is initialised."""

    rank: int
    world: int

    def share(self, samples: list[Any]) -> list[Any]:
        """This replica's share of a step's samples (consecutive runs; none when there are
        fewer samples than replicas)."""
        from reinforge.rl.trainer import split_evenly

        runs = split_evenly(list(range(len(samples))), self.world)
        return [samples[i] for i in runs[self.rank]] if self.rank < len(runs) else []

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the parameters' gradients over the replicas, in float32, in one all-reduce
        (a replica without a gradient for one contributes zeros)."""
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                          .detach().reshape(-1).float() for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset: offset + n].view_as(p).to(p.dtype).clone()
            offset += n

    def sum_figures(self, sums: dict[str, float]) -> dict[str, float]:
        keys = sorted(sums)
        t = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist(), strict=True))

    def max_figure(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def gather_digest(self, trainer: Any) -> list[str]:
        """Every replica's `weights_digest` of its trainer's policy, in rank order."""
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, weights_digest(trainer.model))
        return every

    def gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, tensors)
        return [t for part in every for t in part]


def weights_digest(model: Any) -> str:
    """sha256 over a model's parameters' bytes, in order."""
    import hashlib

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _broadcast(obj: Any = None) -> Any:
    """Rank 0's `obj`, on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _store(port: int, world: int) -> dist.TCPStore:
    """Where the replicas meet: rank 0's (`port` 0: it binds a free port and keeps it, so
    no other process can take it between choosing and binding), or a worker's client."""
    return dist.TCPStore("127.0.0.1", port, world, is_master=port == 0,
                         timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                         wait_for_workers=False)


def _init(rank: int, world: int, store: dist.TCPStore) -> Replica:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return Replica(rank, world)


class ReplicaLost(RuntimeError):
    """A worker replica died: the group cannot go on (the learner restarts)."""


class ReplicaGroup:
    """Rank 0's `Trainer` and the worker processes of ranks 1..`replicas`-1: the learner
    calls it as it calls a `Trainer` (train_step, restore, snapshot, export_model,
    state_dict), then `close`."""

    def __init__(self, cfg: Any, model_dir: str | Path, state: dict[str, Any] | None = None,
                 *, reference_dir: str | Path | None = None, replicas: int = 2) -> None:
        from reinforge.rl.trainer import Trainer

        if replicas < 2:
            raise ValueError(f"a replica group needs replicas >= 2, got {replicas}")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process")
        store = _store(0, replicas)
        self.closed = False
        self.workers = [
            subprocess.Popen([sys.executable, "-P", "-m", "reinforge.rl.replicas", "--rank",
                              str(r), "--world", str(replicas), "--port", str(store.port)])
            for r in range(1, replicas)]
        try:
            self.replica = _init(0, replicas, store)
            _broadcast((cfg, str(model_dir), state,
                        None if reference_dir is None else str(reference_dir)))
            self.trainer = Trainer(cfg, model_dir, state, reference_dir=reference_dir,
                                   replica=self.replica)
        except BaseException:
            self._end_workers()
            raise

    def train_step(self, samples: list[Any], version: int,
                   anchors: list[Any] | None = None) -> dict[str, float]:
        with self._replicas_alive():
            _broadcast(("train", samples, version, anchors))
            return self.trainer.train_step(samples, version, anchors)

    def restore(self, model_dir: str | Path, state: dict[str, Any]) -> None:
        with self._replicas_alive():
            _broadcast(("restore", str(model_dir), state))
            self.trainer.restore(model_dir, state)

    def weight_digests(self) -> list[str]:
        """Each replica's digest of its policy's weights (they must all be the same)."""
        with self._replicas_alive():
            _broadcast(("digest",))
            return self.replica.gather_digest(self.trainer)

    @contextlib.contextmanager
    def _replicas_alive(self) -> Iterator[None]:
        """A collective that failed because a worker is gone says which one."""
        try:
            yield
        except RuntimeError as exc:
            # its sockets close before the process is a zombie: give the exit a moment to show
            deadline = time.monotonic() + EXIT_SHOWS_S
            while not (gone := [f"rank {r} (pid {w.pid}) exited with {w.poll()}"
                                for r, w in enumerate(self.workers, 1) if w.poll() is not None]):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            raise ReplicaLost(f"a learner replica is gone: {', '.join(gone)}; the learner "
                              "stops, and starts again from its last checkpoint") from exc

    def snapshot(self, **state_args: Any) -> Any:
        return self.trainer.snapshot(**state_args)

    def export_model(self) -> Any:
        return self.trainer.export_model()

    def state_dict(self, **state_args: Any) -> dict[str, Any]:
        return self.trainer.state_dict(**state_args)

    def close(self) -> None:
        """Stop the workers and leave the process group (again: nothing)."""
        if self.closed:
            return
        self.closed = True
        try:
            if all(w.poll() is None for w in self.workers):
                _broadcast(("stop",))
        finally:
            self._end_workers()
            if dist.is_initialized():
                dist.destroy_process_group()

    def _end_workers(self) -> None:
        for w in self.workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()

    def __getattr__(self, name: str) -> Any:  # the trainer's other attributes (model, ...)
        if name == "trainer":
            raise AttributeError(name)
        return getattr(self.trainer, name)


def _watch_parent() -> None:
    """End this worker when the process that started it is gone (a killed learner)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(argv: list[str] | None = None) -> int:
    """A worker replica: join the group, build its Trainer, follow rank 0's commands."""
    from reinforge.rl.trainer import Trainer

    ap = argparse.ArgumentParser(prog="python -m reinforge.rl.replicas")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True, help="rank 0's store, on loopback")
    args = ap.parse_args(argv)
    _watch_parent()
    replica = _init(args.rank, args.world, _store(args.port, args.world))
    cfg, model_dir, state, reference_dir = _broadcast()
    trainer = Trainer(cfg, model_dir, state, reference_dir=reference_dir, replica=replica)
    while True:
        command = _broadcast()
        if command[0] == "train":
            trainer.train_step(command[1], command[2], command[3])
        elif command[0] == "restore":
            trainer.restore(command[1], command[2])
        elif command[0] == "digest":
            replica.gather_digest(trainer)
        elif command[0] == "stop":
            dist.destroy_process_group()
            return 0
        else:
            raise ValueError(f"replica {args.rank}: unknown command {command[0]!r}")


if __name__ == "__main__":
    raise SystemExit(worker_main())
