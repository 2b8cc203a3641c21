"""ctypes binding to the native probe library built from probes/*.c (kvbench/_native)."""

from __future__ import annotations

import ctypes
import importlib.machinery
from functools import lru_cache
from pathlib import Path

from kvbench.errors import KvbenchError

ABI_VERSION = 1


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
    so = ctypes.CDLL(str(path))
    so.kvb_abi_version.restype = ctypes.c_int
    if so.kvb_abi_version() != ABI_VERSION:
        raise KvbenchError("native probes are stale: rebuild with `pip install -e .`")
    so.kvb_now_ns.restype = ctypes.c_uint64
    so.kvb_memcpy_loop.restype = ctypes.c_uint64
    so.kvb_memcpy_loop.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                   ctypes.c_size_t]
    return so
