/*
 * The one description of a graph pool's lease slot: its layout, what the lease calls
 * return, the lease kinds, the slot flags, the segment and label sizes. leases.c
 * implements the calls on it; module.c exports every constant here and the slot's layout
 * (each field's offset and size) to Python, where gpumem_shared/lease_table.py builds
 * its enums and maps segments, and a unit test checks its ctypes view of a slot against
 * that layout.
 *
 * The statuses, kinds and flags are lists of (name, value) expanded twice, into the C
 * enums below and into module.c's exports, so that no second list can fall out of step.
 */
#ifndef GPUMEM_LEASE_TABLE_H
#define GPUMEM_LEASE_TABLE_H

#include <stdint.h>

/* Each graph pool's slot lives alone in its own lease segment, a memfd of one page (the
 * unit a mapping comes in) that only the sessions allowed to use the pool receive. */
#define LEASE_SEGMENT_BYTES 4096
#define LEASE_LABEL_BYTES 24

typedef struct {
    uint64_t word;     /* 0, or kind << 56 | session << 32 | pid */
    uint32_t futex;    /* bumped by every release */
    uint32_t waiters;  /* processes sleeping on futex */
    uint64_t since_ns; /* CLOCK_REALTIME when the holder acquired */
    uint32_t epoch;    /* the pool's epoch, written by the daemon */
    uint32_t flags;    /* LEASE_FLAG_*, written by the daemon */
    uint32_t handoff;  /* session of the last releaser that records its IPC event, | LEASE_HANDOFF_RECORDING
                        * while that record is still being made */
    uint32_t escaped;  /* session whose borrowed tensors outlived their scope */
    char label[LEASE_LABEL_BYTES]; /* the holder's label, for error messages (not synchronised) */
} lease_slot;

_Static_assert(sizeof(lease_slot) == 64, "a lease slot is one cache line");
_Static_assert(sizeof(lease_slot) <= LEASE_SEGMENT_BYTES, "a lease slot fits its segment");

/* On the cache line after the slot: under memops ordering (gpumem_shared/lease_order.py)
 * the last releaser's sequence lane and the value its stream writes there, written by
 * the holder before its release frees the slot (whose release store orders them). */
typedef struct {
    uint32_t lane;
    uint32_t pad;
    uint64_t value;
} lease_order_pair;
#define LEASE_ORDER_OFFSET 64
_Static_assert(LEASE_ORDER_OFFSET >= sizeof(lease_slot), "the pair does not overlap the slot");
_Static_assert(LEASE_ORDER_OFFSET + sizeof(lease_order_pair) <= LEASE_SEGMENT_BYTES, "the pair fits the segment");

/* After the pair, on its line: how long the slot's holders keep it (an average of recent
 * holds, each now - since_ns at its release), written by each holder's release before it
 * frees the slot, read by a waiter to sleep until shortly before the holder it found is
 * likely to let go, then watch the word (leases.c). Any process that maps the segment
 * can write it: a value outside (0, LEASE_HOLD_MAX_NS] predicts nothing. */
typedef struct {
    uint64_t typical_ns;
} lease_hold;
#define LEASE_HOLD_OFFSET (LEASE_ORDER_OFFSET + 16)
#define LEASE_HOLD_MAX_NS 10000000 /* 10 ms: longer holds vary by more than a waiter's watch */
_Static_assert(LEASE_HOLD_OFFSET >= LEASE_ORDER_OFFSET + sizeof(lease_order_pair), "the estimate does not overlap the pair");
_Static_assert(LEASE_HOLD_OFFSET + sizeof(lease_hold) <= LEASE_ORDER_OFFSET + 64,
               "the estimate shares the pair's line, not the slot's");

/* A session's side of one memops lane (lease_order.py's ReleaserLane), in that process's
 * memory: read by Python, written only by the session's native releases (the GIL held).
 * A lane's values are generation << LEASE_SEQ_BITS | n, n counting its releases from 1. */
#define LEASE_SEQ_BITS 40
#define LEASE_SEQ_MASK ((UINT64_C(1) << LEASE_SEQ_BITS) - 1)
typedef struct {
    uint64_t word;   /* the lane's word in the sequence chunk, as mapped in this process */
    uint64_t last;   /* the value the lane reaches once every release so far is written */
    uint64_t stream; /* the stream that wrote ``last`` (none while n is 0) */
    uint32_t lane;   /* the lane's index in the chunk, published with each value */
    uint32_t pad;
} lease_lane;

