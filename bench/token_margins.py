"""Two runs' greedy token ids compared: how many sequences differ (``differing``), where
two sequences part (``parting_point``) and, where one parts, whether a near-tie decided it
(``parting_gaps`` against ``TIE_GAP``). The inputs are plain lists and dicts as an
engine's JSON gives them: token ids and, per generated token, the gap between the best and
the second-best logit (which bench/nanovllm_kit.py's greedy sampler records; engines that
record none are judged exactly). No engine is imported here, so the orchestrators that
judge runs, on the host too, take this alone: bench/burst.py, bench/failover.py,
bench/engine.py and tests/integration/test_standby_gpu.py; bench/nanovllm_kit.py counts its
engine's differing sequences with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Greedy tokens of two runs of one request are identical up to near-ties: a batch of
# another size (or a prefill of another length) runs other kernels, and bf16 logits then
# differ in their last bits (on the H200 38 of 128 requests parted between burst.py's
# elastic and static runs, 39 between alone, which runs no daemon at all, and static). A
# run parts where the best logit led by at most this (4 bf16 steps at these logits'
# magnitude, about 2 to 4) in both runs, or it is counted: KV read back wrong changes a
# token where the lead is clear.
TIE_GAP = 1 / 16


def parting_gaps(
    want: dict[str, list[int]], got: dict[str, list[int]], want_margins: dict[str, list[float]], got_margins: dict[str, list[float]],
) -> list[float]:
    """Per request whose tokens in ``got`` differ from ``want``: the larger of the two
    runs' best-to-second-best logit gaps at the first token where they part (inf where a
    run recorded none, e.g. host stand-ins, whose tokens must not part at all)."""
    gaps = []
    for rid, tokens in want.items():
        other = got.get(rid) or []
        if other == tokens:
            continue
        at = parting_point(tokens, other)
        both = [m[rid][at] if at < len(m.get(rid, [])) else math.inf for m in (want_margins, got_margins)]
        gaps.append(max(both))
    return gaps


def differing(a: list[list[int]], b: list[list[int]]) -> int:
    """How many sequences differ between two runs' completions."""
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))


def parting_point(a: Sequence[object], b: Sequence[object]) -> int:
    """The first index where two sequences differ (the shorter's length where one is the
    other's start)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
