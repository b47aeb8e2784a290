"""A pure-torch stand-in for the parts of `flashinfer` that gpu/flashinfer_backend.py calls.

It follows FlashInfer 0.7's documented contracts (wrapper constructors, `plan()` and `run()`
arguments, the CSR page table, the NHD paged layout, causal masks aligned to the end of each
request's KV, CUDA-graph mode copying the plan into caller-owned buffers) and checks what the
documentation requires: int32 page tables, indptr / last_page_len lengths, the fixed batch size of
a graph-mode wrapper, indices fitting its buffer, and the planned dtypes at run time.

In graph mode `run()` reads the page table from the caller's buffers at run time, as the captured
kernel does, so a plan that left stale values there produces wrong attention here too. The CPU
tests install it as `sys.modules["flashinfer"]`; it proves our glue follows the documented API,
not that FlashInfer's kernels compute what we expect (tests/test_cuda.py does that on a GPU).
"""

from __future__ import annotations

from typing import Any

import torch

plans: list[tuple[str, int]] = []  # (wrapper kind, batch size) of every plan() call


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

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False, **buffers: Any):
        assert kv_layout == "NHD"
        assert float_workspace_buffer.dtype == torch.uint8
        self.use_cuda_graph = use_cuda_graph
        self.buffers = buffers
        self.planned: dict[str, Any] | None = None

    def _plan_common(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, kw: dict[str, Any]) -> None:
        assert num_qo_heads % num_kv_heads == 0
        self.planned = dict(
            heads=(num_qo_heads, num_kv_heads, head_dim),
            q_dtype=kw.get("q_data_type"),
            kv_dtype=kw.get("kv_data_type") or kw.get("q_data_type"),
            scale=kw.get("sm_scale") or head_dim**-0.5,
            causal=kw.get("causal", False),
        )

    def _check_run(self, q: torch.Tensor, kv_dtype: torch.dtype) -> dict[str, Any]:
        p = self.planned
        assert p is not None, "plan() must run before run()"
        assert q.dtype == p["q_dtype"] and kv_dtype == p["kv_dtype"], "run() dtypes differ from the plan"
        assert tuple(q.shape[1:]) == (p["heads"][0], p["heads"][2])
        return p


class _PagedMixin(_Wrapper):
    def _store_csr(self, indptr, indices, last_page_len, fixed_bs_key: str) -> None:
        if not self.use_cuda_graph:
            self.csr = (indptr, indices, last_page_len)
            return
        bufs = self.buffers
        assert last_page_len.numel() == bufs[fixed_bs_key].numel(), "graph mode: the batch size is fixed"
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
        if use_cuda_graph:
            for t in (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer):
                assert torch.is_tensor(t), "graph mode needs the three buffers"
            assert paged_kv_indptr_buffer.numel() == paged_kv_last_page_len_buffer.numel() + 1
            self.buffers = dict(indptr=paged_kv_indptr_buffer, indices=paged_kv_indices_buffer, last_page_len=paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *deprecated, **kw) -> None:
        assert not deprecated, "optional plan() arguments are keyword-only in 0.7"
        _check_csr(indptr, indices, last_page_len, page_size)
        self._plan_common(num_qo_heads, num_kv_heads, head_dim, kw)
        self._store_csr(indptr, indices, last_page_len, "last_page_len")
        plans.append((self.kind, last_page_len.numel()))

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], **kw: Any) -> torch.Tensor:
        p = self._check_run(q, paged_kv_cache[0].dtype)
        indptr, indices, last = self.csr
        assert q.shape[0] == last.numel(), "decode: one query per request"
        rows = [_attend(q[i : i + 1], *_paged_kv(paged_kv_cache, indptr, indices, last, i), p["scale"], False) for i in range(q.shape[0])]
        return torch.cat(rows)


class BatchPrefillWithPagedKVCacheWrapper(_PagedMixin):
    kind = "paged_prefill"

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size, **kw) -> None:
        assert qo_indptr.dtype == torch.int32 and qo_indptr.numel() == paged_kv_indptr.numel()
        _check_csr(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        self._plan_common(num_qo_heads, num_kv_heads, head_dim_qk, kw)
        self.qo_indptr = qo_indptr
        self._store_csr(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, "last_page_len")
        plans.append((self.kind, qo_indptr.numel() - 1))

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], **kw: Any) -> torch.Tensor:
        p = self._check_run(q, paged_kv_cache[0].dtype)
        indptr, indices, last = self.csr
        qo = self.qo_indptr
        assert q.shape[0] == int(qo[-1])
        outs = []
        for i in range(qo.numel() - 1):
            k, v = _paged_kv(paged_kv_cache, indptr, indices, last, i)
            outs.append(_attend(q[int(qo[i]) : int(qo[i + 1])], k, v, p["scale"], p["causal"]))
        return torch.cat(outs)


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    kind = "ragged_prefill"

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, **kw) -> None:
        assert qo_indptr.dtype == torch.int32 and kv_indptr.dtype == torch.int32
        self._plan_common(num_qo_heads, num_kv_heads, head_dim_qk, kw)
        self.indptrs = (qo_indptr, kv_indptr)
        plans.append((self.kind, qo_indptr.numel() - 1))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        p = self._check_run(q, k.dtype)
        qo, kv = self.indptrs
        assert q.shape[0] == int(qo[-1]) and k.shape[0] == int(kv[-1])
        outs = []
        for i in range(qo.numel() - 1):
            ks, ke = int(kv[i]), int(kv[i + 1])
            outs.append(_attend(q[int(qo[i]) : int(qo[i + 1])], k[ks:ke], v[ks:ke], p["scale"], p["causal"]))
        return torch.cat(outs)
