"""ctypes binding to the native probe library built from probes/*.c (kvbench/_native)."""

from __future__ import annotations

import ctypes
import importlib.machinery
import re
from functools import lru_cache
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.memory import llc_bytes

ABI_VERSION = 19  # kvb_abi_version() of probes/native.c: bump both when an interface changes


class CopyJob(ctypes.Structure):
    """One thread's share of a copy (kvb_copy_job in probes/copy.c): each iteration copies
    `chunk` bytes at offset w * stride, w stepping by `hop` modulo `windows` from `start`
    (written back on return), on any of the `ncpus` CPUs at `cpus` (0: not pinned), with a
    full fence after each copy when `fence` is 1; `allowed` comes back as the number of CPUs
    the thread could run on."""

    _fields_ = [("dst", ctypes.c_void_p), ("src", ctypes.c_void_p), ("chunk", ctypes.c_size_t),
                ("stride", ctypes.c_size_t), ("windows", ctypes.c_size_t),
                ("hop", ctypes.c_size_t), ("start", ctypes.c_size_t),
                ("cpus", ctypes.POINTER(ctypes.c_int)), ("ncpus", ctypes.c_int),
                ("fence", ctypes.c_int), ("allowed", ctypes.c_int)]


def openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; [] elsewhere). The
    native kernels must share torch's: two runtimes mean two thread pools on the same cores."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    # GNU (libgomp), Intel (libiomp5) and LLVM (libomp) runtimes, torch's hashed copies too
    runtime = re.compile(r"lib[gi]?omp[\w.-]*\.so")
    libs = {line.split()[-1] for line in maps.splitlines()}
    return sorted(x for x in libs if x.startswith("/") and runtime.match(x.rsplit("/", 1)[-1]))


def native_status() -> str:
    """'loaded (ABI n, OpenMP runtime)' or why the native CPU kernel library is unavailable."""
    try:
        lib()
    except KvbenchError as e:
        return f"not loaded: {e}"
    omp = openmp_runtimes()
    return f"loaded (ABI {ABI_VERSION}, OpenMP {' + '.join(omp) if omp else 'not found'})"


@lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    """Load the native library; a one-line error if the package was installed without it."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_native{suffix}"
        if path.exists():
            break
    else:
        raise KvbenchError("native probes are not built: run `pip install -e .` in the kvbench "
                           "checkout (needs a C compiler)")
    # torch first: the library's OpenMP runtime (libgomp.so.1) then resolves to the one torch
    # loaded, so the kernels run on torch's own thread pool (probes/attn.c)
    import torch  # noqa: F401

    so = ctypes.CDLL(str(path))
    so.kvb_abi_version.restype = ctypes.c_int
    if so.kvb_abi_version() != ABI_VERSION:
        raise KvbenchError("native probes are stale: rebuild with `pip install -e .`")
    so.kvb_now_ns.restype = ctypes.c_uint64
    so.kvb_omp_threads.restype = ctypes.c_int
    so.kvb_omp_threads.argtypes = [ctypes.c_int]
    so.kvb_memcpy_loop.restype = ctypes.c_uint64
    so.kvb_memcpy_loop.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                   ctypes.c_size_t]
    so.kvb_copy_jobs.restype = ctypes.c_uint64
    so.kvb_copy_jobs.argtypes = [ctypes.POINTER(CopyJob), ctypes.c_int, ctypes.c_size_t]
    so.kvb_memcpy_threads.restype = ctypes.c_uint64
    so.kvb_memcpy_threads.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                      ctypes.c_size_t, ctypes.c_int]
    so.kvb_read_threads.restype = ctypes.c_uint64
    so.kvb_read_threads.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                    ctypes.c_int]
    so.kvb_chase_build.restype = ctypes.c_int
    so.kvb_chase_build.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                   ctypes.c_uint64]
    so.kvb_chase.restype = ctypes.c_uint64
    so.kvb_chase.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
    i64, vp, i64p = ctypes.c_int64, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)
    so.kvb_attn.restype = ctypes.c_int  # probes/attn.c
    so.kvb_attn.argtypes = [ctypes.c_int, vp, vp, vp, vp, vp, i64, i64, i64, i64, i64, i64,
                            i64p, i64p, vp, vp, vp, i64, i64, i64, i64, ctypes.c_float,
                            ctypes.c_int, i64, i64, ctypes.c_int]
    so.kvb_attn_isa.restype = ctypes.c_int
    so.kvb_attn_isa.argtypes = [ctypes.c_int]
    so.kvb_attn_prefetch_from.restype = i64
    so.kvb_attn_prefetch_from.argtypes = [i64]
    so.kvb_attn_prefetch_from(llc_bytes() // 2)  # dense decode prefetches from half the LLC
    so.kvb_gemv.restype = ctypes.c_int  # probes/gemv.c
    so.kvb_gemv.argtypes = [vp, vp, vp, i64, i64, i64, i64, ctypes.c_int]
    so.kvb_gemv_isa.restype = ctypes.c_int
    so.kvb_gemv_isa.argtypes = [ctypes.c_int]
    so.kvb_rmsnorm.restype = None  # probes/norm.c
    so.kvb_rmsnorm.argtypes = [vp, vp, vp, i64, i64, ctypes.c_float]
    f32 = ctypes.c_float
    so.kvb_llama_pre.restype = ctypes.c_int  # probes/layer.c
    so.kvb_llama_pre.argtypes = [vp, vp, f32, vp, vp, vp, vp, vp, vp, vp, vp, i64, i64, i64,
                                 i64, i64, ctypes.c_int]
    so.kvb_llama_post.restype = ctypes.c_int
    so.kvb_llama_post.argtypes = [vp, vp, vp, vp, f32, vp, vp, i64, i64, i64, i64,
                                  ctypes.c_int]
    so.kvb_llama_step.restype = ctypes.c_int  # probes/step.c
    so.kvb_llama_step.argtypes = [vp, i64, vp, vp, vp, i64, vp, i64, vp, f32, vp, vp, i64, vp,
                                  vp, vp, vp, f32, i64, i64, i64, i64, i64, i64, i64, vp, vp,
                                  ctypes.c_int]
    so.kvb_argmax.restype = ctypes.c_int  # probes/greedy.c
    so.kvb_argmax.argtypes = [vp, i64, i64, vp, ctypes.c_int, ctypes.c_int]
    so.kvb_maw.restype = None  # probes/maw.c
    so.kvb_maw.argtypes = [vp, vp, vp, vp, i64, i64, i64, i64, i64, i64p, ctypes.c_float,
                           ctypes.c_float, i64, ctypes.c_int]
    so.kvb_digest_token.restype = None  # probes/pages.c
    so.kvb_digest_token.argtypes = [vp, i64p, vp, vp, i64p, i64, i64, i64, i64, ctypes.c_int]
    so.kvb_page_select.restype = ctypes.c_int
    so.kvb_page_select.argtypes = [vp, i64, i64, i64, i64, vp, vp, i64p, i64, i64, i64, i64,
                                   ctypes.c_int, i64, i64, vp, vp, ctypes.c_int]
    so.kvb_topk_rows.restype = ctypes.c_int  # probes/topk.c
    so.kvb_topk_rows.argtypes = [vp, i64, i64, i64, i64, vp, vp, ctypes.c_int]
    return so
