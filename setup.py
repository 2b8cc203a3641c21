"""Builds the native probe library from probes/*.c as kvbench/_native (loaded with ctypes)."""

from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvbench._native",
            sources=sorted(glob("probes/*.c")),
            depends=sorted(glob("probes/*.h")),
            # OpenMP: the attention kernel and read loop run on torch's own thread pool
            extra_compile_args=["-O2", "-std=c11", "-pthread", "-fno-strict-aliasing",
                                "-fopenmp"],
            extra_link_args=["-pthread", "-fopenmp"],
        )
    ]
)
