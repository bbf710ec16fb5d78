"""The mixture-of-experts layer: route each token to its top-k experts, run them, add up their
weighted outputs.

    router_logits = x @ gate^T                     [N, E]   (models/qwen3_moe.py: the family's
                                                            router)
    topk_weights, topk_ids = TopK(router_logits)   [N, k] each
    out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])
    expert_e(x) = W2_e (silu(W1_e x) * W3_e x)

`FusedMoE` holds every expert of a layer in two stacked parameters (SGLang's layout):

    w13_weight  [E, 2 * I, H]   rows 0..I-1: gate (checkpoint w1 / gate_proj),
                                rows I..2I-1: up (w3 / up_proj)
    w2_weight   [E, H, I]       down (w2 / down_proj)

and computes the experts one of two ways:

- reference (`reference_experts`): a loop over the experts; each gathers its tokens, runs SwiGLU,
  scatter-adds its weighted output. Plain torch, obviously right, and what transformers' eager path
  does. But it asks the host which experts got which tokens (data-dependent shapes), so it cannot be
  captured in a CUDA graph, and it launches about ten small kernels per active expert: a prefill
  that reaches all 128 experts of Qwen3-30B-A3B launches over a thousand per layer.
- fused (`fused_experts`): the token slots are sorted by expert and padded to the GEMM's block size
  (`moe_align_block_size`), then ONE grouped GEMM computes gate and up for every expert with
  SiLU-and-mul in its epilogue, and ONE more computes down with the routing weight applied: 2 GEMM
  launches per layer whatever E is, no host sync (graph-safe), and the [slots, 2*I] gate/up tensor
  never goes through memory (kernels/triton_moe.py).

Which one runs (`runner_backend`, SGLang's --moe-runner-backend): "auto" takes the fused path when
its Triton kernels run (CUDA; or a CPU under TRITON_INTERPRET=1 when kernels.use_backend("triton")
asks for it), the reference otherwise; "triton" forces the fused path, "torch" the reference.

Tensor parallelism (`tp_size` > 1, stage 7's ranks): each of tp_size ranks holds a slice of EVERY
expert's intermediate dim, I / tp_size rows of gate and of up and the matching columns of down.
silu(gate) * up is elementwise along that dim, so a rank computes its slice exactly, and its down
GEMM gives a partial sum over its slice: the ranks' outputs add up to the layer's output. The router
is replicated (every rank computes the same top-k), and one all-reduce ends the layer.
`FusedMoE(tp_rank, tp_size)` slices in its weight_loader and returns the partial sum; the all-reduce
goes where the MoE block calls it (models/qwen3_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import kernels
from .layers import copy_into

MOE_RUNNER_BACKENDS = ("auto", "triton", "torch")


@dataclass
class TopKOutput:
    topk_weights: torch.Tensor  # [N, top_k] routing weight of each chosen expert
    # [N, top_k] expert ids (int64 from torch.topk; int32 works too), best first
    topk_ids: torch.Tensor
    router_logits: torch.Tensor  # [N, E]


class TopK(nn.Module):
    """softmax over the experts (float32), keep the top_k, optionally renormalise them to sum to
    1."""

    def __init__(self, top_k: int, renormalize: bool, weights_in_logits_dtype: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        # Qwen3-MoE rounds the weights back to the model's dtype; Mixtral keeps them in float32
        # (transformers).
        self.weights_in_logits_dtype = weights_in_logits_dtype

    def forward(self, router_logits: torch.Tensor) -> TopKOutput:
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [N, E]
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        if self.weights_in_logits_dtype:
            topk_weights = topk_weights.to(router_logits.dtype)
        return TopKOutput(topk_weights, topk_ids, router_logits)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the token slots by expert and pad each expert's run to a multiple of block_size
    (SGLang's name).

    topk_ids: [M, k], int32 or int64 (SGLang's and vLLM's top-k give int32, torch.topk int64).
    Slot s = t * k + j is token t's j-th choice. Returns
      sorted_token_ids  [EM] int32: slots expert by expert (in slot order within an expert), each
                        run padded with the invalid id M * k; EM is an upper bound on the padded
                        length, so no host sync is needed
      expert_ids        [EM / block_size] int32: the expert of each block (blocks past the end: any
                        valid id)
      num_tokens_post_padded  [1] int32: the real padded length, sum over experts of ceil(count /
                              block) * block
    """
    # [S] int64: what scatter_add_'s index and the counts below need
    flat = topk_ids.flatten().long()
    S, E, bs, dev = flat.numel(), num_experts, block_size, flat.device
    # At most min(E, S) experts are non-empty, each wasting < block_size entries; and no more than S
    # blocks.
    em = min(S + min(E, S) * (bs - 1), S * bs)
    em = -(-em // bs) * bs
    # [E]
    counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + bs - 1) // bs * bs  # [E]
    ends = padded.cumsum(0)  # [E] end of each expert's run in sorted_token_ids
    order = torch.sort(flat, stable=True).indices  # [S] slots grouped by expert, slot order kept
    expert_of = flat[order]  # [S]
    first = counts.cumsum(0) - counts  # [E] where each expert's slots start in `order`
    # [S] position in the output
    dest = (ends - padded)[expert_of] + torch.arange(S, device=dev) - first[expert_of]
    sorted_token_ids = torch.full((em,), S, dtype=torch.int32, device=dev)
    sorted_token_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, em, bs, device=dev)
    expert_ids = torch.searchsorted(ends, block_starts,
                                    right=True).clamp_(max=E - 1).to(torch.int32)
    num_tokens_post_padded = ends[-1:].to(torch.int32)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, triton: bool = True,
                  config: dict | None = None) -> torch.Tensor:
    """The fused path. x: [M, H] -> [M, H]. triton=False runs the torch versions of the same two
    GEMMs."""
    M, H = x.shape
    top_k = topk_ids.shape[1]
    if M == 0:
        return x.new_zeros(0, H)
    config = config or kernels.moe_config(M * top_k, w13.shape[0], triton)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, config["BLOCK_M"],
                                                            w13.shape[0])
    # [M*k, I]
    inter = kernels.fused_moe_gate_up(x, w13, sorted_ids, expert_ids, num_post, top_k, config,
                                      triton)
    out = kernels.fused_moe_down(inter, w2, topk_weights, sorted_ids, expert_ids, num_post, config,
                                 triton)
    return out.view(M, top_k, H).sum(dim=1)  # [M, H]: each token's k weighted expert outputs


