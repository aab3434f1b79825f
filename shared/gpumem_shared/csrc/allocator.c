/*
 * gpumem native allocator: thread-safe multi-extent first-fit bump allocation for
 * torch's CUDAPluggableAllocator, over address ranges gpumem maps (arenas, borrowed
 * graph-pool runs).
 *
 * torch calls alloc(size, device, stream) with no user data, and one MemPool takes one
 * allocator, so each independent pool needs its own pair of entry points. This file
 * generates GPUMEM_MAX_SLOTS pairs (gpumem_alloc_<i>, gpumem_free_<i>); a Python slot
 * object owns one index for its life.
 *
 * The allocator never touches device memory and needs no CUDA headers: it hands out
 * addresses inside extents that the Python side has mapped (or deliberately left
 * virtual-only). A request that fits no extent returns NULL, which torch reports as
 * out of memory; the Python side turns that into an error naming the arena. Frees are
 * only counted: torch's caching allocator keeps blocks, and the memory comes back by
 * resetting the extents (a decommit or a rebuild), never by the free callback.
 *
 * torch loads the entry points by name from the built extension module; Python calls
 * the same slots by index through the module's functions (module.c, allocator.h).
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "allocator.h"

typedef struct {
    pthread_mutex_t mu;
    int in_use;
    int device;
    size_t alignment;
    size_t n;
    uintptr_t base[GPUMEM_MAX_EXTENTS];
    size_t size[GPUMEM_MAX_EXTENTS];
    size_t cursor[GPUMEM_MAX_EXTENTS];
    /* With checking on, a request is served only where the bytes are mapped (committed
     * or placeholder-backed): a kernel touching unmapped space would kill the CUDA
     * context. A thread that lays out virtual-only tensors turns the check off for
     * itself (gpumem_thread_virtual). */
    int check_backing;
    /* A borrow pool serves one stream: torch caches blocks per stream, so a request
     * from another stream would take fresh space, and its frees would be ordered on a
     * stream the borrow's lease does not cover. */
    int stream_bound;
    uintptr_t stream;
    /* An elastic arena's slot: unbacked space is offered to the grow hook before the
     * request fails. */
    int growing;
    size_t n_backing;
    uintptr_t backing_base[GPUMEM_MAX_BACKING];
    size_t backing_size[GPUMEM_MAX_BACKING];
    gpumem_stats stats;
} slot_t;

static __thread int t_virtual;

/* Per thread: 1 lets this thread's requests land on unbacked (virtual-only) space.
 * Returns the previous setting, so scopes nest. */
int gpumem_thread_virtual(int on) {
    int before = t_virtual;
    t_virtual = on;
    return before;
}


static slot_t g_slots[GPUMEM_MAX_SLOTS];
static gpumem_grow_fn g_grow;

void gpumem_set_grow_hook(gpumem_grow_fn fn) { g_grow = fn; }
static pthread_mutex_t g_registry = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void init_slots(void) {
    for (int i = 0; i < GPUMEM_MAX_SLOTS; i++) pthread_mutex_init(&g_slots[i].mu, NULL);
}

/* SIZE_MAX for a size no address space holds: it then fits nowhere instead of wrapping to 0. */
static size_t align_up(size_t v, size_t a) { return v > SIZE_MAX - a ? SIZE_MAX : (v + a - 1) / a * a; }

static void recompute_largest(slot_t *s) {
    size_t best = 0;
    for (size_t i = 0; i < s->n; i++) {
        size_t left = s->size[i] - s->cursor[i];
        if (left > best) best = left;
    }
    s->stats.largest_free = best;
}

/* Returns a slot index bound to `device`, or -1 when all are taken. `alignment` must be
 * a power of two; every address handed out is a multiple of it. */
int gpumem_slot_acquire(int device, size_t alignment) {
    if (alignment == 0 || (alignment & (alignment - 1))) return -2;
    pthread_once(&g_once, init_slots);
    pthread_mutex_lock(&g_registry);
    int found = -1;
    for (int i = 0; i < GPUMEM_MAX_SLOTS; i++) {
        if (!g_slots[i].in_use) {
            found = i;
            break;
        }
    }
    if (found >= 0) {
        slot_t *s = &g_slots[found];
        pthread_mutex_lock(&s->mu);
        s->in_use = 1;
        s->device = device;
        s->alignment = alignment;
        s->n = 0;
        s->check_backing = 0;
        s->stream_bound = 0;
        s->growing = 0;
        s->n_backing = 0;
        memset(&s->stats, 0, sizeof(s->stats));
        s->stats.device = device;
        pthread_mutex_unlock(&s->mu);
    }
    pthread_mutex_unlock(&g_registry);
    return found;
}

