"""The native allocator is built with the package (gcc and Python headers; no CUDA
headers, no compiler at import time). Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gpumem_shared._native",
            sources=["shared/gpumem_shared/csrc/module.c", "shared/gpumem_shared/csrc/allocator.c", "shared/gpumem_shared/csrc/leases.c"],
            # Rebuild when a header changes; setuptools also ships these in the sdist.
            depends=["shared/gpumem_shared/csrc/allocator.h", "shared/gpumem_shared/csrc/lease_table.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"],
            libraries=["pthread", "dl"],
        )
    ]
)
