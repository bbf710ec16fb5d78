"""RadixAttention's prefix cache: a radix tree from token ids to the KV slots that already hold
their keys/values.

Why a tree. Requests often begin alike: the same system prompt, the same few-shot examples, the
previous turns of a chat. Their KV entries for those tokens are identical (a token's K/V depend only
on the tokens before it), so computing them again is wasted work. A finished request leaves its
tokens and their KV slots in the tree; a new request walks the tree with its prompt, reuses the
slots of the longest prefix found, and prefills only the rest. A *radix* tree (a trie whose
single-child chains are merged into one node) keeps the walk short: a node holds a run of tokens,
`key`, and their slots, `value`, and its children hang off it keyed by the token that follows.

    root ── [The, cat, sat] ──┬── [on, the, mat]   two requests shared "The cat sat", then diverged;
                              └── [down]           "The cat sat down ." reuses 4 slots, prefills 1

A match that ends inside a node splits it in two, so that every matched prefix ends at a node
boundary: the request can then lock exactly what it uses (`last_node`).

Why whole pages only. The KV pool is paged (slot = page * page_size + offset) and attention reads a
request's KV through its list of pages. A page can be shared only if all its tokens are shared, so
with page_size > 1 the tree stores, matches and splits at page boundaries: node lengths are
multiples of page_size, children are keyed by their first *page* (a tuple of tokens), and the
partial last page of a request stays private to it.

Why LRU eviction on leaves. Memory is finite: when the pool runs dry the scheduler evicts cached
tokens that no running request uses. Only a leaf can go: an inner node's tokens are the prefix of
its children's, and a child's KV is useless without them. Locked nodes (lock_ref > 0: some running
request reads them) never go. Among the unlocked leaves the least recently used goes first, and its
parent may then become an unlocked leaf itself (the cascade). The unlocked leaves are kept in a set
and a heap ordered by access time, updated as the tree changes, so eviction never scans the whole
tree.

Invariants (`check_integrity` proves them):
  * evictable_size + protected_size == total tokens in the tree; protected == tokens of nodes with
    lock_ref > 0
  * evictable_leaves == the set of unlocked leaves (root excluded), each with a live heap entry
  * len(node.value) == len(node.key) > 0, a multiple of page_size; a child's dict key is its first
    token / page
  * lock_ref >= 0, and a parent's lock_ref >= each child's (a lock covers the whole path up to the
    root)
  * no KV slot appears twice in the tree
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


class TreeNode:
    """A run of tokens and their KV slots. `key` and `value` have the same length (one slot per
    token)."""

    def __init__(self, node_id: int, key: tuple[int, ...] = (), value: torch.Tensor | None = None,
                 parent: TreeNode | None = None, last_access_time: int = 0):
        self.id = node_id
        self.key = key  # token ids of this run, a tuple
        # [len(key)] int64 slots
        self.value = value if value is not None else torch.empty(0, dtype=torch.int64)
        self.parent = parent
        # first token (or first page) -> child
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0  # running requests whose prefix runs through this node
        # the cache's clock at the last match / insert through here
        self.last_access_time = last_access_time

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass
class MatchResult:
    # [matched_len] int64 KV slots of the longest cached prefix (a fresh tensor)
    indices: torch.Tensor
    # the node where the match ends (the root if nothing matched): lock this one
    last_node: TreeNode


class RadixCache:
    """The prefix tree. It only does bookkeeping of slot indices: the caller allocates and frees the
    KV memory."""

    def __init__(self, page_size: int = 1, device: torch.device | str = "cpu"):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size, self.device = page_size, torch.device(device)
        self.reset()

    def reset(self) -> None:
        """Forget every cached prefix (the caller resets its slot allocator with it)."""
        self._next_id = 0
        # a counter, not wall time: deterministic, and ties cannot happen by accident
        self._clock = 0
        self.root_node = self._new_node((), torch.empty(0, dtype=torch.int64, device=self.device),
                                        None)
        self.evictable_size = 0  # tokens in nodes with lock_ref == 0
        self.protected_size = 0  # tokens in nodes with lock_ref > 0
        self.evictable_leaves: set[TreeNode] = set()
        # (last_access_time, id, leaf); stale entries allowed
        self._heap: list[tuple[int, int, TreeNode]] = []

    # ---- public API
    # ------------------------------------------------------------------------------------------

    def match_prefix(self, ids: Sequence[int] | torch.Tensor) -> MatchResult:
        """The longest cached prefix of `ids` (whole pages only) and its slots. Refreshes the access
        time of what matched; after a split the unmatched rest of the node keeps its older time (it
        was not used)."""
        key = self._page_aligned(self._as_key(ids))
        now = self._tick()
        node, values = self.root_node, []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._match_len(child.key, key)
            if n < len(child.key):
                # the match ends inside child: its first n tokens become a node
                child = self._split(child, n)
            self._touch(child, now)
            values.append(child.value)
            # after a split, key[n:] starts no child of node: the loop ends
            node, key = child, key[n:]
        indices = torch.cat(values) if values else torch.empty(0, dtype=torch.int64,
                                                               device=self.device)
        return MatchResult(indices, node)

    def insert(self, ids: Sequence[int] | torch.Tensor, indices: torch.Tensor) -> int:
        """Cache `ids` with their KV slots `indices` ([len(ids)] ints). Returns how many leading
        tokens were already cached: the caller's slots for those are duplicates, and the caller
        frees them. With page_size > 1 only whole pages are inserted: the caller also frees its
        slots of the partial last page."""
        key = self._as_key(ids)
        if not isinstance(indices,
                          torch.Tensor) or indices.dim() != 1 or indices.is_floating_point():
            raise TypeError(f"indices must be a 1-D integer tensor of KV slots, got {indices!r}")
        if len(indices) != len(key):
            raise ValueError(f"insert got {len(key)} token ids but {len(indices)} KV slot indices")
        key = self._page_aligned(key)
        now = self._tick()
        node, done = self.root_node, 0
        while done < len(key):
            child = node.children.get(self._child_key(key[done:]))
            if child is None:
                break
            n = self._match_len(child.key, key[done:])
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child, now)
            node, done = child, done + n
        if done < len(key):  # the new tail: a fresh unlocked leaf under `node`
            # a copy: the caller may reuse its tensor
            value = indices[done : len(key)].to(torch.int64).clone()
            leaf = self._new_node(key[done:], value, node, now)
            node.children[self._child_key(leaf.key)] = leaf
            self.evictable_size += len(leaf)
            self._update_leaf_status(node)  # node stopped being a leaf
            self._update_leaf_status(leaf)
        return done

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Protect node and its ancestors from eviction. Returns the change of evictable_size (<=
        0)."""
        delta = 0
        while node is not self.root_node:
            self._check_attached(node)
            if node.lock_ref == 0:
                self.evictable_size -= len(node)
                self.protected_size += len(node)
                delta -= len(node)
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one inc_lock_ref(node). Returns the change of evictable_size (>= 0)."""
        delta = 0
        while node is not self.root_node:
            self._check_attached(node)
            if node.lock_ref <= 0:
                raise RuntimeError(
                    f"dec_lock_ref on an unlocked node {node} (unbalanced lock/unlock)")
            if node.lock_ref == 1:
                self.evictable_size += len(node)
                self.protected_size -= len(node)
                delta += len(node)
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent
        return delta

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Drop unlocked leaves, least recently used first, until at least num_tokens tokens are
        gone (or no unlocked leaf is left). Whole nodes go, so a little more may be freed. Returns
        their KV slots ([freed] int64), which the caller gives back to its allocator."""
        if num_tokens < 0:
            raise ValueError(
                f"evict(num_tokens={num_tokens}): the number of tokens to free must be >= 0")
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and self.evictable_leaves:
            leaf = self._pop_lru_leaf()
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            self.evictable_leaves.discard(leaf)
            self.evictable_size -= len(leaf)
            freed.append(leaf.value)
            num_freed += len(leaf)
            leaf.parent = None  # detached: a stale heap entry can never pass for a live leaf
            self._update_leaf_status(parent)  # the cascade: the parent may now be an unlocked leaf
        return torch.cat(freed) if freed else torch.empty(0, dtype=torch.int64, device=self.device)

    def total_size(self) -> int:
        """Tokens in the tree, counted by walking it (the truth the two counters are checked
        against)."""
        return sum(len(node) for node in self.iter_nodes())

    def pretty_print(self) -> None:
        print(self.dump())

    def dump(self) -> str:
        """The tree as text: one line per node, indented by depth: tokens, slots, lock_ref, access
        time."""
        lines = [f"root  (tokens={self.total_size()} evictable={self.evictable_size} "
                 f"protected={self.protected_size} page_size={self.page_size})"]

        def visit(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.key):
                mark = "  evictable leaf" if child in self.evictable_leaves else ""
                lines.append(
                    f"{'  ' * depth}{abbreviate(child.key)}  slots {slot_range(child.value)}  "
                    f"lock_ref={child.lock_ref}  t={child.last_access_time}{mark}")
                visit(child, depth + 1)

        visit(self.root_node, 1)
        return "\n".join(lines)

    def check_integrity(self) -> None:
        """Assert every invariant of the module docstring (walks the whole tree: for tests, not hot
        paths)."""
        total = protected = 0
        leaves, seen_slots = set(), set()
        for node in self.iter_nodes():
            parent = node.parent
            assert parent is not None and parent.children.get(self._child_key(node.key)) is node, (
                f"{node} is not its parent's child under its first token/page")
            assert (
                len(node.key) > 0 and len(node.key) % self.page_size == 0
            ), (
                f"{node} holds {len(node.key)} tokens, not a positive multiple of page_size "
                f"{self.page_size}"
            )
            assert node.value.dim() == 1 and len(node.value) == len(node.key), (
                f"{node} has {len(node.value)} slots for {len(node.key)} tokens")
            assert node.lock_ref >= 0, f"{node} has a negative lock_ref"
            if parent is not self.root_node:
                assert (
                    parent.lock_ref >= node.lock_ref
                ), f"{node} is locked more than its parent {parent}"
            slots = node.value.tolist()
            assert not seen_slots.intersection(slots) and len(
                set(slots)) == len(slots), f"{node}: slot held twice"
            seen_slots.update(slots)
            total += len(node)
            protected += len(node) if node.lock_ref > 0 else 0
            if not node.children and node.lock_ref == 0:
                leaves.add(node)
        assert (
            self.root_node.lock_ref == 0
            and self.root_node.parent is None
            and not self.root_node.key
        )
        assert (
            self.protected_size == protected
        ), f"protected_size {self.protected_size} != {protected} locked tokens"
        assert (
            self.evictable_size + self.protected_size == total
        ), (
            f"evictable {self.evictable_size} + protected {self.protected_size} != {total} tokens "
            "in the tree"
        )
        assert self.evictable_leaves == leaves, (
            f"evictable_leaves is off: {len(self.evictable_leaves - leaves)} too many, "
            f"{len(leaves - self.evictable_leaves)} missing")
        live = {(t, node.id) for t, _, node in self._heap}
        for leaf in leaves:
            assert (leaf.last_access_time,
                    leaf.id) in live, f"evictable leaf {leaf} has no current heap entry"

    # ---- internals
    # -------------------------------------------------------------------------------------------

    def _new_node(self, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None,
                  now: int = 0) -> TreeNode:
        node = TreeNode(self._next_id, key, value, parent, now)
        self._next_id += 1
        return node

    def _check_attached(self, node: TreeNode) -> None:
        if node.parent is None:
            raise RuntimeError(f"{node} is not in this tree (evicted, or from another RadixCache)")

    def iter_nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _as_key(self, ids: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.is_floating_point():
                raise TypeError(
                    f"token ids must be a 1-D integer tensor, got shape {tuple(ids.shape)} "
                    f"{ids.dtype}"
                )
            return tuple(ids.tolist())
        # TypeError for anything that is not an integer
        return tuple(operator.index(t) for t in ids)

    def _page_aligned(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return key[: len(key) // self.page_size * self.page_size]

    def _child_key(self, key: tuple[int, ...]) -> int | tuple[int, ...]:
        return key[0] if self.page_size == 1 else key[: self.page_size]

    def _match_len(self, a: tuple[int, ...], b: tuple[int, ...]) -> int:
        """Length of the common prefix of a and b, counted in whole pages."""
        ps, n = self.page_size, 0
        limit = min(len(a), len(b)) // ps * ps
        while n < limit and a[n : n + ps] == b[n : n + ps]:
            n += ps
        return n

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut node after its first n tokens; returns the new upper node. `node` keeps the lower
        part, so a request holding it as last_node still locks (and later unlocks) its whole
        path."""
        parent = node.parent
        upper = self._new_node(node.key[:n], node.value[:n].clone(), parent, node.last_access_time)
        upper.lock_ref = node.lock_ref  # same requests run through both halves; sizes do not change
        node.key, node.value, node.parent = node.key[n:], node.value[n:].clone(), upper
        upper.children[self._child_key(node.key)] = node
        parent.children[self._child_key(upper.key)] = upper
        return upper

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access_time = now
        if node in self.evictable_leaves:  # its old heap entry is stale now; push the current one
            self._push(node)

    def _update_leaf_status(self, node: TreeNode) -> None:
        """Put node in / take it out of evictable_leaves after its lock_ref or children changed."""
        if node is self.root_node:
            return
        if node.lock_ref == 0 and not node.children:
            if node not in self.evictable_leaves:
                self.evictable_leaves.add(node)
                self._push(node)
        else:
            self.evictable_leaves.discard(node)  # its heap entry becomes stale; skipped when popped

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (node.last_access_time, node.id, node))
        if len(self._heap) > 2 * len(self.evictable_leaves) + 64:  # too many stale entries: rebuild
            self._heap = [(n.last_access_time, n.id, n) for n in self.evictable_leaves]
            heapq.heapify(self._heap)

    def _pop_lru_leaf(self) -> TreeNode:
        while True:
            t, _, node = heapq.heappop(self._heap)
            if node in self.evictable_leaves and node.last_access_time == t:
                return node


def abbreviate(tokens: Sequence, head: int = 6) -> str:
    """`[1, 2, 3, ...+7]`: a node's tokens, short enough for one line."""
    tokens = list(tokens)
    more = f", ...+{len(tokens) - head}" if len(tokens) > head else ""
    return "[" + ", ".join(map(str, tokens[:head])) + more + "]"


def slot_range(value: torch.Tensor) -> str:
    """`12..19` when the slots are consecutive (the usual case: one request's pages), else the
    abbreviated list."""
    slots = value.tolist()
    if slots and slots == list(range(slots[0], slots[0] + len(slots))):
        return f"{slots[0]}..{slots[-1]}" if len(slots) > 1 else str(slots[0])
    return abbreviate(slots, head=4)
