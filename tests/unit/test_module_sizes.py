"""A module past 600 lines is a room that holds two: the architecture asks that it be
split before it grows further (docs/architecture.md). The native module's C sources
count too."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT

LIMIT = 600
PACKAGES = [ROOT / "daemon" / "gpumemd", ROOT / "client" / "gpumem", ROOT / "shared" / "gpumem_shared"]
NATIVE = ROOT / "shared" / "gpumem_shared" / "csrc"


def _over(paths: list[Path]) -> dict[str, int]:
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in paths}
    return {name: n for name, n in sizes.items() if n > LIMIT}


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_module_is_over_the_limit(package: Path) -> None:
    over = _over(list(package.rglob("*.py")))
    assert not over, f"modules over {LIMIT} lines: {over}; split them by what they hold"


def test_no_c_source_is_over_the_limit() -> None:
    sources = [*NATIVE.glob("*.c"), *NATIVE.glob("*.h")]
    assert len(sources) >= 2, f"no C sources found in {NATIVE}"
    over = _over(sources)
    assert not over, f"C sources over {LIMIT} lines: {over}; split them by what they hold"
