"""The radix-tree prefix cache: small readable cases, then thousands of random operations against a brute force."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import pytest
import torch

from stage6_radix.radix_cache import MatchResult, RadixCache, TreeNode


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def tree_keys(cache: RadixCache) -> dict[tuple[int, ...], list[int]]:
    """Every node as (its full token prefix from the root) -> its slots: the shape of the tree."""
    out, stack = {}, [((), cache.root_node)]
    while stack:
        prefix, node = stack.pop()
        for child in node.children.values():
            out[prefix + child.key] = child.value.tolist()
            stack.append((prefix + child.key, child))
    return out


# ---- small cases -------------------------------------------------------------------------------------------------


def test_match_inside_a_node_splits_it():
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4, 5], slots(10, 11, 12, 13, 14)) == 0
    m = cache.match_prefix([1, 2, 3, 9])
    assert isinstance(m, MatchResult) and m.indices.tolist() == [10, 11, 12] and m.indices.dtype == torch.int64
    assert m.last_node.key == (1, 2, 3)
    assert tree_keys(cache) == {(1, 2, 3): [10, 11, 12], (1, 2, 3, 4, 5): [13, 14]}
    cache.check_integrity()


def test_insert_returns_the_cached_length_and_branches():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    assert cache.insert([1, 2, 7, 8], slots(20, 21, 22, 23)) == 2  # the caller frees its duplicates 20, 21
    assert cache.insert([1, 2, 3, 4], slots(30, 31, 32, 33)) == 4  # all present: nothing new stored
    assert tree_keys(cache) == {(1, 2): [10, 11], (1, 2, 3, 4): [12, 13], (1, 2, 7, 8): [22, 23]}
    assert cache.match_prefix([1, 2, 7, 8, 9]).indices.tolist() == [10, 11, 22, 23]
    assert cache.total_size() == cache.evictable_size == 6 and cache.protected_size == 0
    cache.check_integrity()


def test_pages_only_whole_pages_are_stored_matched_and_split():
    cache = RadixCache(page_size=4)
    # 10 tokens: two whole pages go in, the partial third page stays with the caller
    assert cache.insert(list(range(10)), torch.arange(100, 110)) == 0
    assert tree_keys(cache) == {tuple(range(8)): list(range(100, 108))}
    # a match ending mid-page keeps only the whole pages; the node splits at the page boundary
    m = cache.match_prefix([0, 1, 2, 3, 4, 5, 99])
    assert m.indices.tolist() == [100, 101, 102, 103] and len(m.last_node) == 4
    # same first token, different page: a sibling keyed by the whole first page
    assert cache.insert([0, 1, 2, 3, 4, 5, 6, 99], torch.arange(200, 208)) == 4
    assert sorted(cache.root_node.children[(0, 1, 2, 3)].children) == [(4, 5, 6, 7), (4, 5, 6, 99)]
    assert cache.match_prefix([0, 1, 2]).indices.numel() == 0  # shorter than a page: nothing to share
    cache.check_integrity()
    # prompts that part in the middle of a later page share only the pages before it
    cache = RadixCache(page_size=4)
    cache.insert(list(range(12)), torch.arange(100, 112))
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 7, 8]).indices.tolist() == [100, 101, 102, 103]
    assert cache.insert([0, 1, 2, 3, 4, 5, 6, 99], torch.arange(200, 208)) == 4
    assert tree_keys(cache) == {(0, 1, 2, 3): [100, 101, 102, 103], tuple(range(12)): list(range(104, 112)),
                                (0, 1, 2, 3, 4, 5, 6, 99): [204, 205, 206, 207]}
    cache.check_integrity()


def test_locked_nodes_are_never_evicted_and_sizes_follow_locks():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(10, 11, 12))
    cache.insert([1, 2, 4], slots(10, 11, 20))  # -> [1,2] with children [3] and [4]
    m = cache.match_prefix([1, 2, 3])
    assert cache.inc_lock_ref(m.last_node) == -3  # [1,2] and [3] become protected
    assert (cache.evictable_size, cache.protected_size) == (1, 3)
    assert cache.inc_lock_ref(m.last_node) == 0  # a second request on the same path: nothing changes size
    assert cache.evict(100).tolist() == [20]  # only the unlocked leaf [4] can go
    assert tree_keys(cache) == {(1, 2): [10, 11], (1, 2, 3): [12]}
    assert cache.dec_lock_ref(m.last_node) == 0 and cache.dec_lock_ref(m.last_node) == 3
    with pytest.raises(RuntimeError, match="unlocked node"):
        cache.dec_lock_ref(m.last_node)
    cache.check_integrity()


def test_a_lock_survives_a_split_of_the_locked_node():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    held = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(held)
    cache.match_prefix([1, 2])  # splits the locked node: the held object keeps the lower half [3, 4]
    assert held.key == (3, 4) and held.parent.key == (1, 2) and held.parent.lock_ref == 1
    cache.check_integrity()
    assert cache.dec_lock_ref(held) == 4 and cache.protected_size == 0
    cache.check_integrity()


def test_eviction_is_lru_on_leaves():
    cache = RadixCache()
    cache.insert([1, 1], slots(10, 11))  # t=1
    cache.insert([2, 2], slots(20, 21))  # t=2
    cache.insert([3, 3], slots(30, 31))  # t=3
    cache.match_prefix([1, 1])  # [1,1] is now the most recently used
    assert [cache.evict(2).tolist() for _ in range(3)] == [[20, 21], [30, 31], [10, 11]]  # one node each
    assert cache.total_size() == 0 and cache.evict(5).numel() == 0


def test_eviction_cascades_to_parents_that_become_unlocked_leaves():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(10, 11, 12))
    cache.insert([1, 2, 4], slots(10, 11, 20))  # [1,2] -> [3], [4]
    cache.insert([5], slots(50))                # the newest leaf
    freed = cache.evict(3)  # [3] and [4] (older) go, then their parent [1,2], now a leaf, is the oldest
    assert sorted(freed.tolist()) == [10, 11, 12, 20] and tree_keys(cache) == {(5,): [50]}
    cache.check_integrity()
    # a locked parent stops the cascade even when more is asked for
    cache.insert([1, 2, 3], slots(10, 11, 12))
    cache.inc_lock_ref(cache.match_prefix([1, 2]).last_node)
    assert sorted(cache.evict(10).tolist()) == [12, 50] and tree_keys(cache) == {(1, 2): [10, 11]}
    cache.check_integrity()


def test_match_returns_a_copy_and_insert_stores_one():
    cache = RadixCache()
    caller = slots(10, 11, 12)
    cache.insert([1, 2, 3], caller)
    caller.fill_(-1)  # the request's tensor is reused after insert
    got = cache.match_prefix([1, 2, 3]).indices
    assert got.tolist() == [10, 11, 12]
    got.fill_(-2)  # and the scheduler may write into what match returned
    assert cache.match_prefix(torch.tensor([1, 2, 3])).indices.tolist() == [10, 11, 12]


def test_bad_input_gets_a_clear_error():
    cache = RadixCache()
    with pytest.raises(ValueError, match="3 token ids but 2 KV slot"):
        cache.insert([1, 2, 3], slots(1, 2))
    with pytest.raises(TypeError, match="1-D integer tensor"):
        cache.insert([1, 2], torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError):
        cache.match_prefix([1.5, 2])
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(page_size=0)
    with pytest.raises(ValueError, match=">= 0"):
        cache.evict(-1)
    other = RadixCache()
    other.insert([1], slots(1))
    cache.insert([1], slots(1))
    node = cache.match_prefix([1]).last_node
    cache.evict(1)
    with pytest.raises(RuntimeError, match="not in this tree"):
        cache.inc_lock_ref(node)  # an evicted node cannot be locked


def test_eviction_and_matching_do_not_walk_the_tree(monkeypatch):
    cache = RadixCache()
    for i in range(200):
        cache.insert([i // 10, i % 10, i], slots(3 * i, 3 * i + 1, 3 * i + 2))
    cache.check_integrity()

    def no_walk(self):
        raise AssertionError("walked the whole tree")

    monkeypatch.setattr(RadixCache, "iter_nodes", no_walk)
    for _ in range(1000):  # touching one leaf again and again must not grow the heap without bound
        cache.match_prefix([3, 4, 34])
    assert len(cache._heap) <= 2 * len(cache.evictable_leaves) + 64
    assert cache.evict(30).numel() >= 30
    monkeypatch.undo()
    cache.check_integrity()


@pytest.mark.parametrize("corrupt, message", [
    (lambda c, n: setattr(c, "evictable_size", c.evictable_size + 1), "evictable"),
    (lambda c, n: setattr(c, "protected_size", 1), "protected_size"),
    (lambda c, n: c.evictable_leaves.discard(n), "evictable_leaves"),
    (lambda c, n: setattr(n, "value", n.value[:-1]), "slots for"),
    (lambda c, n: setattr(n.parent, "lock_ref", 0) or setattr(n, "lock_ref", 1), "locked more than its parent"),
    (lambda c, n: setattr(n, "value", n.parent.value[:1].clone()), "slot held twice"),
    (lambda c, n: c._heap.clear(), "heap entry"),
])
def test_check_integrity_catches_a_broken_tree(corrupt, message):
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(10, 11, 12))
    cache.insert([1, 2, 4], slots(10, 11, 20))
    leaf = cache.match_prefix([1, 2, 4]).last_node
    cache.check_integrity()
    corrupt(cache, leaf)
    with pytest.raises(AssertionError, match=message):
        cache.check_integrity()


def test_check_integrity_catches_a_page_misaligned_node():
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    (node,) = cache.root_node.children.values()
    node.key, node.value = node.key[:3], node.value[:3]
    with pytest.raises(AssertionError, match="multiple of page_size"):
        cache.check_integrity()


def test_pretty_print_shows_tokens_slots_and_locks(capsys):
    cache = RadixCache()
    cache.insert(list(range(20)), torch.arange(100, 120))
    cache.insert([0, 1, 99], slots(100, 101, 7))
    cache.inc_lock_ref(cache.match_prefix([0, 1, 99]).last_node)
    cache.pretty_print()
    text = capsys.readouterr().out
    assert "[0, 1]  slots 100..101  lock_ref=1" in text
    assert "[2, 3, 4, 5, 6, 7, ...+12]  slots 102..119  lock_ref=0" in text and "evictable leaf" in text
    assert "[99]  slots 7  lock_ref=1" in text


def test_draw_tree_renders_a_png(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from common.radix_draw import draw_tree

    class Letters:  # a stand-in tokenizer: token id -> a letter
        def decode(self, ids):
            return "".join(chr(ord("a") + i) for i in ids)

    cache = RadixCache()
    cache.insert([0, 1, 2], slots(0, 1, 2))
    cache.insert([0, 1, 3], slots(0, 1, 3))
    cache.inc_lock_ref(cache.match_prefix([0, 1, 2]).last_node)
    ax = draw_tree(cache, tokenizer=Letters())
    labels = {t.get_text().split("\n")[0]: t for t in ax.texts}
    assert {"ab", "c", "d"} <= set(labels)  # one box per node, its tokens decoded
    assert labels["ab"].get_bbox_patch().get_facecolor() != labels["d"].get_bbox_patch().get_facecolor()  # locked
    assert labels["d"].get_bbox_patch().get_linestyle() != labels["c"].get_bbox_patch().get_linestyle()  # evictable
    path = tmp_path / "tree.png"
    ax.figure.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert draw_tree(RadixCache()).texts  # an empty tree draws its root


# ---- random operations against a brute force -------------------------------------------------------------------


@dataclass
class Entry:
    slot: int
    time: int
    lock: int = 0


Pos = tuple[tuple[int, ...], int]  # a cached token: (the prompt up to the end of its page, offset in the page)


class Reference:
    """Every cached token -> its slot, access time and lock count, in a flat dict. No tree, no nodes.

    A token is named by the tokens up to the end of its page and its offset there: pages are shared whole,
    so two prompts share a token's KV only if they agree up to the end of that token's page."""

    def __init__(self, page_size: int):
        self.page_size, self.entries, self.clock = page_size, {}, 0

    def pos(self, ids: list[int], i: int) -> Pos:
        return tuple(ids[: (i // self.page_size + 1) * self.page_size]), i % self.page_size

    def parent(self, p: Pos) -> Pos | None:
        pages, offset = p
        if offset:
            return pages, offset - 1
        return (pages[: -self.page_size], self.page_size - 1) if len(pages) > self.page_size else None

    def cached_len(self, ids: list[int]) -> int:
        n, ps = 0, self.page_size
        while n + ps <= len(ids) and self.pos(ids, n) in self.entries:
            n += ps
        return n

    def match(self, ids: list[int]) -> list[int]:
        self.clock += 1
        found = [self.entries[self.pos(ids, i)] for i in range(self.cached_len(ids))]
        for e in found:
            e.time = self.clock
        return [e.slot for e in found]

    def insert(self, ids: list[int], new_slots: list[int]) -> int:
        self.clock += 1
        aligned = len(ids) // self.page_size * self.page_size
        present = self.cached_len(ids[:aligned])
        for i in range(aligned):
            if i < present:
                self.entries[self.pos(ids, i)].time = self.clock
            else:
                self.entries[self.pos(ids, i)] = Entry(new_slots[i], self.clock)
        return present

    def lock(self, prefix: list[int], delta: int) -> None:
        for i in range(len(prefix)):
            self.entries[self.pos(prefix, i)].lock += delta

    def sizes(self) -> tuple[int, int]:
        locked = sum(e.lock > 0 for e in self.entries.values())
        return len(self.entries) - locked, locked

    def lru_order(self) -> list[Pos]:
        """Every unlocked token in the order LRU-on-leaves frees them: repeatedly the oldest unlocked leaf."""
        children: dict[Pos, int] = {}
        for p in self.entries:
            children[self.parent(p)] = children.get(self.parent(p), 0) + 1

        def item(p: Pos) -> tuple:  # oldest first; the deepest token first within one access
            return self.entries[p].time, -len(p[0]) - p[1], p

        heap = [item(p) for p, e in self.entries.items() if e.lock == 0 and not children.get(p)]
        heapq.heapify(heap)
        order = []
        while heap:
            p = heapq.heappop(heap)[-1]
            order.append(p)
            parent = self.parent(p)
            if parent is not None:
                children[parent] -= 1
                if not children[parent] and self.entries[parent].lock == 0:
                    heapq.heappush(heap, item(parent))
        return order


@dataclass
class Running:
    ids: list[int]
    indices: torch.Tensor  # [len(ids)]: the matched tree slots, then the request's own
    last_node: TreeNode
    matched: int


def drive(seed: int, page_size: int, num_ops: int) -> dict[str, int]:
    """Requests start (match, lock, allocate), finish (insert, free duplicates, unlock) or abort, among plain
    matches, extra locks and evictions; every step is checked against the Reference and check_integrity()."""
    rng = random.Random(seed)
    cache, ref = RadixCache(page_size), Reference(page_size)
    longest = max(28, 4 * page_size)  # prompts of a few pages, from 4 tokens: shared prefixes, then divergence
    pool_size = 7 * longest  # small enough that allocation often has to evict
    free = set(range(pool_size))  # the slot allocator
    running: list[Running] = []
    held: list[tuple[TreeNode, list[int]]] = []  # extra locks: (node, locked prefix)
    bases = [[rng.randrange(4) for _ in range(rng.randrange(1, longest))] for _ in range(6)]
    counts = {"evicted": 0, "duplicates": 0}

    def new_ids() -> list[int]:
        base = rng.choice(bases)
        tail = [rng.randrange(4) for _ in range(rng.randrange(0, longest // 3))]
        return base[: rng.randint(0, len(base))] + tail

    def release(freed: list[int]) -> None:
        for s in freed:
            assert s not in free, f"slot {s} came back twice"
            free.add(s)

    def evict(n: int) -> None:
        order = ref.lru_order()
        node_len = {s: len(node) for node in cache.iter_nodes() for s in node.value.tolist()}
        freed = cache.evict(n).tolist()
        k = len(freed)
        assert len(set(freed)) == k
        assert set(freed) == {ref.entries[p].slot for p in order[:k]}, "evict did not free the LRU unlocked leaves"
        assert k >= min(n, len(order)), f"asked for {n}, freed {k} of {len(order)} evictable"
        if k:  # whole nodes go, but not one more than needed: without the last node it was short of n
            assert k - node_len[ref.entries[order[k - 1]].slot] < n
        for p in order[:k]:
            del ref.entries[p]
        release(freed)
        counts["evicted"] += k

    def lock(node: TreeNode, prefix: list[int], delta: int) -> None:
        before = ref.sizes()[0]
        got = cache.inc_lock_ref(node) if delta > 0 else cache.dec_lock_ref(node)
        ref.lock(prefix, delta)
        assert got == ref.sizes()[0] - before, "lock ref returned the wrong change of evictable size"

    def match(ids: list[int]) -> tuple[MatchResult, list[int]]:
        m, expected = cache.match_prefix(ids), ref.match(ids)
        assert m.indices.tolist() == expected, f"match {ids}: {m.indices.tolist()} != {expected}"
        assert len(expected) % page_size == 0
        return m, expected

    def finish(req: Running) -> None:  # cache its tokens, free its duplicates and its partial page, unlock
        present = cache.insert(req.ids, req.indices)
        assert present == ref.insert(req.ids, req.indices.tolist()) and present >= req.matched
        counts["duplicates"] += present - req.matched  # another request cached them meanwhile
        aligned = len(req.ids) // page_size * page_size
        release(req.indices[req.matched : present].tolist() + req.indices[aligned:].tolist())
        req.indices.fill_(-1)  # the tree must hold its own copy
        lock(req.last_node, req.ids[: req.matched], -1)

    for _ in range(num_ops):
        op = rng.choices(["start", "finish", "abort", "match", "lock", "unlock", "evict"], [4, 3, 1, 3, 1, 1, 1])[0]
        if op == "start":  # a new request: reuse the cached prefix, lock it, allocate slots for the rest
            ids = new_ids()
            m, prefix = match(ids)
            lock(m.last_node, ids[: len(prefix)], +1)
            need = len(ids) - len(prefix)
            if need > len(free):
                evict(need - len(free))
            if need > len(free):
                lock(m.last_node, ids[: len(prefix)], -1)
                continue
            own = [free.pop() for _ in range(need)]
            running.append(Running(ids, torch.tensor(prefix + own, dtype=torch.int64), m.last_node, len(prefix)))
        elif op == "finish" and running:
            finish(running.pop(rng.randrange(len(running))))
        elif op == "abort" and running:
            req = running.pop(rng.randrange(len(running)))
            release(req.indices[req.matched :].tolist())
            lock(req.last_node, req.ids[: req.matched], -1)
        elif op == "match":
            m, _ = match(rng.choice([new_ids(), *(r.ids for r in running[:2])]))
            m.indices.fill_(-1)  # the caller's copy, not the tree's slots
        elif op == "lock":
            ids = new_ids()
            m, prefix = match(ids)
            lock(m.last_node, ids[: len(prefix)], +1)
            held.append((m.last_node, ids[: len(prefix)]))
        elif op == "unlock" and held:
            lock(*held.pop(rng.randrange(len(held))), -1)
        elif op == "evict":
            evict(rng.randrange(0, 40))

        cache.check_integrity()
        assert (cache.evictable_size, cache.protected_size) == ref.sizes(), (
            f"after {op}: (evictable, protected) = {(cache.evictable_size, cache.protected_size)}, "
            f"reference {ref.sizes()}")
        assert cache.total_size() == len(ref.entries)
        tree_slots = [s for node in cache.iter_nodes() for s in node.value.tolist()]
        private = [s for r in running for s in r.indices[r.matched :].tolist()]
        assert sorted(tree_slots + private + list(free)) == list(range(pool_size)), "a slot leaked or is held twice"

    for req in running:  # shut down: finish every request, drop every lock, evict everything
        finish(req)
    for node, prefix in held:
        lock(node, prefix, -1)
    assert cache.protected_size == 0
    evict(cache.evictable_size)
    cache.check_integrity()
    assert cache.total_size() == 0 and not cache.root_node.children and cache.evictable_size == 0
    assert free == set(range(pool_size)), "not every slot came back"
    return counts


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_match_a_brute_force_model(page_size, seed):
    counts = drive(seed, page_size, num_ops=3000)
    assert counts["evicted"] > 0 and counts["duplicates"] > 0  # both hard paths were exercised
