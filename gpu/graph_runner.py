"""Decode through CUDA graphs, padded to batch-size buckets.

A decode step launches hundreds of small kernels; on a GPU the launch overhead, not the math,
bounds small batches. Attention metadata is planned outside the graph (a plan reads host-side
lengths). The eager-replay mode (no capture) runs the same padding and buffer logic with a plain
forward, so it is tested on a CPU.

Returned logits are a view of a buffer the next `run` overwrites (as with any CUDA graph output):
consume them (sample) before the next decode step is launched on the same stream.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu.attention import AttentionBackend
from gpu.forward_batch import ForwardBatch
from gpu.models import CausalLM
from runtime.forward_mode import ForwardMode

# Padded rows are the dummy request row at position 0 writing the reserved KV slot (see kv_pool.py),
# so they never touch a live request's KV.
DUMMY_ROW = 0
DUMMY_SLOT = 0
DUMMY_TOKEN = 0
# Forward passes run before capturing a bucket: they trigger lazy initialisation (cuBLAS handles,
# kernel autotuning, FlashInfer's JIT modules) that must not be recorded into the graph.
WARMUP_RUNS = 2

GIB = 1 << 30


def capture_batch_sizes(max_bs: int) -> list[int]:
    """SGLang's decode buckets up to `max_bs`; `max_bs` itself is added when it is not one of them,
    so every decode batch the scheduler can form up to the limit has a graph."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    candidates = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    sizes = [bs for bs in candidates if bs <= max_bs]
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def default_cuda_graph_max_bs(gpu_memory_bytes: int) -> int:
    """SGLang's default for one GPU (tensor parallel size 1), by the GPU's total memory: graphs
    and their padded activations cost memory that small GPUs need for the KV cache."""
    gib = gpu_memory_bytes / GIB
    if gib < 20:
        return 8
    if gib < 35:
        return 24
    if gib < 60:
        return 32
    if gib < 160:
        return 256  # A100/H100 80 GB, H20/H200
    return 512


def bucket_for(buckets: Sequence[int], batch_size: int) -> int:
    """The smallest bucket that holds `batch_size` rows (`buckets` sorted ascending)."""
    i = bisect.bisect_left(buckets, batch_size)
    if i == len(buckets):
        raise ValueError(f"decode batch of {batch_size} exceeds the largest graph bucket {buckets[-1]}")
    return buckets[i]


class GraphDecodeAttention(ABC):
    """Graph hooks of an attention backend whose decode metadata lives in static buffers."""

    @abstractmethod
    def init_graph_state(self, buckets: Sequence[int]) -> None:
        """Allocate the static metadata buffers and one decode plan per bucket."""

    @abstractmethod
    def plan_graph_decode(self, batch: ForwardBatch) -> None:
        """Plan a padded decode batch (its size is a bucket) into that bucket's static buffers."""


class _PrePlanned(AttentionBackend):
    """The runner plans before the forward (and outside the graph); the model's own
    `init_forward_metadata` call inside the captured forward must then do nothing."""

    def __init__(self, inner: AttentionBackend):
        self.inner = inner

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        return self.inner.forward(q, k, v, layer_id)


@dataclass(slots=True)
class StaticDecodeInputs:
    """Decode inputs at fixed addresses, `max_bs` rows; a bucket uses the leading rows."""

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    out_cache_loc: torch.Tensor  # [max_bs] int64
    req_rows: torch.Tensor  # [max_bs] int64

    @classmethod
    def allocate(cls, max_bs: int, device: torch.device) -> StaticDecodeInputs:
        def full(value: int) -> torch.Tensor:
            return torch.full((max_bs,), value, dtype=torch.int64, device=device)

        return cls(full(DUMMY_TOKEN), full(0), full(DUMMY_SLOT), full(DUMMY_ROW))

    def fill(self, batch: ForwardBatch, bucket: int) -> ForwardBatch:
        """Copy `batch` into the leading rows, reset rows up to `bucket` to the dummy request
        (stale rows of an earlier, larger batch must not be replayed), return the padded view."""
        n = batch.batch_size
        sources = (batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_rows)
        for (buf, pad), src in zip(self._columns(), sources):
            buf[:n].copy_(src, non_blocking=True)
            buf[n:bucket].fill_(pad)
        return self.view(bucket, list(batch.prefix_lens) + [0] * (bucket - n))

    def dummy(self, bucket: int) -> ForwardBatch:
        """A batch of `bucket` dummy rows: what a graph is captured with."""
        for buf, pad in self._columns():
            buf[:bucket].fill_(pad)
        return self.view(bucket, [0] * bucket)

    def _columns(self) -> tuple[tuple[torch.Tensor, int], ...]:
        """Each buffer with the value of a padded row."""
        return ((self.input_ids, DUMMY_TOKEN), (self.positions, 0), (self.out_cache_loc, DUMMY_SLOT), (self.req_rows, DUMMY_ROW))

    def view(self, bucket: int, prefix_lens: list[int]) -> ForwardBatch:
        # A dummy row has prefix 0 and one new token: seq_len 1, attending to slot 0 only.
        # return_all_logits: in decode every token is its request's last, and skipping the
        # last-token gather keeps a host-built index tensor out of the captured graph.
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            out_cache_loc=self.out_cache_loc[:bucket],
            req_rows=self.req_rows[:bucket],
            prefix_lens=prefix_lens,
            extend_lens=[1] * bucket,
            return_all_logits=True,
        )


