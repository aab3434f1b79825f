"""A module past 600 lines is a room that holds two: the architecture asks that it be
split before it grows further (docs/architecture.md)."""

from __future__ import annotations

import pytest

from conftest import ROOT

LIMIT = 600
PACKAGES = [ROOT / "daemon" / "gpumemd", ROOT / "client" / "gpumem", ROOT / "shared" / "gpumem_shared"]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_module_is_over_the_limit(package) -> None:  # type: ignore[no-untyped-def]
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in package.rglob("*.py")}
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines: {over}; split them by what they hold"
