"""The engine port: what every engine on gpumemd needs, written once, over one object an
engine supplies (``EngineAdapter``, gpumem.port.adapter). docs/engines.md, "The engine port".

- ``adapter``: the Protocol an engine implements, its layout and step figures;
- ``settings``: what an engine is asked to do (``Settings``);
- ``blocks``: the block manager following its KV pool (grow, shrink, live blocks moved);
- ``prefix``: the prefix cache kept in a retained prefix directory;
- ``weights``: a primary's weights mapped read-only by its standby, a model its caller
  built moved into the model arena;
- ``takeover``: a standby's settling and take-over;
- ``gate``: the step gate of an engine that steps on a thread of its own;
- ``engine_port``: ``EnginePort``, the calls an engine makes at its seams.
"""

from gpumem.port.adapter import EngineAdapter, KvLayout, SeamMissing, StepNeed, Unsupported, require_seams
from gpumem.port.engine_port import EnginePort
from gpumem.port.settings import STANDBY_ROOM, Settings

__all__ = ["STANDBY_ROOM", "EngineAdapter", "EnginePort", "KvLayout", "SeamMissing", "Settings", "StepNeed", "Unsupported", "require_seams"]