class DecodeGraphRunner:
    """Runs decode batches padded to buckets: CUDA graph replay, or eager replay (`capture=False`)."""

    def __init__(
        self,
        model: CausalLM,
        attn: AttentionBackend,
        buckets: Sequence[int],
        *,
        device: torch.device,
        capture: bool,
    ):
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise ValueError(f"graph buckets must be distinct positive sizes in ascending order, got {list(buckets)}")
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}; use capture=False for eager replay")
        if capture and not isinstance(attn, GraphDecodeAttention):
            # Its metadata would be frozen at the shapes of the capture batch: wrong for any other.
            raise ValueError(f"{type(attn).__name__} keeps no decode metadata in static buffers and cannot be captured; use flashinfer")
        self.model = model
        self.attn = attn
        self.buckets = list(buckets)
        self.max_bs = self.buckets[-1]
        self.device = device
        self.capture_enabled = capture
        self.inputs = StaticDecodeInputs.allocate(self.max_bs, device)
        self._planned = _PrePlanned(attn)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # per bucket: the captured graph's logits
        self._eager_logits: torch.Tensor | None = None  # eager replay: one [max_bs, vocab] buffer
        self.replays = 0
        if isinstance(attn, GraphDecodeAttention):
            attn.init_graph_state(self.buckets)
        if capture:
            self._capture_all()

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode == ForwardMode.DECODE and 1 <= batch.batch_size <= self.max_bs

    def bucket_for(self, batch_size: int) -> int:
        return bucket_for(self.buckets, batch_size)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[batch_size, vocab]` of a decode batch; valid until the next `run`."""
        if not self.can_run(batch):
            raise ValueError(f"the graph runner takes decode batches of 1..{self.max_bs} rows, got {batch.mode.name} x {batch.batch_size}")
        bucket = self.bucket_for(batch.batch_size)
        padded = self.inputs.fill(batch, bucket)
        self._plan(padded)
        self.replays += 1
        if self.capture_enabled:
            self._graphs[bucket].replay()
            return self._outputs[bucket][: batch.batch_size]
        return self._eager_replay(padded)[: batch.batch_size]

    def _plan(self, padded: ForwardBatch) -> None:
        if isinstance(self.attn, GraphDecodeAttention):
            self.attn.plan_graph_decode(padded)
        else:
            self.attn.init_forward_metadata(padded)

    def _forward(self, padded: ForwardBatch) -> torch.Tensor:
        return self.model(padded, self._planned)

    def _eager_replay(self, padded: ForwardBatch) -> torch.Tensor:
        logits = self._forward(padded)
        if self._eager_logits is None:
            self._eager_logits = logits.new_empty((self.max_bs, logits.shape[1]))
        out = self._eager_logits[: padded.batch_size]
        out.copy_(logits)
        return out

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # Largest first: the smaller graphs then fit in the memory the largest one left in the
        # shared pool instead of each growing it.
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for bucket in reversed(self.buckets):
            self._graphs[bucket], self._outputs[bucket] = self._capture_one(bucket, pool, stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _capture_one(self, bucket: int, pool: tuple[int, int], stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        with torch.cuda.stream(stream):  # the fills too: the warm-up on this stream reads them
            padded = self.inputs.dummy(bucket)
            self._plan(padded)  # plan() may not run inside a capture; the graph records its buffers
            for _ in range(WARMUP_RUNS):
                self._forward(padded)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the runner is built in a worker thread (asyncio.to_thread); under the
        # default "global" mode an unsafe CUDA call (a cudaMalloc, a sync) made meanwhile by any
        # other thread, e.g. the event loop's, errors and breaks the capture. Only this thread's
        # calls are recorded, so only they need checking.
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            out = self._forward(padded)
        return graph, out
