"""The import graph the architecture promises (docs/architecture.md): the shared package
imports neither side, the daemon and the client never import each other, inside the
daemon no book imports one above it, and inside the client nothing below the Session
facade imports it. Read from the source with ast, so a lazy import inside a function
counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGES = {"gpumemd": ROOT / "daemon" / "gpumemd", "gpumem": ROOT / "client" / "gpumem", "gpumem_shared": ROOT / "shared" / "gpumem_shared"}

# Bottom up: a module may import only modules before it in this list.
DAEMON_LAYERS = [
    "config", "notify", "runtime", "fencing", "logs", "startup", "tally", "records", "image", "admission", "control_door", "control_channel", "checks", "names", "memory_caps", "tenants", "grants", "kv_math", "kv_moves", "window_plan", "arenas", "lease_order_lanes", "graph_pools", "kv_rounds", "kv_pools", "sleepers", "retain_fence", "retained", "sessions", "status", "state", "durable", "outbox", "metrics", "exporter", "server",
    "cli", "__main__",
]


def imports(path: Path) -> set[str]:
    """Absolute module names imported anywhere in ``path``."""
    return imported_names(ast.parse(path.read_text(), str(path)))


def runtime_imports(path: Path) -> set[str]:
    """``imports`` less those under ``if TYPE_CHECKING:``, which never run; an import
    inside a function runs when the function does, so it counts."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            node.body = []
    return imported_names(tree)


def imported_names(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
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


# The client bottom up, by module (a package by its folder): a module may import at run
# time only modules before it. ``session`` is the facade: everything below it holds the
# session's core (gpumem.core), and names Session only under ``if TYPE_CHECKING:``.
CLIENT_LAYERS = [
    "errors", "views", "discovery", "control", "handshake", "channel", "allocator", "torch_support", "capture_routing", "elastic",
    "address_slices", "graph_pools", "handoffs", "leases", "core", "window", "arena", "borrow", "kv_pool", "paged_kv", "sleep", "prefix_directory", "retain", "standby",
    "session",
    "leased_graph", "engine", "port", "integrations", "ctl", "__init__",
]


def client_layer(module: str) -> str:
    """The layer of a client module: a package's modules sit at its folder's
    (``gpumem.integrations.nanovllm``: ``integrations``), gpumemctl's ``ctl_*`` parts at
    ``ctl``'s."""
    name = module.split(".")[1]
    return "ctl" if name.startswith("ctl_") else name


def test_every_client_module_has_a_layer() -> None:
    assert {client_layer(name) for name in modules("gpumem")} == set(CLIENT_LAYERS)


def test_nothing_below_the_client_facade_imports_one_above_it_at_run_time() -> None:
    for name, path in modules("gpumem").items():
        layer = client_layer(name)
        for imported in runtime_imports(path):
            if imported.split(".")[0] != "gpumem" or "." not in imported or client_layer(imported) == layer:
                continue
            assert CLIENT_LAYERS.index(client_layer(imported)) < CLIENT_LAYERS.index(layer), f"{name} imports {imported}, which sits above it"


def test_runtime_imports_leave_out_type_checking_blocks_only(tmp_path: Path) -> None:
    source = tmp_path / "module.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gpumem.session import Session\n"
        "def later() -> None:\n    from gpumem.engine import EngineMemory\n"
    )
    assert {"gpumem.engine", "gpumem.engine.EngineMemory"} <= runtime_imports(source)
    assert not any(name.startswith("gpumem.session") for name in runtime_imports(source))
    assert "gpumem.session" in imports(source)


@pytest.mark.parametrize(("module", "above"), [("core", "standby"), ("prefix_directory", "session")])
def test_the_core_and_the_prefix_directory_do_not_even_name_what_sits_above_them(module: str, above: str) -> None:
    """Not even under ``if TYPE_CHECKING:``: a standby's windows are claims in the address
    slice, which the core reads without knowing standbys, and a prefix directory is made
    over the core, not the facade."""
    named = imports(PACKAGES["gpumem"] / f"{module}.py")
    assert not any(n == f"gpumem.{above}" or n.startswith(f"gpumem.{above}.") for n in named), f"gpumem.{module} names gpumem.{above}"