def reference_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The reference path: one expert at a time, as transformers' eager MoE. x: [M, H] -> [M, H]."""
    out = torch.zeros_like(x)  # [M, H]
    for e in torch.unique(topk_ids).tolist():  # the host learns which experts have tokens: a sync
        # [n_e] tokens routed to e, and which of their k choices
        token_idx, choice = torch.where(topk_ids == e)
        gate_up = x[token_idx] @ w13[e].t()  # [n_e, 2*I]
        h = kernels.native.silu_and_mul(gate_up)  # [n_e, I]
        expert_out = (h @ w2[e].t()) * topk_weights[token_idx, choice, None]  # [n_e, H], weighted
        out.index_add_(0, token_idx, expert_out.to(x.dtype))
    return out


class FusedMoE(nn.Module):
    """Every expert of one layer, stacked (see the module docstring for the layout, the paths and
    the TP plan)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 tp_rank: int = 0, tp_size: int = 1, runner_backend: str = "auto"):
        super().__init__()
        if not 0 <= tp_rank < tp_size or intermediate_size % tp_size:
            raise ValueError(
                f"cannot split an expert's {intermediate_size} intermediate rows over {tp_size} "
                f"ranks (rank {tp_rank})")
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.intermediate_size = intermediate_size  # the checkpoint's full width I
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.intermediate_size_per_partition = Ip = intermediate_size // tp_size
        self.runner_backend = runner_backend
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * Ip, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, Ip),
                                      requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader

    @property
    def runner_backend(self) -> str:
        return self._runner_backend

    @runner_backend.setter
    def runner_backend(self, name: str) -> None:
        if name not in MOE_RUNNER_BACKENDS:
            raise ValueError(
                f"unknown moe_runner_backend {name!r}; choose one of "
                f"{', '.join(MOE_RUNNER_BACKENDS)}"
            )
        self._runner_backend = name

    def checkpoint_shape(self, shard_id: tuple) -> tuple[int, ...]:
        """The full (unsliced) shape of the checkpoint tensor that fills shard_id = (expert_id,
            part).
        One expert:  (e, "w1") gate_proj [I, H], (e, "w3") up_proj [I, H], (e, "w2") down_proj [H,
                     I].
        All experts: (None, "w13") gate_up [E, 2I, H] (gate rows, then up), (None, "w2") down [E, H,
            I].
        """
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and
                shard_id[1] in ("w1", "w2", "w3", "w13")):
            raise ValueError(
                f"expert shard_id must be (expert_id or None, 'w1' | 'w2' | 'w3' | 'w13'), "
                f"got {shard_id!r}")
        expert_id, part = shard_id
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        if expert_id is not None and not 0 <= expert_id < E:
            raise ValueError(f"expert {expert_id} does not exist: this layer has {E} experts")
        stack = () if expert_id is not None else (E,)
        return stack + {"w1": (I, H), "w3": (I, H), "w13": (2 * I, H), "w2": (H, I)}[part]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple) -> None:
        """Copy this rank's slice of a checkpoint tensor (shard ids: checkpoint_shape): rows (w1,
        w3) or columns (w2) [rank * I/tp, (rank + 1) * I/tp) of each expert's intermediate dim."""
        want = self.checkpoint_shape(shard_id)
        if tuple(loaded.shape) != want:
            raise ValueError(
                f"checkpoint shape {tuple(loaded.shape)} != {want} expected for shard {shard_id!r}")
        expert_id, part = shard_id
        I, Ip = self.intermediate_size, self.intermediate_size_per_partition
        dst = param.data if expert_id is None else param.data[expert_id]
        start = self.tp_rank * Ip
        if part == "w2":  # down: the columns of this rank's slice
            copy_into(dst, loaded.narrow(-1, start, Ip))
            return
        # gate rows go to [0, Ip) of w13, up rows to [Ip, 2*Ip): each rank keeps [its gate slice |
        # its up slice]
        halves = {"w1": [(0, 0)], "w3": [(Ip, 0)], "w13": [(0, 0), (Ip, I)]}[part]
        for dst_row, src_row in halves:
            copy_into(dst.narrow(-2, dst_row, Ip), loaded.narrow(-2, src_row + start, Ip))

    def use_fused(self, x: torch.Tensor) -> bool:
        if self.runner_backend == "auto":
            return kernels.use_triton(x)
        return self.runner_backend == "triton"

    def forward(self, x: torch.Tensor, topk_output: TopKOutput) -> torch.Tensor:
        """x: [N, hidden] -> [N, hidden]: this rank's partial sum (the whole output when tp_size ==
        1)."""
        w, ids = topk_output.topk_weights, topk_output.topk_ids
        if self.use_fused(x):
            return fused_experts(x, self.w13_weight, self.w2_weight, w, ids, triton=True)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the reference MoE path reads the routing on the host and cannot be captured in a "
                "CUDA graph: use moe_runner_backend='triton' (or 'auto'), or disable CUDA graphs")
        return reference_experts(x, self.w13_weight, self.w2_weight, w, ids)


