"""The native module against the Python that reads it: lease_table.h's slot layout and
lists as the module exports them, against gpumem_shared.lease_table's ctypes view of a
slot and its enums; the type stub against the module's names; and the argument checks
that every native call shares (args.h).

A field, status, kind or flag changed on either side alone fails here."""

from __future__ import annotations

import ast
import ctypes
import os
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import pytest

from gpumem.allocator import Slot
from gpumem_shared import _native, lease_table
from gpumem_shared.lease_order import _LaneState
from gpumem_shared.lease_table import LeaseFlag, LeaseKind, LeaseSegment, LeaseStatus, _Hold, _Order, _Slot


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


def test_the_ctypes_memops_lane_matches_the_exported_layout() -> None:
    """lease_order's view of lease_table.h's lease_lane, which the native release updates;
    the exported fields tile it (one added to lease_lane alone leaves a hole)."""
    ours = [(name, getattr(_LaneState, name).offset, getattr(_LaneState, name).size) for name, *_ in _LaneState._fields_]
    assert ours == list(_native.LEASE_LANE_FIELDS)
    assert ctypes.sizeof(_LaneState) == _native.LEASE_LANE_BYTES == sum(size for _, _, size in _native.LEASE_LANE_FIELDS)


def test_the_ctypes_hold_estimate_matches_the_exported_layout_after_the_memops_pair() -> None:
    """lease_table's view of lease_table.h's lease_hold, on the segment's second line after
    the memops pair: off the slot's line, clear of the pair."""
    ours = [(name, getattr(_Hold, name).offset, getattr(_Hold, name).size) for name, *_ in _Hold._fields_]
    assert ours == list(_native.LEASE_HOLD_FIELDS)
    assert ctypes.sizeof(_Hold) == _native.LEASE_HOLD_BYTES == sum(size for _, _, size in _native.LEASE_HOLD_FIELDS)
    order, hold = _native.LEASE_ORDER_OFFSET, _native.LEASE_HOLD_OFFSET
    assert order + ctypes.sizeof(_Order) <= hold and hold + ctypes.sizeof(_Hold) <= order + 64 and hold % 8 == 0


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


def test_the_stub_names_what_the_module_offers() -> None:
    stub = ast.parse((Path(lease_table.__file__).parent / "_native.pyi").read_text())
    declared = {node.name for node in stub.body if isinstance(node, ast.FunctionDef)}
    declared |= {node.target.id for node in stub.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    assert declared == {name for name in vars(_native) if not name.startswith("_")}


# ======================================================================= argument checks


@pytest.fixture
def segment() -> Iterator[LeaseSegment]:
    seg, fd = LeaseSegment.create(1)
    yield seg
    seg.close()
    os.close(fd)


def test_lease_calls_check_their_arguments(segment: LeaseSegment) -> None:
    with pytest.raises(ValueError, match="is not 0"):
        _native.lease_peek(0)
    with pytest.raises(ValueError, match="not 64-byte aligned"):
        _native.lease_peek(segment.address + 8)
    with pytest.raises(TypeError, match=r"lease_set_epoch\(segment_address, epoch\)"):
        _native.lease_set_epoch(segment.address)  # type: ignore[call-arg]
    with pytest.raises(OverflowError, match="32-bit"):
        segment.set_epoch(1 << 32)
    with pytest.raises(OverflowError):
        segment.clear(-1)
    with pytest.raises(TypeError):
        segment.set_flags("shared")  # type: ignore[arg-type]
    assert segment.epoch() == 0 and segment.flags() == 0, "a refused call wrote nothing"


def test_slot_calls_check_their_arguments() -> None:
    slot = Slot(device=0)
    try:
        with pytest.raises(TypeError, match=r"\(address, size\) tuples"):
            slot.set_extents([[1 << 30, 4096]])  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"\(address, size\) tuples"):
            slot.set_backing([(1 << 30, 4096, 0)])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="at most"):
            slot.set_backing([(i << 20, 512) for i in range(4096)])
        with pytest.raises(OverflowError):
            slot.alloc(-1)
        with pytest.raises(TypeError, match=r"slot_free\(slot, address, nbytes, device, stream\)"):
            _native.slot_free(slot.index, 0, 0)  # type: ignore[call-arg]
        assert slot.stats().n_extents == 0 and slot.stats().calls == 0, "a refused call changed nothing"
    finally:
        slot.release()
    with pytest.raises(RuntimeError, match="not in use"):
        slot.stats()
