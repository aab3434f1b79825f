/*
 * Lease words in shared memory: the fast path of capture / replay / borrow leases on
 * graph pools.
 *
 * Each registered graph pool has one 64-byte slot (lease_table.h describes it) in a
 * segment of its own: a memfd the daemon creates and hands only to the sessions allowed
 * to use the pool, which map it. A free slot's word is 0; a held one encodes the lease
 * kind, the holder's session id and pid. An uncontended acquire or release is one
 * compare-and-swap, no daemon round trip. A waiter sleeps on the slot's futex word,
 * which every release bumps; a release makes the wake system call only when waiters are
 * counted. Each release also folds its hold into the segment's estimate (lease_hold), so
 * that a waiter can sleep only until just before the holder it found is likely to let go
 * and be awake, watching the word, when it does (gpumem_lease_acquire). The daemon
 * clears the word of a session that ended (a holder killed mid-lease) and words and
 * fields a client could not rightly have written (garbage, or a session that may not use
 * the pool), and wakes the waiters. Shared (not private)
 * futexes: a segment is MAP_SHARED across processes.
 *
 * Across processes, a lease also orders GPU work: on a pool other processes use, the
 * releaser records its IPC event on its stream and names itself in ``handoff``; a taker
 * from another process waits on that event (LEASE_OK_ORDER tells it to). The ordered
 * release frees the slot before it records, with ``handoff`` marked recording until the
 * record lands: the waiter's wake-up (tens of microseconds) and the record overlap, and
 * every taker waits for the mark to go before it touches the pool or its event, within
 * its own bound (a try does not wait: it gives the slot back at once). Within one
 * process nothing is waited on: work on one stream is ordered by the stream, and work on
 * two streams of one process is the caller's to order. A borrower whose tensors
 * outlived their scope asks the daemon to mark ``escaped``, which refuses replay and
 * capture until it reports them gone (or its session ends).
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "lease_table.h"

static int64_t now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int valid(uint64_t word) {
    switch (LEASE_KIND_OF(word)) {
#define KIND_CASE(name, value) case value:
        LEASE_KINDS(KIND_CASE)
#undef KIND_CASE
        return 1;
    default:
        return word == 0;
    }
}

/* A replay or capture would overwrite (or re-carve) bytes a borrower still uses. */
static int escaped_for(lease_slot *slot, uint64_t mine) {
    return LEASE_KIND_OF(mine) != LEASE_KIND_BORROW && __atomic_load_n(&slot->escaped, __ATOMIC_ACQUIRE) != 0;
}

static void wake(lease_slot *slot);

/* How long a waiter watches the word before it sleeps on the futex: a holder that lets
 * go within it hands over without a wake-up (which costs 4-23 us from C alone, by
 * machine: bench/lease.py measures it), and a longer hold costs the waiter this much CPU
 * once. */
#define LEASE_SPIN_NS 20000
#define LEASE_SPIN_CHECK 64 /* pauses between clock reads */

/* A waiter with a predicted release (release_ahead) wakes this long before it, then
 * watches the word for up to twice as long. More than the kernel's default timer slack
 * (50 us), by which a normal thread's timed sleep may end late (on the 2-core VM it ended
 * 94 us late at the median, the slack and the wake-up together); the watch covers a hold
 * that ends that much early or late. */
