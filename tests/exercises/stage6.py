"""Stage 6's exercises: the radix tree's insert (with split), match_prefix, lock counts and LRU
eviction.

Run them with `python -m common.exercises check 6` (your copy) or `check 6 --reference`.
"""

from __future__ import annotations

import pytest
import torch

STAGE = "stage6_radix"


def slots(*values):
    return torch.tensor(values, dtype=torch.int64)


def child(node, first):
    return node.children[first]


@pytest.mark.task("6.insert_split")
def test_insert_reports_what_was_already_cached(stage):
    cache = stage.radix_cache.RadixCache()
    assert cache.insert([1, 2, 3], slots(10, 11, 12)) == 0
    already = cache.insert([1, 2, 3, 4, 5], slots(20, 21, 22, 23, 24))
    assert already == 3, "the first 3 were cached: the caller's slots for them are duplicates"
    a = child(cache.root_node, 1)
    assert a.key == (1, 2, 3) and a.value.tolist() == [10, 11, 12]
    b = child(a, 4)
    assert b.key == (4, 5) and b.value.tolist() == [23, 24] and b.parent is a
    assert cache.evictable_size == 5 and cache.total_size() == 5
    cache.check_integrity()


@pytest.mark.task("6.insert_split")
def test_insert_splits_a_node_where_the_keys_diverge(stage):
    cache = stage.radix_cache.RadixCache()
    cache.insert([1, 2, 3, 4, 5], slots(10, 11, 12, 13, 14))
    assert cache.insert([1, 2, 9], slots(30, 31, 32)) == 2
    upper = child(cache.root_node, 1)
    assert upper.key == (1, 2) and upper.value.tolist() == [10, 11]
    assert set(upper.children) == {3, 9}
    lower, new = child(upper, 3), child(upper, 9)
    assert lower.key == (3, 4, 5) and lower.value.tolist() == [12, 13, 14] and lower.parent is upper
    assert new.key == (9,) and new.value.tolist() == [32]
    assert cache.evictable_leaves == {lower, new} and cache.evictable_size == 6
    cache.check_integrity()


@pytest.mark.task("6.insert_split")
def test_insert_keeps_whole_pages_and_copies_the_slots(stage):
    cache = stage.radix_cache.RadixCache(page_size=2)
    mine = slots(10, 11, 12, 13, 14)
    assert cache.insert([1, 2, 3, 4, 5], mine) == 0
    assert cache.total_size() == 4, "the partial last page stays private"
    mine[0] = -1  # the caller reuses its tensor: the tree kept a copy
    assert child(cache.root_node, (1, 2)).value.tolist() == [10, 11, 12, 13]
    already = cache.insert([1, 2, 3, 9], slots(20, 21, 22, 23))
    assert already == 2, "pages (1, 2) match, (3, 9) does not"
    upper = child(cache.root_node, (1, 2))
    assert upper.key == (1, 2) and set(upper.children) == {(3, 4), (3, 9)}
    cache.check_integrity()
    with pytest.raises(ValueError):
        cache.insert([1, 2], slots(1, 2, 3))  # not one slot per token


@pytest.mark.task("6.match_prefix")
def test_match_prefix_finds_the_longest_cached_prefix(stage):
    cache = stage.radix_cache.RadixCache()
    empty = cache.match_prefix([1, 2, 3])
    assert empty.indices.tolist() == [] and empty.last_node is cache.root_node
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    cache.insert([1, 2, 3, 4, 5, 6], slots(0, 0, 0, 0, 14, 15))
    full = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert full.indices.tolist() == [10, 11, 12, 13, 14, 15] and full.last_node.key == (5, 6)
    part = cache.match_prefix([1, 2, 3, 4, 8])
    assert part.indices.tolist() == [10, 11, 12, 13] and part.last_node.key == (1, 2, 3, 4)
    assert cache.match_prefix([7, 1]).last_node is cache.root_node


