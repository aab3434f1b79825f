"""A model's weights in gpumemd's memory: a model its caller built moved into the model
arena (``move_in``), and a standby engine on its primary's weights (issue 26): the
standby maps the primary's model arena read-only and holds only its own activations and
graphs.

The primary (``enable(retain=group, weights_to=standby)``), once its model is built and
loaded, describes where every parameter and buffer of the model lies in its model arena
(name, kind, offset, dtype, shape, stride), writes that weight map into a small arena of
its own, ``<group>-weights``, and grants both arenas read-only to the standby's client
name. The standby (``enable(standby=(group, secret), share_weights=True)``) attaches the
map, then the model arena (at the primary's addresses), builds the engine's model on
torch's meta device (no storage; the adapter's ``building_model`` routes the engine's
construction here), refuses unless the map names exactly the model's parameters and
buffers with the same dtypes and shapes, points each at the mapped bytes and loads
nothing. Buffers are mapped too: they are the model's state the primary computed from
the same config (a rotary cache), read at run time, never written (a write through a
read-only mapping faults, it does not go unnoticed).

The map's bytes: ``MAGIC`` (8 bytes), the JSON's length (8 bytes, little-endian), the
JSON: {"version", "arena", "arena_bytes", "tensors": [{"name", "kind", "offset",
"dtype", "shape", "stride"}, ...]}. Encoding, decoding and the checks are plain Python
(unit-tested); the torch parts import torch when called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from gpumem.errors import InvalidArgument, NotFound, PermissionDenied

if TYPE_CHECKING:
    from gpumem.arena import Arena
    from gpumem.port.adapter import EngineAdapter
    from gpumem.session import Session

MAGIC = b"GMWMAP\x00\x01"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8
# A map describes a model's tensors, a few thousand at most: a length past this is a
# corrupt header, not a map to read.
MAX_MAP_BYTES = 64 << 20
KINDS = ("parameter", "buffer")
ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "float32": 4, "int64": 8, "float64": 8,
}
_SHOWN = 5  # problems a refusal names of each sort


class WeightMapError(InvalidArgument):
    """The weight map cannot be read, or does not describe the standby's model."""


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str  # as named_parameters / named_buffers name it (aliases of a tied weight each)
    kind: str  # "parameter" or "buffer"
    offset: int  # of its first element, in the model arena
    dtype: str  # torch's name without "torch."
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements

    @property
    def span(self) -> int:
        """Bytes from ``offset`` to just past its last element (0 when it has none)."""
        if any(n == 0 for n in self.shape):
            return 0
        return (1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))) * ITEMSIZE[self.dtype]


@dataclasses.dataclass(frozen=True)
class WeightMap:
    arena: str  # the model arena's name, as the daemon answered it
    arena_bytes: int  # its reserved size
    entries: tuple[Entry, ...]

    def shared_bytes(self) -> int:
        """Bytes of the arena the entries cover (a tied weight's aliases count once)."""
        covered, end = 0, 0
        for start, stop in sorted((e.offset, e.offset + e.span) for e in self.entries if e.span):
            covered += max(0, stop - max(start, end))
            end = max(end, stop)
        return covered


def encode(m: WeightMap) -> bytes:
    body = json.dumps({
        "version": VERSION, "arena": m.arena, "arena_bytes": m.arena_bytes,
        "tensors": [
            {"name": e.name, "kind": e.kind, "offset": e.offset, "dtype": e.dtype, "shape": list(e.shape), "stride": list(e.stride)}
            for e in m.entries
        ],
    }, separators=(",", ":")).encode()
    return MAGIC + len(body).to_bytes(8, "little") + body


def body_length(header: bytes) -> int:
    """The JSON's length from the map's first ``HEADER_BYTES`` bytes."""
    if len(header) < HEADER_BYTES or header[: len(MAGIC)] != MAGIC:
        raise WeightMapError("the weight map's header is not a gpumem weight map (wrong magic or version): is the primary's gpumem this one?")
    length = int.from_bytes(header[len(MAGIC) : HEADER_BYTES], "little")
    if length > MAX_MAP_BYTES:
        raise WeightMapError(f"the weight map's header says {length} bytes, past the {MAX_MAP_BYTES} a map may take: it is corrupt")
    return length


def decode(data: bytes) -> WeightMap:
    """The map ``encode`` wrote; WeightMapError naming what is wrong otherwise."""
    length = body_length(data[:HEADER_BYTES])
    if len(data) < HEADER_BYTES + length:
        raise WeightMapError(f"the weight map is cut short: {len(data) - HEADER_BYTES} of its {length} bytes")
    try:
        doc = json.loads(data[HEADER_BYTES : HEADER_BYTES + length])
        if doc["version"] != VERSION:
            raise WeightMapError(f"the weight map is version {doc['version']}; this gpumem reads version {VERSION}")
        entries = tuple(_entry(t) for t in doc["tensors"])
        m = WeightMap(arena=_typed(doc["arena"], str), arena_bytes=_typed(doc["arena_bytes"], int), entries=entries)
    except WeightMapError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise WeightMapError(f"the weight map is malformed ({type(exc).__name__}: {exc})") from None
    if not m.arena:
        raise WeightMapError("the weight map names no model arena")
    return m


