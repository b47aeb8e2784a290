"""Each step's batch, from rank 0 (the scheduler's rank) to the other tensor-parallel ranks.

Before each forward rank 0 broadcasts the `ForwardBatch` and the request-to-token table entries
written since the last step. Each rank keeps its own copy of the table and of the KV pool for its
heads; slot numbers are the same on every rank, so one allocator on rank 0 serves them all.

Under overlap the scheduler runs ahead of the device, so a batch's own slots may have been sent
with an earlier batch and a later rewrite of them with this one: sending the logged entries in
write order, never re-deriving them from `out_cache_loc`, keeps every rank's table equal to rank 0's.

With a host tier (HiCache L2), the step's KV moves between the device pool and host memory go
first: every rank moves the same slots of its own heads between its own pool and host buffers.

Wire format: two broadcasts per message of int64 tensors on the group's device (so under NCCL the
token ids never leave the GPU): a fixed header, then one packed payload.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.cuda_streams import host_to_device
from gpu.forward_batch import ForwardBatch
from gpu.kv_pool import KVMove, ReqToTokenPool
from gpu.tensor_parallel import TPGroup
from runtime.forward_mode import ForwardMode

_HEADER = 7  # kind, batch size, tokens, logit indices (-1: none), all-logits flag, table entries, mode
_STOP, _FORWARD, _MOVES = 0, 1, 2  # a _MOVES header: kind, moves, slots moved, host slots, 0, 0, 0


@dataclass(frozen=True, slots=True)
class HostMoves:
    """A step's KV moves to and from the host tier, whose buffers hold `host_slots` tokens."""

    moves: list[KVMove]
    host_slots: int


@dataclass(slots=True)
class BatchChannel:
    """Rank 0 `send`s each batch; every other rank `receive`s it (None: stop)."""

    tp: TPGroup
    table: ReqToTokenPool
    device: torch.device

    def send(self, batch: ForwardBatch) -> None:
        rows, positions = self.table.take_writes()
        # The entries as they are now: a later write to the same entry is taken again next step.
        values = self.table.table[host_to_device(rows, self.device), host_to_device(positions, self.device)]
        logit_index = batch.logit_index
        header = [
            _FORWARD, batch.batch_size, batch.num_tokens, -1 if logit_index is None else logit_index.numel(),
            int(batch.return_all_logits), rows.numel(), int(batch.mode),
        ]
        host = torch.cat([torch.tensor([*batch.prefix_lens, *batch.extend_lens], dtype=torch.int64), rows, positions])
        parts = [batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_rows, host_to_device(host, self.device), values]
        if logit_index is not None:
            parts.append(logit_index)
        self.tp.broadcast_header(host_to_device(torch.tensor(header, dtype=torch.int64), self.device))
        self.tp.broadcast(torch.cat([p.to(self.device, torch.int64) for p in parts]))

    def send_moves(self, moves: HostMoves) -> None:
        counts = [m.device_slots.numel() for m in moves.moves]
        header = [_MOVES, len(counts), sum(counts), moves.host_slots, 0, 0, 0]
        flags = torch.tensor([[int(m.to_host), n] for m, n in zip(moves.moves, counts)], dtype=torch.int64).flatten()
        slots = [s.to("cpu", torch.int64) for m in moves.moves for s in (m.device_slots, m.host_slots)]
        self.tp.broadcast_header(host_to_device(torch.tensor(header, dtype=torch.int64), self.device))
        self.tp.broadcast(host_to_device(torch.cat([flags, *slots]), self.device))

    def send_stop(self) -> None:
        self.tp.broadcast_header(host_to_device(torch.tensor([_STOP] + [0] * (_HEADER - 1), dtype=torch.int64), self.device))

    def receive(self) -> ForwardBatch | HostMoves | None:
        header = self.tp.broadcast_header(torch.empty(_HEADER, dtype=torch.int64, device=self.device)).tolist()
        kind, size, tokens, num_logits, all_logits, entries, mode = header
        if kind == _STOP:
            return None
        if kind == _MOVES:
            return self._receive_moves(num_moves=size, slots=tokens, host_slots=num_logits)
        sizes = [tokens, tokens, tokens, size, 2 * size, entries, entries, entries, max(num_logits, 0)]
        payload = self.tp.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=self.device))
        input_ids, positions, out_cache_loc, req_rows, lens, rows, table_positions, values, logit_index = payload.split(sizes)
        lens_list = lens.tolist()
        self.table.table[rows, table_positions] = values.to(self.table.table.dtype)
        return ForwardBatch(
            mode=ForwardMode(mode), input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc, req_rows=req_rows,
            prefix_lens=lens_list[:size], extend_lens=lens_list[size:], return_all_logits=bool(all_logits),
            logit_index=logit_index if num_logits >= 0 else None,
        )

    def _receive_moves(self, num_moves: int, slots: int, host_slots: int) -> HostMoves:
        payload = self.tp.broadcast(torch.empty(2 * num_moves + 2 * slots, dtype=torch.int64, device=self.device)).cpu()
        flags, rest = payload[: 2 * num_moves].view(-1, 2).tolist(), payload[2 * num_moves :]
        moves, at = [], 0
        for to_host, n in flags:
            moves.append(KVMove(bool(to_host), rest[at : at + n], rest[at + n : at + 2 * n]))
            at += 2 * n
        return HostMoves(moves, host_slots)
