"""Issue 11 item 3: does the buffers' layout slow a plain threaded memcpy?

Three layouts, two allocations (a src/dst pair) each, all touched once:
  exact    numa_alloc_onnode(SIZE): a mapping whose length is a multiple of 2 MiB, which
           Linux 6.7+ starts on a 2 MiB boundary (kvbench's HostBuffer before this change);
  +page    numa_alloc_onnode(SIZE + one page): no such boundary (HostBuffer now);
  malloc   libc malloc(SIZE), as an independent C loop gets it.
Each round copies SIZE bytes COPIES times with kvb_memcpy_threads in every pair, in list
order on even rounds and reversed on odd ones; prints each pair's median ratio to the
round's mean. Usage (repository root): python layout.py THREADS [ROUNDS] [COPIES]
"""
from __future__ import annotations

import ctypes
import statistics
import sys

from kvbench.native import lib
from kvbench.topology import libnuma
from kvbench.units import gbps

SIZE = 256 << 20
PAGE = 4096


def main() -> None:
    threads = int(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    copies = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    so, numa, libc = lib(), libnuma(), ctypes.CDLL(None)
    assert numa is not None, "needs libnuma"
    numa.numa_alloc_onnode.restype = libc.malloc.restype = ctypes.c_void_p
    numa.numa_alloc_onnode.argtypes = [ctypes.c_size_t, ctypes.c_int]
    libc.malloc.argtypes = [ctypes.c_size_t]

    def touched(ptr: int) -> int:
        ctypes.memset(ptr, 1, SIZE)
        return ptr

    layouts = {"exact": lambda: numa.numa_alloc_onnode(SIZE, 0),
               "+page": lambda: numa.numa_alloc_onnode(SIZE + PAGE, 0),
               "malloc": lambda: libc.malloc(SIZE)}
    pairs = {f"{name}#{i}": (touched(alloc()), touched(alloc()))
             for i in range(2) for name, alloc in layouts.items()}

    def rate(dst: int, src: int) -> float:
        return gbps(copies * SIZE, so.kvb_memcpy_threads(dst, src, SIZE, copies, threads) * 1e-9)

    names = list(pairs)
    for n in names:  # warm-up
        rate(*pairs[n])
    got: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            got[n].append(rate(*pairs[n]))
    means = [statistics.mean(x) for x in zip(*got.values(), strict=True)]
    print(f"# threads {threads}, {rounds} rounds of {copies} copies of {SIZE} bytes")
    for n in names:
        d, s = pairs[n]
        ratio = [a / b for a, b in zip(got[n], means, strict=True)]
        q = statistics.quantiles(ratio)
        print(f"{n:9s} src%2MiB {s % (2 << 20):7d} dst%2MiB {d % (2 << 20):7d}  "
              f"ratio to round mean: median {statistics.median(ratio):.3f} "
              f"(q1 {q[0]:.3f}, q3 {q[2]:.3f}); median {statistics.median(got[n]):.2f} GB/s")


if __name__ == "__main__":
    main()
