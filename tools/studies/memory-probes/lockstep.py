"""Issue 11 item 3 in lockstep: kvbench's host copy against an independent memcpy process,
sample by sample, so the VM's drift over seconds reaches both alike.

One round takes one unit of each, in list order on even rounds and reversed on odd ones:
  probe      the probe's own sampler as the sweep uses it at 256M (one copy per sample),
             median of 10 samples;
  probe10    the same sampler, one sample of 10 copies;
  inproc     kvbench's plain threaded memcpy (kvb_memcpy_threads) on the probe's buffers,
             10 copies;
  malloc     the same plain memcpy on buffers from libc malloc (as memcpy_ref.c has);
  ref        memcpy_ref.c in its own process (serve mode), 10 copies on its own buffers.
Prints every round and, per variant, the median over rounds of its ratio to `ref` in the
same round. Usage (repository root): python lockstep.py THREADS [ROUNDS] [SIZE_BYTES]
"""
from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import sys
from pathlib import Path

from kvbench.memory import Endpoint
from kvbench.native import lib
from kvbench.probes._copy import HostCopier, Pair
from kvbench.units import gbps

HERE = Path(__file__).parent


def busy_threads() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process but the main one."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path("/proc/self/task").iterdir():
        if int(task.name) == os.getpid():
            continue
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        name = (task / "comm").read_text().strip()
        out[f"{name}:{task.name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    threads = int(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 256 << 20
    binary = Path("/tmp/memcpy_ref_lockstep")
    subprocess.run(["cc", "-O2", "-pthread", str(HERE / "memcpy_ref.c"), "-o", str(binary)],
                   check=True)
    ref = subprocess.Popen([str(binary), str(threads), str(size), "serve"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    host = Endpoint("host", 0)
    copier = HostCopier(Pair(host, host), "pageable", size, threads, False)
    so = lib()
    sample = copier.sampler(size)
    sb, db, _ = copier.routes[0]

    def ref_unit() -> float:
        assert ref.stdin is not None and ref.stdout is not None
        ref.stdin.write("x\n")
        ref.stdin.flush()
        return float(ref.stdout.readline())

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    msrc, mdst = libc.malloc(size), libc.malloc(size)
    ctypes.memset(msrc, 1, size)
    ctypes.memset(mdst, 2, size)
    units = {
        "probe": lambda: statistics.median(gbps(size, sample(1)) for _ in range(10)),
        "probe10": lambda: gbps(size, sample(10)),
        "inproc": lambda: gbps(10 * size,
                               so.kvb_memcpy_threads(db.ptr, sb.ptr, size, 10, threads) * 1e-9),
        "malloc": lambda: gbps(10 * size,
                               so.kvb_memcpy_threads(mdst, msrc, size, 10, threads) * 1e-9),
        "ref": ref_unit,
    }
    names = list(units)
    for n in names:  # warm-up round
        units[n]()
    before = busy_threads()
    print("round " + " ".join(f"{n:>8}" for n in names))
    got: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            got[n].append(units[n]())
        print(f"{r:5d} " + " ".join(f"{got[n][-1]:8.3f}" for n in names), flush=True)
    after = busy_threads()
    ref.stdin.close()  # type: ignore[union-attr]
    ref.wait()
    copier.close()
    print(f"# threads {threads}, size {size}, {rounds} rounds, placement {copier.placement}, "
          f"cpus_per_thread {copier.cpus_per_thread}")
    for n in names[:-1]:
        ratios = [a / b for a, b in zip(got[n], got["ref"], strict=True)]
        print(f"# {n}/ref: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
              f"max {max(ratios):.3f}; {sum(x >= 0.9 for x in ratios)} of {rounds} >= 0.9); "
              f"median GB/s {statistics.median(got[n]):.2f} vs ref "
              f"{statistics.median(got['ref']):.2f}")
    spent = {k: round(after.get(k, 0) - before.get(k, 0), 2) for k in after}
    print(f"# CPU s spent by other threads of this process during the rounds: {spent}")


if __name__ == "__main__":
    main()
