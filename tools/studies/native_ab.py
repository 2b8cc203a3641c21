"""Two builds of the native attention kernel timed against each other, call by call.

On the 2-core VM a run's speed drifts +-25% within seconds, so two builds timed in turn, run
after run, cannot show a 10% change. This loads both libraries into one process and times
kvb_attn of A and of B alternately (order swapped every round) on the same tensors; it
prints each build's median KV-read GB/s and the median per-round speed ratio B/A.
Usage (repository root):
  python tools/studies/native_ab.py A.so B.so HQ HKV D TOKENS fp32|bf16 [SECONDS]
Build a variant with the flags of setup.py, e.g.
  gcc -DNDEBUG -fwrapv -O2 -std=c11 -pthread -fno-strict-aliasing -fopenmp -fPIC -shared \
      probes/*.c -o /tmp/b.so
"""
from __future__ import annotations

import ctypes
import statistics
import sys
import time

import torch

import kvbench.native  # noqa: F401  (loads torch's OpenMP runtime first, as the kernel needs)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    paths, (hq, hkv, d, n), dtype = sys.argv[1:3], map(int, sys.argv[3:7]), DTYPES[sys.argv[7]]
    seconds = float(sys.argv[8]) if len(sys.argv) > 8 else 3.0
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, t, d).to(dtype) for h, t in ((hq, 1), (hkv, n), (hkv, n)))
    outs = [torch.empty_like(q) for _ in paths]
    lses = [torch.empty(1, hq, 1) for _ in paths]
    ks = (ctypes.c_int64 * 3)(*k.stride()[:3])
    vs = (ctypes.c_int64 * 3)(*v.stride()[:3])
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    libs = [ctypes.CDLL(p) for p in paths]
    for so in libs:
        so.kvb_attn.restype = ctypes.c_int
        so.kvb_attn.argtypes = [ctypes.c_int, vp, vp, vp, vp, vp, i64, i64, i64, i64, i64, i64,
                                vp, vp, vp, vp, i64, ctypes.c_float, ctypes.c_int, i64, i64,
                                ctypes.c_int]

    def call(i: int) -> int:
        t0 = time.perf_counter_ns()
        rc = libs[i].kvb_attn(int(dtype == torch.bfloat16), q.data_ptr(), k.data_ptr(),
                              v.data_ptr(), outs[i].data_ptr(), lses[i].data_ptr(), 1, hq, hkv,
                              1, n, d, ctypes.cast(ks, vp), ctypes.cast(vs, vp), None, None, 0,
                              d ** -0.5, 0, n - 1, 1, 2)
        assert rc == 0
        return time.perf_counter_ns() - t0

    call(0)
    call(1)
    ta: list[int] = []
    tb: list[int] = []
    end = time.time() + seconds
    while time.time() < end:
        if len(ta) % 2:
            tb.append(call(1))
            ta.append(call(0))
        else:
            ta.append(call(0))
            tb.append(call(1))
    nbytes = k.numel() * k.element_size() * 2
    ratio = statistics.median(a / b for a, b in zip(ta, tb, strict=True))
    diff = (outs[0].float() - outs[1].float()).abs().max().item()
    print(f"{hq}/{hkv}x{d} {n} {sys.argv[7]}: A {nbytes / statistics.median(ta):.2f} GB/s, "
          f"B {nbytes / statistics.median(tb):.2f} GB/s, B/A speed median per-round "
          f"{ratio:.3f} (n={len(ta)}), max |out diff| {diff:.2e}")


if __name__ == "__main__":
    main()
