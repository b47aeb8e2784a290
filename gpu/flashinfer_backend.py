"""FlashInfer attention over the paged KV pool (CUDA only; `flashinfer` is imported lazily).

Paths, chosen per batch in `init_forward_metadata`:

- DECODE: `BatchDecodeWithPagedKVCacheWrapper` over each request's pages.
- EXTEND with nothing cached for any request: `BatchPrefillWithRaggedKVCacheWrapper`, causal,
  straight over the new tokens' k/v (no gather through the page table, which is what makes it
  the faster path); their K/V is still written to the pool for the decode steps that follow.
- EXTEND over cached prefixes, and MIXED: `BatchPrefillWithPagedKVCacheWrapper`, causal. FlashInfer
  aligns the causal mask to the end of each request's KV, so a decode row in a mixed batch (one
  query, all of its KV) and an extend row both come out right.
- Graph decode: one `BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True)` per bucket over
  shared static indptr / indices / last_page_len buffers (`init_graph_state`), re-planned before
  every replay (`plan_graph_decode`).

All wrappers share one float workspace buffer: they run one after another on one stream.

Planning happens once per forward pass, never per layer, from lengths the scheduler holds on the
host (plan() reads them on the host anyway: device tensors would add a sync). Nothing here
synchronizes the stream (step N+1 is planned while step N runs); only `PlanFence` waits, so that
with two steps in flight the host never overwrites a schedule the GPU has not read yet.

The KV pool is `[slots, kv_heads, head_dim]` per layer with slot = page * page_size + offset, so a
`[pages, page_size, kv_heads, head_dim]` view of it is FlashInfer's "NHD" paged layout, no copy.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch

from gpu.attention import AttentionBackend
from gpu.cuda_streams import host_to_device
from gpu.forward_batch import ForwardBatch
from gpu.graph_runner import GraphDecodeAttention
from gpu.kv_pool import KVBuffers
from runtime.forward_mode import ForwardMode

# FlashInfer's recommended float workspace (split-k partial results), shared by every wrapper.
WORKSPACE_BYTES = 128 << 20
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # head sizes FlashInfer ships kernels for
HALF_DTYPES = (torch.float16, torch.bfloat16)
KV_LAYOUT = "NHD"
INSTALL_HINT = "pip install 'actorserve[gpu]' (flashinfer-python==0.7.2.post1)"


def import_flashinfer() -> ModuleType:
    """The `flashinfer` module; an ImportError that says how to install it otherwise."""
    try:
        return importlib.import_module("flashinfer")
    except Exception as exc:  # a broken CUDA install fails here with other errors than ImportError
        raise ImportError(f"flashinfer cannot be imported ({exc}); {INSTALL_HINT}") from exc


def flashinfer_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashInfer cannot run this model here, or None when it can."""
    if device.type != "cuda":
        return f"FlashInfer runs on CUDA only and the device is {str(device)!r}"
    if dtype not in HALF_DTYPES:
        return f"FlashInfer needs float16 or bfloat16 and the model runs in {dtype} (set --dtype)"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"FlashInfer supports head_dim {SUPPORTED_HEAD_DIMS}, the model has {head_dim}"
    try:
        import_flashinfer()
    except ImportError as exc:
        return str(exc)
    return None


def resolve_attention_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """'torch' or 'flashinfer': auto takes flashinfer where it can run; an explicit request for
    flashinfer where it cannot is an error at startup, not a kernel failure later."""
    if requested == "torch":
        return "torch"
    if requested not in ("auto", "flashinfer"):
        raise ValueError(f"attention_backend {requested!r} is unknown; choose one of auto, torch, flashinfer")
    reason = flashinfer_unavailable(device, dtype, head_dim)
    if reason is None:
        return "flashinfer"
    if requested == "flashinfer":
        raise ValueError(f"--attention-backend flashinfer cannot be used: {reason}. Use --attention-backend torch or auto.")
    return "torch"


