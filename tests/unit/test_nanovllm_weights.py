"""The weight map a nano-vllm primary publishes for its standby
(gpumem.port.weights), without torch: its bytes both ways, what a
corrupt map is refused for, the check that refuses a map of another model (names,
kinds, dtypes, shapes exactly; every tensor inside the arena), and the primary's
description of a model from its tensors' addresses."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import pytest

from gpumem.errors import InvalidArgument
from nanovllm_fakes import FakeModel, FakeTensor
from gpumem.port.weights import (
    HEADER_BYTES,
    MAGIC,
    Entry,
    WeightMap,
    WeightMapError,
    check,
    decode,
    describe,
    encode,
)

MiB = 1 << 20
ARENA = 64 * MiB


def model_map() -> WeightMap:
    """A small model's: an embedding tied to the head (two names, one place), a strided
    view, a float32 buffer."""
    return WeightMap("fo-primary-model", ARENA, (
        Entry("model.embed_tokens.weight", "parameter", 0, "bfloat16", (1024, 256), (256, 1)),
        Entry("lm_head.weight", "parameter", 0, "bfloat16", (1024, 256), (256, 1)),
        Entry("model.layers.0.qkv.weight", "parameter", 2 * MiB, "bfloat16", (768, 256), (256, 1)),
        Entry("model.layers.0.qkv.t", "parameter", 2 * MiB, "bfloat16", (256, 768), (1, 256)),
        Entry("model.norm.weight", "parameter", 4 * MiB, "bfloat16", (256,), (1,)),
        Entry("rotary.cos_sin_cache", "buffer", 6 * MiB, "float32", (1024, 1, 128), (128, 128, 1)),
    ))


def expected_of(m: WeightMap) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    return {e.name: (e.kind, e.dtype, e.shape) for e in m.entries}


def test_a_map_round_trips_and_counts_each_shared_byte_once() -> None:
    m = model_map()
    data = encode(m)
    assert data.startswith(MAGIC) and int.from_bytes(data[len(MAGIC) : HEADER_BYTES], "little") == len(data) - HEADER_BYTES
    assert decode(data) == m
    assert decode(data + b"\0" * 4096) == m  # the rest of its arena's granule
    # The tied head and the transposed view add nothing; the norm and the buffer do.
    assert m.shared_bytes() == 1024 * 256 * 2 + 768 * 256 * 2 + 256 * 2 + 1024 * 128 * 4
    check(m, expected_of(m), ARENA)


def test_an_entrys_span_follows_its_strides() -> None:
    e = Entry("w", "parameter", 0, "float16", (4, 3), (1, 4))  # a transposed 3x4
    assert e.span == 12 * 2
    assert replace(e, shape=(4, 0)).span == 0
    assert replace(e, stride=(0, 1), shape=(8, 3)).span == 3 * 2  # broadcast rows read one row


def corrupt(doc_change: Any = None, *, raw: bytes | None = None) -> bytes:
    data = encode(model_map())
    if raw is not None:
        return raw
    doc = json.loads(data[HEADER_BYTES:])
    doc_change(doc)
    body = json.dumps(doc).encode()
    return MAGIC + len(body).to_bytes(8, "little") + body


@pytest.mark.parametrize(("data", "says"), [
    (corrupt(raw=b"\0" * 64), "not a gpumem weight map"),
    (corrupt(raw=b"GMWMAP\x00\x02" + bytes(56)), "not a gpumem weight map"),  # another version's magic
    (corrupt(raw=MAGIC + (1 << 40).to_bytes(8, "little")), "corrupt"),
    (corrupt(raw=encode(model_map())[:-10]), "cut short"),
    (corrupt(raw=MAGIC + (5).to_bytes(8, "little") + b"{oops"), "malformed"),
    (corrupt(lambda d: d.update(version=2)), "version 2"),
    (corrupt(lambda d: d.pop("arena")), "malformed"),
    (corrupt(lambda d: d.update(arena="")), "names no model arena"),
    (corrupt(lambda d: d.update(arena_bytes=True)), "malformed"),
    (corrupt(lambda d: d["tensors"][0].update(offset=-2)), "do not describe a tensor"),
    (corrupt(lambda d: d["tensors"][0].update(offset=1.5)), "malformed"),
    (corrupt(lambda d: d["tensors"][0].update(stride=[256])), "do not describe a tensor"),
    (corrupt(lambda d: d["tensors"][0].update(stride=[256, -1])), "do not describe a tensor"),
    (corrupt(lambda d: d["tensors"][0].update(shape=[1024, "256"])), "malformed"),
    (corrupt(lambda d: d["tensors"][0].update(dtype="complex32")), "unknown"),
    (corrupt(lambda d: d["tensors"][0].update(kind="constant")), "unknown"),
    (corrupt(lambda d: d["tensors"][0].pop("name")), "malformed"),
    (corrupt(lambda d: d.update(tensors={"a": 1})), "malformed"),
])
def test_a_corrupt_map_is_refused_saying_what_is_wrong(data: bytes, says: str) -> None:
    with pytest.raises(WeightMapError, match=says):
        decode(data)


@pytest.mark.parametrize(("change", "says"), [
    (lambda m: replace(m, entries=m.entries[:-1]), r"1 of the model's tensors are not in it: rotary\.cos_sin_cache"),
    (lambda m: replace(m, entries=(*m.entries, Entry("extra.bias", "parameter", 0, "bfloat16", (8,), (1,)))), r"not the model's: extra\.bias"),
    (lambda m: replace(m, entries=(replace(m.entries[0], dtype="float16"), *m.entries[1:])), r"model\.embed_tokens\.weight is parameter float16"),
    (lambda m: replace(m, entries=(replace(m.entries[0], shape=(1025, 256)), *m.entries[1:])), r"\[1025, 256\], the model's parameter bfloat16 \[1024, 256\]"),
    (lambda m: replace(m, entries=(*m.entries[:-1], replace(m.entries[-1], kind="parameter"))), r"rotary\.cos_sin_cache is parameter"),
    (lambda m: replace(m, entries=(*m.entries[:-1], replace(m.entries[-1], offset=ARENA - 4096))), r"past the arena's .*cos_sin_cache"),
    (lambda m: replace(m, arena_bytes=2 * ARENA), "written for an arena of"),
    (lambda m: replace(m, entries=(*m.entries, m.entries[0])), "names a tensor twice"),
])
def test_a_map_of_another_model_is_refused(change: Any, says: str) -> None:
    good = model_map()
    with pytest.raises(WeightMapError, match=says) as refused:
        check(change(good), expected_of(good), ARENA)
    assert isinstance(refused.value, InvalidArgument) and "must build the same model" in str(refused.value)


@dataclass
class FakeArena:
    name: str
    address: int
    reserved: int


def test_the_primary_describes_each_tensor_by_its_offset_in_the_model_arena() -> None:
    arena = FakeArena("fo-primary-model", 0x7F0000000000, ARENA)
    w = FakeTensor(arena.address + 2 * MiB, "torch.bfloat16", (768, 256), (256, 1))
    model = FakeModel({"a.weight": w, "b.weight": w}, {"rope.cache": FakeTensor(arena.address + 6 * MiB, "torch.float32", (16, 1, 8), (8, 8, 1))})
    m = describe(model, arena)  # type: ignore[arg-type]
    assert (m.arena, m.arena_bytes) == ("fo-primary-model", ARENA)
    assert m.entries == (
        Entry("a.weight", "parameter", 2 * MiB, "bfloat16", (768, 256), (256, 1)),
        Entry("b.weight", "parameter", 2 * MiB, "bfloat16", (768, 256), (256, 1)),
        Entry("rope.cache", "buffer", 6 * MiB, "float32", (16, 1, 8), (8, 8, 1)),
    )
    assert decode(encode(m)) == m


@pytest.mark.parametrize("where", ["below", "past", "dtype"])
def test_a_tensor_outside_the_model_arena_is_not_published(where: str) -> None:
    arena = FakeArena("fo-primary-model", 0x7F0000000000, ARENA)
    ptr = {"below": arena.address - 4096, "past": arena.address + ARENA - 1024, "dtype": arena.address}[where]
    dtype = "torch.complex64" if where == "dtype" else "torch.bfloat16"
    model = FakeModel({"w": FakeTensor(ptr, dtype, (1024,), (1,))}, {})
    with pytest.raises(InvalidArgument, match="is not in model arena 'fo-primary-model'"):
        describe(model, arena)  # type: ignore[arg-type]
