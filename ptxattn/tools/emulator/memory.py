"""Device memory: a global address space of allocations, and each CTA's shared memory with the
shadow state that the hazard checks read.

Global: device pointers are plain integers handed out by a bump allocator, 256-byte aligned,
with an unmapped guard gap after every allocation, so that an off-by-one access past the end
faults instead of landing in a neighbour. Any access must lie wholly inside one live allocation.

Shared: one window per CTA, addresses 0 .. window. The first RESERVED bytes stand for the
1 KiB that sm_90 keeps per CTA (never addressable by the kernel); static .shared variables
follow, then the .extern (dynamic) array at its declared alignment; accesses past the launch's
dynamic size fault. Shadow arrays, one entry per 4-byte word (every access our kernels make is
4 bytes or wider):
  - async_readers: in-flight asynchronous reads (wgmma operands issued, not retired; TMA
    stores issued, not yet read);
  - tma_pending: TMA loads issued and not yet landed;
  - unfenced: thread id + 1 of a generic-proxy store (st.shared, stmatrix) not yet followed by
    fence.proxy.async in that thread (0: none).
"""

from __future__ import annotations

import bisect

import numpy as np

from .errors import MemoryFault

GLOBAL_BASE = 0x0000_7A00_0000_0000
GLOBAL_ALIGN = 256
GUARD_BYTES = 4096
RESERVED_SHARED = 1024          # sm_90: 1 KiB of system shared memory per CTA
# generic addresses of the parameter space and of each CTA's shared window (cvta)
PARAM_GENERIC_BASE = 0x0000_7C00_0000_0000
SHARED_GENERIC_BASE = 0x0000_7D00_0000_0000
SHARED_GENERIC_SPAN = 1 << 24


