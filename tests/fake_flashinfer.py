"""A pure-torch stand-in for the parts of `flashinfer` that gpu/flashinfer_backend.py calls.

It follows FlashInfer 0.7.2.post1's source (flashinfer/decode.py, flashinfer/prefill.py): the
wrapper constructors' parameter names and defaults (the decode wrapper's graph buffers are
`paged_kv_*_buffer`, the prefill wrappers' `*_buf`), `plan()` and `run()` parameter names and which
of them are keyword-only, `q_data_type` defaulting to float16, `sm_scale` to 1/sqrt(head_dim), the
CSR page table, the NHD paged layout passed as a (k, v) tuple, causal masks aligned to the end of
each request's KV, CUDA-graph mode copying the plan into caller-owned buffers. An argument name
the real API does not have is a TypeError here as there. It also checks what the kernels need:
int32 page tables, indptr / last_page_len lengths, the fixed batch size of a graph-mode wrapper,
indices fitting its buffer, graph buffers on the workspace's device, the planned dtypes, head
counts and page size at run time.

Stricter than the real one where that catches our mistakes: optional plan() arguments must be
passed by keyword (the real decode plan() still takes them positionally, deprecated; the two
prefill plans take them positionally in different orders), and options whose effect the fake does
not model (custom masks, RoPE in the kernel, windows, soft-cap, lse, fp8 scales) are refused.

In graph mode `run()` reads the page table from the caller's buffers at run time, as the captured
kernel does, so a plan that left stale values there produces wrong attention here too. The CPU
tests install it as `sys.modules["flashinfer"]`; it proves our glue follows the API, not that
FlashInfer's kernels compute what we expect (tests/test_cuda.py does that on a GPU).

`strict_module()` is the same API with the kernels' own limits on (`KernelLimits`): half
precision, the head sizes and GQA groups kernels are compiled for, K and V caches with equal
strides and a contiguous last dimension, every tensor on the (CUDA) workspace device. Without it
the fake computes in float32 on anything, which the real kernels refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch

plans: list[tuple[str, int]] = []  # (kernel path, batch size) of every plan() call


@dataclass(frozen=True, slots=True)
class KernelLimits:
    """What FlashInfer 0.7.2.post1's attention kernels accept (include/flashinfer/utils.cuh's
    DISPATCH_HEAD_DIM and DISPATCH_GQA_GROUP_SIZE, the wrappers' dtype checks)."""

    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    head_dims: tuple[int, ...] = (64, 128, 256)
    # The CUDA-core decode kernel is compiled per group size; the tensor-core (prefill) kernels
    # take any group at run time.
    cuda_core_decode_groups: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 16)
    # The CPU tests stand the CPU in for the GPU: tensors must still all be on the workspace's device.
    cpu_stands_for_cuda: bool = False

    def check_device(self, device: torch.device) -> None:
        assert device.type == "cuda" or (self.cpu_stands_for_cuda and device.type == "cpu"), (
            f"FlashInfer's kernels run on CUDA tensors, got {device}"
        )

    def check_plan(self, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, group: int | None) -> None:
        assert q_dtype in self.dtypes and kv_dtype in self.dtypes, f"no kernels for {q_dtype} / {kv_dtype}: float16 or bfloat16"
        assert head_dim in self.head_dims, f"no kernels for head_dim {head_dim}: {self.head_dims}"
        if group is not None:
            assert group in self.cuda_core_decode_groups, (
                f"Unsupported group_size: {group} (the CUDA-core decode kernel has {self.cuda_core_decode_groups}; use_tensor_cores=True takes any)"
            )

    def check_run(self, device: torch.device, *tensors: torch.Tensor) -> None:
        for t in tensors:
            assert t.device == device, f"a {tuple(t.shape)} tensor is on {t.device}, the workspace on {device}"
            assert t.stride(-1) == 1, "the last (head_dim) dimension must be contiguous"