#define LEASE_WAKE_EARLY_NS 150000
#define LEASE_WATCH_NS (2 * LEASE_WAKE_EARLY_NS)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Watch the word while it still holds ``seen``, up to ``spin_ns`` or the deadline;
 * ``yield``: giving the core away between checks to whatever else waits for it. A watch
 * of hundreds of microseconds must: the holder it waits for may be queued behind it on
 * its core (on the 2-core VM, where the two took turns on one core most of the time, a
 * plain spin made the holds' p90 up to 250 us longer), while with nothing else to run
 * the yield returns at once (0.8 us there). */
static void spin_while(lease_slot *slot, uint64_t seen, int64_t spin_ns, int64_t deadline, int yield) {
    int64_t until = now_ns(CLOCK_MONOTONIC) + spin_ns;
    if (until > deadline) until = deadline;
    for (;;) {
        for (int i = 0; i < LEASE_SPIN_CHECK; i++) {
            if (__atomic_load_n(&slot->word, __ATOMIC_ACQUIRE) != seen) return;
            cpu_relax();
        }
        if (yield) sched_yield();
        if (now_ns(CLOCK_MONOTONIC) >= until) return;
    }
}

static lease_hold *hold_of(lease_slot *slot) { return (lease_hold *)((char *)slot + LEASE_HOLD_OFFSET); }

/* The holder, before its release frees the slot: its hold (since its take's since_ns)
 * folded into the estimate, a quarter of the way from the last one. A hold outside (0,
 * LEASE_HOLD_MAX_NS] (a long one, or a since_ns another process scribbled) leaves no
 * estimate, and an estimate out of that range is started afresh from this hold. */
static void record_hold(lease_slot *slot) {
    lease_hold *hold = hold_of(slot);
    uint64_t held = (uint64_t)now_ns(CLOCK_REALTIME) - __atomic_load_n(&slot->since_ns, __ATOMIC_RELAXED);
    uint64_t before = __atomic_load_n(&hold->typical_ns, __ATOMIC_RELAXED);
    uint64_t next = 0;
    if (held > 0 && held <= LEASE_HOLD_MAX_NS)
        next = before > 0 && before <= LEASE_HOLD_MAX_NS ? (uint64_t)((int64_t)before + ((int64_t)held - (int64_t)before) / 4)
                                                         : held;
    __atomic_store_n(&hold->typical_ns, next, __ATOMIC_RELAXED);
}

/* ns from now until the holder that took the slot at its since_ns lets go, by the
 * estimate; 0 predicts nothing: no estimate or one out of range, or a release not ahead
 * (the holder overran it, or since_ns is in the future: the difference wraps). Written
 * by any process that maps the segment: the answer is never above LEASE_HOLD_MAX_NS. */
static int64_t release_ahead(lease_slot *slot) {
    uint64_t typical = __atomic_load_n(&hold_of(slot)->typical_ns, __ATOMIC_RELAXED);
    if (typical == 0 || typical > LEASE_HOLD_MAX_NS) return 0;
    uint64_t held = (uint64_t)now_ns(CLOCK_REALTIME) - __atomic_load_n(&slot->since_ns, __ATOMIC_RELAXED);
    return held < typical ? (int64_t)(typical - held) : 0;
}

static void set_label(lease_slot *slot, const char *label, uint32_t len) {
    if (len > sizeof(slot->label)) len = sizeof(slot->label);
    for (uint32_t i = 0; i < len; i++) slot->label[i] = label[i];
    if (len < sizeof(slot->label)) slot->label[len] = 0;
}

/* The epoch and escape checks come before the compare-and-swap; a whole retire or
 * borrow-and-escape may fit between the two. Checked again once the slot is ours; if
 * either changed, the take is undone. */
static int recheck(lease_slot *slot, uint64_t mine, uint32_t epoch) {
    int status = 0;
    if (epoch && __atomic_load_n(&slot->epoch, __ATOMIC_SEQ_CST) != epoch) status = LEASE_STALE;
    else if (escaped_for(slot, mine)) status = LEASE_ESCAPED;
    if (status) {
        uint64_t held = mine;
        if (__atomic_compare_exchange_n(&slot->word, &held, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) wake(slot);
    }
    return status;
}

/* After a successful take: must the new holder order its stream after the releaser's?
 * A record still in flight is waited for by any taker, of the same session too: the
 * session's next record into the same event must not land before it. */
static int taken(lease_slot *slot, uint64_t mine) {
    slot->since_ns = (uint64_t)now_ns(CLOCK_REALTIME);
    if (!(__atomic_load_n(&slot->flags, __ATOMIC_ACQUIRE) & LEASE_FLAG_SHARED)) return LEASE_OK;
    uint32_t last = __atomic_load_n(&slot->handoff, __ATOMIC_ACQUIRE);
    if (!LEASE_HANDOFF_VALID(last)) return LEASE_OK; /* garbage names no releaser: nothing to wait for */
    if (last & LEASE_HANDOFF_RECORDING) return LEASE_OK_ORDER;
    return last && last != LEASE_SESSION_OF(mine) ? LEASE_OK_ORDER : LEASE_OK;
}

/* Take the slot for ``mine`` (a nonzero word). ``epoch`` 0 skips the epoch check.
 * timeout_ns 0 tries once; > 0 waits at most that long: watching the word for a while,
 * then asleep on the futex. Once per call, a holder predicted to let go within
 * LEASE_HOLD_MAX_NS (release_ahead) is slept on only until LEASE_WAKE_EARLY_NS before
 * then, and the word watched for LEASE_WATCH_NS: a release in that window hands over to a
 * waiter that is awake, with no wake system call on either side, where a sleeper woken
 * by the futex runs its first lines cold on a core that slept (bench/lease.py: ~10 us of
 * a handoff). A release during the timed sleep wakes it by the futex as before; a holder
 * that overruns the watch finds it asleep again until the deadline. A ``label`` (NULL:
 * none) is recorded once the slot is ours, in the same call, so a waiter woken by a
 * release returns holding a labelled lease.
 * On LEASE_HELD or LEASE_CORRUPT, *holder is the word found. */
int gpumem_lease_acquire(lease_slot *slot, uint64_t mine, uint32_t epoch, int64_t timeout_ns, uint64_t *holder,
                         const char *label, uint32_t len) {
    int64_t deadline = timeout_ns > 0 ? now_ns(CLOCK_MONOTONIC) + timeout_ns : 0;
    int spun = 0, predicted = 0;
    for (;;) {
        uint64_t seen = __atomic_load_n(&slot->word, __ATOMIC_ACQUIRE);
        if (!valid(seen)) {
            *holder = seen;
            return LEASE_CORRUPT;
        }
        if (seen == 0) {
            if (epoch && __atomic_load_n(&slot->epoch, __ATOMIC_ACQUIRE) != epoch) return LEASE_STALE;
            if (escaped_for(slot, mine)) return LEASE_ESCAPED;
            uint64_t expected = 0;
            if (__atomic_compare_exchange_n(&slot->word, &expected, mine, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
                int undone = recheck(slot, mine, epoch);
                if (undone) return undone;
                if (label) set_label(slot, label, len);
                return taken(slot, mine);
            }
            continue; /* lost the race: look again */
        }
        *holder = seen;
        /* A retired segment stays retired whatever its word says: a pool that moved to a
         * fresh segment leaves the old one to a former user, who may write any word there. */
        if (epoch && __atomic_load_n(&slot->epoch, __ATOMIC_ACQUIRE) != epoch) return LEASE_STALE;
        int64_t left = deadline - now_ns(CLOCK_MONOTONIC);
        if (timeout_ns <= 0 || left <= 0) return LEASE_HELD;
        if (!spun) {
            spun = 1;
            spin_while(slot, seen, LEASE_SPIN_NS, deadline, 0);
            continue;
        }
        int64_t ahead = predicted ? 0 : release_ahead(slot);
        predicted = 1;
        int64_t nap = ahead ? ahead - LEASE_WAKE_EARLY_NS : left;
        if (nap > left) nap = left;
        if (nap > 0) {
            uint32_t generation = __atomic_load_n(&slot->futex, __ATOMIC_ACQUIRE);
            __atomic_add_fetch(&slot->waiters, 1, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(&slot->word, __ATOMIC_SEQ_CST) == seen) {
                struct timespec rel = {.tv_sec = nap / 1000000000LL, .tv_nsec = nap % 1000000000LL};
                /* Sleeps only while the generation is unchanged: a release after our load
                 * bumped it, and the kernel returns at once. */
                syscall(SYS_futex, &slot->futex, FUTEX_WAIT, generation, &rel, NULL, 0);
            }
            __atomic_sub_fetch(&slot->waiters, 1, __ATOMIC_SEQ_CST);
        }
        if (ahead) spin_while(slot, seen, LEASE_WATCH_NS, deadline, 1);
    }
}

/* The uncontended path in one call: take a free slot whose epoch matches and record
 * the holder's label. Returns LEASE_OK or LEASE_OK_ORDER when taken, or anything else
 * to send the caller to gpumem_lease_acquire for the reason and the wait. */
int gpumem_lease_try(lease_slot *slot, uint64_t mine, uint32_t epoch, const char *label, uint32_t len) {
    uint64_t expected = 0;
    if (epoch && __atomic_load_n(&slot->epoch, __ATOMIC_ACQUIRE) != epoch) return LEASE_STALE;
    if (escaped_for(slot, mine)) return LEASE_ESCAPED;
    if (!__atomic_compare_exchange_n(&slot->word, &expected, mine, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return LEASE_HELD;
    int undone = recheck(slot, mine, epoch);
    if (undone) return undone;
    set_label(slot, label, len);
    return taken(slot, mine);
}

static void wake(lease_slot *slot) {
    __atomic_add_fetch(&slot->futex, 1, __ATOMIC_SEQ_CST);
    /* Sequentially consistent with the waiter's "count myself, then look at the word":
     * either it sees the word free, or this sees it counted and wakes it. */
    if (__atomic_load_n(&slot->waiters, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &slot->futex, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Free the slot if it still holds ``word``, without ordering: the daemon's sweep, a
 * take undone, and the last step of the holders' releases below (after record_hold). */
int gpumem_lease_clear(lease_slot *slot, uint64_t word) {
    uint64_t expected = word;
    if (!__atomic_compare_exchange_n(&slot->word, &expected, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return LEASE_NOT_HOLDER;
    wake(slot);
    return LEASE_OK;
}

/* A holder's release: LEASE_NOT_HOLDER if the slot no longer holds ``word`` (a double
 * release, or a lease the daemon already swept). On a shared pool it frees nothing and
 * returns LEASE_RECORD: the holder records its IPC event first (release_recorded). */
int gpumem_lease_release(lease_slot *slot, uint64_t word) {
    if (__atomic_load_n(&slot->word, __ATOMIC_ACQUIRE) != word) return LEASE_NOT_HOLDER;
    if (__atomic_load_n(&slot->flags, __ATOMIC_ACQUIRE) & LEASE_FLAG_SHARED) return LEASE_RECORD;
    record_hold(slot);
    return gpumem_lease_clear(slot, word);
}

/* The release of a holder that recorded its IPC event on its stream: the next holder
 * from another session waits on that event before touching the pool. */
int gpumem_lease_release_recorded(lease_slot *slot, uint64_t word) {
    if (__atomic_load_n(&slot->word, __ATOMIC_ACQUIRE) != word) return LEASE_NOT_HOLDER;
    __atomic_store_n(&slot->handoff, LEASE_SESSION_OF(word), __ATOMIC_RELEASE);
    record_hold(slot);
    return gpumem_lease_clear(slot, word);
}

/* The ordered release's first half: the slot names the holder as the releaser to order
 * after, marked recording, and is freed (its waiters woken). The caller records its
 * event next and ends the mark with gpumem_lease_recorded. */
int gpumem_lease_release_recording(lease_slot *slot, uint64_t word) {
    if (__atomic_load_n(&slot->word, __ATOMIC_ACQUIRE) != word) return LEASE_NOT_HOLDER;
    uint32_t session = LEASE_SESSION_OF(word);
    __atomic_store_n(&slot->handoff, session | LEASE_HANDOFF_RECORDING, __ATOMIC_SEQ_CST);
    record_hold(slot);
    int status = gpumem_lease_clear(slot, word);
    if (status != LEASE_OK) gpumem_lease_recorded(slot, session, 0); /* swept meanwhile: nothing to record for */
    return status;
}

/* The record ``session`` marked is done: ``ok``, its event now marks its work; else it
 * failed, and the slot stops naming it (nobody waits on an event that marks nothing). A
 * mark the daemon cleared meanwhile is left alone. */
void gpumem_lease_recorded(lease_slot *slot, uint32_t session, int ok) {
    uint32_t seen = session | LEASE_HANDOFF_RECORDING;
    __atomic_compare_exchange_n(&slot->handoff, &seen, ok ? session : 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

/* Between polls of a record still not landed after LEASE_SPIN_NS: the pause starts at
 * this and doubles up to the cap, so a releaser stopped mid-record costs a taker that
 * waits long little CPU, and the taker overshoots its bound by one cap at most. */
#define RECORD_POLL_NS 20000
#define RECORD_POLL_MAX_NS 1000000

/* After a take told LEASE_OK_ORDER: the releaser to order after (0: none), once its
 * record has landed: watched for LEASE_SPIN_NS, then polled. LEASE_RECORDING if it has
 * not within ``timeout_ns`` (the releaser stopped between freeing and recording; the
 * daemon clears the mark of one that ends), with *releaser the session still marked.
 * timeout_ns <= 0 looks once. The taker's bound is the caller's: what is left of its
 * wait, nothing for a try. */
int gpumem_lease_await_record(lease_slot *slot, int64_t timeout_ns, uint32_t *releaser) {
    int64_t start = 0;
    int64_t pause = RECORD_POLL_NS;
    for (;;) {
        uint32_t seen = __atomic_load_n(&slot->handoff, __ATOMIC_ACQUIRE);
        if (!LEASE_HANDOFF_VALID(seen)) { /* garbage: no releaser records anything */
            *releaser = 0;
            return LEASE_OK;
        }
        if (!(seen & LEASE_HANDOFF_RECORDING)) {
            *releaser = seen;
            return LEASE_OK;
        }
        int64_t now = now_ns(CLOCK_MONOTONIC);
        if (!start) start = now;
        if (now - start >= timeout_ns) {
            *releaser = seen & ~LEASE_HANDOFF_RECORDING;
            return LEASE_RECORDING;
        }
        if (now - start < LEASE_SPIN_NS) {
            for (int i = 0; i < LEASE_SPIN_CHECK; i++) cpu_relax();
        } else {
            int64_t left = timeout_ns - (now - start);
            struct timespec rest = {.tv_sec = 0, .tv_nsec = (long)(pause < left ? pause : left)};
            nanosleep(&rest, NULL);
            if (pause < RECORD_POLL_MAX_NS) pause *= 2;
        }
    }
}

/* The daemon: the slot's flags, its escape mark (one of the sessions whose borrowed
 * tensors outlived their scope, 0 for none: the daemon keeps the whole set), and
 * forgetting a session that ended as the last releaser (its event died with it). */
void gpumem_lease_set_flags(lease_slot *slot, uint32_t flags) { __atomic_store_n(&slot->flags, flags, __ATOMIC_RELEASE); }

void gpumem_lease_set_escaped(lease_slot *slot, uint32_t session) {
    __atomic_store_n(&slot->escaped, session, __ATOMIC_SEQ_CST);
}

void gpumem_lease_forget_handoff(lease_slot *slot, uint32_t session) {
    uint32_t seen = session;
    if (__atomic_compare_exchange_n(&slot->handoff, &seen, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return;
    seen = session | LEASE_HANDOFF_RECORDING; /* it ended (or lost the right) mid-record */
    __atomic_compare_exchange_n(&slot->handoff, &seen, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

/* The daemon's repair: clear the handoff if it still holds ``seen`` (which names no user,
 * or is no valid handoff at all). LEASE_NOT_HOLDER if it changed meanwhile. */
int gpumem_lease_clear_handoff(lease_slot *slot, uint64_t seen) {
    uint32_t expected = (uint32_t)seen;
    if (seen > UINT32_MAX) return LEASE_NOT_HOLDER;
    return __atomic_compare_exchange_n(&slot->handoff, &expected, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST) ? LEASE_OK
                                                                                                          : LEASE_NOT_HOLDER;
}

uint64_t gpumem_lease_peek(lease_slot *slot) { return __atomic_load_n(&slot->word, __ATOMIC_ACQUIRE); }

/* The session whose event a taker told LEASE_OK_ORDER waits on (0: none, or forgotten
 * since: the releaser ended, and its queued work went with its context). */
uint32_t gpumem_lease_handoff(lease_slot *slot) { return __atomic_load_n(&slot->handoff, __ATOMIC_ACQUIRE); }

void gpumem_lease_set_epoch(lease_slot *slot, uint32_t epoch) { __atomic_store_n(&slot->epoch, epoch, __ATOMIC_RELEASE); }
