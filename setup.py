"""The native module is built with the package (gcc and the Python headers; no CUDA
headers, no compiler at import time). Everything else is in pyproject.toml.

It uses only the stable ABI of Python 3.10 (Py_LIMITED_API), so the wheel is tagged
cp310-abi3 and one build serves every Python the package supports."""

import shutil
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError, ExecError, PlatformError

LIMITED_API = "0x030A0000"  # 3.10: requires-python's floor, and METH_FASTCALL's first stable release
NEEDS = "a C compiler and the Python headers (Debian/Ubuntu: apt install gcc python3-dev; Fedora/RHEL: dnf install gcc python3-devel)"


class BuildNative(build_ext):
    """build_ext that says what is missing in one line instead of a compiler traceback."""

    def build_extension(self, ext: Extension) -> None:
        compiler = self.compiler.compiler_so[0] if getattr(self.compiler, "compiler_so", None) else None
        if compiler is not None and shutil.which(compiler) is None:
            raise PlatformError(f"gpumemd's native module needs {NEEDS}: no compiler '{compiler}' on PATH")
        headers = Path(sysconfig.get_path("include"), "Python.h")
        if not headers.exists():
            raise PlatformError(f"gpumemd's native module needs {NEEDS}: {headers} is missing")
        try:
            super().build_extension(ext)
        except (CompileError, ExecError) as exc:
            raise PlatformError(f"building gpumemd's native module failed ({exc}); it needs {NEEDS}") from None


setup(
    ext_modules=[
        Extension(
            "gpumem_shared._native",
            sources=[f"shared/gpumem_shared/csrc/{name}.c" for name in ("module", "lease_order", "allocator", "leases")],
            # Rebuild when a header changes; setuptools also ships these in the sdist.
            depends=[f"shared/gpumem_shared/csrc/{name}.h" for name in ("args", "lease_order", "allocator", "lease_table")],
            define_macros=[("Py_LIMITED_API", LIMITED_API)],
            py_limited_api=True,
            # A call outside the limited API is undeclared there: an error, not a warning.
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
            libraries=["pthread", "dl"],
        )
    ],
    cmdclass={"build_ext": BuildNative},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