# Keyword arguments of each plan() after its required ones, with the real defaults
# (decode.py BatchDecodeWithPagedKVCacheWrapper._plan_impl, prefill.py ...Wrapper.plan).
_DECODE_PLAN = dict(
    pos_encoding_mode="NONE", window_left=-1, window_right=0, logits_soft_cap=None, q_data_type="float16",
    kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
    non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False,
    q_len_per_req=1, is_causal=None,
)
_PREFILL_PLAN_COMMON = dict(
    head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
    use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None,
    rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking=True,
    prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None,
    seq_lens=None, seq_lens_q=None, max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None,
    disable_split_kv=False, uniform_q_len=None,
)
_PAGED_PREFILL_PLAN = dict(_PREFILL_PLAN_COMMON, block_tables=None)
_RAGGED_PREFILL_PLAN = dict(_PREFILL_PLAN_COMMON, v_indptr=None, o_indptr=None)
# Keyword-only arguments of each run() (all default to None / False / the planned value).
_DECODE_RUN = dict(
    q_scale=None, k_scale=None, v_scale=None, out=None, lse=None, return_lse=False, enable_pdl=None,
    window_left=None, sinks=None, q_len_per_req=None, skip_softmax_threshold_scale_factor=None, kv_cache_sf=None,
)
_PAGED_PREFILL_RUN = dict(
    q_scale=None, k_scale=None, v_scale=None, out=None, lse=None, return_lse=False, lse_base="log2", lse_layout="NH",
    enable_pdl=None, window_left=None, sinks=None, kv_cache_sf=None, skip_softmax_threshold_scale_factor=None,
    use_fp16_softmax=None, uses_spcompress=None,
)
_RAGGED_PREFILL_RUN = dict(
    q_scale=None, k_scale=None, v_scale=None, o_scale=None, out=None, lse=None, return_lse=False, lse_base="log2",
    lse_layout="NH", enable_pdl=None, kv_cache_sf=None,
)
# Options the fake computes as the real kernels do, with the values it models; others are refused.
_MODELLED: dict[str, tuple[Any, ...]] = dict(
    pos_encoding_mode=("NONE",), window_left=(-1, None), window_right=(0,), logits_soft_cap=(None, 0.0),
    custom_mask=(None,), packed_custom_mask=(None,), q_scale=(None,), k_scale=(None,), v_scale=(None,),
    out=(None,), lse=(None,), return_lse=(False,), sinks=(None,), kv_cache_sf=(None,), q_len_per_req=(1, None),
    is_causal=(None, False), o_data_type=(None,), v_indptr=(None,), o_indptr=(None,), block_tables=(None,),
    seq_lens=(None,), seq_lens_q=(None,), prefix_len_ptr=(None,), use_fp16_qk_reduction=(False,),
    skip_softmax_threshold_scale_factor=(None,),
)


def _options(method: str, given: dict[str, Any], accepted: dict[str, Any]) -> dict[str, Any]:
    """`given` keyword arguments over the real defaults; unknown names fail as in a real call."""
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise TypeError(f"{method}() got unexpected keyword argument(s) {unknown}")
    for name, value in given.items():
        modelled = _MODELLED.get(name)
        if modelled is not None and not any(value is m or (not torch.is_tensor(value) and value == m) for m in modelled):
            raise NotImplementedError(f"the fake does not model {method}({name}={value!r})")
    return {**accepted, **given}


def _dtype(d: str | torch.dtype) -> torch.dtype:
    return getattr(torch, d) if isinstance(d, str) else d  # flashinfer.utils.canonicalize_torch_dtype


