"""The paged KV pool: one `PagedKVCache` per layer plus a reference-counted block allocator.

A sequence owns an ordered list of block ids (its block-table row). Blocks holding only
prompt tokens are shared by the `n` samples of one prompt (refcount > 1), and by the prefix
cache (`prefix_cache.py`), which owns the full pages of earlier requests; the block that
holds the prompt's tail is copied per sample (copy-on-write done eagerly at admission).
Blocks return to the free list when their refcount reaches 0. Invariant: a block id is
either free or has refcount >= 1, never both; `statistics()` reports the counts.
"""

from __future__ import annotations

import msgspec
import torch
from reinforge.engine.model import ModelConfig


class KVPoolStats(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    backend: str
    block_size: int
    num_blocks: int
    free_blocks: int
    bytes_per_token: int
    """All layers, K and V, scales included."""
    total_bytes: int


class KVPool:
    """Per-layer caches and the block allocator. Used from the engine thread only."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        kind: str,
        num_blocks: int,
        block_size: int,
        backend: str = "auto",
        num_threads: int | None = None,
    ) -> None:
        from reinforge.kernels.paged_kv import allocate_cache, get_kv_ops

        if num_blocks < 1:
            raise ValueError(f"KVPool: num_blocks must be >= 1, got {num_blocks}")
        self.kind = kind
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.caches = [
            allocate_cache(
                kind=kind,
                num_blocks=num_blocks,
                block_size=block_size,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
            )
            for _ in range(config.num_layers)
        ]
        self.ops = get_kv_ops(kind, backend, num_threads=num_threads)
        self._refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks (refcount 1). The caller checked `num_free` first."""
        if count > len(self._free):
            raise RuntimeError(f"KVPool.allocate: {count} blocks asked, {len(self._free)} free")
        out = [self._free.pop() for _ in range(count)]
        for b in out:
            self._refcount[b] = 1
        return out

    def refcount(self, block: int) -> int:
        """How many owners `block` has (0: free)."""
        return self._refcount[block]

    def share(self, blocks: list[int]) -> None:
        """One more owner for each of `blocks`."""
        for b in blocks:
            assert self._refcount[b] > 0, f"sharing free block {b}"
            self._refcount[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one owner of each block; a block with no owner left is free again."""
        for b in blocks:
            assert self._refcount[b] > 0, f"releasing free block {b}"
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)

    def copy_block(self, src: int, dsts: list[int]) -> None:
        """Copy page `src` into each of `dsts`, in every layer."""
        if not dsts:
            return
        s = torch.tensor([src] * len(dsts), dtype=torch.int32)
        d = torch.tensor(dsts, dtype=torch.int32)
        for cache in self.caches:
            self.ops.copy_blocks(cache, s, d)

    def reset(self) -> None:
        """Forget every block (flush): only valid when no sequence holds one."""
        assert all(r == 0 for r in self._refcount), "reset with blocks in use"
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def bytes_per_token(self) -> int:
        return sum(c.bytes_per_token() for c in self.caches)

    def statistics(self) -> KVPoolStats:
        return KVPoolStats(
            kind=self.kind,
            backend=self.ops.name,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            free_blocks=len(self._free),
            bytes_per_token=self.bytes_per_token(),
            total_bytes=sum(c.nbytes() for c in self.caches),
        )
