"""The generation engine: continuous batching over a paged KV pool, driven by one thread.

Requests move through named states: WAITING (queued, no KV) -> RUNNING (blocks held, one
token per step) -> FINISHED (blocks released, final update sent). Every step:
  1. apply pending aborts;
  2. if a weight swap is pending and nothing runs, swap (queued requests stay queued);
  3. unless a swap is pending, admit waiting groups in arrival order while the pool has the
     blocks for their worst case (prompt + max_new_tokens for each of the n samples, the
     prompt's full blocks shared among them, those the prefix cache holds reused); the
     prefix cache gives back its least recently used pages when blocks run short; a group
     that does not fit waits (never crash);
  4. prefill admitted groups, oldest first, from the end of their cached prefix, at most
     `chunked_prefill_size` prompt tokens per step (a long prompt takes several steps); a
     group whose prompt is then whole samples its n first tokens and starts running;
  5. decode one token for every running sequence in one batch, attention through the
     paged-KV ops.
Invariants: a sequence's tokens all come from one weight version (swaps wait for an empty
batch, and flush the prefix cache); blocks are reserved for the worst case at admission, so
a running sequence never waits for memory and nothing is ever preempted.

Updates go to each sequence's `sink`, called on the engine thread: the HTTP layer hops them
onto its event loop.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from reinforge.engine.kvpool import KVPool, KVPoolStats
from reinforge.engine.model import Model, Weights
from reinforge.engine.prefix_cache import PrefixCache
from reinforge.engine.speculative import NgramIndex, accept
from reinforge.engine.sampling import (
    GREEDY_TEMPERATURE,
    TOP_K_ALL,
    SamplingParams,
    sample_tokens,
    token_logprobs,
    truncation_mask,
)

PREFILL_TOKENS = 4096
"""Prompt tokens prefilled together at most when prefill is not chunked (bounds the padded
attention's memory)."""


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of one engine (the server's `--kv-cache-dtype` etc. end up here)."""

    kv_cache_dtype: str = "int8"
    """KV cache kind: int8 (default), int4, float32, bfloat16 (`auto` resolves to int8)."""
    kernel_backend: str = "auto"
    """Paged-KV ops: auto (TVM when it compiles, else torch), tvm, or torch."""
    kernel_threads: int | None = 1
    """Threads of the TVM kernels' pool. 1 (default) runs them on the engine thread: a second
    spinning thread pool next to torch's OpenMP pool made every torch op ~3x slower on 2 cores.
    None = every CPU."""
    block_size: int = 16
    """Tokens per KV page."""
    max_total_tokens: int = 65536
    """KV pool capacity in tokens (rounded up to whole pages)."""
    max_running_requests: int = 256
    """Sequences decoded together at most."""
    context_length: int | None = None
    """Prompt + generated tokens at most per sequence (default: the model's max positions)."""
    weight_version: str = "default"
    chunked_prefill_size: int = 1024
    """Prompt tokens prefilled per engine step at most, shared by the prompts being prefilled:
    a longer prompt is prefilled over several steps, and the running sequences decode a token
    between them (bounded memory, bounded inter-token latency). -1: every admitted prompt
    whole, in the step that admits it (SGLang's --chunked-prefill-size)."""
    speculative_num_draft_tokens: int = 0
    """Speculative decoding by prompt lookup (`speculative.py`): up to this many draft tokens
    per sequence and step, verified in one forward pass (0: off). Exact for greedy, the same
    distribution when sampling, the same logprobs."""
    speculative_ngram_max: int = 3
    """The longest tail n-gram looked up for a draft."""
    prefix_cache: bool = True
    """Reuse the full KV pages of earlier requests whose tokens a new prompt starts with
    (`prefix_cache.py`); False prefills every prompt whole (SGLang's --disable-radix-cache)."""

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "int8", "int4", "float32", "bfloat16"):
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of "
                "auto, int8, int4, float32, bfloat16"
            )
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(
                f"EngineConfig.chunked_prefill_size must be >= 1 or -1, got "
                f"{self.chunked_prefill_size}"
            )
        if self.speculative_num_draft_tokens < 0 or self.speculative_ngram_max < 1:
            raise ValueError("EngineConfig: speculative_num_draft_tokens must be >= 0 and "
                             "speculative_ngram_max >= 1")
        for name in ("block_size", "max_total_tokens", "max_running_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")