class Allocation:
    __slots__ = ("base", "size", "data", "live", "label")

    def __init__(self, base: int, size: int, label: str = ""):
        self.base = base
        self.size = size
        # rounded up to 16 bytes so that any element view works; bounds use `size`. Fresh
        # memory is poisoned: all ones is a NaN in bf16, f16, f32 and f64, so output a kernel
        # leaves unwritten shows up
        self.data = np.full(max(-(-size // 16) * 16, 16), 0xFF, np.uint8)
        self.live = True
        self.label = label

    @property
    def end(self) -> int:
        return self.base + self.size


class GlobalMemory:
    """Allocations keyed by base address; reads and writes check bounds and liveness."""

    def __init__(self):
        self._bases: list[int] = []
        self._allocs: list[Allocation] = []
        self._next = GLOBAL_BASE
        self.bytes_live = 0

    def alloc(self, size: int, label: str = "") -> int:
        size = int(size)
        base = self._next
        self._next = -(-(base + max(size, 1) + GUARD_BYTES) // GLOBAL_ALIGN) * GLOBAL_ALIGN
        a = Allocation(base, size, label)
        self._bases.append(base)
        self._allocs.append(a)
        self.bytes_live += size
        return base

    def free(self, ptr: int) -> None:
        a = self._exact(ptr)
        if a is None:
            raise MemoryFault(f"free of 0x{ptr:x}, which is not the base of a live allocation")
        a.live = False
        self.bytes_live -= a.size
        a.data = np.zeros(1, np.uint8)          # free the bytes; the range stays unmapped

    def _exact(self, ptr: int) -> Allocation | None:
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0 and self._bases[i] == ptr and self._allocs[i].live:
            return self._allocs[i]
        return None

    def find(self, addr: int) -> Allocation | None:
        """The live allocation holding byte `addr`, or None."""
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0:
            return None
        a = self._allocs[i]
        if a.live and a.base <= addr < a.end:
            return a
        return None

    def span(self, addr: int, nbytes: int, what: str = "access") -> tuple[Allocation, int]:
        """(allocation, offset) of [addr, addr + nbytes), which must lie in one allocation."""
        a = self.find(addr)
        if a is None or addr + nbytes > a.end:
            raise MemoryFault(f"{what} of {nbytes} bytes at 0x{addr:x}: "
                              f"{self.describe(addr)}")
        return a, addr - a.base

    def describe(self, addr: int) -> str:
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0:
            return "below every allocation"
        a = self._allocs[i]
        state = "" if a.live else " (freed)"
        if a.base <= addr < a.end and a.live:
            return f"inside allocation 0x{a.base:x}+{a.size}{state}"
        return (f"outside every live allocation (nearest below: 0x{a.base:x}, {a.size} bytes"
                f"{state}, ends {addr - a.end} bytes before this address)")

    # -- host copies (the fake driver's memcpy/memset)
    def write_bytes(self, addr: int, data: bytes | np.ndarray) -> None:
        buf = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) \
            else np.asarray(data).reshape(-1).view(np.uint8)
        a, off = self.span(addr, buf.size, "host write")
        a.data[off:off + buf.size] = buf

    def read_bytes(self, addr: int, nbytes: int) -> np.ndarray:
        a, off = self.span(addr, nbytes, "host read")
        return a.data[off:off + nbytes].copy()

    def fill(self, addr: int, pattern: bytes, count: int) -> None:
        total = len(pattern) * count
        a, off = self.span(addr, total, "memset")
        a.data[off:off + total] = np.tile(np.frombuffer(pattern, np.uint8), count)

    # -- warp accesses: addrs (uint64, one per active lane), each of `size` bytes
    def locate(self, addrs: np.ndarray, size: int, lanes: np.ndarray):
        """(allocation, offsets) when every address lies in one allocation, else
        (None, per-lane list of (allocation, offset)); raises MemoryFault naming the first
        lane at fault (`lanes`: the lane number of each address)."""
        lo = int(addrs.min())
        hi = int(addrs.max())
        a = self.find(lo)
        if a is not None and hi + size <= a.end:
            return a, (addrs - np.uint64(a.base)).astype(np.int64)
        per = []
        for i, x in enumerate(addrs.tolist()):
            b = self.find(x)
            if b is None or x + size > b.end:
                raise MemoryFault(f"{size}-byte global access at 0x{x:x}: {self.describe(x)}",
                                  int(lanes[i]), x)
            per.append((b, x - b.base))
        return None, per


def check_alignment(addrs: np.ndarray, size: int, space: str):
    """Index of the first misaligned address, or None."""
    if size <= 1:
        return None
    bad = (addrs & np.uint64(size - 1)) != 0
    if bad.any():
        return int(np.argmax(bad))
    return None


class SharedMemory:
    """One CTA's shared window: bytes plus the word-granular shadow state (module docstring)."""

    def __init__(self, window: int, dyn_base: int, dyn_size: int):
        self.window = int(window)                   # addressable end: dyn_base + dyn_size
        self.dyn_base = dyn_base
        self.dyn_size = dyn_size
        words = -(-self.window // 16) * 4
        self.data = np.zeros(words * 4, np.uint8)
        # uninitialised shared memory reads as a NaN pattern (bf16 and f32 alike)
        self.data[RESERVED_SHARED:] = 0xFF
        self.async_readers = np.zeros(words, np.int16)
        self.tma_pending = np.zeros(words, np.int16)
        self.unfenced = np.zeros(words, np.int32)

    def check(self, addrs: np.ndarray, size: int) -> int | None:
        """Index of the first address whose access leaves the window, or None."""
        bad = (addrs < RESERVED_SHARED) | (addrs + np.uint64(size) > np.uint64(self.window))
        if bad.any():
            return int(np.argmax(bad))
        return None

    def words_of(self, addrs: np.ndarray, size: int) -> np.ndarray:
        """Word indices touched by accesses of `size` bytes at `addrs` (flat, int64)."""
        first = (addrs >> np.uint64(2)).astype(np.int64)
        n = max(1, -(-size // 4))
        if n == 1:
            return first
        return (first[:, None] + np.arange(n)).reshape(-1)
