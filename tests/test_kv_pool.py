import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu.kv_pool import KVBuffers, ReqToTokenPool, TokenSlotAllocator

ROOT = Path(__file__).resolve().parent.parent


def test_page_aligned_allocation_and_reserved_page():
    alloc = TokenSlotAllocator(64, page_size=4)
    slots = alloc.alloc(6)
    assert slots.tolist()[:4] == list(range(slots[0], slots[0] + 4))
    assert int(slots[0]) % 4 == 0 and int(slots[4]) % 4 == 0  # each page filled from its start
    assert int(slots.min()) >= 4  # page 0 (slots 0..3) is never handed out
    assert alloc.available_size() == 64 - 8  # two whole pages taken
    assert alloc.total_slots == 68


def test_alloc_extend_fills_the_partial_page_first():
    alloc = TokenSlotAllocator(64, page_size=4)
    first = alloc.alloc(5)  # one full page + 1 slot of a second page
    more = alloc.alloc_extend(5, int(first[-1]), 6)
    assert more[:3].tolist() == [int(first[-1]) + 1, int(first[-1]) + 2, int(first[-1]) + 3]
    assert int(more[3]) % 4 == 0
    assert alloc.available_size() == 64 - 12
    with pytest.raises(ValueError, match="last slot"):
        alloc.alloc_extend(5, None, 2)


def test_exhaustion_is_an_explicit_none():
    alloc = TokenSlotAllocator(8, page_size=2)
    assert alloc.alloc(8) is not None
    assert alloc.alloc(1) is None
    assert alloc.available_size() == 0


def test_free_returns_pages_and_refuses_double_free():
    alloc = TokenSlotAllocator(16, page_size=4)
    slots = alloc.alloc(7)
    alloc.free(slots)
    assert alloc.available_size() == 16
    with pytest.raises(ValueError, match="double free"):
        alloc.free(slots)
    with pytest.raises(ValueError, match="outside the pool"):
        alloc.free(torch.tensor([0]))


def test_no_slot_is_handed_out_twice():
    alloc = TokenSlotAllocator(40, page_size=1)
    seen = torch.cat([alloc.alloc(10) for _ in range(4)])
    assert len(set(seen.tolist())) == 40
    assert alloc.alloc(1) is None


def test_req_rows():
    pool = ReqToTokenPool(max_requests=2, context_len=8)
    a, b = pool.alloc(), pool.alloc()
    assert {a, b} == {1, 2} and pool.alloc() is None
    pool.write(a, 2, torch.tensor([7, 8, 9]))
    assert pool.slots(a, 5).tolist() == [0, 0, 7, 8, 9]
    with pytest.raises(ValueError, match="context length"):
        pool.write(a, 6, torch.tensor([1, 2, 3]))
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a)
    with pytest.raises(ValueError, match="outside"):
        pool.free(0)


def test_kv_buffers_write_by_slot():
    kv = KVBuffers.allocate(num_layers=2, num_slots=10, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    k = torch.randn(3, 2, 4)
    kv.write(1, torch.tensor([2, 5, 7]), k, -k)
    assert torch.equal(kv.k[1][5], k[1]) and torch.equal(kv.v[1][7], -k[2])
    assert kv.k[0].abs().sum() == 0
    assert kv.bytes() == 2 * 2 * 10 * 2 * 4 * 4


def test_free_takes_each_page_once_in_any_order():
    alloc = TokenSlotAllocator(32, page_size=4)
    slots = alloc.alloc(13)  # four pages, the last partly used
    shuffled = slots[torch.randperm(len(slots), generator=torch.Generator().manual_seed(0))]
    alloc.free(shuffled)
    assert alloc.available_size() == 32
    again = torch.cat([alloc.alloc(4) for _ in range(8)])
    assert sorted(again.tolist()) == list(range(4, 36))  # every page back exactly once (page 0 reserved)


def test_free_does_not_import_numpy_ma():
    # np.unique's first call imports numpy.ma (17-20 ms): the first request after a server start
    # that freed a KV slot (a repeated prompt's recomputed last token) waited for it.
    code = (
        "import sys, torch\n"
        "from gpu.kv_pool import TokenSlotAllocator\n"
        "alloc = TokenSlotAllocator(16, page_size=2)\n"
        "alloc.free(alloc.alloc(5))\n"
        "assert alloc.available_size() == 16\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
