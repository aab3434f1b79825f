"""What an engine supplies to run on gpumemd: one object, ``EngineAdapter``.

The port (gpumem.port) holds everything that is the same in every engine: the KV cache
laid out virtually and committed by the round after capture, the block manager that
follows its pool, sleep and wake, retain and the prefix directory, a standby's settling
and take-over, shared read-only weights. What differs between engines is how their KV
tensors are shaped, how their block manager keeps its blocks, where a step begins and
ends, how their prefix cache names a block: an adapter answers exactly that, and nothing
else, through the methods below. An engine calls the port at its own seams (the calls
the other way, ``gpumem.port.engine_port.EnginePort``):

    port = EnginePort(adapter, settings)       # where the engine builds its model runner
    with port.starting():                      # build, load, warm up: into the arenas
        port.lay_out_kv()                      # where it would allocate its KV cache
        graphs = port.captured(graphs)         # once its graphs are captured
    port.started()                             # built: the round's report goes out
    blocks = port.blocks()                     # before its block manager is built
    port.follow()                              # its block manager built (and final)
    port.before_step()                         # the step hook: before scheduling,
    port.scheduled()                           #   after scheduling, before the step runs,
    port.after_step()                          #   once the step's outputs reached the host
    port.idle()                                # while it has nothing to do
    port.settle() / port.take_over(wait=)      # a standby: once built / to serve
    port.close()

The port calls an adapter's methods from the engine's own thread, at the port calls
above, never concurrently. A method an engine cannot provide raises ``Unsupported``
naming what it cannot do; the port calls a method only for the feature that needs it
(the column "needed for" in docs/engines.md), so an engine without, say, a prefix cache
still gets elastic KV and sleep.

Block ids are rows: block ``i`` is row ``i`` of every KV buffer, and the block manager
holds ``block_count()`` blocks, ids ``0 .. block_count() - 1``, all of them backed by
committed memory. No torch here: tensors pass through as ``Any``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from gpumem.errors import InvalidArgument


class Unsupported(InvalidArgument):
    """The engine cannot do what a setting asked of it (its adapter says what and why)."""


class SeamMissing(InvalidArgument):
    """The installed engine lacks a seam its adapter hooks: another version than the one
    the adapter was written for."""


@dataclasses.dataclass(frozen=True)
class KvLayout:
    """The engine's paged KV cache (gpumem.paged_kv): ``layers`` layers, each a K and a V
    buffer (one buffer, K then V in each block, when ``combined``) whose block ``i`` is
    a tensor of ``block_shape`` elements of ``dtype`` (``itemsize`` bytes each)."""

    layers: int
    block_shape: tuple[int, ...]  # one layer's K (or V) for one block, e.g. (block_size, kv_heads, head_dim)
    itemsize: int
    dtype: Any  # the tensors' torch dtype
    combined: bool = False
    # The rows the cache is laid out over (0: what the whole device could hold); an engine
    # that sizes other tensors by its cache's blocks (an attention mask) gives its ceiling.
    max_blocks: int = 0
    # Rows 0 .. reserved_blocks - 1 the engine keeps for itself (transformers' trash blocks:
    # padding reads zeros from one, writes into the other): in use for good (used_blocks
    # names them), so the follower never moves them nor gives their rows back; the round
    # commits at least one more, and a sleep that drops the KV cache does not count them.
    reserved_blocks: int = 0

    def describe(self) -> dict[str, Any]:
        """The keywords ``EngineMemory.kv_cache`` / ``adopt_kv`` and ``Reservation.paged_kv``
        take (``max_blocks`` and ``reserved_blocks`` apart: an adopted or reserved cache has
        its primary's rows)."""
        return {"layers": self.layers, "block_shape": self.block_shape, "itemsize": self.itemsize, "combined": self.combined}


@dataclasses.dataclass(frozen=True)
class StepNeed:
    """What the next step needs of the block manager, read before it is scheduled."""

    blocks: int  # free blocks the next steps take: the waiting sequences', and one per running sequence about to start a block
    short: bool  # the step cannot run as it should with the blocks free now (nothing schedulable, or a preemption)
    busy: bool  # any sequence waiting or running


class EngineAdapter(Protocol):
    """One engine's answers to the port (see the module doc). Each method says when the
    port calls it and what the engine guarantees in return. An adapter that subclasses
    it takes the defaults of the three methods that have one (``restore_graph_inputs``,
    ``synchronize``, ``building_model``)."""

    # ------------------------------------------------------------------ KV layout (every feature)

    def kv_layout(self) -> KvLayout:
        """Called once, in ``port.lay_out_kv()``, where the engine would allocate its KV
        cache (after its model is built and warmed up, before graph capture). The engine
        guarantees the layout is the one its attention kernels read: the port lays the
        cache out virtually at the declared maximum of blocks, a placeholder under it."""
        ...

    def bind_kv(self, layers: list[list[Any]]) -> None:
        """Called once, right after ``kv_layout``: ``layers[i]`` is layer ``i``'s [K, V]
        (or [KV] combined), torch tensors of shape (max blocks, *block_shape) at their
        final addresses. The engine points its attention layers at them (and keeps them
        for ``copy_blocks``: ``gpumem.port.blocks.copy_rows`` copies over them), allocates
        no KV cache of its own, and captures its graphs on them afterwards; it hands out
        block ids below ``block_count()`` only. A standby's tensors lie on its primary's
        windows (its placeholder under them until the take-over)."""
        ...

    # ------------------------------------------------------------------ blocks (elastic KV, take-over)

    def block_count(self) -> int:
        """Blocks the block manager holds now (free and used). Called at step boundaries."""
        ...

    def used_blocks(self) -> Collection[int]:
        """Ids of the blocks some sequence holds (reference count above 0). Called at step
        boundaries and while idle; the engine guarantees no other block is read by a step."""
        ...

    def free_blocks(self) -> Collection[int]:
        """Ids of the blocks the scheduler may take. Called at step boundaries and while idle."""
        ...

    def resize_blocks(self, blocks: int) -> None:
        """Make the block manager hold exactly ``blocks`` blocks: new ones appended free
        (and uncached) at the end, or the ones from ``blocks`` on dropped, with any prefix
        cache entry naming them. Called once the round answered (``port.blocks()`` already
        sized it before the manager was built: the engine sizes it from that figure), after
        a grow came, after a shrink, and on take-over (the adopted blocks). The port drops
        only blocks that are free."""
        ...

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy blocks ``src[i]`` into ``dst[i]`` in every layer's K and V, device to
        device, complete when it returns (the rows at ``src`` may be unmapped next).
        Called at a step boundary or while idle, when the daemon asked for blocks back and
        some live ones lie past what is kept; sources and destinations never overlap,
        destinations are free. If it raises, the port gives nothing back (the daemon's
        books stay as they were) and the error reaches the engine's step."""
        ...

    def relocate_blocks(self, moves: Sequence[tuple[int, int]]) -> None:
        """The bookkeeping of ``moves`` ((from, to) pairs) once ``copy_blocks`` copied
        them: each destination takes its source's place (reference count, prefix hash,
        tokens) in the block manager and in every sequence's block table; each source
        becomes free and uncached."""
        ...

    def step_need(self) -> StepNeed:
        """Called in ``port.before_step()``, before the scheduler takes blocks for the
        step, and again while the step waits for a grow. The engine guarantees the figure
        covers what its scheduler will take."""
        ...

    # ------------------------------------------------------------------ prefix cache (retain, take-over, sleep)

    def hook_prefix_events(self, taken: Callable[[int], None], filled: Callable[[int], None]) -> None:
        """Called once the block manager is final (``port.follow()`` on a retaining
        primary, ``port.take_over()`` on a standby). From then on the engine calls
        ``taken(block)`` when its scheduler takes a block for new rows (not a prefix-cache
        hit that keeps the block's rows as they are), and ``filled(block)`` when a step
        it schedules writes a block's last slot; both before ``port.scheduled()``.
        Called again after ``reset_scheduler`` (a new block manager) if it replaced it."""
        ...

    def block_hash(self, block: int) -> int:
        """The content hash the engine's prefix cache holds for ``block`` (-1: none): the
        engine guarantees a block with a hash holds, once the step that filled it ran,
        the tokens the hash names. Called in ``port.scheduled()`` and ``port.after_step()``."""
        ...

    def seed_block(self, block: int, content_hash: int) -> bool:
        """On take-over: make ``block`` (free) a cached block holding ``content_hash``, so
        that a prompt whose prefix hashes to it reuses its rows. False when the engine
        cannot take it (in use, past its blocks, the hash cached already)."""
        ...

    def forget_prefix_cache(self) -> None:
        """Called when the KV cache's contents are dropped (a sleep with "kv" dropped): no
        block may be a prefix-cache hit afterwards. The engine holds no sequence then."""
        ...

    # ------------------------------------------------------------------ standby (settle, take-over)

    def rehearse(self) -> None:
        """A standby, once built, its graphs captured on the placeholder: serve a few
        requests to their end on its serving path (a prefill, a prefill hitting the
        prefix cache, decode steps, sampling), so that its first step after the take-over
        pays no first-use costs. The tokens mean nothing. The engine holds no sequence
        before or after."""
        ...

    def reset_scheduler(self) -> None:
        """Called after ``rehearse``: the scheduler and block manager as built (nothing
        waiting or running, every block free and unhashed). Raises if sequences remain."""
        ...

    def restore_graph_inputs(self) -> None:
        """On take-over, once what slept woke (a dropped model arena comes back zeroed):
        the captured graphs' static inputs as capture left them, so that rows a replay
        does not rewrite hold values in range. The default restores nothing: right for an
        engine whose graphs' inputs lie in a model arena kept in host memory while it sleeps
        (a standby with weights of its own)."""
        return None  # a body: the default, not a member left to implement

    def synchronize(self) -> None:
        """Wait for the engine's device work (before its memory goes to sleep). The
        default: every stream of the current CUDA device (``torch.cuda.synchronize``)."""
        from gpumem.torch_support import import_torch

        import_torch("waiting for an engine's device work").cuda.synchronize()

    # ------------------------------------------------------------------ shared weights

    def model(self) -> Any:
        """The engine's model (a torch module), built and loaded: on a primary that
        grants its weights (``weights_to``), each parameter and buffer lies in the model
        arena and stays there."""
        ...

    def building_model(self, build: Callable[[Callable[[], Any]], Any]) -> contextlib.AbstractContextManager[None]:
        """A standby with ``share_weights``: while the returned context is open (around
        the engine's model construction), the engine makes its model by calling
        ``build(make)`` (``make()`` constructs it; the port runs it on torch's meta
        device and points every parameter and buffer at the primary's bytes) and loads no
        weights. The default refuses (``Unsupported``): an engine whose caller builds
        its model before the engine exists has no construction to route."""
        raise Unsupported(f"{type(self).__name__}: share_weights= builds the model on a primary's weights, and this engine's model "
                          "is built by its caller, not through its adapter: load the standby's own weights")


def require_seams(package: str, owner: object, names: Sequence[str], *, written_for: str) -> None:
    """Refuse (``SeamMissing``) unless ``owner`` (a class or module of ``package``) has
    every attribute in ``names``: the seams an adapter hooks, checked before it hooks one."""
    missing = [n for n in names if not hasattr(owner, n)]
    if missing:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "(version unknown: not installed as a distribution)"
        where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
        raise SeamMissing(
            f"{package} {version}: {where} has no {', '.join(missing)}, which gpumem's adapter hooks; it was written for "
            f"{package} {written_for}: install that version, or update the adapter"
        )
