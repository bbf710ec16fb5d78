"""The engine: the model, the paged KV pool and page table, and one forward pass of a Batch. No scheduling here:
the scheduler decides which requests run, gives them pages, and calls `forward`.

    prefill batch: the uncached tokens of each request (a whole prompt, a chunk of one, or a preempted request's
                   prompt + output to recompute), packed into [N]
    decode batch:  one token per running request, [B]
    both:          -> logits [B, vocab] of each request's last fed token

Stage 5 splits `forward` into `prepare` (host: build the tensors; the overlap scheduler runs it on the CPU while the
device is busy with the previous step) and `run` (device: the model, by CUDA-graph replay for decode batches on a
GPU, eagerly otherwise). An input id < 0 is a *future token*: -(row + 1) stands for the token the previous step
sampled for page-table row `row`, which is still on the device in `future_tokens` (see scheduler.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .attention import ForwardBatch, create_backend
from .core import Batch
from .graph import GraphRunner
from .kv_cache import PageTable, PagedKVPool
from .model import LlamaForCausalLM, ModelConfig
from .weights import load_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_eos_token_ids(model_path: Path, hf_config: dict) -> set[int]:
    """EOS may be one id or a list, in config.json and/or generation_config.json: take them all."""
    ids: set[int] = set()
    sources = [hf_config]
    gen_file = model_path / "generation_config.json"
    if gen_file.exists():
        sources.append(json.loads(gen_file.read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


class Engine:
    def __init__(self, model_path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32",
                 attention_backend: str | None = None, kv_cache_bytes: int = 256 << 20, page_size: int = 16,
                 max_running_requests: int = 128, cuda_graph: bool = True, cuda_graph_max_bs: int = 64):
        model_path = Path(model_path)
        if not (model_path / "config.json").exists():
            raise FileNotFoundError(f"no config.json in {model_path}: not a Hugging Face model folder")
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
            dtype = DTYPES[dtype]
        if page_size < 1 or max_running_requests < 1:
            raise ValueError(f"page_size and max_running_requests must be >= 1, got {page_size}, "
                             f"{max_running_requests}")
        hf_config = json.loads((model_path / "config.json").read_text())
        self.config = cfg = ModelConfig.from_hf(hf_config)
        self.device, self.dtype = torch.device(device), dtype
        self.eos_token_ids = read_eos_token_ids(model_path, hf_config)
        self.attn_backend = create_backend(attention_backend, self.device)

        self.model = LlamaForCausalLM(cfg).to(device=self.device, dtype=dtype).eval()
        load_weights(self.model, model_path)

        # The KV pool is sized once, from a memory budget: every page any request will ever use comes from here.
        bytes_per_token = PagedKVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
        num_pages = kv_cache_bytes // (bytes_per_token * page_size)
        if num_pages < 1:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds no page of {page_size} tokens "
                             f"({bytes_per_token} bytes per token)")
        # CUDA graphs pad batches with rows whose K/V must land somewhere harmless: one extra page that the cache
        # manager never sees (num_pages stays the usable count) holds the dummy slot.
        use_graphs = cuda_graph and self.device.type == "cuda"
        self.kv_pool = PagedKVPool(cfg.num_layers, num_pages + int(use_graphs), page_size, cfg.num_kv_heads,
                                   cfg.head_dim, dtype, self.device)
        self.kv_pool.num_pages = num_pages
        self.dummy_slot = num_pages * page_size  # first slot of the reserved page (used only with graphs)
        max_pages_per_req = -(-self.max_context_len // page_size)
        self.page_table = PageTable(max_running_requests, max_pages_per_req, self.device)

        # Stage 5: the last sampled token of each page-table row, kept on the device for the next step's input.
        self.future_tokens = torch.zeros(max_running_requests, dtype=torch.long, device=self.device)  # [rows]
        self.num_graph_replays = self.num_eager_forwards = 0  # which path ran (the tests check CPU stays eager)
        self.graph_runner = GraphRunner(self, min(cuda_graph_max_bs, max_running_requests)) if use_graphs else None

    @property
    def max_context_len(self) -> int:
        return self.config.max_position_embeddings

    def check_prompt_fits(self, prompt_len: int) -> None:
        if prompt_len >= self.max_context_len:
            raise ValueError(f"prompt has {prompt_len} tokens; the model's context is "
                             f"{self.max_context_len}, leaving no room to generate")
        pool_tokens = self.kv_pool.num_pages * self.kv_pool.page_size
        if prompt_len + 1 > pool_tokens:
            raise ValueError(f"prompt has {prompt_len} tokens but the whole KV pool holds {pool_tokens}")

    def prepare(self, batch: Batch) -> ForwardBatch:
        """Pack the batch's uncached tokens into flat tensors plus the metadata attention needs."""
        input_ids, positions, seqlens, last = [], [], [], []
        for req in batch.reqs:
            ids = req.next_input_ids()  # extend_len tokens
            input_ids += ids
            positions += range(req.cached_len, req.device_len)
            seqlens.append(len(ids))
            last.append(len(input_ids) - 1)
        assert len(batch.out_cache_loc) == len(input_ids), "the scheduler must give every new token a KV slot"
        dev = self.device
        prefix_lens = [r.cached_len for r in batch.reqs]
        seq_lens = [r.device_len for r in batch.reqs]
        as_tensor = lambda xs, dtype=torch.int32: torch.tensor(xs, dtype=dtype, device=dev)  # noqa: E731
        return ForwardBatch(
            phase=batch.phase,
            input_ids=as_tensor(input_ids, torch.long),  # [N]
            positions=as_tensor(positions, torch.long),  # [N]
            out_cache_loc=as_tensor(batch.out_cache_loc, torch.long),  # [N]
            req_rows=as_tensor([r.table_idx for r in batch.reqs]),  # [B]
            prefix_lens=as_tensor(prefix_lens),  # [B]
            seq_lens=as_tensor(seq_lens),  # [B]
            cu_seqlens=as_tensor([0] + seqlens).cumsum(0, dtype=torch.int32),  # [B+1]
            max_seqlen=max(seqlens),
            max_seq_len=max(seq_lens),
            prefix_lens_cpu=prefix_lens,
            seq_lens_cpu=seq_lens,
            last_token_indices=as_tensor(last, torch.long),  # [B]
            kv_pool=self.kv_pool,
            page_table=self.page_table.table,
            attn_backend=self.attn_backend,
        )

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.run(self.prepare(batch))  # [B, vocab]

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """The device half of a step: resolve future tokens, then graph replay (decode on CUDA) or eager."""
        ids = fb.input_ids  # [N]; -(row + 1) = "the token row `row` sampled last step", still on the device
        fb.input_ids = torch.where(ids < 0, self.future_tokens[(-ids - 1).clamp(min=0)], ids)
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            self.num_graph_replays += 1
            return self.graph_runner.replay(fb)  # [B, vocab]
        self.num_eager_forwards += 1
        return self.model(fb.input_ids, fb.positions, fb)  # [B, vocab]