#define LEASE_KIND_OF(word) ((uint32_t)((word) >> 56))
#define LEASE_SESSION_OF(word) ((uint32_t)(((word) >> 32) & 0xFFFFFFu))

/* In ``handoff``: the releaser it names freed the slot and has not finished recording
 * its event yet (a release frees first, so that a waiter wakes while it records). */
#define LEASE_HANDOFF_RECORDING 0x80000000u
/* A handoff is 0, a 24-bit session, or one | LEASE_HANDOFF_RECORDING: any other bit set
 * names nobody (a user wrote garbage). Takers order after no one for it, and the daemon
 * clears it. */
#define LEASE_HANDOFF_SESSION 0x00FFFFFFu
#define LEASE_HANDOFF_VALID(handoff) (((handoff) & ~(LEASE_HANDOFF_RECORDING | LEASE_HANDOFF_SESSION)) == 0)

/* What the lease calls return. */
#define LEASE_STATUSES(X)                                                                            \
    X(OK, 0)         /* taken, or released */                                                        \
    X(HELD, 1)       /* another holder has the slot */                                               \
    X(STALE, 2)      /* the slot's epoch is not the caller's: the pool was recaptured or retired */  \
    X(CORRUPT, 3)    /* the slot holds an impossible word (the daemon clears it on its next tick) */ \
    X(NOT_HOLDER, 4) /* the slot no longer holds the caller's word */                                \
    X(OK_ORDER, 5)   /* taken; the last releaser was another process (or is still recording): order */ \
    X(ESCAPED, 6)    /* refused: borrowed tensors outlived their scope (see `escaped`) */            \
    X(RECORD, 7)     /* not released: a shared pool; record the event, then release_recorded */      \
    X(OK_WAITED, 8)  /* taken, and the stream already waits on that event (lease_order.c's ordered calls) */ \
    X(RECORDING, 9)  /* not taken: the last releaser's record did not land within the caller's bound */

/* A lease word's kind, its top byte; 0 is no kind, so a held word is never 0. */
#define LEASE_KINDS(X)                                                                               \
    X(CAPTURE, 1)                                                                                    \
    X(REPLAY, 2)                                                                                     \
    X(BORROW, 3)

/* Slot flags, written by the daemon. */
#define LEASE_FLAGS(X)                                                                               \
    X(SHARED, 1u) /* other processes take leases on this pool: releasers record their IPC event */

#define LEASE_STATUS_MEMBER(name, value) LEASE_##name = value,
#define LEASE_KIND_MEMBER(name, value) LEASE_KIND_##name = value,
#define LEASE_FLAG_MEMBER(name, value) LEASE_FLAG_##name = value,
enum lease_status { LEASE_STATUSES(LEASE_STATUS_MEMBER) };
enum lease_kind { LEASE_KINDS(LEASE_KIND_MEMBER) };
enum lease_flag { LEASE_FLAGS(LEASE_FLAG_MEMBER) };
#undef LEASE_STATUS_MEMBER
#undef LEASE_KIND_MEMBER
#undef LEASE_FLAG_MEMBER

/* The calls, on a mapped slot (leases.c says what each does). */
int gpumem_lease_acquire(lease_slot *slot, uint64_t mine, uint32_t epoch, int64_t timeout_ns, uint64_t *holder,
                         const char *label, uint32_t len);
int gpumem_lease_try(lease_slot *slot, uint64_t mine, uint32_t epoch, const char *label, uint32_t len);
int gpumem_lease_clear(lease_slot *slot, uint64_t word);
int gpumem_lease_release(lease_slot *slot, uint64_t word);
int gpumem_lease_release_recorded(lease_slot *slot, uint64_t word);
int gpumem_lease_release_recording(lease_slot *slot, uint64_t word);
void gpumem_lease_recorded(lease_slot *slot, uint32_t session, int ok);
int gpumem_lease_await_record(lease_slot *slot, int64_t timeout_ns, uint32_t *releaser);
void gpumem_lease_set_flags(lease_slot *slot, uint32_t flags);
void gpumem_lease_set_escaped(lease_slot *slot, uint32_t session);
void gpumem_lease_forget_handoff(lease_slot *slot, uint32_t session);
int gpumem_lease_clear_handoff(lease_slot *slot, uint64_t seen);
uint64_t gpumem_lease_peek(lease_slot *slot);
uint32_t gpumem_lease_handoff(lease_slot *slot);
void gpumem_lease_set_epoch(lease_slot *slot, uint32_t epoch);

#endif
