"""The prefix cache: full KV pages of earlier requests, found again by their token ids.

A radix tree over token ids at page granularity (SGLang's RadixAttention, with edges one
page long): the path from the root spells a prefix page by page, and each node holds the
KV block of its page. A later request whose prompt starts with a cached path reuses those
blocks instead of prefilling them: GRPO sends one prompt many times, and a multi-turn
episode sends each turn's whole history again.

Ownership: the cache is one owner of each block it holds (the pool's refcount), running
sequences are the others. Only a leaf whose block has no other owner can be evicted (least
recently used first), so eviction never touches a page a running request reads; a weight
swap flushes everything (its KV came from the old weights). Used from the engine thread
only.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from reinforge.engine.kvpool import KVPool


@dataclass(eq=False)
class _Node:
    block: int
    parent: _Node | None
    key: tuple[int, ...]
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0


class PrefixCache:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.page = pool.block_size
        self._root = _Node(block=-1, parent=None, key=())
        self._nodes = 0
        self._clock = 0  # a use counter: the LRU order

    @property
    def num_pages(self) -> int:
        return self._nodes

    def _pages(self, token_ids: list[int], count: int) -> list[tuple[int, ...]]:
        p = self.page
        return [tuple(token_ids[i * p : (i + 1) * p]) for i in range(count)]

    def match(self, token_ids: list[int], max_pages: int) -> list[int]:
        """The blocks of the longest cached prefix of `token_ids`, at most `max_pages`
        pages; marks them used. The caller takes its own reference before anything evicts."""
        self._clock += 1
        node, blocks = self._root, []
        for key in self._pages(token_ids, min(max_pages, len(token_ids) // self.page)):
            node = node.children.get(key)
            if node is None:
                break
            node.last_used = self._clock
            blocks.append(node.block)
        return blocks

    def insert(self, token_ids: list[int], blocks: list[int], pages: int) -> int:
        """Cache the first `pages` full pages of `token_ids`, held in `blocks`; a page
        already cached keeps its block. Returns the pages added."""
        self._clock += 1
        node, added = self._root, 0
        for key, block in zip(self._pages(token_ids, pages), blocks):
            child = node.children.get(key)
            if child is None:
                self.pool.share([block])
                child = node.children[key] = _Node(block=block, parent=node, key=key)
                self._nodes += 1
                added += 1
            child.last_used = self._clock
            node = child
        return added

    def evict(self, blocks_wanted: int) -> int:
        """Free up to `blocks_wanted` blocks, least recently used leaves first (a parent left
        childless joins them), never a block a running sequence holds. Returns the blocks
        freed."""
        heap = [(n.last_used, i, n) for i, n in enumerate(self._walk()) if self._evictable(n)]
        heapq.heapify(heap)
        tie = len(heap)
        freed = 0
        while heap and freed < blocks_wanted:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            self._drop(leaf)
            freed += 1
            if parent is not self._root and self._evictable(parent):
                tie += 1
                heapq.heappush(heap, (parent.last_used, tie, parent))
        return freed

    def _evictable(self, node: _Node) -> bool:
        return not node.children and self.pool.refcount(node.block) == 1

    def flush(self) -> int:
        """Drop every page (after a weight swap, or on request). Returns the pages dropped."""
        dropped = 0
        for node in list(self._walk()):
            self.pool.release([node.block])
            dropped += 1
        self._root.children.clear()
        self._nodes = 0
        return dropped

    def _drop(self, leaf: _Node) -> None:
        assert leaf.parent is not None and not leaf.children
        del leaf.parent.children[leaf.key]
        self.pool.release([leaf.block])
        self._nodes -= 1

    def _walk(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
