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

Kernels: FlashInfer compiles each kernel family (per dtype and head_dim) with nvcc at first use,
minutes on a first run, unless its precompiled kernels are installed (`flashinfer
install-jit-cache-wheel`). So the backend is refused at startup where neither is available
(`kernels_unavailable`), and `warm_up` runs every wrapper once before serving: the compile happens
then, behind a log line, not inside a client's first request or a graph capture.

Memory: the float workspace (128 MiB) is shared; each wrapper also allocates FlashInfer's own
8 MiB device and 8 MiB pinned host int workspace (its plan), so 3 eager wrappers and one per graph
bucket (36 buckets at cuda_graph_max_bs 256) hold about 312 MiB of each.

The KV pool is `[slots, kv_heads, head_dim]` per layer with slot = page * page_size + offset, so a
`[pages, page_size, kv_heads, head_dim]` view of it is FlashInfer's "NHD" paged layout, no copy.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch

from gpu.attention import AttentionBackend
from gpu.cuda_streams import host_to_device
from gpu.forward_batch import ForwardBatch
from gpu.graph_runner import DUMMY_ROW, DUMMY_SLOT, GraphDecodeAttention
from gpu.kv_pool import KVBuffers
from runtime.forward_mode import ForwardMode

# FlashInfer's recommended float workspace (split-k partial results), shared by every wrapper.
WORKSPACE_BYTES = 128 << 20
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # head sizes FlashInfer ships kernels for
HALF_DTYPES = (torch.float16, torch.bfloat16)
KV_LAYOUT = "NHD"
INSTALL_HINT = "pip install 'actorserve[gpu]' (flashinfer-python==0.7.2.post1)"
# FlashInfer takes its Hopper (fa3) prefill kernels on compute capability 9.x; nvcc builds them from 12.3.
FA3_MIN_NVCC = (12, 3)
PRECOMPILED_HINT = "`flashinfer install-jit-cache-wheel` installs FlashInfer's precompiled kernels for this CUDA"

log = logging.getLogger(__name__)


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
    return kernels_unavailable(torch.cuda.get_device_capability(device))


def kernels_unavailable(capability: tuple[int, int]) -> str | None:
    """Why FlashInfer can neither load nor build its kernels here, or None: it loads them from
    its precompiled package (flashinfer-jit-cache) or builds them with nvcc, found as FlashInfer
    finds it (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda)."""
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        return (
            "FlashInfer compiles its attention kernels with nvcc at first use and finds none "
            f"(set CUDA_HOME or put nvcc on PATH), or {PRECOMPILED_HINT}"
        )
    version = nvcc_version(nvcc)
    if version is None:
        return f"FlashInfer compiles its attention kernels with nvcc, and `{nvcc} --version` names no release"
    if capability[0] == 9 and version < FA3_MIN_NVCC:
        need = ".".join(map(str, FA3_MIN_NVCC))
        return (
            f"FlashInfer's prefill kernels for this GPU (compute capability 9.x) need CUDA >= {need} and "
            f"{nvcc} is {version[0]}.{version[1]}; install a newer CUDA toolkit, or {PRECOMPILED_HINT}"
        )
    return None


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [os.path.join(home, "bin", "nvcc")] if home else [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def nvcc_version(nvcc: str) -> tuple[int, int] | None:
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"release (\d+)\.(\d+)", text)
    return (int(found[1]), int(found[2])) if found else None


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
    if device.type == "cuda":
        log.warning("attention backend: torch, without CUDA graphs (%s)", reason)
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
            # blocking: the host thread sleeps in synchronize() instead of spinning a core.
            event = self._events[id(wrapper)] = torch.cuda.Event(blocking=True)
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
        self.warm_up()

    def warm_up(self) -> None:
        """Run each path once (decode, prefill from scratch, prefill over a prefix) on the dummy
        row, which writes only the reserved slot: FlashInfer loads its kernels now, or on a first
        run compiles them, before any request waits for it."""
        s = self.shape
        log.info(
            "FlashInfer: loading attention kernels (%s, head_dim %d, %d query / %d kv heads); "
            "a first run compiles them with nvcc, which takes minutes",
            str(self.dtype).removeprefix("torch."), s.head_dim, s.num_heads, s.num_kv_heads,
        )
        started = time.perf_counter()
        for mode, prefix in ((ForwardMode.DECODE, 1), (ForwardMode.EXTEND, 0), (ForwardMode.EXTEND, 1)):
            batch = self._dummy_batch(mode, prefix)
            self.init_forward_metadata(batch)
            q = torch.zeros((1, s.num_heads, s.head_dim), dtype=self.dtype, device=self.device)
            kv = torch.zeros((1, s.num_kv_heads, s.head_dim), dtype=self.dtype, device=self.device)
            self.forward(q, kv, kv, 0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("FlashInfer: attention kernels ready in %.1f s", time.perf_counter() - started)

    def _dummy_batch(self, mode: ForwardMode, prefix: int) -> ForwardBatch:
        one = torch.tensor([DUMMY_SLOT], dtype=torch.int64, device=self.device)
        return ForwardBatch(
            mode=mode, input_ids=torch.zeros_like(one), positions=one.new_tensor([prefix]), out_cache_loc=one,
            req_rows=one.new_tensor([DUMMY_ROW]), prefix_lens=[prefix], extend_lens=[1],
        )

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
