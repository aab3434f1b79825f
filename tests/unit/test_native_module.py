"""The native module against the Python that reads it: lease_table.h's slot layout and
lists as the module exports them, against gpumem_shared.lease_table's ctypes view of a
slot and its enums.

A field, status, kind or flag changed on either side alone fails here."""

from __future__ import annotations

import ctypes
from enum import Enum

import pytest

from gpumem_shared import _native, lease_table
from gpumem_shared.lease_table import LeaseFlag, LeaseKind, LeaseStatus, _Slot


def test_the_ctypes_slot_matches_the_exported_layout() -> None:
    ours = [(name, getattr(_Slot, name).offset, getattr(_Slot, name).size) for name, *_ in _Slot._fields_]
    assert ours == list(_native.LEASE_SLOT_FIELDS)
    assert ctypes.sizeof(_Slot) == _native.LEASE_SLOT_BYTES == lease_table.SLOT_BYTES


def test_the_exported_fields_cover_the_whole_slot() -> None:
    """module.c lists the fields by name: one added to lease_slot but not to that list
    leaves a hole here."""
    end = 0
    for name, offset, size in _native.LEASE_SLOT_FIELDS:
        assert offset == end, f"lease slot field {name} starts at {offset}, after a field that ends at {end}"
        end = offset + size
    assert end == _native.LEASE_SLOT_BYTES


def test_the_label_size_is_the_label_fields() -> None:
    sizes = {name: size for name, _, size in _native.LEASE_SLOT_FIELDS}
    assert sizes["label"] == _native.LEASE_LABEL_BYTES == lease_table.LABEL_BYTES


@pytest.mark.parametrize(
    ("enum", "exported"),
    [(LeaseStatus, _native.LEASE_STATUSES), (LeaseKind, _native.LEASE_KINDS), (LeaseFlag, _native.LEASE_FLAGS)],
    ids=["statuses", "kinds", "flags"],
)
def test_each_enum_is_the_headers_list(enum: type[Enum], exported: tuple[tuple[str, int], ...]) -> None:
    assert len({name for name, _ in exported}) == len(exported), f"a name twice in {exported}"
    assert [(member.name, member.value) for member in enum] == list(exported)


def test_kind_names_are_the_ones_status_replies_carry() -> None:
    assert lease_table.KIND_NAMES == {LeaseKind.CAPTURE: "capture", LeaseKind.REPLAY: "replay", LeaseKind.BORROW: "borrow"}