def paged_kv_plan_args(
    req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: Sequence[int], page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table of requests `req_rows` holding `seq_lens` tokens each: int32
    (indptr [bs + 1] host, indices [total_pages] on the table's device, last_page_len [bs] host,
    pinned on CUDA). Page j of a request is the page of its token at position j * page_size."""
    device = req_to_token.device
    pages = [-(-n // page_size) for n in seq_lens]
    counts = torch.tensor(pages, dtype=torch.int64)
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
    indptr[1:] = counts.cumsum(0)
    last_page_len = torch.tensor([n - (p - 1) * page_size for n, p in zip(seq_lens, pages)], dtype=torch.int32)
    total = int(indptr[-1])
    # Only O(batch) values cross to the device (one `host_to_device` copy); the O(pages) index
    # arithmetic runs there. output_size spares repeat_interleave a device-to-host sync.
    counts_starts = host_to_device(torch.stack([counts, indptr[:-1].to(torch.int64)]), device)
    req_of_page = torch.repeat_interleave(torch.arange(len(pages), device=device), counts_starts[0], output_size=total)
    page_in_req = torch.arange(total, device=device) - counts_starts[1][req_of_page]
    slots = req_to_token[req_rows.to(device)[req_of_page], page_in_req * page_size]
    return _host(indptr, device), (slots // page_size).to(torch.int32), _host(last_page_len, device)


class PlanFence:
    """Before a wrapper is planned again, wait until the GPU has run its previous plan's copy."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: dict[int, torch.cuda.Event] = {}

    @contextmanager
    def guard(self, wrapper: object) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        event = self._events.get(id(wrapper))
        if event is None:
            event = self._events[id(wrapper)] = torch.cuda.Event()
        event.synchronize()  # returns at once for a never-recorded event (the first plan)
        yield
        event.record()  # on the current stream, right after the plan's host-to-device copy


@dataclass(slots=True)
class _Plan:
    kind: Literal["decode", "ragged", "paged"]
    wrapper: Any
    out_cache_loc: torch.Tensor


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    scale: float


class FlashInferAttention(AttentionBackend, GraphDecodeAttention):
    def __init__(self, kv: KVBuffers, req_to_token: torch.Tensor, shape: AttentionShape, max_context_len: int):
        self.fi = import_flashinfer()
        self.kv = kv
        self.req_to_token = req_to_token
        self.shape = shape
        self.max_context_len = max_context_len
        self.dtype = kv.k[0].dtype
        self.device = kv.k[0].device
        # FlashInfer: the float workspace "must be initialized to 0 for its first use".
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # The CUDA-core decode kernels cover only small GQA groups; larger groups run faster (and
        # at all) on the tensor-core (prefill) kernels.
        self.use_tensor_cores = shape.num_heads // shape.num_kv_heads >= 4
        self.decode = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, KV_LAYOUT, use_tensor_cores=self.use_tensor_cores)
        self.paged_prefill = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, KV_LAYOUT)
        self.ragged_prefill = self.fi.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, KV_LAYOUT)
        self.fence = PlanFence(self.device)
        self.pages = [(self._paged(k), self._paged(v)) for k, v in zip(kv.k, kv.v)]
        self.graph_decode: dict[int, Any] = {}
        self._plan: _Plan | None = None

    def _paged(self, buf: torch.Tensor) -> torch.Tensor:
        slots, heads, dim = buf.shape
        assert slots % self.shape.page_size == 0, "KV buffers hold whole pages"
        return buf.view(slots // self.shape.page_size, self.shape.page_size, heads, dim)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode == ForwardMode.DECODE:
            self._plan_decode(self.decode, batch)
        elif all(p == 0 for p in batch.prefix_lens):
            self._plan_ragged(batch)
        else:
            self._plan_paged_prefill(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "init_forward_metadata must run before forward"
        self.kv.write(layer_id, plan.out_cache_loc, k, v)
        if plan.kind == "ragged":
            return plan.wrapper.run(q.contiguous(), k.contiguous(), v.contiguous())
        return plan.wrapper.run(q.contiguous(), self.pages[layer_id])

    def _plan_decode(self, wrapper: Any, batch: ForwardBatch) -> None:
        s = self.shape
        indptr, indices, last_page_len = paged_kv_plan_args(self.req_to_token, batch.req_rows, batch.seq_lens, s.page_size)
        with self.fence.guard(wrapper):
            wrapper.plan(
                indptr, indices, last_page_len, s.num_heads, s.num_kv_heads, s.head_dim, s.page_size,
                q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=s.scale,
            )
        self._plan = _Plan("decode", wrapper, batch.out_cache_loc)

    def _plan_ragged(self, batch: ForwardBatch) -> None:
        s = self.shape
        qo_indptr = _indptr(batch.extend_lens, self.device)
        with self.fence.guard(self.ragged_prefill):
            self.ragged_prefill.plan(
                qo_indptr, qo_indptr, s.num_heads, s.num_kv_heads, s.head_dim,
                causal=True, sm_scale=s.scale, q_data_type=self.dtype, kv_data_type=self.dtype,
            )
        self._plan = _Plan("ragged", self.ragged_prefill, batch.out_cache_loc)

    def _plan_paged_prefill(self, batch: ForwardBatch) -> None:
        s = self.shape
        indptr, indices, last_page_len = paged_kv_plan_args(self.req_to_token, batch.req_rows, batch.seq_lens, s.page_size)
        with self.fence.guard(self.paged_prefill):
            self.paged_prefill.plan(
                _indptr(batch.extend_lens, self.device), indptr, indices, last_page_len,
                s.num_heads, s.num_kv_heads, s.head_dim, s.page_size,
                causal=True, sm_scale=s.scale, q_data_type=self.dtype, kv_data_type=self.dtype,
            )
        self._plan = _Plan("paged", self.paged_prefill, batch.out_cache_loc)

    def init_graph_state(self, buckets: Sequence[int]) -> None:
        # One set of static buffers for all buckets (each uses a leading slice): only one graph
        # runs at a time and every plan copies into them on the stream the replay runs on.
        max_bs = max(buckets)
        max_pages = max_bs * -(-self.max_context_len // self.shape.page_size)
        indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        indices = torch.zeros(max_pages, dtype=torch.int32, device=self.device)
        last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self.graph_decode = {
            bs: self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                KV_LAYOUT,
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=indptr[: bs + 1],
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len[:bs],
            )
            for bs in buckets
        }

    def plan_graph_decode(self, batch: ForwardBatch) -> None:
        wrapper = self.graph_decode.get(batch.batch_size)
        if wrapper is None:
            raise ValueError(f"no graph decode plan for batch size {batch.batch_size}; buckets are {sorted(self.graph_decode)}")
        self._plan_decode(wrapper, batch)


def _indptr(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """int32 CSR offsets of `lengths`, on the host (pinned for a CUDA `device`, see `_host`)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)
    return _host(out, device)


def _host(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` as plan() wants its host arguments: plan() copies them to the device with
    non_blocking=True, which from pageable memory may still synchronize the stream (CUDA's
    staging rule); from pinned memory it does not, and the caching host allocator keeps the block
    until the copy has run."""
    return t.pin_memory() if device.type == "cuda" else t
