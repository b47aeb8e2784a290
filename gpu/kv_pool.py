"""Paged KV memory: request rows, a token-slot allocator and the per-layer K/V buffers.

Row 0 and page 0 are reserved: padded graph-batch rows read and write them (gpu/graph_runner.py).
Running out is an explicit `None`, never an overwrite. The Adder owns allocation (rows and
slots); the Executor owns the buffers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from gpu.kv_quant import dequantize_rows, quantize_rows, row_width


class ReqToTokenPool:
    """`table[row, p]`: the KV slot of the row's request's token at position p;
    `[max_requests + 1, context_len]` int32, row 0 the dummy."""

    def __init__(self, max_requests: int, context_len: int, device: str | torch.device = "cpu", record_writes: bool = False):
        if max_requests < 1 or context_len < 1:
            raise ValueError(f"ReqToTokenPool needs max_requests >= 1 and context_len >= 1, got {max_requests}, {context_len}")
        self.max_requests = max_requests
        self.context_len = context_len
        self.table = torch.zeros((max_requests + 1, context_len), dtype=torch.int32, device=device)
        # Pop from the end: lowest rows first, which keeps small tests easy to read.
        self._free_rows: list[int] = list(range(max_requests, 0, -1))
        self._is_free = [False] + [True] * max_requests
        # (rows, positions) of every write since the last `take_writes` when recording: the
        # entries the other tensor-parallel ranks' copies of the table still lack (gpu/tp_batch.py).
        self._recording = record_writes
        self._writes: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._writes_lock = threading.Lock()  # written on the scheduling loop, taken by the forward thread

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row, or None when every row is in use."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._is_free[row] = False
        return row

    def free(self, row: int) -> None:
        if row <= 0 or row > self.max_requests:
            raise ValueError(f"request row {row} is outside 1..{self.max_requests}")
        if self._is_free[row]:
            raise ValueError(f"request row {row} is already free (double free)")
        self._is_free[row] = True
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record `slots` as the KV slots of positions start .. start + len(slots) - 1."""
        end = start + slots.numel()
        if end > self.context_len:
            raise ValueError(f"positions up to {end} exceed the context length {self.context_len}")
        self.table[row, start:end] = slots.to(self.table.dtype)
        if self._recording:
            self._record(torch.full((end - start,), row), torch.arange(start, end))

    def write_at(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Entry (rows[i], positions[i]) becomes slots[i], for every i (a decode step's new tokens)."""
        self.table[rows, positions] = slots.to(self.table.dtype)
        if self._recording:
            self._record(rows, positions)

    def _record(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        # Copies: a caller's index tensor may be a view it changes later (the running positions).
        rows, positions = rows.to("cpu", torch.int64, copy=True), positions.to("cpu", torch.int64, copy=True)
        with self._writes_lock:  # after the write: whoever takes the entry finds its value in place
            self._writes.append((rows, positions))

    def take_writes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, positions) of the entries written since the last call, in write order."""
        with self._writes_lock:
            taken, self._writes = self._writes, []
        if not taken:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty
        return torch.cat([r for r, _ in taken]), torch.cat([p for _, p in taken])

    def slots(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        return self.table[row, start:end]


class TokenSlotAllocator:
    """Allocates KV slots in whole pages of `page_size` slots.

    `size` is the number of usable token slots; it is rounded down to whole pages. Page 0 is
    reserved on top of that (slots 0 .. page_size - 1), so buffers need `size + page_size` slots.
    """

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        num_pages = size // page_size
        if num_pages < 1:
            raise ValueError(f"a KV pool of {size} tokens holds no page of {page_size} tokens")
        self.page_size = page_size
        self.num_pages = num_pages
        self.size = num_pages * page_size
        self.device = device
        self._on_host = torch.device(device).type == "cpu"
        # Host bookkeeping in numpy arrays: taking or returning n pages is one slice, not n Python
        # operations, and a numpy call costs less than a torch call on the scheduling loop.
        self._page_is_free = np.ones(num_pages + 1, dtype=np.bool_)
        self._page_is_free[0] = False
        # A stack of free pages: _free_stack[:_num_free], the next page to hand out last.
        self._free_stack = np.arange(num_pages, 0, -1, dtype=np.int64)
        self._num_free = num_pages

    @property
    def total_slots(self) -> int:
        """Slots a KV buffer must hold, the reserved page included."""
        return (self.num_pages + 1) * self.page_size

    def available_size(self) -> int:
        """Free token slots (whole free pages)."""
        return self._num_free * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for `num_tokens` tokens filling fresh pages from their start, or None if not
        enough are free."""
        if num_tokens < 0:
            raise ValueError(f"cannot allocate {num_tokens} tokens")
        pages_needed = -(-num_tokens // self.page_size)
        if pages_needed > self._num_free:
            return None
        top = self._num_free
        page_ids = self._free_stack[top - pages_needed : top][::-1].copy()  # a copy: the stack moves on
        self._num_free = top - pages_needed
        self._page_is_free[page_ids] = False
        if self.page_size > 1:
            page_ids = (page_ids[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)[:num_tokens]
        slots = torch.from_numpy(page_ids)
        return slots if self._on_host else slots.to(self.device)

    def alloc_extend(self, cur_len: int, last_slot: int | None, num_tokens: int) -> torch.Tensor | None:
        """Slots for `num_tokens` more tokens of a request holding `cur_len`: its partly filled last
        page first (`last_slot` is its token cur_len - 1's), then fresh pages."""
        in_last_page = 0 if cur_len % self.page_size == 0 else self.page_size - cur_len % self.page_size
        in_last_page = min(in_last_page, num_tokens)
        if in_last_page and last_slot is None:
            raise ValueError("alloc_extend needs the request's last slot to continue its partial page")
        fresh = self.alloc(num_tokens - in_last_page)
        if fresh is None:
            return None
        if not in_last_page:
            return fresh
        tail = torch.arange(last_slot + 1, last_slot + 1 + in_last_page, dtype=torch.int64, device=fresh.device)
        return torch.cat([tail, fresh])

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages that hold `slots`. Freeing a page that is already free is refused."""
        if slots.numel() == 0:
            return
        page_ids = _distinct(slots.detach().to("cpu", torch.int64).numpy() // self.page_size)
        if page_ids[0] < 1 or page_ids[-1] > self.num_pages:
            raise ValueError(f"slots outside the pool (pages 1..{self.num_pages}): {page_ids.tolist()}")
        if self._page_is_free[page_ids].any():
            already = page_ids[self._page_is_free[page_ids]].tolist()
            raise ValueError(f"double free of KV pages {already}")
        self._page_is_free[page_ids] = True
        top = self._num_free
        self._free_stack[top : top + len(page_ids)] = page_ids
        self._num_free = top + len(page_ids)

    def reset(self) -> None:
        self._page_is_free[1:] = True
        self._free_stack = np.arange(self.num_pages, 0, -1, dtype=np.int64)
        self._num_free = self.num_pages


def _distinct(values: np.ndarray) -> np.ndarray:
    """`values` sorted, each once: np.unique without its first call's import of numpy.ma (17-20
    ms, which the first request to free a slot after a server started waited for)."""
    ordered = np.sort(values)
    keep = np.ones(len(ordered), dtype=bool)
    keep[1:] = ordered[1:] != ordered[:-1]
    return ordered[keep]


@dataclass(frozen=True, slots=True)
class KVMove:
    """The same slots' KV from the device pool to the host tier's buffers, or back."""

    to_host: bool
    device_slots: torch.Tensor
    host_slots: torch.Tensor


@dataclass(slots=True)
class KVBuffers:
    """K and V for every layer: `[num_slots, num_kv_heads, head_dim]` each in the model's dtype, or
    `[num_slots, num_kv_heads, head_dim + 4]` int8 rows with their scales (gpu/kv_quant.py)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(
        cls, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str | torch.device,
        int8_rows: bool = False,
    ) -> KVBuffers:
        shape = (num_slots, num_kv_heads, row_width(head_dim) if int8_rows else head_dim)
        dtype = torch.int8 if int8_rows else dtype
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
        )

    @property
    def int8_rows(self) -> bool:
        return self.k[0].dtype == torch.int8

    def host_buffers(self, num_slots: int) -> KVBuffers:
        """Host memory for `num_slots` of these buffers' tokens (the host tier's), pinned when
        these are on CUDA so that copies overlap the device's work."""
        _, heads, dim = self.k[0].shape
        host = KVBuffers.allocate(len(self.k), num_slots, heads, dim, self.k[0].dtype, "cpu")
        if self.k[0].device.type == "cuda":
            host = KVBuffers([t.pin_memory() for t in host.k], [t.pin_memory() for t in host.v])
        return host

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.int8_rows:
            k, v = quantize_rows(k), quantize_rows(v)
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows gathered from these pools as `dtype` values (int8 rows dequantized)."""
        return dequantize_rows(rows, dtype) if self.int8_rows else rows

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def move(self, moves: list[KVMove], host: KVBuffers) -> None:
        """Copy between these (the device pool) and the host tier's buffers, in order."""
        for m in moves:
            if m.to_host:
                self.copy_to(m.device_slots, host, m.host_slots)
            else:
                host.copy_to(m.host_slots, self, m.device_slots)

    def copy_to(self, slots: torch.Tensor, other: KVBuffers, other_slots: torch.Tensor, layers: range | None = None) -> None:
        """K and V of `slots` in every layer (or `layers`) into `other_slots` of `other` (another
        device: the host tier's buffers, or back)."""
        self.copy_planned(self.plan_copy(slots, other, other_slots), other, layers)

    def plan_copy(self, slots: torch.Tensor, other: KVBuffers, other_slots: torch.Tensor) -> SlotCopy:
        """What `copy_to` works out once for every layer it copies."""
        src, dst = slots.to(self.k[0].device), other_slots.to(other.k[0].device)
        # Only a copy onto the device may be asynchronous: one to the host is read at once.
        to_device = other.k[0].device.type != "cpu"
        # A run of slots (a host-tier block) is read as a view: from pinned memory that copy is
        # asynchronous, where gathering the rows first would make a pageable copy the host waits for.
        return SlotCopy(src, dst, _run_start(src) if to_device else None, to_device)

    def copy_planned(self, plan: SlotCopy, other: KVBuffers, layers: range | None = None) -> None:
        src, run = plan.src, plan.run
        for layer in layers if layers is not None else range(len(self.k)):
            for mine, theirs in ((self.k, other.k), (self.v, other.v)):
                rows = mine[layer][run : run + src.numel()] if run is not None else mine[layer][src]
                theirs[layer][plan.dst] = rows.to(theirs[layer].device, non_blocking=plan.to_device)


@dataclass(frozen=True, slots=True)
class SlotCopy:
    """A copy between two pools' slots, worked out once (`KVBuffers.plan_copy`)."""

    src: torch.Tensor  # on the source's device
    dst: torch.Tensor  # on the destination's device
    run: int | None  # the first source slot when they are consecutive (read as a view)
    to_device: bool  # onto the device: may be asynchronous


def _run_start(slots: torch.Tensor) -> int | None:
    """The first slot when `slots` are consecutive, else None."""
    first = int(slots[0]) if slots.numel() else 0
    return first if bool(torch.equal(slots, torch.arange(first, first + slots.numel(), dtype=slots.dtype))) else None


class LayerLoads:
    """Host-tier loads into the device pool for one forward, made layer by layer: the forward
    calls `ready(layer)` before each layer. On CUDA every layer's copies are issued at once on a
    side stream, each followed by an event, and `ready` makes the forward stream wait for that
    layer's event: the loads of later layers overlap the compute of earlier ones. On a CPU (no copy
    engine to overlap with) `ready` copies the layers up to that one, on the forward's thread."""

    def __init__(self, moves: list[KVMove], host: KVBuffers, device: KVBuffers, side: torch.cuda.Stream | None = None):
        assert all(not m.to_host for m in moves), "only loads to the device are made layer by layer"
        self.moves, self.host, self.device = moves, host, device
        # Worked out once: each layer's copy would otherwise move the slots to the device and test
        # them for a run again (a wait for the host on CUDA).
        self._plans = [host.plan_copy(m.host_slots, device, m.device_slots) for m in moves]
        self.num_layers = len(device.k)
        self._copied = 0  # layers copied (a CPU)
        self._events: list[torch.cuda.Event] = []
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(side.device))  # after the step's earlier copies
            with torch.cuda.stream(side):
                for layer in range(self.num_layers):
                    self._copy(range(layer, layer + 1))
                    event = torch.cuda.Event()
                    event.record(side)
                    self._events.append(event)

    def ready(self, layer: int) -> None:
        if self._events:
            torch.cuda.current_stream(self.device.k[0].device).wait_event(self._events[layer])
        elif layer >= self._copied:
            self._copy(range(self._copied, layer + 1))
            self._copied = layer + 1

    def finish(self) -> None:
        """Every layer ready (for a forward that does not go layer by layer)."""
        self.ready(self.num_layers - 1)

    def _copy(self, layers: range) -> None:
        for plan in self._plans:
            self.host.copy_planned(plan, self.device, layers)