def _check_csr(indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> None:
    for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    assert indptr.numel() == last_page_len.numel() + 1, "indptr is [batch_size + 1]"
    assert int(indptr[-1]) == indices.numel(), "indices is [indptr[-1]]"
    assert bool(((last_page_len >= 1) & (last_page_len <= page_size)).all()), "1 <= last_page_len <= page_size"


def _paged_kv(cache: tuple[torch.Tensor, torch.Tensor], indptr, indices, last_page_len, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    k_pages, v_pages = cache
    page_size = k_pages.shape[1]
    pages = indices[int(indptr[i]) : int(indptr[i + 1])].long()
    kv_len = (pages.numel() - 1) * page_size + int(last_page_len[i])
    k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:kv_len]
    v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:kv_len]
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """q [n, H, D], k/v [kv_len, KVH, D]; causal aligned to the end of the KV."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if causal:
        n, kv_len = q.shape[0], k.shape[0]
        q_pos = torch.arange(n)[:, None] + kv_len - n
        scores = scores.masked_fill(torch.arange(kv_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


class _Wrapper:
    kind = "?"
    limits: ClassVar[KernelLimits | None] = None  # set by strict_module()

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str, use_cuda_graph: bool):
        assert kv_layout in ("NHD", "HND"), f"Invalid kv_layout {kv_layout}"
        assert kv_layout == "NHD", "the fake models the NHD layout only"
        assert float_workspace_buffer.dtype == torch.uint8
        self.device = float_workspace_buffer.device
        if self.limits is not None:
            self.limits.check_device(self.device)
        self.use_cuda_graph = use_cuda_graph
        self.buffers: dict[str, torch.Tensor] = {}
        self.planned: dict[str, Any] | None = None

    def _plan_common(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int | None, o: dict[str, Any]) -> None:
        assert num_qo_heads % num_kv_heads == 0
        q_dtype = o["q_data_type"]
        kv_dtype = o["kv_data_type"]
        if o.get("data_type") is not None:  # decode only, deprecated; q_data_type wins unless None
            q_dtype = o["data_type"] if q_dtype is None else q_dtype
            kv_dtype = o["data_type"] if kv_dtype is None else kv_dtype
        q_dtype = _dtype(q_dtype)
        kv_dtype = q_dtype if kv_dtype is None else _dtype(kv_dtype)
        if self.limits is not None:
            group = num_qo_heads // num_kv_heads if self.path == "decode" else None
            self.limits.check_plan(q_dtype, kv_dtype, head_dim, group)
        self.planned = dict(
            heads=(num_qo_heads, num_kv_heads, head_dim),
            page_size=page_size,
            q_dtype=q_dtype,
            kv_dtype=kv_dtype,
            scale=head_dim**-0.5 if o["sm_scale"] is None else o["sm_scale"],
            causal=o.get("causal", False),
        )

    @property
    def path(self) -> str:
        """Which kernels plan() and run() use (the decode wrapper has two kinds)."""
        return self.kind

    def _check_run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
        p = self.planned
        assert p is not None, "plan() must run before run()"
        if self.limits is not None:
            self.limits.check_run(self.device, q, k, v)
            # One stride set serves both (the kernels' same_kv_strides path; others are lazily built variants).
            assert k.stride() == v.stride(), f"K and V strides differ: {k.stride()} and {v.stride()}"
        # flashinfer.utils._check_cached_qkv_data_type
        assert q.dtype == p["q_dtype"] and k.dtype == p["kv_dtype"], "run() dtypes differ from the plan"
        num_qo_heads, num_kv_heads, head_dim = p["heads"]
        assert tuple(q.shape[1:]) == (num_qo_heads, head_dim), "q is [tokens, num_qo_heads, head_dim]"
        assert k.shape[-2:] == (num_kv_heads, head_dim), "k/v end in [num_kv_heads, head_dim] (NHD)"
        return p

    @staticmethod
    def _unpack_paged(paged_kv_cache: Any, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(paged_kv_cache, tuple), "the fake takes the (k_cache, v_cache) tuple form"
        k, v = paged_kv_cache
        assert k.dim() == 4 and k.shape == v.shape, "each cache is [max_num_pages, page_size, num_kv_heads, head_dim]"
        assert k.shape[1] == page_size, f"cache pages hold {k.shape[1]} tokens, plan() said {page_size}"
        return k, v


class _PagedMixin(_Wrapper):
    def _store_csr(self, indptr, indices, last_page_len) -> None:
        if not self.use_cuda_graph:
            self.csr = (indptr, indices, last_page_len)
            return
        bufs = self.buffers
        # decode.py _plan_impl: the batch size is fixed, indices must fit the buffer.
        assert last_page_len.numel() == bufs["last_page_len"].numel(), "graph mode: the batch size is fixed"
        assert indices.numel() <= bufs["indices"].numel(), "indices exceed the graph buffer"
        bufs["indptr"].copy_(indptr)
        bufs["last_page_len"].copy_(last_page_len)
        bufs["indices"][: indices.numel()].copy_(indices)
        self.csr = (bufs["indptr"], bufs["indices"], bufs["last_page_len"])  # read at run time


class BatchDecodeWithPagedKVCacheWrapper(_PagedMixin):
    kind = "decode"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: Any = None,
    ):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        self.use_tensor_cores = use_tensor_cores
        if use_cuda_graph:
            bufs = dict(indptr=paged_kv_indptr_buffer, indices=paged_kv_indices_buffer, last_page_len=paged_kv_last_page_len_buffer)
            for name, t in bufs.items():
                if not torch.is_tensor(t):
                    raise ValueError(f"paged_kv_{name}_buffer should be a torch.Tensor in cudagraph mode")
                assert t.dtype == torch.int32, f"paged_kv_{name}_buffer is read by the kernels as int32"
                assert t.device == self.device, f"paged_kv_{name}_buffer must be on the workspace's device"
            if len(paged_kv_indptr_buffer) != len(paged_kv_last_page_len_buffer) + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
            self.buffers = bufs

    @property
    def path(self) -> str:
        return "tensor_core_decode" if self.use_tensor_cores else "decode"

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *deprecated, **kwargs) -> None:
        assert not deprecated, "optional plan() arguments positionally are deprecated in 0.7; pass them by keyword"
        o = _options("BatchDecodeWithPagedKVCacheWrapper.plan", kwargs, _DECODE_PLAN)
        _check_csr(indptr, indices, last_page_len, page_size)
        self._plan_common(num_qo_heads, num_kv_heads, head_dim, page_size, o)
        self._store_csr(indptr, indices, last_page_len)
        plans.append((self.path, last_page_len.numel()))

    def run(self, q: torch.Tensor, paged_kv_cache: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert not args, "extra positional run() arguments are for custom (jit_args) kernels"
        _options("BatchDecodeWithPagedKVCacheWrapper.run", kwargs, _DECODE_RUN)
        p = self.planned
        assert p is not None, "plan() must run before run()"
        k_cache, v_cache = self._unpack_paged(paged_kv_cache, p["page_size"])
        p = self._check_run(q, k_cache, v_cache)
        indptr, indices, last = self.csr
        assert q.shape[0] == last.numel(), "decode: one query per request (q_len_per_req 1)"
        cache = (k_cache, v_cache)
        rows = [_attend(q[i : i + 1], *_paged_kv(cache, indptr, indices, last, i), p["scale"], False) for i in range(q.shape[0])]
        return torch.cat(rows)


class BatchPrefillWithPagedKVCacheWrapper(_PagedMixin):
    kind = "paged_prefill"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None,
        paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: Any = None,
        jit_kwargs: Any = None,
        variant_owns_mask: bool = False,
    ):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        if use_cuda_graph:
            raise NotImplementedError("the fake has no graph-mode prefill: actorserve captures decode only")

    def plan(
        self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size, **kwargs
    ) -> None:
        o = _options("BatchPrefillWithPagedKVCacheWrapper.plan", kwargs, _PAGED_PREFILL_PLAN)
        assert o["head_dim_vo"] in (None, head_dim_qk), "the fake models head_dim_vo == head_dim_qk"
        assert qo_indptr.dtype == torch.int32 and qo_indptr.numel() == paged_kv_indptr.numel()
        _check_csr(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        self._plan_common(num_qo_heads, num_kv_heads, head_dim_qk, page_size, o)
        self.qo_indptr = qo_indptr
        self._store_csr(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        plans.append((self.kind, qo_indptr.numel() - 1))

    def run(self, q: torch.Tensor, paged_kv_cache: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert not args, "extra positional run() arguments are for custom (jit_args) kernels"
        _options("BatchPrefillWithPagedKVCacheWrapper.run", kwargs, _PAGED_PREFILL_RUN)
        p = self.planned
        assert p is not None, "plan() must run before run()"
        cache = self._unpack_paged(paged_kv_cache, p["page_size"])
        p = self._check_run(q, *cache)
        indptr, indices, last = self.csr
        qo = self.qo_indptr
        assert q.shape[0] == int(qo[-1]), "q is [qo_indptr[-1], num_qo_heads, head_dim]"
        outs = []
        for i in range(qo.numel() - 1):
            k, v = _paged_kv(cache, indptr, indices, last, i)
            outs.append(_attend(q[int(qo[i]) : int(qo[i + 1])], k, v, p["scale"], p["causal"]))
        return torch.cat(outs)


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    kind = "ragged_prefill"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        kv_indptr_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: Any = None,
        jit_kwargs: Any = None,
        variant_owns_mask: bool = False,
    ):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        if use_cuda_graph:
            raise NotImplementedError("the fake has no graph-mode prefill: actorserve captures decode only")

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, **kwargs) -> None:
        o = _options("BatchPrefillWithRaggedKVCacheWrapper.plan", kwargs, _RAGGED_PREFILL_PLAN)
        assert o["head_dim_vo"] in (None, head_dim_qk), "the fake models head_dim_vo == head_dim_qk"
        assert qo_indptr.dtype == torch.int32 and kv_indptr.dtype == torch.int32
        if len(kv_indptr) != len(qo_indptr):
            raise ValueError("The kv_indptr length should be equal to mask_indptr length.")
        self._plan_common(num_qo_heads, num_kv_heads, head_dim_qk, None, o)
        self.indptrs = (qo_indptr, kv_indptr)
        plans.append((self.kind, qo_indptr.numel() - 1))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert not args, "extra positional run() arguments are for custom (jit_args) kernels"
        _options("BatchPrefillWithRaggedKVCacheWrapper.run", kwargs, _RAGGED_PREFILL_RUN)
        p = self._check_run(q, k, v)
        assert v.shape == k.shape and v.dtype == k.dtype
        qo, kv = self.indptrs
        assert q.shape[0] == int(qo[-1]) and k.shape[0] == int(kv[-1])
        outs = []
        for i in range(qo.numel() - 1):
            ks, ke = int(kv[i]), int(kv[i + 1])
            outs.append(_attend(q[int(qo[i]) : int(qo[i + 1])], k[ks:ke], v[ks:ke], p["scale"], p["causal"]))
        return torch.cat(outs)


def strict_module(limits: KernelLimits = KernelLimits()) -> ModuleType:
    """A `flashinfer` stand-in whose wrappers refuse what the real kernels refuse (`limits`)."""
    chosen = limits

    class StrictDecode(BatchDecodeWithPagedKVCacheWrapper):
        limits = chosen

    class StrictPagedPrefill(BatchPrefillWithPagedKVCacheWrapper):
        limits = chosen

    class StrictRaggedPrefill(BatchPrefillWithRaggedKVCacheWrapper):
        limits = chosen

    module = ModuleType("flashinfer", "fake_flashinfer with the kernels' limits")
    module.BatchDecodeWithPagedKVCacheWrapper = StrictDecode  # type: ignore[attr-defined]
    module.BatchPrefillWithPagedKVCacheWrapper = StrictPagedPrefill  # type: ignore[attr-defined]
    module.BatchPrefillWithRaggedKVCacheWrapper = StrictRaggedPrefill  # type: ignore[attr-defined]
    return module
