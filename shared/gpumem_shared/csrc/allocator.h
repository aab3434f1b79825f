/*
 * The native allocator's limits, failure reasons, counters and calls by slot index:
 * allocator.c implements them, module.c offers them to Python (gpumem.allocator) and
 * exports the limits and reasons, so Python states none of them again. torch does not
 * use this header: it loads gpumem_alloc_xx / gpumem_free_xx from the built module by
 * name (see allocator.c).
 */
#ifndef GPUMEM_ALLOCATOR_H
#define GPUMEM_ALLOCATOR_H

#include <stddef.h>
#include <stdint.h>

#define GPUMEM_MAX_SLOTS 256
#define GPUMEM_MAX_EXTENTS 64
#define GPUMEM_MAX_BACKING 512

/* Why the last request failed. */
#define GPUMEM_FAIL_NONE 0
#define GPUMEM_FAIL_FULL 1     /* no extent has room */
#define GPUMEM_FAIL_UNBACKED 2 /* room, but the bytes there are not backed yet */
#define GPUMEM_FAIL_DEVICE 3   /* asked for another device than the slot's */
#define GPUMEM_FAIL_STREAM 4   /* asked on another stream than the one the slot is bound to */

typedef struct {
    uint64_t calls;           /* alloc calls, failed ones included */
    uint64_t failures;        /* alloc calls that returned NULL */
    uint64_t frees;           /* free callbacks */
    uint64_t cursor_bytes;    /* bytes handed out since the extents were set */
    uint64_t freed_bytes;     /* bytes torch gave back since the extents were set */
    uint64_t capacity_bytes;  /* total size of the extents */
    uint64_t largest_free;    /* largest request that would still fit */
    uint64_t last_failed;     /* size of the last request that failed */
    int64_t last_fail_reason; /* GPUMEM_FAIL_* */
    int64_t n_extents;
    int64_t device;
} gpumem_stats;

/* Called with no lock held when a request of a growing slot finds room in an extent but
 * the bytes there are not backed: `end` is the address the request would end at. The
 * owner may back more (an elastic arena commits) and return nonzero; the request is then
 * tried once more. */
typedef int (*gpumem_grow_fn)(int slot, uint64_t end);

int gpumem_thread_virtual(int on);
void gpumem_set_grow_hook(gpumem_grow_fn fn);
int gpumem_slot_set_growing(int slot, int on);
int gpumem_slot_acquire(int device, size_t alignment);
void gpumem_slot_release(int slot);
int gpumem_slot_set_extents(int slot, const uint64_t *base, const uint64_t *size, size_t n);
int gpumem_slot_set_backing(int slot, int enable, const uint64_t *base, const uint64_t *size, size_t n);
int gpumem_slot_bind_stream(int slot, int bound, uint64_t stream);
int gpumem_slot_stats(int slot, gpumem_stats *out);
size_t gpumem_slot_rounded(int slot, size_t size);
void *gpumem_slot_alloc(int slot, size_t size, int device, uint64_t stream);
void gpumem_slot_free(int slot, uint64_t ptr, size_t size, int device, uint64_t stream);

#endif
