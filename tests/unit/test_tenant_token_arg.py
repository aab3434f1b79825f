"""connect()'s tenant token (gpumem.session): given, or read from a file such as the one a
DRA claim's directory gives the pod; refused before any socket opens when it cannot be a
token, and never quoted in the error."""

from __future__ import annotations

from pathlib import Path

import pytest

import gpumem
from gpumem.errors import InvalidArgument
from gpumem_shared import protocol as p

SECRET = "tok-3f9a1c7e5b2d4068a1f2e3d4"


def test_a_token_file_is_read_with_its_surrounding_whitespace_dropped(tmp_path: Path) -> None:
    from gpumem.session import _tenant_token

    path = tmp_path / "tenant-token"
    path.write_text(f"  {SECRET}\n")
    assert _tenant_token(None, path) == SECRET
    assert _tenant_token(SECRET, None) == SECRET
    assert _tenant_token(None, None) == ""


MISSING = object()  # a token file named that does not exist


@pytest.mark.parametrize(
    ("token", "file", "named"),
    [
        (SECRET, SECRET, "not both"),
        (None, MISSING, "cannot read the tenant token file .*: No such file"),
        (None, "\n", "is empty"),
        ("x" * (p.MAX_TENANT_TOKEN + 1), None, "1 to 256 printable characters"),
        (SECRET + "\x00", None, "printable"),
        ("", None, "1 to 256"),
    ],
)
def test_connect_refuses_what_cannot_be_a_token_before_it_connects(tmp_path: Path, token: str | None, file: object, named: str) -> None:
    path = tmp_path / "tenant-token"
    if isinstance(file, str):
        path.write_text(file)
    with pytest.raises(InvalidArgument, match=named) as info:
        gpumem.connect(0, "pod", runtime_dir=tmp_path / "no-daemon", tenant_token=token, tenant_token_file=None if file is None else path)
    assert SECRET not in str(info.value)
