"""Stage 7's exercises: column- and row-parallel weight slicing, the vocabulary-parallel embedding.

The ranks here are threads of one process, and the collectives are done with a barrier
(SimulatedTP): the same sums and gathers as gloo or NCCL, without starting processes.
Run them with `python -m common.exercises check 7` (your copy) or `check 7 --reference`.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

STAGE = "stage7_tp"


class SimulatedTP:
    """What the layers use of TPInfo (rank, size, all_reduce, all_gather); ranks are threads."""

    def __init__(self, rank: int, size: int, shared: dict):
        self.rank, self.size, self.group, self.shared = rank, size, None, shared

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.shared["slots"][self.rank] = x.clone()
        self.shared["barrier"].wait()
        everyone = list(self.shared["slots"])
        self.shared["barrier"].wait()  # nobody overwrites a slot before all have read them
        return everyone

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(sum(self._exchange(x)))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=-1)  # [B, size * n]


def on_ranks(size: int, fn) -> list:
    """fn(tp) on `size` threads at once -> each rank's result."""
    shared = {"slots": [None] * size, "barrier": threading.Barrier(size, timeout=20)}

    def run(rank):
        try:
            return fn(SimulatedTP(rank, size, shared))
        except BaseException:
            shared["barrier"].abort()  # the other ranks stop waiting for this one
            raise

    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(run, range(size)))


@pytest.mark.task("7.column_parallel")
def test_column_parallel_ranks_hold_their_output_rows(stage):
    torch.manual_seed(0)
    W, b, x = torch.randn(8, 6), torch.randn(8), torch.randn(3, 6)
    outs = []
    for rank in range(2):
        tp = stage.distributed.TPInfo(rank, 2)
        layer = stage.layers.ColumnParallelLinear(6, 8, bias=True, tp=tp)
        layer.weight.weight_loader(layer.weight, W)
        layer.bias.weight_loader(layer.bias, b)
        rows = slice(4 * rank, 4 * rank + 4)
        assert torch.equal(layer.weight, W[rows]) and torch.equal(layer.bias, b[rows])
        outs.append(layer(x))  # [3, 4]: this rank's slice of the output, no communication
    torch.testing.assert_close(torch.cat(outs, dim=-1), F.linear(x, W, b))
    with pytest.raises(ValueError):
        layer.weight.weight_loader(layer.weight, torch.randn(6, 6))  # not the full 8 rows


@pytest.mark.task("7.column_parallel")
def test_merged_column_parallel_splits_every_part(stage):
    torch.manual_seed(1)
    gate, up = torch.randn(8, 6), torch.randn(8, 6)
    for rank in range(2):
        tp = stage.distributed.TPInfo(rank, 2)
        layer = stage.layers.MergedColumnParallelLinear(6, {0: 8, 1: 8}, tp=tp)
        layer.weight.weight_loader(layer.weight, up, 1)
        layer.weight.weight_loader(layer.weight, gate, 0)
        rows = slice(4 * rank, 4 * rank + 4)
        want = torch.cat([gate[rows], up[rows]])
        assert torch.equal(layer.weight, want), "[its gate slice | its up slice]"


@pytest.mark.task("7.column_parallel")
def test_qkv_replicates_kv_heads_when_ranks_outnumber_them(stage):
    torch.manual_seed(2)
    q, k, v = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4)  # 4 q heads, 2 KV, D = 2
    for rank in range(4):
        layer = stage.layers.QKVParallelLinear(4, 4, 2, 2, tp=stage.distributed.TPInfo(rank, 4))
        for shard, part in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, part, shard)
        kv_head = rank // 2  # ranks 0, 1 share KV head 0; ranks 2, 3 KV head 1
        want = torch.cat([q[2 * rank : 2 * rank + 2], k[2 * kv_head : 2 * kv_head + 2],
                          v[2 * kv_head : 2 * kv_head + 2]])
        assert torch.equal(layer.weight, want)


def row_parallel(stage, tp, W, b):
    layer = stage.layers.RowParallelLinear(W.shape[1], W.shape[0], bias=True, tp=tp)
    layer.weight.weight_loader(layer.weight, W)
    layer.bias.weight_loader(layer.bias, b)  # replicated: the default loader
    return layer


@pytest.mark.task("7.row_parallel")
def test_row_parallel_ranks_hold_their_input_columns(stage):
    torch.manual_seed(3)
    W, b = torch.randn(5, 8), torch.randn(5)
    for rank in range(2):
        layer = row_parallel(stage, stage.distributed.TPInfo(rank, 2), W, b)
        assert torch.equal(layer.weight, W[:, 4 * rank : 4 * rank + 4])
    with pytest.raises(ValueError):
        layer.weight.weight_loader(layer.weight, torch.randn(5, 6))


@pytest.mark.task("7.row_parallel")
@pytest.mark.parametrize("tp_size", [2, 4])
def test_row_parallel_partial_sums_add_up_to_the_full_linear(stage, tp_size):
    torch.manual_seed(4)
    W, b, x = torch.randn(5, 8), torch.randn(5), torch.randn(3, 8)
    cols = 8 // tp_size

    def rank_forward(tp):
        layer = row_parallel(stage, tp, W, b)
        return layer(x[:, tp.rank * cols : (tp.rank + 1) * cols])  # the slice made before it

    for out in on_ranks(tp_size, rank_forward):
        torch.testing.assert_close(out, F.linear(x, W, b), atol=1e-5, rtol=1e-5)  # bias once


def embedding(stage, tp, E):
    layer = stage.layers.VocabParallelEmbedding(E.shape[0], E.shape[1], tp=tp)
    layer.weight.weight_loader(layer.weight, E)
    return layer


@pytest.mark.task("7.vocab_parallel")
def test_vocab_parallel_ranks_hold_their_rows_and_zero_padding(stage):
    E = torch.randn(10, 4)
    for rank in range(3):  # 10 ids over 3 ranks: 4 rows each; the last: ids 8, 9 and 2 padding rows
        layer = embedding(stage, stage.distributed.TPInfo(rank, 3), E)
        assert layer.weight.shape == (4, 4)
        real = E[4 * rank : 4 * rank + 4]
        assert torch.equal(layer.weight[: len(real)], real) and not layer.weight[len(real) :].any()


@pytest.mark.task("7.vocab_parallel")
@pytest.mark.parametrize("tp_size", [1, 3])
def test_vocab_parallel_lookup_assembles_every_row(stage, tp_size):
    torch.manual_seed(5)
    E, ids = torch.randn(10, 4), torch.tensor([0, 9, 4, 3, 8, 4])
    for out in on_ranks(tp_size, lambda tp: embedding(stage, tp, E)(ids)):
        assert torch.equal(out, E[ids]), "every rank ends with every row"
    logits = on_ranks(tp_size, lambda tp: embedding(stage, tp, E).logits(E[:2]))
    torch.testing.assert_close(logits[0], E[:2] @ E.T)  # the tied LM head reads the same shards
