"""What the package says about itself: one version, written in gpumem_shared/_version.py,
the installed metadata's, reported everywhere; the license it declares; a native module
built for the stable ABI, so that one wheel serves every supported Python."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from click.testing import CliRunner

import gpumem
from gpumem.ctl import main as gpumemctl
from gpumem_shared import _native, _version
from gpumem_shared import protocol as p
from gpumemd.cli import command as gpumemd

from .harness import Harness

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = (ROOT / "pyproject.toml").read_text()


def _project_field(name: str) -> str:
    match = re.search(rf'^{name} = "([^"]+)"$', PYPROJECT, re.M)
    assert match, f"pyproject.toml has no {name} = \"...\""
    return match.group(1)


def test_the_version_is_written_once_and_is_the_metadata() -> None:
    assert gpumem.__version__ == metadata.version("gpumemd") == _version.__version__
    assert re.search(r'^version\s*=\s*\{\s*attr\s*=\s*"gpumem_shared._version.__version__"', PYPROJECT, re.M)
    assert not re.search(r'^version\s*=\s*"', PYPROJECT, re.M), "pyproject.toml writes a version of its own"
    written = [
        str(path.relative_to(ROOT))
        for folder in ("daemon", "client", "shared")
        for path in (ROOT / folder).rglob("*.py")
        if re.search(r"^\s*__version__\s*=\s*['\"]", path.read_text(), re.M)
    ]
    assert written == ["shared/gpumem_shared/_version.py"], f"a version written in code, apart from _version.py: {written}"


def test_the_daemon_reports_the_package_version(h: Harness) -> None:
    _, hello = h.state.open_session(p.Hello(name="engine-a"), pid=4242, uid=1000, gid=1000)
    assert hello.daemon_version == h.state.status().daemon.version == metadata.version("gpumemd")


def test_both_console_scripts_say_their_version() -> None:
    for name, command in (("gpumemd", gpumemd), ("gpumemctl", gpumemctl)):
        out = CliRunner().invoke(command, ["--version"])
        assert out.exit_code == 0 and out.output.strip() == f"{name}, version {gpumem.__version__}", out.output


def test_the_license_is_declared_as_spdx_and_shipped() -> None:
    assert _project_field("license") == "Apache-2.0"
    assert metadata.metadata("gpumemd")["License-Expression"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()


def test_the_native_module_is_built_for_the_stable_abi() -> None:
    # The abi3 suffix is what setuptools gives an extension built with py_limited_api;
    # csrc/*.c compiled with Py_LIMITED_API fails on any call outside it (setup.py).
    assert _native.__file__ is not None and _native.__file__.endswith(".abi3.so"), _native.__file__
    floor = _project_field("requires-python").removeprefix(">=")
    major, minor = (int(x) for x in floor.split("."))
    setup = (ROOT / "setup.py").read_text()
    assert f'LIMITED_API = "0x{major:02X}{minor:02X}0000"' in setup
    assert f'"py_limited_api": "cp{major}{minor}"' in setup


def test_cuda_bindings_come_with_the_cuda_extra_only() -> None:
    """31 MB that a host-backend or gpumemctl-only install does without; the extras
    that run on a GPU bring it."""
    requires = metadata.requires("gpumemd") or []
    cuda = [r for r in requires if r.startswith("cuda-bindings")]
    assert cuda and all("extra ==" in r for r in cuda), requires
    extras = {re.search(r'extra == "(\w+)"', r).group(1) for r in cuda}  # type: ignore[union-attr]
    assert extras == {"cuda", "torch", "nanovllm", "transformers", "test"}, cuda
