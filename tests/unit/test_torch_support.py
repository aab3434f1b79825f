"""torch stays optional and is feature-detected: the daemon and gpumemctl never import it,
and a torch that lacks what a feature needs gets an error naming the feature."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from gpumem.errors import TorchFeatureMissing
from gpumem.torch_support import import_torch, require


@pytest.mark.parametrize("module", ["gpumemd.cli", "gpumemd.server", "gpumem.ctl", "gpumem"])
def test_daemon_ctl_and_client_core_import_no_torch(module: str) -> None:
    code = f"import sys, {module}; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0, f"{module} imports torch"


def test_missing_torch_names_the_feature(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(TorchFeatureMissing, match="arena memory pools needs torch"):
        import_torch("arena memory pools")


def test_torch_without_mempool_names_what_is_missing() -> None:
    old = types.SimpleNamespace(__version__="2.4.0", cuda=types.SimpleNamespace(memory=types.SimpleNamespace()))
    with pytest.raises(TorchFeatureMissing, match=r"needs torch\.cuda\.MemPool, which torch 2\.4\.0 lacks"):
        require(old, "arena memory pools", "cuda.MemPool", "cuda.use_mem_pool")
    newer = types.SimpleNamespace(__version__="2.9.0", cuda=types.SimpleNamespace(MemPool=object, use_mem_pool=object))
    require(newer, "arena memory pools", "cuda.MemPool", "cuda.use_mem_pool")
