"""A standby engine from its start-up to its promotion (issue 26): what the port does with
an engine built with ``Settings.standby=(group, secret)`` between its build and its first
step as the primary's successor. No torch and no engine here: the engine is reached
through its adapter (gpumem.port.adapter: ``rehearse``, ``reset_scheduler``,
``synchronize``, ``restore_graph_inputs``, its blocks and prefix cache).

Once built, its decode graphs captured on the reservation's placeholder
(gpumem.standby), the standby settles (``settle``):

- It rehearses serving (``Settings.standby_rehearses``). Its first step after a
  take-over is a prefill whose prompts hit the prefix cache, and an engine's start-up ran
  only a plain prefill (its warm-up) and the decode graphs' capture: that first step
  paid, on the way to the first token, for kernels loaded on their first launch (the
  prefix path's attention over a block table), pinned host tensors of new sizes, the
  sampler's first borrow of the graph pool (the borrow pool built) and the like: on the
  H200 about 150 ms from the adoption to the first token, 9 ms with the host stand-ins.
  So the standby serves a few requests itself first: a plain prefill, then a prefill of
  two prompts that share the first one's full block (the prefix-cache path), then
  decode steps (graph replays), the sampler at each (``rehearsal_prompts``; the
  adapter's ``rehearse`` serves them: nano-vllm's start-up is what was measured). The KV
  cache is the reservation's placeholder: writes land in the standby's own scratch and
  reads see scratch, nothing of the primary's KV is read or written; the tokens mean
  nothing and are dropped.
- It resets the scheduler and the block manager (``reset_scheduler``): every block free
  and unhashed. A hash a rehearsal block kept (a prefix-cache entry, or a freed block's
  own hash) would be a prefix hit on adopted rows that hold other tokens,
  or be published into the adopted directory as such (DirectoryKeeper publishes a block
  whose hash it has not published once the block count changes).
- It puts its own memory to sleep (``Settings.standby_sleeps``; ``EngineMemory.sleep``):
  before its promotion it holds its placeholder and little else. The graphs arena is
  kept in host memory: a replay reads what its capture left in the graph pool. The
  model arena is dropped when the standby maps the primary's weights
  (``share_weights=True``): what it holds then is torch's cached blocks of the warm-up's
  and the rehearsal's activations (free), cuBLAS workspaces (scratch each call
  rewrites) and the decode graphs' static inputs and output (nano-vllm's
  ``graph_vars``, made there at capture), which each replay rewrites for its batch; the
  weights and the rotary cache are the primary's arena, the KV cache the reservation.
  The rows past a batch that a larger graph reads (token ids, positions, block tables)
  keep what was last written there, which must be in range (an embedding index, a
  rotary position, a block id): ``take_over`` has the static inputs zeroed after the
  wake, their state at capture (woken chunks are zeroed by the daemon too). What lives
  there is checked per run: bench/failover.py prints the blocks in use from torch's
  snapshot of the arena's pool, graph inputs apart. A standby with weights of its own
  keeps the model arena in host memory instead. Its reservation is parked then
  (``Reservation.park``): the placeholder leaves the KV windows, which nothing touches
  until the adoption maps the adopted chunks there.

``take_over`` adopts the pool and the directory into the reservation, wakes what slept
(same addresses: the graphs replay as captured) before anything runs, sizes the block
manager to the adopted blocks and seeds its prefix cache, and says when each happened.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from gpumem.errors import InvalidArgument
from gpumem.port.adapter import EngineAdapter, KvLayout
from gpumem.port.blocks import BlockFollower, resize
from gpumem.port.prefix import DirectoryKeeper
from gpumem.port.settings import Settings
from gpumem.sleep import DEFAULT_WAKE_WAIT_S

if TYPE_CHECKING:
    from gpumem.engine import EngineMemory
    from gpumem.standby import Reservation

# Tokens the rehearsal's first request generates past its prefill; the two that share
# its block one fewer, so the decode steps run batches of three, then of one.
REHEARSAL_TOKENS = 3


def rehearsal_prompts(block_size: int, vocab: int, max_len: int) -> list[list[int]]:
    """A prompt of one full block and a token, then two that share its full block and
    differ after it (token ids below ``vocab``): each a full block of its own and a token
    or two (a prefill of some length, as serving's are) where that fits in ``max_len``
    (the engine's longest sequence) with the tokens generated, a token or two otherwise.
    An adapter's ``rehearse`` serves the first alone for a step, then the two beside it."""
    first = [i % vocab for i in range(block_size + 1)]
    own = block_size if 2 * block_size + 2 + REHEARSAL_TOKENS <= max_len else 0
    return [first] + [first[:block_size] + [(block_size + 1 + k + i) % vocab for i in range(own + 1 + k)] for k in range(2)]


def sleep_plan(share_weights: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tags, dropped) of a standby's sleep: the graphs kept, the model arena dropped
    when it holds no weights (see the module doc)."""
    return ("weights", "graphs"), ("weights",) if share_weights else ()


def settle(engine: EngineAdapter, mem: EngineMemory, s: Settings, reservation: Reservation) -> None:
    """Once the standby is built: rehearse and reset (``s.standby_rehearses``), then
    sleep (``s.standby_sleeps``) once the device's work is done."""
    if s.standby_rehearses:
        engine.rehearse()
        engine.reset_scheduler()
    if s.standby_sleeps:
        engine.synchronize()
        tags, dropped = sleep_plan(s.share_weights)
        mem.sleep(*tags, drop=dropped)
        # Asleep, it runs nothing until take_over: its KV windows need no placeholder,
        # and the adoption then has none to unmap (gpumem.standby.Reservation.park).
        reservation.park()


@dataclasses.dataclass
class TakeOver:
    """What ``take_over`` did, and when (``time.monotonic()``)."""

    seeded: int  # directory entries the block manager took as cached blocks
    trusted: int  # entries the directory vouched for
    corrupt: int  # entries it did not (a write cut short, an entry in another's slot)
    adopted_at: float  # the pool and the directory adopted
    woke_at: float  # what slept awake again (= adopted_at when nothing slept)
    seeded_at: float  # the block manager sized and seeded: the engine may step


@dataclasses.dataclass
class Promoted:
    """The standby as a primary: what it took over, its directory's keeper, and its
    follower (None with ``follow=False``)."""

    took: TakeOver
    keeper: DirectoryKeeper
    follower: BlockFollower | None


def take_over(
    engine: EngineAdapter, mem: EngineMemory, s: Settings, layout: KvLayout, reservation: Reservation, *, wait: float
) -> Promoted:
    """Wait up to ``wait`` seconds for the primary's death and its fence, adopt its KV
    cache and prefix directory into ``reservation`` (the graphs captured on it replay on
    the adopted rows), wake what the standby put to sleep (then the graphs' static inputs
    restored), size the block manager to the adopted blocks and seed its prefix cache
    from the directory's trusted entries."""
    if s.standby is None:
        raise InvalidArgument(f"engine '{s.name}' is no standby: build it with standby=(group, secret) to take over")
    mem.adopt_kv(*s.standby, **layout.describe(), wait=wait, reservation=reservation)
    adopted_at = time.monotonic()
    kv, prefix = mem.kv, mem.prefix
    if kv is None or prefix is None:
        raise InvalidArgument(f"retain group '{s.standby[0]}' kept no prefix directory: the primary must retain with one (retain=)")
    woke_at = adopted_at
    if mem.asleep:
        mem.wake(wait=DEFAULT_WAKE_WAIT_S)
        engine.restore_graph_inputs()
        woke_at = time.monotonic()
    resize(engine, kv.blocks)
    keeper = DirectoryKeeper(engine, prefix)
    scan = prefix.scan(kv.blocks)
    seeded = keeper.seed(scan.blocks)
    follower = None
    if s.follow:
        follower = BlockFollower(kv.pool, engine, watermark=s.watermark_blocks, step=s.grow_step_blocks, reserved=layout.reserved_blocks)
    took = TakeOver(seeded, len(scan.blocks), scan.corrupt, adopted_at, woke_at, time.monotonic())
    return Promoted(took, keeper, follower)