@pytest.mark.task("6.match_prefix")
def test_match_ending_inside_a_node_splits_it(stage):
    cache = stage.radix_cache.RadixCache()
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    m = cache.match_prefix([1, 2, 7])
    assert m.indices.tolist() == [10, 11]
    assert m.last_node.key == (1, 2), "the match ends on a node boundary"
    assert child(m.last_node, 3).key == (3, 4)
    assert cache.total_size() == 4
    cache.check_integrity()
    paged = stage.radix_cache.RadixCache(page_size=2)
    paged.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    assert paged.match_prefix([1, 2, 3]).indices.tolist() == [10, 11], "whole pages only"


@pytest.mark.task("6.match_prefix")
def test_match_refreshes_the_access_time_of_its_path_only(stage):
    cache = stage.radix_cache.RadixCache()
    cache.insert([1, 2, 3], slots(10, 11, 12))
    cache.insert([1, 2, 4], slots(10, 11, 13))
    upper = child(cache.root_node, 1)
    leaf3, leaf4 = child(upper, 3), child(upper, 4)
    before = leaf4.last_access_time
    m = cache.match_prefix([1, 2, 3])
    assert m.last_node is leaf3
    assert leaf3.last_access_time == upper.last_access_time > before, "the path just matched"
    assert leaf4.last_access_time == before, "a sibling that did not match keeps its time"
    cache.check_integrity()


def forked(stage):
    """root -> [1, 2] -> {[3], [4]}, slots 10, 11 and 12 / 13."""
    cache = stage.radix_cache.RadixCache()
    cache.insert([1, 2, 3], slots(10, 11, 12))
    cache.insert([1, 2, 4], slots(10, 11, 13))
    upper = child(cache.root_node, 1)
    return cache, upper, child(upper, 3), child(upper, 4)


@pytest.mark.task("6.lock_ref")
def test_locks_protect_the_whole_path(stage):
    cache, upper, leaf3, leaf4 = forked(stage)
    assert cache.inc_lock_ref(leaf3) == -3, "leaf [3] and its parent [1, 2] are protected now"
    assert (cache.evictable_size, cache.protected_size) == (1, 3)
    assert (upper.lock_ref, leaf3.lock_ref, leaf4.lock_ref) == (1, 1, 0)
    assert cache.evictable_leaves == {leaf4}
    assert cache.inc_lock_ref(leaf4) == -1 and upper.lock_ref == 2, "a 2nd request through [1, 2]"
    cache.check_integrity()
    assert cache.dec_lock_ref(leaf3) == 1 and cache.evictable_leaves == {leaf3}
    assert cache.dec_lock_ref(leaf4) == 3 and (cache.evictable_size, cache.protected_size) == (4, 0)
    cache.check_integrity()


@pytest.mark.task("6.lock_ref")
def test_unbalanced_unlock_is_refused(stage):
    cache, _, leaf3, _ = forked(stage)
    cache.inc_lock_ref(leaf3)
    cache.dec_lock_ref(leaf3)
    with pytest.raises(RuntimeError, match="unbalanced"):
        cache.dec_lock_ref(leaf3)


@pytest.mark.task("6.evict")
def test_evict_frees_least_recently_used_leaves_first(stage):
    cache = stage.radix_cache.RadixCache()
    for i, first in enumerate((1, 3, 5)):  # inserted in this order
        cache.insert([first, first + 1], slots(10 * i, 10 * i + 1))
    cache.insert([1, 2], slots(90, 91))  # touches [1, 2]: now [3, 4] is the least recently used
    assert cache.evict(2).tolist() == [10, 11], "2 tokens asked, 2 freed: one node and no more"
    assert cache.evict(1).tolist() == [20, 21], "a whole node goes, even for fewer tokens asked"
    assert cache.evict(5).tolist() == [0, 1], "all there is"
    assert cache.total_size() == cache.evictable_size == 0 and cache.evict(5).tolist() == []
    cache.check_integrity()


@pytest.mark.task("6.evict")
def test_evict_cascades_to_parents_but_never_takes_a_locked_node(stage):
    cache, upper, leaf3, leaf4 = forked(stage)
    freed = sorted(cache.evict(3).tolist())
    assert freed == [10, 11, 12, 13], "both leaves, then their parent, a childless leaf now"
    assert not cache.root_node.children
    cache, upper, leaf3, leaf4 = forked(stage)
    cache.inc_lock_ref(leaf3)
    assert cache.evict(100).tolist() == [13], "only the unlocked leaf can go"
    assert cache.total_size() == 3 and cache.protected_size == 3
    cache.check_integrity()
    with pytest.raises(ValueError):
        cache.evict(-1)


