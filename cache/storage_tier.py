"""`StorageTier`: host-tier blocks kept in files, found again after a restart (SGLang's HiCache L3,
`--hicache-storage-backend file`).

A block is one file named by its chain key (cache/host_tier.py's digest of the block and every
block before it, and the cache namespace), in a directory of its own per model identity (the
model's files, dtype, KV layout and block size: `identity`), so another model never reads it.
A file holds a header (the layout), the block's token ids (compared on a read, so a digest
collision is a miss), its K and V for every layer, and a checksum of all that: a truncated or
corrupt file is a miss, never served, and is removed.

With a capacity (`capacity_bytes`, SGLang's file backend's `capacity_gb`) the directory's block
files stay within it: before a write, the least recently used files go (a read hit or a write
makes a file the most recent; at startup the files found are ordered by modification time, which
a hit refreshes, and the oldest go if they are over the capacity). A file removed is a miss like
any other.

Three parts, three users, each on its own thread:

- writes: the Executor, after a host copy that carries `persist`, gathers the block from the
  host buffers and hands it to `write` (a thread of the tier's; at most `MAX_PENDING_WRITES`
  queued, later ones are dropped: storage is a cache, the step never waits for the disk);
- prefetch: the Policy, when a request is queued, starts reading the blocks that continue its
  device match (`prefetch`, on a second thread); with `wait_complete` or `timeout` it holds the
  request until `Prefetch.may_end` says so, with `best_effort` it does not hold it;
- adoption: the Adder's first try to admit the request ends the prefetch: `KVLedger.match` makes
  room, hands what was read to the host tier (`HostTier.adopt`) and loads it into device pages
  as any host hit, so storage -> host -> device all happen before the step that reads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from cache.host_tier import chain_digests
from cache.keys import encode_tokens

log = logging.getLogger(__name__)

PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
PREFETCH_POLICIES: tuple[PrefetchPolicy, ...] = ("best_effort", "wait_complete", "timeout")
MAX_PENDING_WRITES = 1024  # blocks queued for the disk at most
TIMEOUT_PER_KI_TOKEN_S = 0.25  # SGLang's prefetch_timeout_per_ki_token default

_MAGIC = b"ASKVBLK1"
_HEADER = struct.Struct("<8sIIII16sQ")  # magic, tokens, layers, kv heads, head dim, dtype, payload bytes
_CHECKSUM_BYTES = 32


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one token's KV is: the payload of a block file is [2 x num_layers, tokens, heads, dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def block_shape(self, block_tokens: int) -> tuple[int, int, int, int]:
        return (2 * self.num_layers, block_tokens, self.num_kv_heads, self.head_dim)

    def dtype_name(self) -> bytes:
        return str(self.dtype).removeprefix("torch.").encode()


@dataclass(slots=True)
class StorageStats:
    """Written by the tier's threads (each counter by one thread; `dropped_writes` under the
    tier's lock), read by the Adder's stats."""

    written_blocks: int = 0
    written_bytes: int = 0
    write_s: float = 0.0
    dropped_writes: int = 0  # the queue was full, or the disk refused
    read_blocks: int = 0
    read_bytes: int = 0
    read_s: float = 0.0
    corrupt_blocks: int = 0  # failed the checksum or the layout: removed
    evicted_blocks: int = 0  # removed to stay within the capacity


@dataclass(slots=True)
class Prefetch:
    """One request's read of consecutive blocks (`keys`, each block's `tokens`) from storage. The
    reader thread appends to `blocks` (a read stops at the first miss); the Adder takes what is
    there."""

    keys: list[bytes]
    tokens: list[bytes]
    deadline: float  # monotonic; the `timeout` policy lets the request go then
    blocks: list[torch.Tensor] = field(default_factory=list)
    cancelled: bool = False
    future: Future[None] | None = None

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def may_end(self, policy: PrefetchPolicy, now: float) -> bool:
        """SGLang's `can_terminate_prefetch`: best_effort at once, wait_complete once read,
        timeout once read or past the deadline."""
        if policy == "best_effort" or self.done():
            return True
        return policy == "timeout" and now >= self.deadline

    def take(self) -> list[torch.Tensor]:
        """End the read (the thread stops before its next block) and return the blocks read."""
        self.cancelled = True
        return list(self.blocks)


class StorageTier:
    """The block files of one model identity under `root`, and the threads that write and read them."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        identity: dict[str, Any],
        layout: KVLayout,
        block_tokens: int,
        prefetch_policy: PrefetchPolicy = "best_effort",
        prefetch_timeout_s: float = 1.0,
        capacity_bytes: int | None = None,
    ) -> None:
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"hicache_storage_prefetch_policy {prefetch_policy!r} is unknown; choose one of {', '.join(PREFETCH_POLICIES)}")
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"the storage tier's capacity must be positive, got {capacity_bytes} bytes")
        self.layout = layout
        self.block_tokens = block_tokens
        self.prefetch_policy: PrefetchPolicy = prefetch_policy
        self.prefetch_timeout_s = prefetch_timeout_s
        manifest = {**identity, "layout": [layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype_name().decode()], "block_tokens": block_tokens, "format": _MAGIC.decode()}
        text = json.dumps(manifest, sort_keys=True)
        self.dir = Path(root) / hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.dir / "manifest.json", text.encode())  # for people: which model this is
        self.stats = StorageStats()
        self._shape = layout.block_shape(block_tokens)
        self._payload_bytes = math.prod(self._shape) * torch.empty((), dtype=layout.dtype).element_size()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="actorserve-storage-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="actorserve-storage-read")
        self._lock = threading.Lock()  # orders `write` against `close`; guards `_files`
        self._closed = False
        self._pending_writes = 0
        self.capacity_bytes = capacity_bytes
        self._files = _block_files(self.dir) if capacity_bytes is not None else OrderedDict()  # name -> bytes, least recent first
        self._file_bytes = sum(self._files.values())
        self._make_room(0)  # a capacity lowered since the files were written
        self._block_read_s = 0.0  # a modelled disk's time per block (`pace_reads`); the reader thread's
        self._disk_free_at = 0.0  # monotonic: when the modelled disk has finished the blocks asked of it

    def path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.kv"

    # -- writes (the Executor's worker thread submits, the writer thread writes)

    def write(self, key: bytes, tokens: bytes, kv: torch.Tensor) -> None:
        """Queue a block for the disk: `kv` is [2 x layers, block, heads, dim], a copy the caller
        no longer touches."""
        with self._lock:
            if self._closed or self._pending_writes >= MAX_PENDING_WRITES:
                self.stats.dropped_writes += 1
                return
            self._pending_writes += 1
            self._writer.submit(self._write_file, key, tokens, kv)

    def _write_file(self, key: bytes, tokens: bytes, kv: torch.Tensor) -> None:
        start, failed = time.perf_counter(), False
        try:
            path = self.path(key)
            if not path.exists():  # written before (this run or an earlier one)
                payload = kv.contiguous().view(torch.uint8).numpy()
                header = _HEADER.pack(_MAGIC, len(tokens) // 4, self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim, self.layout.dtype_name(), payload.nbytes)
                size = len(header) + len(tokens) + payload.nbytes + _CHECKSUM_BYTES
                if not self._make_room(size):
                    failed = True  # larger than the whole capacity
                    return
                digest = hashlib.blake2b(header, digest_size=_CHECKSUM_BYTES)
                digest.update(tokens)
                digest.update(payload.data)
                _write_atomic(path, header, tokens, payload.data, digest.digest())
                self._track(path.name, size)
                self.stats.written_blocks += 1
                self.stats.written_bytes += size
            else:
                self._touch(path)
        except OSError as error:  # a full or read-only disk costs hits, never the engine
            failed = True
            self._forget(self.path(key).name)
            log.warning("storage tier: writing %s failed: %s", key.hex(), error)
        finally:
            self.stats.write_s += time.perf_counter() - start
            with self._lock:
                self._pending_writes -= 1
                self.stats.dropped_writes += failed

    # -- reads (the Policy starts a prefetch, the reader thread reads)

    def prefetch(self, token_ids: Sequence[int], extra_key: str | None, matched: int) -> Prefetch | None:
        """Start reading the blocks of `token_ids` (the request's match key) from the one that
        holds token `matched` (its device match ends there: the host tier continues a match from
        that block) on; None when no whole block is left."""
        b = self.block_tokens
        first, last = matched // b, len(token_ids) // b
        if last <= first:
            return None
        keys = chain_digests(token_ids, extra_key, b, last)[first:]
        encoded = encode_tokens(token_ids[first * b : last * b])
        tokens = [encoded[i * b * 4 : (i + 1) * b * 4] for i in range(last - first)]
        timeout = self.prefetch_timeout_s + TIMEOUT_PER_KI_TOKEN_S * (last - first) * b / 1024
        prefetch = Prefetch(keys, tokens, deadline=time.monotonic() + timeout)
        with self._lock:
            if self._closed:
                return None
            prefetch.future = self._reader.submit(self._read_blocks, prefetch)
        return prefetch

    def pace_reads(self, block_s: float) -> None:
        """From now on a prefetch's blocks come no faster than one per `block_s` seconds, one block
        after another as one disk reads them: a benchmark's modelled disk under the micro model's
        small files (bench/trace_serving.py). Call before the first prefetch."""
        self._block_read_s = block_s

    def _read_blocks(self, prefetch: Prefetch) -> None:
        for key, tokens in zip(prefetch.keys, prefetch.tokens):
            if prefetch.cancelled:
                return
            block = self.read(key, tokens)
            if block is None:
                return
            self._wait_for_modelled_disk()
            prefetch.blocks.append(block)

    def _wait_for_modelled_disk(self) -> None:
        if self._block_read_s <= 0:
            return
        now = time.monotonic()
        self._disk_free_at = max(self._disk_free_at, now) + self._block_read_s
        time.sleep(self._disk_free_at - now)

    def read(self, key: bytes, tokens: bytes) -> torch.Tensor | None:
        """The block's KV if its file is whole and holds these tokens; a file that fails the
        checksum or the layout is removed."""
        start = time.perf_counter()
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:  # not there (the usual miss), or unreadable
            return None
        block = self._parse(data, tokens)
        if block is None:
            self.stats.corrupt_blocks += 1
            log.warning("storage tier: %s is corrupt or truncated; removed", path.name)
            path.unlink(missing_ok=True)
            self._forget(path.name)
        elif block.numel():
            self.stats.read_blocks += 1
            self.stats.read_bytes += len(data)
            self._touch(path)
        self.stats.read_s += time.perf_counter() - start
        return block if block is not None and block.numel() else None

    def _parse(self, data: bytes, tokens: bytes) -> torch.Tensor | None:
        """None: corrupt; an empty tensor: a whole file of other tokens (a digest collision)."""
        expected = _HEADER.size + len(tokens) + self._payload_bytes + _CHECKSUM_BYTES
        if len(data) != expected:
            return None
        body, checksum = data[:-_CHECKSUM_BYTES], data[-_CHECKSUM_BYTES:]
        if hashlib.blake2b(body, digest_size=_CHECKSUM_BYTES).digest() != checksum:
            return None
        header = _HEADER.unpack_from(body)
        layout = (_MAGIC, len(tokens) // 4, self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim, self.layout.dtype_name().ljust(16, b"\0"), self._payload_bytes)
        if header != layout:
            return None
        if body[_HEADER.size : _HEADER.size + len(tokens)] != tokens:
            return torch.empty(0)
        payload = bytearray(body[_HEADER.size + len(tokens) :])
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.layout.dtype).view(self._shape)

    # -- the capacity (the writer and the reader thread both use it, under the lock)

    def stored_bytes(self) -> int:
        """Bytes of the block files this tier keeps within its capacity (0 without one)."""
        with self._lock:
            return self._file_bytes

    def _make_room(self, size: int) -> bool:
        """Remove the least recently used files until `size` more bytes fit; False if they never can."""
        if self.capacity_bytes is None:
            return True
        if size > self.capacity_bytes:
            return False
        with self._lock:
            while self._files and self._file_bytes + size > self.capacity_bytes:
                name, freed = self._files.popitem(last=False)
                self._file_bytes -= freed
                (self.dir / name).unlink(missing_ok=True)
                self.stats.evicted_blocks += 1
        return True

    def _track(self, name: str, size: int) -> None:
        if self.capacity_bytes is None:
            return
        with self._lock:
            self._file_bytes += size - self._files.pop(name, 0)
            self._files[name] = size

    def _touch(self, path: Path) -> None:
        """A hit: the file becomes the most recently used, here and (its mtime) for a restart."""
        if self.capacity_bytes is None:
            return
        with self._lock:
            if path.name not in self._files:
                return  # removed meanwhile, or written by another engine on the directory
            self._files.move_to_end(path.name)
        try:
            os.utime(path)
        except OSError:  # removed since: the order here is what counts
            pass

    def _forget(self, name: str) -> None:
        with self._lock:
            self._file_bytes -= self._files.pop(name, 0)

    def clear(self) -> int:
        """Remove every block file of this model identity (SGLang's
        /clear_hicache_storage_backend); returns how many. A write queued before the call may
        still land after it."""
        with self._lock:
            names = list(_block_files(self.dir))
            for name in names:
                (self.dir / name).unlink(missing_ok=True)
            self._files.clear()
            self._file_bytes = 0
        return len(names)

    def close(self) -> None:
        """Finish the queued writes (an engine started next on this directory finds them) and
        stop the prefetches."""
        with self._lock:
            self._closed = True
        self._reader.shutdown(wait=False, cancel_futures=True)
        self._writer.shutdown(wait=True)


def _block_files(directory: Path) -> OrderedDict[str, int]:
    """The block files already in `directory`, least recently modified first, with their sizes."""
    found = []
    for entry in os.scandir(directory):
        if entry.name.endswith(".kv") and not entry.name.startswith("."):
            stat = entry.stat()
            found.append((stat.st_mtime_ns, entry.name, stat.st_size))
    return OrderedDict((name, size) for _, name, size in sorted(found))


def _write_atomic(path: Path, *parts: bytes | memoryview) -> None:
    """Write to a temporary name and rename: a reader sees the whole file or none."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        for part in parts:
            f.write(part)
    os.replace(tmp, path)
