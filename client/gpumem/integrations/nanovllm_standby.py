"""A nano-vllm standby from its start-up to its promotion (issue 26): what
gpumem.integrations.nanovllm does with an engine built by
``enable(name, standby=(group, secret))`` between its build and its first step as the
primary's successor. No torch and no nano-vllm here: the engine, its scheduler and its
block manager are reached through their fields and methods (nano-vllm's names), and
the torch parts (a device synchronisation, nano-vllm's sampling parameters) are the
caller's.

Once built, its decode graphs captured on the reservation's placeholder
(gpumem.standby), the standby settles (``settle``):

- It rehearses serving (``Settings.standby_rehearses``). Its first step after a
  take-over is a prefill whose prompts hit the prefix cache, and nano-vllm's start-up ran
  only a plain prefill (its warm-up) and the decode graphs' capture: that first step
  paid, on the way to the first token, for kernels loaded on their first launch (the
  prefix path's attention over a block table), pinned host tensors of new sizes, the
  sampler's first borrow of the graph pool (the borrow pool built) and the like: on the
  H200 about 150 ms from the adoption to the first token, 9 ms with the host stand-ins.
  So the standby serves a few requests itself first: a plain prefill, then a prefill of
  two prompts that share the first one's full block (the prefix-cache path), then
  decode steps (graph replays), the sampler at each (``rehearsal_prompts``). The KV
  cache is the reservation's placeholder: writes land in the standby's own scratch and
  reads see scratch, nothing of the primary's KV is read or written; the tokens mean
  nothing and are dropped.
- It resets the scheduler and the block manager: a new block manager, every block free
  and unhashed. A hash a rehearsal block kept (an entry of ``hash_to_block_id``, or a
  freed block's own hash) would be a prefix hit on adopted rows that hold other tokens,
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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpumem.errors import InvalidArgument
from gpumem.integrations.nanovllm_blocks import BlockFollower, resize
from gpumem.integrations.nanovllm_prefix import DirectoryKeeper
from gpumem.sleep import DEFAULT_WAKE_WAIT_S

if TYPE_CHECKING:
    from gpumem.engine import EngineMemory
    from gpumem.integrations.nanovllm import Settings

# Tokens the rehearsal's first request generates past its prefill; the two that share
# its block one fewer, so the decode steps run batches of three, then of one.
REHEARSAL_TOKENS = 3


def rehearsal_prompts(block_size: int, vocab: int, max_len: int) -> list[list[int]]:
    """A prompt of one full block and a token, then two that share its full block and
    differ after it (token ids below ``vocab``): each a full block of its own and a token
    or two (a prefill of some length, as serving's are) where that fits in ``max_len``
    (nano-vllm's ``max_model_len``) with the tokens generated, a token or two otherwise."""
    first = [i % vocab for i in range(block_size + 1)]
    own = block_size if 2 * block_size + 2 + REHEARSAL_TOKENS <= max_len else 0
    return [first] + [first[:block_size] + [(block_size + 1 + k + i) % vocab for i in range(own + 1 + k)] for k in range(2)]


def rehearse(llm: Any, params: Callable[[int], Any]) -> None:
    """Serve the rehearsal's requests to their end (``params(n)``: sampling parameters
    for ``n`` tokens, the end of sequence ignored)."""
    if not llm.is_finished():
        raise InvalidArgument("the standby has requests of its own: it rehearses before it serves, never between")
    config = llm.model_runner.config
    first, *sharing = rehearsal_prompts(llm.scheduler.block_manager.block_size, config.hf_config.vocab_size, config.max_model_len)
    if len(sharing[-1]) > config.max_num_batched_tokens:
        raise InvalidArgument(
            f"the standby's rehearsal prefills {len(sharing[-1])} tokens at once, past max_num_batched_tokens "
            f"({config.max_num_batched_tokens}): raise it, or enable(..., standby_rehearses=False)"
        )
    llm.add_request(first, params(REHEARSAL_TOKENS))
    llm.step()  # a plain prefill; its full block is hashed (a prefix-cache entry)
    for prompt in sharing:
        llm.add_request(prompt, params(REHEARSAL_TOKENS - 1))
    while not llm.is_finished():  # a prefill with a block table (both hit the first's block), then decodes
        llm.step()


def reset(scheduler: Any) -> None:
    """The scheduler as built: nothing waiting or running, a new block manager of the
    same size (every block free and unhashed, the free list in its first order)."""
    if scheduler.waiting or scheduler.running:
        raise InvalidArgument(f"the scheduler holds {len(scheduler.waiting) + len(scheduler.running)} sequences: a reset would leak their blocks")
    manager = scheduler.block_manager
    scheduler.block_manager = type(manager)(len(manager.blocks), manager.block_size)


def sleep_plan(share_weights: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tags, dropped) of a standby's sleep: the graphs kept, the model arena dropped
    when it holds no weights (see the module doc)."""
    return ("weights", "graphs"), ("weights",) if share_weights else ()


def settle(llm: Any, s: Settings, *, params: Callable[[int], Any], synchronize: Callable[[], None]) -> None:
    """Once the standby is built: rehearse and reset (``s.standby_rehearses``), then
    sleep (``s.standby_sleeps``); ``synchronize`` waits for the device's work, which must
    be done before memory is handed back."""
    if s.standby_rehearses:
        rehearse(llm, params)
        reset(llm.scheduler)
    if s.standby_sleeps:
        synchronize()
        tags, dropped = sleep_plan(s.share_weights)
        mem: EngineMemory = llm.model_runner._gpumem
        mem.sleep(*tags, drop=dropped)
        # Asleep, it runs nothing until take_over: its KV windows need no placeholder,
        # and the adoption then has none to unmap (gpumem.standby.Reservation.park).
        llm.model_runner.config.gpumem_reservation.park()


@dataclasses.dataclass
class TakeOver:
    """What ``take_over`` did, and when (``time.monotonic()``)."""

    seeded: int  # directory entries the block manager took as cached blocks
    trusted: int  # entries the directory vouched for
    corrupt: int  # entries it did not (a write cut short, an entry in another's slot)
    adopted_at: float  # the pool and the directory adopted
    woke_at: float  # what slept awake again (= adopted_at when nothing slept)
    seeded_at: float  # the block manager sized and seeded: the engine may step


def take_over(llm: Any, s: Settings, *, wait: float, new_block: Callable[[int], Any], restore_inputs: Callable[[], None]) -> TakeOver:
    """``gpumem.integrations.nanovllm.take_over`` (its doc); ``new_block``: nano-vllm's
    ``Block``; ``restore_inputs``: zero the graphs' static inputs, called once what slept
    is awake (see the module doc)."""
    if s.standby is None:
        raise InvalidArgument("this engine is no standby: enable(name, standby=(group, secret)) before building it")
    runner = llm.model_runner
    mem: EngineMemory = runner._gpumem
    config = runner.config
    mem.adopt_kv(*s.standby, **config.gpumem_layout, wait=wait, reservation=config.gpumem_reservation)
    adopted_at = time.monotonic()
    kv, prefix = mem.kv, mem.prefix
    if kv is None or prefix is None:
        raise InvalidArgument(f"retain group '{s.standby[0]}' kept no prefix directory: the primary must enable(retain=...)")
    woke_at = adopted_at
    if mem.asleep:
        mem.wake(wait=DEFAULT_WAKE_WAIT_S)
        restore_inputs()
        woke_at = time.monotonic()
    scheduler = llm.scheduler
    resize(scheduler.block_manager, kv.blocks, new_block)
    scheduler.gpumem_prefix = keeper = DirectoryKeeper(scheduler.block_manager, prefix)
    scan = prefix.scan(kv.blocks)
    seeded = keeper.seed(scan.blocks)
    if s.follow:
        scheduler.gpumem = BlockFollower(
            kv.pool, scheduler.block_manager, new_block=new_block, copy_blocks=config.gpumem_copy,
            sequences=lambda: [*scheduler.running, *scheduler.waiting], watermark=s.watermark_blocks, step=s.grow_step_blocks,
        )
    return TakeOver(seeded, len(scan.blocks), scan.corrupt, adopted_at, woke_at, time.monotonic())