def beam_state(stage, k=2, max_new_tokens=4, stop=(9,), length_penalty=1.0, early_stopping=False):
    return stage.beam_search.BeamState([1, 2, 3], k, max_new_tokens, set(stop), length_penalty,
                                       early_stopping)


def top(*pairs):
    """(token, probability) pairs -> (log-probabilities, token ids) as a beam request keeps them."""
    return (torch.tensor([p for _, p in pairs]).log(), torch.tensor([t for t, _ in pairs]))


@pytest.mark.task("6.fork_beam")
def test_a_beam_forks_and_a_poor_one_dies(stage):
    state = beam_state(stage)  # k = 2, one stop token (9): 3 * 2 = 6 candidates per round
    state.advance([top((5, 0.5), (6, 0.3), (7, 0.1), (8, 0.05), (10, 0.03), (11, 0.02))])
    assert [tokens for tokens, _ in state.running] == [[5], [6]]
    assert abs(state.running[0][1] - torch.tensor(0.5).log().item()) < 1e-6
    # beam [5] is far better: both of its best tokens beat beam [6]'s best; [6] dies
    state.advance([top((1, 0.6), (2, 0.39), (3, 0.004), (4, 0.003), (12, 0.002), (13, 0.001)),
                   top((1, 0.4), (2, 0.3), (3, 0.1), (4, 0.1), (12, 0.05), (13, 0.05))])
    assert [tokens for tokens, _ in state.running] == [[5, 1], [5, 2]]
    assert not state.finished and not state.done


@pytest.mark.task("6.fork_beam")
def test_a_stop_token_finishes_a_hypothesis_with_the_length_penalty(stage):
    state = beam_state(stage, length_penalty=2.0)
    state.advance([top((5, 0.6), (9, 0.3), (7, 0.05), (8, 0.03), (10, 0.01), (11, 0.01))])
    assert [tokens for tokens, _ in state.running] == [[5], [7]], "the stopped one does not go on"
    (score, tokens, cumulative, reason), = state.finished
    assert tokens == [9] and reason == "stop"
    assert abs(cumulative - torch.tensor(0.3).log().item()) < 1e-6 and abs(score - cumulative) < 1e-6
    # second round: beam [5] stops too, with 2 tokens: its score is divided by 2 ** 2
    state.advance([top((9, 0.5), (1, 0.4), (2, 0.05), (3, 0.03), (4, 0.01), (6, 0.01)),
                   top((1, 0.5), (2, 0.4), (3, 0.05), (4, 0.03), (6, 0.01), (8, 0.01))])
    best = state.finished[0]
    assert best[1] == [5, 9] and abs(best[0] - (torch.tensor(0.6).log() +
                                                torch.tensor(0.5).log()).item() / 4) < 1e-6
    assert [f[1] for f in state.finished] == [[5, 9], [9]], "best first, k kept"


@pytest.mark.task("6.fork_beam")
def test_when_beam_search_stops(stage):
    # early_stopping=True: done once k hypotheses are finished
    state = beam_state(stage, k=1, early_stopping=True)
    state.advance([top((9, 0.6), (5, 0.4))])
    assert state.done and state.finished[0][1] == [9]
    # max_new_tokens reached: every candidate stops, the best k finish by length
    state = beam_state(stage, max_new_tokens=1)
    state.advance([top((5, 0.5), (6, 0.3), (7, 0.1), (8, 0.05), (10, 0.03), (11, 0.02))])
    assert state.done and [(f[1], f[3]) for f in state.finished] == [([5], "length"), ([6], "length")]
    # early_stopping=False: a live beam that cannot beat the worst finished one ends the search
    state = beam_state(stage, k=1)
    state.advance([top((9, 0.6), (5, 0.4))])
    assert state.done and not state.improvable