log = logging.getLogger(__name__)


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SeqUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one sequence, sent after each step it advanced and when it finishes."""

    index: int
    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    input_logprobs: list[float | None]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    cached_tokens: int
    weight_version: str
    admitted: bool
    """False when the request was aborted before it ever ran (SGLang's reduced meta_info)."""


@dataclass(eq=False)
class Sequence:
    """One sample being generated (a prompt with n=4 has four)."""

    rid: str
    index: int
    """Position in the HTTP response list."""
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[SeqUpdate], None]
    stream: bool = False
    logprob_start_len: int = -1
    generator: torch.Generator | None = None
    state: SeqState = SeqState.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    weight_version: str = ""
    cached_tokens: int = 0
    stop_check: Callable[[list[int]], str | None] | None = None
    """Returns the matched stop string once the decoded output contains one."""
    ngrams: NgramIndex | None = None
    """Its tokens' n-gram index, for speculative drafts (made at its first draft)."""

    def update(self) -> SeqUpdate:
        return SeqUpdate(
            index=self.index,
            rid=self.rid,
            output_ids=list(self.output_ids),
            output_logprobs=list(self.output_logprobs),
            input_logprobs=list(self.input_logprobs),
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self.cached_tokens,
            weight_version=self.weight_version,
            admitted=bool(self.weight_version),  # set when blocks are reserved
        )


@dataclass(eq=False)
class Group:
    """The n samples of one prompt: admitted together, prefilled once."""

    prompt_ids: list[int]
    seqs: list[Sequence]
    start: int = 0
    """Prompt tokens whose KV is stored: from the prefix cache at admission, then each
    prefill chunk's."""
    blocks: list[int] = field(default_factory=list)
    """While it is prefilled: the block table prefill writes (the first sample's), one
    reference held, so that aborting that sample mid-prefill loses nothing."""


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    num_waiting_reqs: int
    num_running_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    steps: int
    generated_tokens: int
    prompt_tokens: int
    cached_tokens: int
    weight_version: str
    prefix_cache_pages: int
    spec_verify_steps: int
    """Sequence-steps that verified a draft ..."""
    spec_draft_tokens: int
    """... the draft tokens they proposed ..."""
    spec_accepted_tokens: int
    """... and those accepted (each step also emits one token of its own)."""
    kv: KVPoolStats


