"""Where a prefix cache keeps its entries: the accelerator, a host NUMA node, or a disk.

CXL KV-storage paper section 2: the CXL card is a CPU-less NUMA node; host buffers are
allocated there and copied to the GPU with cudaMemcpyAsync. `host:N` does the same on any
node with memory (local, remote, memory-only), through `kvbench.memory.HostBuffer` (libnuma
placement checked page by page with move_pages, as the bandwidth probe does) and pinned
with cudaHostRegister when the accelerator is CUDA. `accel` keeps entries in accelerator
memory (the paper's PC-GPU); `disk:PATH` writes one file per entry, for comparison.

A tier stores opaque byte payloads (uint8 tensors) under an entry id: `put` copies one in
(one copy, the paper's `save`), `source` gives an entry's bytes to copy from (a view of the
arena; a disk entry is read from its file into host memory first), `drop` frees it. Accelerator
and host tiers carve entries out of one arena of `capacity` bytes allocated when the tier
opens (first fit, freed ranges merged), so a save never allocates memory.

Disk entries are `<id>.kvc` files: a magic line, a JSON header (format version, model,
layers, dtype, KV heads, head dim, chunk size, chunk ids, payload bytes, blake2b checksum)
and the payload. They are written to a temporary name, fsynced and renamed, so a save that
is interrupted never leaves a file under an entry's name; a file whose header does not
match this run (another model, shape, dtype or version) or whose payload fails its
checksum is refused with a one-line error, never loaded. After a write and before each
read the file's pages are dropped from the page cache (posix_fadvise DONTNEED), so a load
reads the device rather than memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbench.errors import KvbenchError, require

if TYPE_CHECKING:
    import torch

MAGIC = b"KVBENCH-PREFIX\n"
FORMAT_VERSION = 1
SUFFIX = ".kvc"
ALIGN = 64  # arena ranges start on 64-byte boundaries


@dataclass(frozen=True)
class TierSpec:
    """A parsed --prefix-cache value: kind 'accel', 'host' (NUMA node `node`) or 'disk'."""

    kind: str
    node: int = -1
    path: str = ""

    def __str__(self) -> str:
        return {"accel": "accel", "host": f"host:{self.node}", "disk": f"disk:{self.path}"
                }[self.kind]


def parse_tier(text: str, root: Path | str = "/") -> TierSpec:
    """'accel', 'host:N' (a NUMA node with memory here) or 'disk:PATH' (a writable folder,
    created if missing); anything else is a one-line error."""
    from kvbench.memory import Endpoint, check_endpoint

    t = text.strip()
    if t == "accel":
        return TierSpec("accel")
    if m := re.fullmatch(r"host:(\d+)", t):
        node = int(m.group(1))
        check_endpoint(Endpoint("host", node), root)  # exists and has memory
        return TierSpec("host", node=node)
    if t.startswith("disk:") and len(t) > 5:
        path = Path(t[5:])
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KvbenchError(f"--prefix-cache {t}: cannot create {path} ({e.strerror})"
                               ) from None
        require(path.is_dir() and os.access(path, os.W_OK | os.X_OK),
                f"--prefix-cache {t}: {path} is not a writable folder")
        return TierSpec("disk", path=str(path))
    raise KvbenchError(f"--prefix-cache '{text}': accel, host:N (a NUMA node) or disk:PATH")


class Arena:
    """First-fit allocation of byte ranges in [0, size); freed neighbours merge."""

    def __init__(self, size: int) -> None:
        self.free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted

    def alloc(self, n: int) -> int | None:
        for i, (off, length) in enumerate(self.free):
            if length >= n:
                self.free[i:i + 1] = [(off + n, length - n)] if length > n else []
                return off
        return None

    def release(self, off: int, n: int) -> None:
        self.free.append((off, n))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for o, length in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((o, length))
        self.free = merged


class MemoryTier:
    """Entries in one uint8 arena tensor: on the accelerator, or a NUMA-placed host buffer.

    `buffer` is the HostBuffer class (a parameter so tests can place it on a fake node)."""

    def __init__(self, spec: TierSpec, capacity: int, accel: torch.device,
                 buffer: Any = None) -> None:
        import torch

        self.spec, self.capacity = spec, capacity
        self.host = None
        if spec.kind == "accel":
            self.arena_t = torch.empty(capacity, dtype=torch.uint8, device=accel)
            self.placement = f"accelerator ({accel.type})"
        else:
            from kvbench.memory import HostBuffer

            self.host = (buffer or HostBuffer)(spec.node, capacity)
            if accel.type == "cuda":
                self.host.register_cuda()
            self.arena_t = self.host.tensor()
            self.placement = self.host.placement
        self.arena = Arena(capacity)
        self.where: dict[str, tuple[int, int]] = {}

    @property
    def pinned(self) -> bool:
        return self.host is not None and self.host.pinned

    @property
    def used(self) -> int:
        return sum(-(-n // ALIGN) * ALIGN for _, n in self.where.values())

    def put(self, key: str, payload: torch.Tensor, header: dict[str, Any]) -> bool:
        """Copy payload (uint8, any device) in; False when no free range is large enough."""
        n = payload.numel()
        off = self.arena.alloc(-(-n // ALIGN) * ALIGN)  # aligned for any dtype view
        if off is None:
            return False
        self.arena_t[off:off + n].copy_(payload)
        self.where[key] = (off, n)
        return True

    def source(self, key: str) -> torch.Tensor:
        """The entry's bytes, a uint8 view of the arena (no copy)."""
        off, n = self.where[key]
        return self.arena_t[off:off + n]

    def drop(self, key: str) -> None:
        off, n = self.where.pop(key)
        self.arena.release(off, -(-n // ALIGN) * ALIGN)

    def close(self) -> None:
        if self.host is not None:
            self.arena_t = None
            self.host.close()


class DiskTier:
    """One file per entry under a folder; see the module docstring for the format."""

    def __init__(self, spec: TierSpec, capacity: int, accel: torch.device) -> None:
        self.spec, self.capacity = spec, capacity
        self.dir = Path(spec.path)
        self.cuda = accel.type == "cuda"
        self.placement = f"files under {self.dir}"
        self.pinned = self.cuda
        self.sizes: dict[str, int] = {}

    @property
    def used(self) -> int:
        return sum(self.sizes.values())

    def file(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def scan(self, expect: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """(entry id, header) of every cache file in the folder, each checked against
        `expect` (model, shapes, dtype, version); a foreign or unreadable one is refused.
        Temporary files of interrupted saves are never entries."""
        out = []
        for f in sorted(self.dir.glob(f"*{SUFFIX}")):
            header, _ = read_header(f)
            wrong = {k: (header.get(k), v) for k, v in expect.items() if header.get(k) != v}
            require(not wrong, f"prefix cache file {f} is foreign to this run ("
                    + ", ".join(f"{k} {a!r} != {b!r}" for k, (a, b) in wrong.items())
                    + "); refused (remove it or use another disk: folder)")
            self.sizes[f.stem] = f.stat().st_size
            out.append((f.stem, header))
        return out

    def put(self, key: str, payload: torch.Tensor, header: dict[str, Any]) -> bool:
        """Write the entry's file atomically; False when it would exceed the capacity."""
        data = payload.cpu().numpy().tobytes()
        if self.used + len(data) > self.capacity:
            return False
        head = json.dumps({**header, "payload_bytes": len(data),
                           "checksum": hashlib.blake2b(data).hexdigest()}).encode()
        tmp = self.dir / f".{key}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC + len(head).to_bytes(8, "little") + head + data)
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, self.file(key))  # atomic: the entry exists whole or not at all
        self.sizes[key] = self.file(key).stat().st_size
        return True

    def source(self, key: str) -> torch.Tensor:
        """The payload read from the file into host memory (pinned on CUDA), after its
        checksum: a corrupt file is refused, never loaded."""
        import torch

        path = self.file(key)
        header, start = read_header(path)
        n = header["payload_bytes"]
        out = torch.empty(n, dtype=torch.uint8, pin_memory=self.cuda)
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            f.seek(start)
            got = f.readinto(memoryview(out.numpy()))
        require(got == n and hashlib.blake2b(out.numpy()).hexdigest() == header["checksum"],
                f"prefix cache file {path} fails its checksum (corrupt); refused")
        return out

    def drop(self, key: str) -> None:
        self.sizes.pop(key, None)
        self.file(key).unlink(missing_ok=True)

    def close(self) -> None:
        """Files stay: a later run with the same disk: folder finds them."""


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, payload offset) of a cache file; one-line error when it is not one."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(MAGIC))
            size = int.from_bytes(f.read(8), "little")
            require(magic == MAGIC and 0 < size < 1 << 24, f"prefix cache file {path} is "
                    "not a kvbench prefix cache file (bad magic); refused")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as e:
        raise KvbenchError(f"prefix cache file {path} is unreadable or corrupt ({e}); "
                           "refused") from None
    require(isinstance(header, dict) and "checksum" in header and "chunk_ids" in header,
            f"prefix cache file {path} has an incomplete header; refused")
    return header, len(MAGIC) + 8 + size


def open_tier(spec: TierSpec, capacity: int, accel: torch.device,
              buffer: Any = None) -> MemoryTier | DiskTier:
    """The tier for spec with `capacity` bytes (allocated now for memory tiers)."""
    if spec.kind == "disk":
        return DiskTier(spec, capacity, accel)
    return MemoryTier(spec, capacity, accel, buffer)
