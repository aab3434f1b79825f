"""The import graph the architecture promises (docs/architecture.md): the shared package
imports neither side, the daemon and the client never import each other, and inside the
daemon no book imports one above it. Read from the source with ast, so a lazy import
inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGES = {"gpumemd": ROOT / "daemon" / "gpumemd", "gpumem": ROOT / "client" / "gpumem", "gpumem_shared": ROOT / "shared" / "gpumem_shared"}

# Bottom up: a module may import only modules before it in this list.
DAEMON_LAYERS = [
    "config", "notify", "runtime", "logs", "tally", "records", "image", "admission", "checks", "grants", "kv_math", "arenas", "graph_pools", "kv_pools", "status", "state", "durable", "outbox", "metrics", "exporter", "server",
    "cli", "__main__",
]


def imports(path: Path) -> set[str]:
    """Absolute module names imported anywhere in ``path``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def modules(package: str) -> dict[str, Path]:
    root = PACKAGES[package]
    return {".".join(p.relative_to(root.parent).with_suffix("").parts): p for p in root.rglob("*.py")}


@pytest.mark.parametrize(("package", "forbidden"), [("gpumem_shared", ("gpumem", "gpumemd")), ("gpumem", ("gpumemd",)), ("gpumemd", ("gpumem",))])
def test_packages_import_only_downwards(package: str, forbidden: tuple[str, ...]) -> None:
    for name, path in modules(package).items():
        bad = sorted(i for i in imports(path) if i.split(".")[0] in forbidden)
        assert not bad, f"{name} imports {bad}"


def test_every_daemon_module_has_a_layer() -> None:
    assert {name.split(".", 1)[1] for name in modules("gpumemd") if name != "gpumemd.__init__"} == set(DAEMON_LAYERS)


def test_no_daemon_book_imports_one_above_it() -> None:
    for name, path in modules("gpumemd").items():
        if name == "gpumemd.__init__":
            continue
        level = DAEMON_LAYERS.index(name.split(".", 1)[1])
        for imported in imports(path):
            parts = imported.split(".")
            if parts[0] == "gpumemd" and len(parts) > 1 and parts[1] in DAEMON_LAYERS:
                assert DAEMON_LAYERS.index(parts[1]) < level, f"{name} imports {imported}, which sits above it"