def _typed(value: Any, kind: type) -> Any:
    if type(value) is not kind:  # bool is no int here
        raise TypeError(f"{value!r} is not {kind.__name__}")
    return value


def _entry(t: Mapping[str, Any]) -> Entry:
    shape = tuple(_typed(n, int) for n in _typed(t["shape"], list))
    stride = tuple(_typed(s, int) for s in _typed(t["stride"], list))
    e = Entry(_typed(t["name"], str), _typed(t["kind"], str), _typed(t["offset"], int), _typed(t["dtype"], str), shape, stride)
    if e.kind not in KINDS or e.dtype not in ITEMSIZE:
        raise ValueError(f"tensor {e.name!r}: kind {e.kind!r} or dtype {e.dtype!r} unknown")
    if len(shape) != len(stride) or any(n < 0 for n in shape) or any(s < 0 for s in stride) or e.offset < 0:
        raise ValueError(f"tensor {e.name!r}: shape {list(shape)}, stride {list(stride)}, offset {e.offset} do not describe a tensor")
    return e


Expected = Mapping[str, tuple[str, str, tuple[int, ...]]]  # name -> (kind, dtype, shape)


def check(m: WeightMap, expected: Expected, arena_bytes: int) -> None:
    """Refuse (WeightMapError) unless ``m`` names exactly the tensors in ``expected`` with
    the same kinds, dtypes and shapes, each inside the model arena (``arena_bytes``, the
    reserve the standby attached): the standby would otherwise read another model's
    bytes, or bytes that are not the weights."""
    got = {e.name: e for e in m.entries}
    problems: list[str] = []
    if len(got) != len(m.entries):
        problems.append("it names a tensor twice")
    if m.arena_bytes != arena_bytes:
        problems.append(f"it was written for an arena of {m.arena_bytes} bytes; '{m.arena}' has {arena_bytes}")
    missing = sorted(expected.keys() - got.keys())
    extra = sorted(got.keys() - expected.keys())
    if missing:
        problems.append(f"{len(missing)} of the model's tensors are not in it: {', '.join(missing[:_SHOWN])}")
    if extra:
        problems.append(f"{len(extra)} tensors are not the model's: {', '.join(extra[:_SHOWN])}")
    differ = [
        f"{name} is {got[name].kind} {got[name].dtype} {list(got[name].shape)}, the model's {kind} {dtype} {list(shape)}"
        for name, (kind, dtype, shape) in sorted(expected.items())
        if name in got and (got[name].kind, got[name].dtype, got[name].shape) != (kind, dtype, shape)
    ]
    if differ:
        problems.append(f"{len(differ)} differ: {'; '.join(differ[:_SHOWN])}")
    outside = [e.name for e in m.entries if e.offset + e.span > arena_bytes]
    if outside:
        problems.append(f"{len(outside)} lie past the arena's {arena_bytes} bytes: {', '.join(outside[:_SHOWN])}")
    if problems:
        raise WeightMapError(
            f"the primary's weight map does not describe this standby's model ({'; '.join(problems)}): the standby must "
            "build the same model (same config and dtype) as the primary; it refuses to map another's weights"
        )


# ---------------------------------------------------------------------- torch


def map_arena_name(group: str) -> str:
    return f"{group}-weights"


def describe(model: Any, arena: Arena) -> WeightMap:
    """The primary's map: where each parameter and buffer of ``model`` lies in ``arena``
    (every one must lie there: built inside ``EngineMemory.running()``)."""
    entries = []
    for kind, named in (("parameter", model.named_parameters(remove_duplicate=False)), ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            e = Entry(name, kind, t.data_ptr() - arena.address, str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()))
            if e.dtype not in ITEMSIZE or e.offset < 0 or e.offset + e.span > arena.reserved:
                raise InvalidArgument(
                    f"{kind} {name} ({e.dtype}, at {t.data_ptr():#x}) is not in model arena '{arena.name}' "
                    f"({arena.address:#x}, {arena.reserved} bytes): only a model built inside EngineMemory.running() is shared"
                )
            entries.append(e)
    return WeightMap(arena.name, arena.reserved, tuple(entries))