static slot_t *slot_at(int slot) {
    if (slot < 0 || slot >= GPUMEM_MAX_SLOTS) return NULL;
    pthread_once(&g_once, init_slots);
    return &g_slots[slot];
}

void gpumem_slot_release(int slot) {
    slot_t *s = slot_at(slot);
    if (!s) return;
    pthread_mutex_lock(&g_registry);
    pthread_mutex_lock(&s->mu);
    s->in_use = 0;
    s->n = 0;
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_unlock(&g_registry);
}

/* Replace the extents and reset cursors and counters (calls survive). Extents must
 * be aligned and must not overlap; returns 0, or -1 for a bad slot, -2 for too many
 * extents, -3 for a misaligned or overlapping extent. */
int gpumem_slot_set_extents(int slot, const uint64_t *base, const uint64_t *size, size_t n) {
    slot_t *s = slot_at(slot);
    if (!s || !s->in_use) return -1;
    if (n > GPUMEM_MAX_EXTENTS) return -2;
    for (size_t i = 0; i < n; i++) {
        if (base[i] % s->alignment || size[i] == 0) return -3;
        for (size_t j = 0; j < i; j++)
            if (base[i] < base[j] + size[j] && base[j] < base[i] + size[i]) return -3;
    }
    pthread_mutex_lock(&s->mu);
    s->n = n;
    uint64_t capacity = 0;
    for (size_t i = 0; i < n; i++) {
        s->base[i] = (uintptr_t)base[i];
        s->size[i] = (size_t)size[i];
        s->cursor[i] = 0;
        capacity += size[i];
    }
    s->stats.cursor_bytes = 0;
    s->stats.freed_bytes = 0;
    s->stats.capacity_bytes = capacity;
    s->stats.n_extents = (int64_t)n;
    s->stats.last_failed = 0;
    recompute_largest(s);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* Turn the backing check on with these (disjoint, merged) mapped ranges; n == 0 with
 * enable == 1 means nothing is backed. enable == 0 turns the check off. */
int gpumem_slot_set_backing(int slot, int enable, const uint64_t *base, const uint64_t *size, size_t n) {
    slot_t *s = slot_at(slot);
    if (!s || !s->in_use) return -1;
    if (n > GPUMEM_MAX_BACKING) return -2;
    pthread_mutex_lock(&s->mu);
    s->check_backing = enable;
    s->n_backing = n;
    for (size_t i = 0; i < n; i++) {
        s->backing_base[i] = (uintptr_t)base[i];
        s->backing_size[i] = (size_t)size[i];
    }
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* Serve only requests made on `stream` (bound != 0), or on any stream (bound == 0). */
int gpumem_slot_bind_stream(int slot, int bound, uint64_t stream) {
    slot_t *s = slot_at(slot);
    if (!s || !s->in_use) return -1;
    pthread_mutex_lock(&s->mu);
    s->stream_bound = bound;
    s->stream = (uintptr_t)stream;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int gpumem_slot_set_growing(int slot, int on) {
    slot_t *s = slot_at(slot);
    if (!s || !s->in_use) return -1;
    pthread_mutex_lock(&s->mu);
    s->growing = on;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

static int backed(const slot_t *s, uintptr_t p, size_t n) {
    for (size_t i = 0; i < s->n_backing; i++)
        if (s->backing_base[i] <= p && p + n <= s->backing_base[i] + s->backing_size[i]) return 1;
    return 0;
}

int gpumem_slot_stats(int slot, gpumem_stats *out) {
    slot_t *s = slot_at(slot);
    if (!s || !s->in_use) return -1;
    pthread_mutex_lock(&s->mu);
    *out = s->stats;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* How many bytes a request of `size` consumes (what `can_fit` must account for). */
size_t gpumem_slot_rounded(int slot, size_t size) {
    slot_t *s = slot_at(slot);
    if (!s || !s->in_use) return 0;
    return align_up(size ? size : 1, s->alignment);
}

/* One try. With `grow_end` given (the first try), a request that meets unbacked space in a growing slot is
 * not counted as failed: *grow_end says where it would end, for the grow hook. */
static void *try_alloc(slot_t *s, size_t size, int device, void *stream, uintptr_t *grow_end) {
    void *p = NULL;
    int reason = GPUMEM_FAIL_FULL;
    pthread_mutex_lock(&s->mu);
    if (grow_end) s->stats.calls++; /* the first try of a request, not its retry */
    if (!s->in_use || device != s->device) {
        reason = GPUMEM_FAIL_DEVICE;
    } else if (s->stream_bound && (uintptr_t)stream != s->stream) {
        reason = GPUMEM_FAIL_STREAM;
    } else {
        size_t need = align_up(size ? size : 1, s->alignment);
        for (size_t i = 0; i < s->n; i++) {
            if (s->size[i] - s->cursor[i] < need) continue;
            uintptr_t at = s->base[i] + s->cursor[i];
            if (s->check_backing && !t_virtual && !backed(s, at, need)) {
                reason = GPUMEM_FAIL_UNBACKED;
                if (grow_end && s->growing) {
                    *grow_end = at + need;
                    pthread_mutex_unlock(&s->mu);
                    return NULL;
                }
                break;
            }
            p = (void *)at;
            s->cursor[i] += need;
            s->stats.cursor_bytes += need;
            recompute_largest(s);
            break;
        }
    }
    if (!p) {
        s->stats.failures++;
        s->stats.last_failed = size;
        s->stats.last_fail_reason = reason;
    }
    pthread_mutex_unlock(&s->mu);
    return p;
}

static void *slot_alloc(int slot, size_t size, int device, void *stream) {
    slot_t *s = &g_slots[slot];
    uintptr_t grow_end = 0;
    void *p = try_alloc(s, size, device, stream, &grow_end);
    if (p || !grow_end) return p;
    /* The slot's lock is not held here: the hook backs more and sets the backing. */
    gpumem_grow_fn grow = g_grow;
    if (grow) grow(slot, grow_end);
    return try_alloc(s, size, device, stream, NULL);
}

static void slot_free(int slot, void *ptr, size_t size, int device, void *stream) {
    (void)ptr;
    (void)device;
    (void)stream;
    slot_t *s = &g_slots[slot];
    pthread_mutex_lock(&s->mu);
    if (s->in_use) { /* a block of a slot given up since: nothing to count it against */
        s->stats.frees++;
        s->stats.freed_bytes += size;
    }
    pthread_mutex_unlock(&s->mu);
}

/* The same calls by slot index, for callers other than torch (module.c). */
void *gpumem_slot_alloc(int slot, size_t size, int device, uint64_t stream) {
    if (!slot_at(slot)) return NULL;
    return slot_alloc(slot, size, device, (void *)(uintptr_t)stream);
}

void gpumem_slot_free(int slot, uint64_t ptr, size_t size, int device, uint64_t stream) {
    if (!slot_at(slot)) return;
    slot_free(slot, (void *)(uintptr_t)ptr, size, device, (void *)(uintptr_t)stream);
}

/* The entry points torch loads by name: gpumem_alloc_<xx> / gpumem_free_<xx>, where
 * xx is the slot index in two hex digits (00..ff). */
#define GPUMEM_ENTRY(h, l)                                                              \
    void *gpumem_alloc_##h##l(size_t size, int device, void *stream) {                 \
        return slot_alloc(0x##h##l, size, device, stream);                              \
    }                                                                                   \
    void gpumem_free_##h##l(void *ptr, size_t size, int device, void *stream) {        \
        slot_free(0x##h##l, ptr, size, device, stream);                                 \
    }
#define GPUMEM_ROW(h)                                                                   \
    GPUMEM_ENTRY(h, 0) GPUMEM_ENTRY(h, 1) GPUMEM_ENTRY(h, 2) GPUMEM_ENTRY(h, 3)         \
    GPUMEM_ENTRY(h, 4) GPUMEM_ENTRY(h, 5) GPUMEM_ENTRY(h, 6) GPUMEM_ENTRY(h, 7)         \
    GPUMEM_ENTRY(h, 8) GPUMEM_ENTRY(h, 9) GPUMEM_ENTRY(h, a) GPUMEM_ENTRY(h, b)         \
    GPUMEM_ENTRY(h, c) GPUMEM_ENTRY(h, d) GPUMEM_ENTRY(h, e) GPUMEM_ENTRY(h, f)

GPUMEM_ROW(0) GPUMEM_ROW(1) GPUMEM_ROW(2) GPUMEM_ROW(3)
GPUMEM_ROW(4) GPUMEM_ROW(5) GPUMEM_ROW(6) GPUMEM_ROW(7)
GPUMEM_ROW(8) GPUMEM_ROW(9) GPUMEM_ROW(a) GPUMEM_ROW(b)
GPUMEM_ROW(c) GPUMEM_ROW(d) GPUMEM_ROW(e) GPUMEM_ROW(f)
