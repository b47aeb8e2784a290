"""The device-side description of one forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu.cuda_streams import host_to_device
from gpu.kv_pool import LayerLoads
from runtime.forward_mode import ForwardMode


@dataclass(slots=True)
class ForwardBatch:
    """Requests in one forward pass, their new tokens packed request after request.

    Request i owns row `req_rows[i]` of the request-to-token table; it has `prefix_lens[i]` tokens
    whose KV is already in the pool and `extend_lens[i]` new tokens at positions
    prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1, whose KV goes to `out_cache_loc`.
    The table row must already hold the slots of all prefix_lens[i] + extend_lens[i] positions.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64 KV slots of the new tokens
    req_rows: torch.Tensor  # [batch] int64
    prefix_lens: list[int]
    extend_lens: list[int]
    return_all_logits: bool = False  # logits for every new token, not only each request's last
    # Packed token indices to compute logits for, in this order (overrides the two above).
    logit_index: torch.Tensor | None = None
    # Host-tier loads the forward makes ready layer by layer, before each layer runs.
    layer_loads: LayerLoads | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @classmethod
    def build(
        cls,
        input_ids: Sequence[Sequence[int]],
        req_rows: Sequence[int],
        prefix_lens: Sequence[int],
        out_cache_loc: torch.Tensor,
        device: torch.device | str = "cpu",
        return_all_logits: bool = False,
    ) -> ForwardBatch:
        """A batch from per-request new token ids; the mode follows from the extend lengths."""
        extend_lens = [len(ids) for ids in input_ids]
        if any(n < 1 for n in extend_lens):
            raise ValueError("every request in a batch needs at least one new token")
        decoding = [n == 1 and p > 0 for p, n in zip(prefix_lens, extend_lens)]
        mode = ForwardMode.DECODE if all(decoding) else ForwardMode.MIXED if any(decoding) else ForwardMode.EXTEND
        flat_ids = [t for ids in input_ids for t in ids]
        positions = [p + j for p, n in zip(prefix_lens, extend_lens) for j in range(n)]
        return cls(
            mode=mode,
            input_ids=torch.tensor(flat_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            req_rows=torch.tensor(list(req_rows), dtype=torch.int64, device=device),
            prefix_lens=list(prefix_lens),
            extend_lens=extend_lens,
            return_all_logits=return_all_logits,
        )

    def last_token_index(self) -> torch.Tensor:
        """Index into the packed tokens of each request's last new token."""
        ends = torch.tensor(self.extend_lens, dtype=torch.int64).cumsum(0) - 1
        # Not .to(device): from pageable memory that copy synchronizes the (forward) stream.
        return host_to_device(ends, self.input_ids.device)