def expert_params_mapping(num_experts: int, gate: str, down: str, up: str,
                          prefix: str = ".mlp.experts.") -> list[tuple[str, str, tuple]]:
    """Checkpoint names of one-tensor-per-expert layouts -> FusedMoE's stacked parameters, with
    (expert_id, part) shard ids (SGLang's FusedMoE.make_expert_params_mapping):

        model.layers.3.mlp.experts.17.up_proj.weight  ->  model.layers.3.mlp.experts.w13_weight,
                                                          shard (17, "w3")
    """
    param = {gate: "w13_weight", up: "w13_weight", down: "w2_weight"}
    return [(f".mlp.experts.{param[name]}", f"{prefix}{e}.{name}.weight", (e, part))
            for e in range(num_experts) for part, name in (("w1", gate), ("w2", down), ("w3", up))]


# transformers 5 keeps experts stacked in memory (gate_up_proj [E, 2I, H], gate rows first;
# down_proj [E, H, I]) and writes them so with save_pretrained(..., save_original_format=False).
STACKED_EXPERTS_MAPPING = [
    (".mlp.experts.w13_weight", ".mlp.experts.gate_up_proj", (None, "w13")),
    (".mlp.experts.w2_weight", ".mlp.experts.down_proj", (None, "w2")),
]


def moe_params_mapping(
    model: nn.Module, checkpoint_names, gate: str, down: str, up: str,
    prefix: str = ".mlp.experts.", renames: tuple = ()) -> list[tuple[str, str, object]]:
    """A MoE family's loader mapping for this checkpoint: stacked experts if it has them, else one
    tensor per expert (plus the family's renames); the dense rules come last, so a dense layer's
    gate_proj is never taken for an expert's (the loader uses the first fragment that matches)."""
    if any(
            name.endswith((".experts.gate_up_proj", ".experts.down_proj"))
            for name in checkpoint_names):
        return STACKED_EXPERTS_MAPPING + model.stacked_params_mapping
    experts = expert_params_mapping(model.config.num_experts, gate, down, up, prefix)
    return experts + list(renames) + model.stacked_params_mapping


def set_moe_runner_backend(model: nn.Module, name: str) -> None:
    """Choose the path of every MoE layer of `model` (the moe_runner_backend option)."""
    if name == "triton":
        reason = kernels.triton_unavailable_reason(next(model.parameters()).device)
        if reason is not None:
            raise ValueError(f"moe_runner_backend='triton': {reason}")
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.runner_backend = name