def publish(session: Session, group: str, model: Any, arena: Arena, standby: str) -> Arena:
    """Write the map into ``<group>-weights`` and grant it and ``arena`` read-only to the
    client ``standby`` (its name under this uid). The primary keeps the returned arena."""
    data = encode(describe(model, arena))
    granularity = session.device.granularity
    size = -(-len(data) // granularity) * granularity
    holder = session.create_arena(map_arena_name(group), size)
    holder.commit(size)
    holder.write(0, data)
    holder.share(standby, read_only=True)
    arena.share(standby, read_only=True)
    return holder


def move_in(model: Any, arena: Arena) -> int:
    """A model its caller built before the engine (on the device, outside gpumemd: a
    transformers model made before its manager) moved into ``arena``: each parameter and
    buffer copied there once (a tied weight is one tensor under two names) and pointed at
    its copy, so that the model arena holds the weights as if they had been built inside
    ``EngineMemory.running()`` (sleep, a standby's map). Returns the bytes moved; the old
    copies go back to torch's cache (the caller empties it)."""
    tensors = {id(t): t for m in model.modules() for t in (*m._parameters.values(), *m._buffers.values()) if t is not None}
    elsewhere = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if not t.is_cuda]
    if elsewhere:
        raise InvalidArgument(
            f"{len(elsewhere)} of the model's tensors are not on a CUDA device ({', '.join(elsewhere[:_SHOWN])}): "
            "gpumem moves a model its caller built into its model arena from the device; move the model there first"
        )
    with arena.allocating():
        for t in tensors.values():
            t.data = t.data.clone()  # .data: no autograd record, the Parameter object kept
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclasses.dataclass
class SharedWeights:
    arena: Arena  # the primary's model arena, attached read-only
    map: WeightMap


def attach(session: Session, group: str) -> SharedWeights:
    """The standby's side: read the map the primary published for ``group`` (then let
    go of it) and attach the model arena it names."""
    name = map_arena_name(group)
    try:
        holder = session.attach_arena(name)
    except (NotFound, PermissionDenied) as exc:
        raise type(exc)(
            f"{exc.message}; the standby maps the weights the primary publishes in arena '{name}' once built with "
            f"enable(retain='{group}', weights_to='{session.name}')", exc.detail,
        ) from None
    try:
        header = holder.read(0, HEADER_BYTES)
        m = decode(header + holder.read(HEADER_BYTES, min(body_length(header), holder.committed - HEADER_BYTES)))
    finally:
        holder.release()
    return SharedWeights(session.attach_arena(m.arena), m)


def build(make: Callable[[], Any], shared: SharedWeights) -> Any:
    """``make()`` (the engine's model construction) without storage of its own: built on
    the meta device, checked against the map, each parameter and buffer then a tensor on
    the mapped bytes. Other tensors its modules keep (empty KV placeholders) are made anew
    where empty; one with contents the map cannot give is refused."""
    from gpumem.torch_support import import_torch

    torch = import_torch("shared weights")
    with torch.device("meta"):
        model = make()
    named = [("parameter", n, t) for n, t in model.named_parameters(remove_duplicate=False)]
    named += [("buffer", n, t) for n, t in model.named_buffers(remove_duplicate=False)]
    check(shared.map, {n: (kind, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for kind, n, t in named}, shared.arena.reserved)
    device = _device(torch, shared.arena)
    for e in shared.map.entries:
        owner_name, _, leaf = e.name.rpartition(".")
        owner = model.get_submodule(owner_name)
        t = _mapped(torch, shared.arena, e, device)
        setattr(owner, leaf, torch.nn.Parameter(t, requires_grad=False) if e.kind == "parameter" else t)
    for module_name, module in model.named_modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.is_meta:
                if value.numel():
                    raise InvalidArgument(
                        f"{module_name or 'the model'}.{attr} ({list(value.shape)}) is neither a parameter nor a buffer: its "
                        "contents cannot be mapped from the primary; this model cannot run on shared weights"
                    )
                setattr(module, attr, torch.empty(value.shape, dtype=value.dtype, device=device))
    return model


def _device(torch: Any, arena: Arena) -> Any:
    """Where the arena's tensors are (``Arena.view``'s rule): its GPU, or host memory on
    the host backend."""
    return torch.device("cuda", arena.core.device_ordinal or 0) if arena.core.backend == "cuda" else torch.device("cpu")


def _mapped(torch: Any, arena: Arena, e: Entry, device: Any) -> Any:
    dtype = getattr(torch, e.dtype)
    if not e.span:
        return torch.empty(e.shape, dtype=dtype, device=device)
    flat = arena.tensor(e.offset, (e.span,), torch.uint8).view(dtype)
    return flat.as_strided(e.shape, e.stride)


@contextlib.contextmanager
def standby_model(engine: EngineAdapter, session: Session, group: str) -> Iterator[SharedWeights]:
    """While the engine builds its model: it builds on the primary's weights and loads
    nothing (the weights are there); the engine's ``building_model`` routes it here."""
    shared = attach(session, group)
    with engine.building_model(lambda make: build(make, shared)):
        yield shared
