"""Host values on their way to the device, on a CPU (the CUDA side: tests/test_cuda.py)."""

from __future__ import annotations

import torch

from gpu.cuda_streams import host_to_device
from gpu.forward_batch import ForwardBatch


def test_host_to_device_on_a_cpu_returns_equal_values() -> None:
    for t in (torch.tensor([[3, -1], [7, 1 << 40]]), torch.tensor([0.25, -2.0]), torch.empty(0, dtype=torch.int64)):
        out = host_to_device(t, torch.device("cpu"))
        assert out.device.type == "cpu" and out.dtype == t.dtype and torch.equal(out, t)


def test_last_token_index_points_at_each_request_last_new_token() -> None:
    batch = ForwardBatch.build([[1, 2, 3], [4], [5, 6]], [1, 2, 3], [0, 5, 0], torch.arange(6))
    index = batch.last_token_index()
    assert index.dtype == torch.int64 and index.tolist() == [2, 3, 5]
    assert batch.input_ids[index].tolist() == [3, 4, 6]