class Engine:
    """Owns the model, the KV pool and the scheduling loop (`run_forever` on its own thread)."""

    def __init__(
        self, model: Model, config: EngineConfig, eos_token_ids: tuple[int, ...] = ()
    ) -> None:
        self.model = model
        self.config = config
        kind = "int8" if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        mc = model.config
        self.context_length = min(
            config.context_length or mc.max_position_embeddings, config.max_total_tokens
        )
        num_blocks = math.ceil(config.max_total_tokens / config.block_size)
        self.pool = KVPool(
            mc,
            kind=kind,
            num_blocks=num_blocks,
            block_size=config.block_size,
            backend=config.kernel_backend,
            num_threads=config.kernel_threads,
        )
        self.prefix_cache = PrefixCache(self.pool) if config.prefix_cache else None
        self.eos_token_ids = frozenset(eos_token_ids or mc.eos_token_ids)
        self.weight_version = config.weight_version
        self._cond = threading.Condition()
        self._waiting: deque[Group] = deque()
        self._running: list[Sequence] = []
        self._prefilling: deque[Group] = deque()  # admitted, blocks held, prompt part-stored
        self._aborts: list[tuple[str, bool, bool]] = []
        self._swap: tuple[Weights, str, Future] | None = None
        self._flushes: list[Future] = []
        self._stop = False
        self._steps = 0
        self._generated = 0
        self._prompt_tokens = 0
        self._cached = 0
        self._spec = [0, 0, 0]  # verify steps, draft tokens, accepted tokens

    # ------------------------------------------------------------------ thread-safe API

    def max_blocks_for(self, prompt_len: int, params: SamplingParams) -> int:
        """Blocks a group needs at admission (worst case), for the 'can this ever fit' check."""
        bs = self.config.block_size
        per_seq = math.ceil(max(prompt_len + params.max_new_tokens, 1) / bs)
        shared = prompt_len // bs if params.n > 1 else 0
        return shared + params.n * (per_seq - shared)

    def submit(self, group: Group) -> None:
        """Queue a group. Raises ValueError if it could never fit the pool (the caller checks
        the context length)."""
        params = msgspec.structs.replace(group.seqs[0].params, n=len(group.seqs))
        need = self.max_blocks_for(len(group.prompt_ids), params)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"a request needing {need} KV blocks can never fit a pool of {self.pool.num_blocks}"
            )
        with self._cond:
            self._waiting.append(group)
            self._cond.notify()

    def abort(self, rid: str = "", abort_all: bool = False, exact: bool = False) -> None:
        """Abort every request whose rid starts with `rid` (SGLang's prefix match; equals it
        if `exact`), or all: running ones return their partial output with finish_reason
        abort; queued ones are dropped with an abort."""
        with self._cond:
            self._aborts.append((rid, abort_all, exact))
            self._cond.notify()

    def swap_weights(self, weights: Weights, version: str, abort_all: bool = False) -> Future:
        """Install `weights` as `version` once no sequence is running; resolves when done."""
        fut: Future = Future()
        with self._cond:
            if self._swap is not None:
                fut.set_exception(RuntimeError("another weight update is in progress"))
                return fut
            if abort_all:
                self._aborts.append(("", True, False))
            self._swap = (weights, version, fut)
            self._cond.notify()
        return fut

    def flush_cache(self) -> Future:
        """Drop the prefix cache once no sequence runs; resolves to the pages dropped."""
        fut: Future = Future()
        with self._cond:
            self._flushes.append(fut)
            self._cond.notify()
        return fut

    def is_idle(self) -> bool:
        with self._cond:
            return (not self._waiting and not self._running and not self._prefilling
                    and self._swap is None)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def statistics(self) -> EngineStats:
        with self._cond:
            used = sum(len(s.prompt_ids) + len(s.output_ids) for s in self._running)
            used += sum(g.start for g in self._prefilling)
            return EngineStats(
                num_waiting_reqs=sum(len(g.seqs) for g in self._waiting),
                num_running_reqs=len(self._running) + sum(len(g.seqs) for g in self._prefilling),
                num_used_tokens=used,
                max_total_num_tokens=self.pool.num_blocks * self.pool.block_size,
                steps=self._steps,
                generated_tokens=self._generated,
                prompt_tokens=self._prompt_tokens,
                cached_tokens=self._cached,
                weight_version=self.weight_version,
                prefix_cache_pages=self.prefix_cache.num_pages if self.prefix_cache else 0,
                spec_verify_steps=self._spec[0],
                spec_draft_tokens=self._spec[1],
                spec_accepted_tokens=self._spec[2],
                kv=self.pool.statistics(),
            )

    # ------------------------------------------------------------------ the loop

    def run_forever(self) -> None:
        """The engine thread's body: step while there is work, sleep when idle."""
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (
                        self._stop or self._waiting or self._running or self._prefilling
                        or self._aborts or self._swap or self._flushes
                    ):
                        self._cond.wait()
                    if self._stop:
                        return
                try:
                    self.step()
                except Exception as exc:  # never leave HTTP callers waiting on a dead thread
                    log.exception("engine step failed; aborting every request")
                    self._fail_all(exc)

    def _fail_all(self, exc: Exception) -> None:
        reason = {
            "type": "abort",
            "message": f"engine error: {type(exc).__name__}: {exc}",
            "status_code": 500,
            "err_type": "InternalServerError",
        }
        with self._cond:
            prefilling = [s for g in self._prefilling for s in g.seqs]
            for seq in list(self._running) + prefilling:
                if seq.state is not SeqState.FINISHED:
                    self._finish(seq, reason)
            self._running.clear()
            for group in self._prefilling:
                self.pool.release(group.blocks)
            self._prefilling.clear()
            for group in self._waiting:
                for seq in group.seqs:
                    self._finish(seq, reason)
            self._waiting.clear()
            self._flush_prefix_cache()  # a step failed part-way: trust no cached page

    def run_until_idle(self) -> None:
        """Step until nothing is queued or running (for tests and benchmarks, same thread)."""
        with torch.inference_mode():
            while not self.is_idle() or self._aborts or self._flushes:
                self.step()

    def step(self) -> None:
        with self._cond:
            aborts, self._aborts = self._aborts, []
            for rid, abort_all, exact in aborts:
                self._apply_abort(rid, abort_all, exact)
            busy = bool(self._running or self._prefilling)
            if self._swap is not None and not busy:
                weights, version, fut = self._swap
                self.model.weights = weights
                self.weight_version = version
                self._swap = None
                self._flush_prefix_cache()  # its KV came from the old weights
                fut.set_result(version)
            if self._flushes and not busy:
                dropped = self._flush_prefix_cache()
                for fut in self._flushes:
                    fut.set_result(dropped)
                self._flushes = []
            if self._swap is None:
                self._prefilling.extend(self._admit())
        if self._prefilling:
            self._prefill_step()
        self._decode()
        self._steps += 1

    # ------------------------------------------------------------------ internals

    def _flush_prefix_cache(self) -> int:
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        seq.finish_reason = reason
        if seq.state is SeqState.RUNNING:
            if self.prefix_cache is not None and reason["type"] in ("stop", "length"):
                # a later turn resends prompt + output: cache their full pages (the last
                # output token's KV was never written)
                tokens = seq.prompt_ids + seq.output_ids
                pages = (len(tokens) - 1) // self.config.block_size
                self.prefix_cache.insert(tokens, seq.blocks, pages)
            self.pool.release(seq.blocks)
            seq.blocks = []
        seq.state = SeqState.FINISHED
        seq.sink(seq.update())

    def _apply_abort(self, rid: str, abort_all: bool, exact: bool) -> None:
        if not rid and not abort_all:
            return

        def hit(s: Sequence) -> bool:
            return abort_all or (s.rid == rid if exact else s.rid.startswith(rid))

        for seq in [s for s in self._running if hit(s)]:
            self._running.remove(seq)
            self._finish(
                seq,
                {
                    "type": "abort",
                    "message": "Abort requested",
                    "status_code": None,
                    "err_type": None,
                },
            )
        for group in list(self._prefilling):
            for seq in [s for s in group.seqs if hit(s)]:
                self._finish(seq, {"type": "abort", "message": "Abort requested",
                                   "status_code": None, "err_type": None})
            group.seqs = [s for s in group.seqs if s.state is not SeqState.FINISHED]
            if not group.seqs:
                self._prefilling.remove(group)
                self.pool.release(group.blocks)
        kept: deque[Group] = deque()
        for group in self._waiting:
            for seq in group.seqs:
                if hit(seq):
                    self._finish(
                        seq,
                        {
                            "type": "abort",
                            "message": "Abort in waiting queue",
                            "status_code": None,
                            "err_type": None,
                        },
                    )
            group.seqs = [s for s in group.seqs if s.state is not SeqState.FINISHED]
            if group.seqs:
                kept.append(group)
        self._waiting = kept

    def _admit(self) -> list[Group]:
        admitted: list[Group] = []
        running = len(self._running) + sum(len(g.seqs) for g in self._prefilling)
        bs = self.config.block_size
        while self._waiting:
            group = self._waiting[0]
            n = len(group.seqs)
            if running + n > self.config.max_running_requests and running:
                break
            cached = self._cached_prefix(group)
            p = len(group.prompt_ids)
            per_seq = math.ceil(max(p + group.seqs[0].params.max_new_tokens, 1) / bs)
            need = (p // bs - len(cached)) + n * (per_seq - p // bs)
            if need > self.pool.num_free and self.prefix_cache is not None:
                self.prefix_cache.evict(need - self.pool.num_free)
            if need > self.pool.num_free:
                self.pool.release(cached)
                break
            self._waiting.popleft()
            self._reserve(group, cached)
            admitted.append(group)
            running += n
        return admitted

    def _cached_prefix(self, group: Group) -> list[int]:
        """The prefix cache's blocks for the group's prompt, with a reference held (so no
        eviction takes them); at least one prompt token is left to prefill (its logits
        give the first sample). None when a sample wants its prompt's logprobs."""
        if self.prefix_cache is None or any(s.logprob_start_len >= 0 for s in group.seqs):
            return []
        pages = (len(group.prompt_ids) - 1) // self.config.block_size
        blocks = self.prefix_cache.match(group.prompt_ids, pages)
        self.pool.share(blocks)
        return blocks

    def _reserve(self, group: Group, cached: list[int]) -> None:
        """Give each sample its block table: the prompt's full pages (cached ones, then fresh
        ones), shared by the n samples, then pages of its own for the tail and the output."""
        bs = self.config.block_size
        p = len(group.prompt_ids)
        per_seq = math.ceil(max(p + group.seqs[0].params.max_new_tokens, 1) / bs)
        full = p // bs
        shared = cached + self.pool.allocate(full - len(cached))
        group.start = len(cached) * bs
        for j, seq in enumerate(group.seqs):
            if j > 0:
                self.pool.share(shared)
            seq.blocks = shared + self.pool.allocate(per_seq - full)
            seq.state = SeqState.RUNNING
            seq.weight_version = self.weight_version
            seq.cached_tokens = full * bs if j > 0 else group.start
        group.blocks = list(group.seqs[0].blocks)
        self.pool.share(group.blocks)

    def _prefill_step(self) -> None:
        """Prefill the admitted prompts, oldest first, within the step's token budget. A
        prompt whose samples want its logprobs is prefilled whole (its logits are needed
        together)."""
        budget = self.config.chunked_prefill_size
        work: list[tuple[Group, int]] = []  # (group, prompt position to prefill up to)
        for group in self._prefilling:
            if budget == 0:
                break
            todo = len(group.prompt_ids) - group.start
            whole = budget < 0 or any(s.logprob_start_len >= 0 for s in group.seqs)
            take = todo if whole else min(todo, budget)
            work.append((group, group.start + take))
            budget = budget if budget < 0 else max(0, budget - take)
        batch: list[tuple[Group, int]] = []
        size = 0
        for group, end in work:
            if batch and size + end - group.start > PREFILL_TOKENS:
                self._prefill_batch(batch)
                batch, size = [], 0
            batch.append((group, end))
            size += end - group.start
        if batch:
            self._prefill_batch(batch)

    def _prefill_batch(self, work: list[tuple[Group, int]]) -> None:
        """Store the KV of prompt tokens [start, end) of each group; a group whose prompt is
        then whole samples its n first tokens and joins the running batch."""
        bs, pool = self.config.block_size, self.pool
        want = [any(s.logprob_start_len >= 0 for s in g.seqs) for g, _ in work]
        logits = self._extend([(g.blocks, g.start, g.prompt_ids[g.start : end])
                               for g, end in work], want)
        seqs: list[Sequence] = []
        rows: list[torch.Tensor] = []
        for (g, end), lg in zip(work, logits):
            self._prompt_tokens += end - g.start
            g.start = end
            p = len(g.prompt_ids)
            if end < p:
                continue  # more chunks to come
            self._prefilling.remove(g)
            self._running.extend(g.seqs)  # at once: an error from here on still finishes them
            tail = p // bs
            if p % bs:  # the prompt's tail page, copied for each sample that has its own
                pool.copy_block(g.blocks[tail], [s.blocks[tail] for s in g.seqs
                                                 if s.blocks[tail] != g.blocks[tail]])
            self._cached += sum(s.cached_tokens for s in g.seqs)
            if self.prefix_cache is not None:
                self.prefix_cache.insert(g.prompt_ids, g.blocks, tail)
            pool.release(g.blocks)
            g.blocks = []
            for seq in g.seqs:
                if seq.logprob_start_len >= 0:  # then it was prefilled whole, in one pass
                    prompt = torch.tensor(g.prompt_ids, dtype=torch.int64)
                    seq.input_logprobs = self._input_logprobs(seq, prompt, lg)
            seqs += g.seqs
            rows.append(lg[-1:].expand(len(g.seqs), -1))
        if seqs:
            self._sample_and_advance(seqs, torch.cat(rows))

    def _extend(self, rows: list[tuple[list[int], int, list[int]]],
                want: list[bool]) -> list[torch.Tensor]:
        """One `prefill_batch` pass over the new tokens of several sequences, each row (its
        block table, the tokens already stored, its new tokens): their K/V is stored at their
        positions, and attention reads each sequence's K/V as stored, as decode does, so a
        cached prefix gives the tokens a fresh one gives. Returns prefill_batch's logits."""
        bs, pool = self.config.block_size, self.pool
        ends = [start + len(new) for _, start, new in rows]
        slots = torch.tensor([blocks[q // bs] * bs + q % bs
                              for (blocks, start, _), end in zip(rows, ends)
                              for q in range(start, end)], dtype=torch.int32)
        tables = [torch.tensor(blocks[: math.ceil(end / bs)], dtype=torch.int32)
                  for (blocks, _, _), end in zip(rows, ends)]

        def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
            cache = pool.caches[layer]
            pool.ops.append(cache, k.contiguous(), v.contiguous(), slots)
            kv = [pool.ops.gather(cache, t, end) for t, end in zip(tables, ends)]
            return torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv])

        return self.model.prefill_batch(
            [torch.tensor(new, dtype=torch.int64) for _, _, new in rows], want,
            starts=[start for _, start, _ in rows], store=store,
        )

    @staticmethod
    def _input_logprobs(
        seq: Sequence, tokens: torch.Tensor, logits: torch.Tensor
    ) -> list[float | None]:
        """Prompt logprobs from position logprob_start_len on; position 0 has none (null)."""
        p = tokens.shape[0]
        picked: list[float | None] = [None]
        if p > 1:
            t = torch.full((p - 1,), seq.params.temperature)
            picked += token_logprobs(logits[:-1], t).gather(1, tokens[1:, None]).flatten().tolist()
        return picked[min(seq.logprob_start_len, p) :]

    def _decode(self) -> None:
        seqs = [s for s in self._running if s.output_ids]
        if not seqs:
            return
        drafts = self._drafts(seqs) if self.config.speculative_num_draft_tokens else {}
        plain = [s for s in seqs if s not in drafts]
        if plain:
            self._decode_batch(plain)
        if drafts:
            self._verify(drafts)

    def _decode_batch(self, seqs: list[Sequence]) -> None:
        bs = self.config.block_size
        tokens = torch.tensor([s.output_ids[-1] for s in seqs], dtype=torch.int64)
        pos_list = [len(s.prompt_ids) + len(s.output_ids) - 1 for s in seqs]
        positions = torch.tensor(pos_list, dtype=torch.int64)
        slots = torch.tensor(
            [s.blocks[q // bs] * bs + q % bs for s, q in zip(seqs, pos_list)], dtype=torch.int32
        )
        seq_lens = torch.tensor([q + 1 for q in pos_list], dtype=torch.int32)
        width = max(q // bs for q in pos_list) + 1
        table = torch.tensor([(s.blocks + [0] * width)[:width] for s in seqs], dtype=torch.int32)
        mc = self.model.config
        out = torch.empty(len(seqs), mc.num_heads, mc.head_dim, dtype=torch.float32)
        ops, caches, scale = self.pool.ops, self.pool.caches, self.model.sm_scale

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ops.append(caches[i], k, v, slots)
            ops.decode_attention(q, caches[i], table, seq_lens, scale, out)
            return out

        logits = self.model.decode(tokens, positions, attend)
        self._sample_and_advance(seqs, logits)

    def _drafts(self, seqs: list[Sequence]) -> dict[Sequence, list[int]]:
        """Prompt-lookup drafts of the sequences that have one, each short enough that
        accepting all of it and one more token stays within the sequence's reserved pages,
        its max_new_tokens and the context length."""
        cfg = self.config
        out: dict[Sequence, list[int]] = {}
        for seq in seqs:
            if seq.ngrams is None:
                seq.ngrams = NgramIndex(seq.prompt_ids, cfg.speculative_ngram_max)
                seq.ngrams.extend(seq.output_ids)
            room = min(seq.params.max_new_tokens - len(seq.output_ids),
                       self.context_length - len(seq.prompt_ids) - len(seq.output_ids)) - 1
            draft = seq.ngrams.draft(min(cfg.speculative_num_draft_tokens, room))
            if draft:
                out[seq] = draft
        return out

    def _verify(self, drafts: dict[Sequence, list[int]]) -> None:
        """One forward pass over each sequence's last token and its draft (the prompt path:
        K/V stored, attention over them as stored); then accept per `speculative.accept`."""
        seqs = list(drafts)
        logits = self._extend(
            [(s.blocks, len(s.prompt_ids) + len(s.output_ids) - 1, [s.output_ids[-1]] + drafts[s])
             for s in seqs], [True] * len(seqs))
        for seq, lg in zip(seqs, logits):
            p = seq.params
            lp = token_logprobs(lg, p.temperature)
            keep = None
            if p.top_k < TOP_K_ALL or p.top_p < 1.0 or p.min_p > 0:
                rows = lp.shape[0]
                keep = truncation_mask(lp, torch.full((rows,), p.top_k),
                                       torch.full((rows,), p.top_p, dtype=torch.float32),
                                       torch.full((rows,), p.min_p, dtype=torch.float32))
            emitted = accept(drafts[seq], lp, keep, p.greedy, seq.generator)
            self._spec[0] += 1
            self._spec[1] += len(drafts[seq])
            self._spec[2] += len(emitted) - 1
            self._advance(seq, emitted)

    def _sample_and_advance(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token for each of `seqs` from logits [len(seqs), V], then check stops."""
        todo = [i for i, s in enumerate(seqs) if s.params.max_new_tokens > 0]
        for i, s in enumerate(seqs):
            if s.params.max_new_tokens == 0:
                self._running.remove(s)
                self._finish(s, {"type": "length", "length": 0})
        if not todo:
            return
        seqs = [seqs[i] for i in todo]
        logits = logits[todo]
        temps = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32)
        lp = token_logprobs(logits, temps)
        greedy = temps < GREEDY_TEMPERATURE
        keep = None
        if any(
            s.params.top_k < TOP_K_ALL or s.params.top_p < 1.0 or s.params.min_p > 0 for s in seqs
        ):
            keep = truncation_mask(
                lp,
                torch.tensor([s.params.top_k for s in seqs]),
                torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32),
                torch.tensor([s.params.min_p for s in seqs], dtype=torch.float32),
            )
        next_ids = sample_tokens(lp, greedy, keep, [s.generator for s in seqs])
        picked = lp.gather(1, next_ids[:, None]).flatten().tolist()
        for seq, tok, tok_lp in zip(seqs, next_ids.tolist(), picked):
            self._advance(seq, [(tok, tok_lp)])

    def _advance(self, seq: Sequence, tokens: list[tuple[int, float]]) -> None:
        """Append emitted (token, logprob) pairs, each checked for a stop; then one update."""
        for tok, tok_lp in tokens:
            seq.output_ids.append(tok)
            seq.output_logprobs.append(tok_lp)
            if seq.ngrams is not None:
                seq.ngrams.extend([tok])
            self._generated += 1
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                self._running.remove(seq)
                self._finish(seq, reason)
                return
        if seq.stream:
            seq.sink(seq.update())

    def _stop_reason(self, seq: Sequence, tok: int) -> dict[str, Any] | None:
        p = seq.params
        if len(seq.output_ids) > p.min_new_tokens:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                return {"type": "stop", "matched": tok}
            if seq.stop_check is not None:
                matched = seq.stop_check(seq.output_ids)
                if matched is not None:
                    return {"type": "stop", "matched": matched}
        if len(seq.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(seq.prompt_ids) + len(seq.output_ids) >= self.context_length:
            return {"type": "length", "length": len(seq.output_ids)}
        return None


def default_torch_threads() -> int:
    """Torch intra-op threads for the engine thread: 1 on machines with 2 CPUs or fewer, else
    all but one. Measured on 2 shared cores: the decode step's ops are small (B x hidden), and
    with 2 OpenMP threads a busy neighbour stalled every barrier (median step 10x the best);
    1 thread was stable and as fast at the best."""
    cpus = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    return 1 if cpus <= 2 else cpus - 1


def make_generator(seed: int | None, sample_index: int) -> torch.Generator | None:
    """The per-sample RNG: seeded `seed + sample_index`, or None (the shared global RNG)."""
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed + sample_index)
    return g
