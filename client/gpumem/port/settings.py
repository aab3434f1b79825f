"""What an engine on the port is asked to do: one ``Settings`` per engine, given to
``EnginePort`` (an integration's ``enable(name, **options)`` builds it from its keywords).
Engine-agnostic: an option an engine cannot honour is refused by its adapter
(``gpumem.port.adapter.Unsupported``), never ignored."""

from __future__ import annotations

import dataclasses

from gpumem.errors import InvalidArgument

# What a standby takes on the GPU beside its primary before it adopts: its CUDA context,
# its warm-up's and graph capture's temporaries, its graph pool and its own weights unless
# it maps the primary's. A retaining primary's round leaves it free (``standby_room``): on
# the H200 a primary that left only its 512 MiB headroom took all but 1 GiB, and the
# standby of bench/nanovllm_kit.py's model (0.75 GB of weights) failed to load its
# weights; 8 GiB let it build, weights included (bench/failover.py).
STANDBY_ROOM = 8 << 30


@dataclasses.dataclass
class Settings:
    name: str
    device: int | str = 0
    expect: int = 0  # engines the round gathers (0: whoever reported by then)
    headroom_bytes: int = 512 << 20  # left free by the round: what the engine takes past its arenas after it (bench/engine.py: after_round)
    min_blocks: int = 0
    weight: float = 1.0
    borrow_sampler: bool = True
    runtime_dir: str | None = None
    tenant_token_file: str | None = None  # the engine pod's tenant token (its DRA claim's directory gives it)
    follow: bool = True  # the block manager follows the pool at run time
    watermark_blocks: int = 16  # grow once fewer would stay free
    grow_step_blocks: int = 64  # grows in multiples of this
    retain: str = ""  # a retain group for the KV cache and its prefix directory (EnginePort.retain_secret gives the secret)
    standby_room: int = STANDBY_ROOM  # with retain: left free by the round beside headroom_bytes, for a standby or successor to build in
    standby: tuple[str, str] | None = None  # (group, secret): build as the standby of the engine retaining that group
    weights_to: str = ""  # with retain: grant the model's weights read-only to this standby (its client name)
    share_weights: bool = False  # with standby: map the primary's weights (its weights_to names this engine), load none
    standby_rehearses: bool = True  # with standby: serve a few requests on the placeholder once built (gpumem.port.takeover)
    standby_sleeps: bool = True  # with standby: then sleep until take_over (graphs kept, model arena dropped with share_weights)

    def __post_init__(self) -> None:
        if self.weights_to and not self.retain or self.share_weights and not self.standby:
            raise InvalidArgument("weights_to= goes with retain= (a primary), share_weights=True with standby= (its standby)")
        if self.retain and self.standby:
            raise InvalidArgument("an engine is a primary (retain=) or a standby (standby=), not both")

    @property
    def round_headroom(self) -> int:
        """What the round leaves free for this engine: its headroom, and a retaining
        primary's room for its standby."""
        return self.headroom_bytes + (self.standby_room if self.retain else 0)
