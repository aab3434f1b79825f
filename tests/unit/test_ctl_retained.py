"""gpumemctl's RETAINED section, from status replies built by hand: an orphaned group
names whose death orphaned it, whether that process is fenced and when it is released;
a held one names its holder. No section where there are no groups."""

from __future__ import annotations

from gpumem.ctl_render import render_retained, render_status
from gpumem_shared import protocol as p

from .test_ctl_render import MiB, reply


def group(state: p.RetainState, **fields: object) -> p.RetainedStatus:
    base: dict[str, object] = dict(group="engine-a", uid=1000, objects=["engine-a-kv", "engine-a-prefix"], committed_bytes=512 * MiB)
    return p.RetainedStatus(state=state, **{**base, **fields})  # type: ignore[arg-type]


def test_an_orphaned_group_names_the_dead_holder_the_fence_and_the_deadline() -> None:
    s = reply(retained=[
        group(p.RetainState.ORPHANED, previous="engine-a", previous_pid=4711, fenced=True, deadline_in_s=42.5),
        group(p.RetainState.ORPHANED, group="engine-b", previous="engine-b", previous_pid=4712, fenced=False, deadline_in_s=59.0, objects=["b-kv"]),
        group(p.RetainState.HELD, group="engine-c", holder="engine-c", holder_pid=4713, objects=[]),
        group(p.RetainState.ADOPTING, group="engine-d", holder="standby", holder_pid=4714, deadline_in_s=10.0, objects=["d-kv"]),
    ])
    assert render_retained(s) == [
        "  GROUP     UID   STATE     HOLDER / ORPHANED BY                 COMMITTED  OBJECTS                      DEADLINE",
        "  engine-a  1000  orphaned  engine-a (pid 4711, fenced)          512 MiB    engine-a-kv,engine-a-prefix  released in 0m42s",
        "  engine-b  1000  orphaned  engine-b (pid 4712, NOT fenced yet)  512 MiB    b-kv                         released in 0m59s",
        "  engine-c  1000  held      engine-c (pid 4713)                  512 MiB    -                            -",
        "  engine-d  1000  adopting  standby (pid 4714)                   512 MiB    d-kv                         unconfirmed: released in 0m10s if it dies",
    ]
    text = render_status(s)
    assert "\n".join(["", "RETAINED", *render_retained(s)]) in text


def test_no_retained_section_without_groups() -> None:
    assert "RETAINED" not in render_status(reply())
