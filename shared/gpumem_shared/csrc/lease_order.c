/*
 * The lease calls that order a handoff on the GPU, for module.c's method table
 * (lease_order.h): libcuda's entry points, resolved at first use; the IPC-event calls at a
 * lease handoff and the lease calls that make them in the same call as the
 * compare-and-swap (shared pools); the same under memops ordering (lease_order.py); and
 * the wait for a releaser's record that both start with. The driver's function tables
 * live here alone. The stable ABI only, as module.c says.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <time.h>

#include "args.h"
#include "lease_table.h"
#include "lease_order.h"

/* ============================================================= the releaser's record */

/* The releaser a taker told LEASE_OK_ORDER orders after, once its record landed (without
 * the GIL while it has not): LEASE_OK or LEASE_RECORDING (see leases.c). */
static int await_record(lease_slot *slot, int64_t timeout_ns, uint32_t *releaser) {
    uint32_t seen = gpumem_lease_handoff(slot);
    if (LEASE_HANDOFF_VALID(seen) && !(seen & LEASE_HANDOFF_RECORDING)) {
        *releaser = seen;
        return LEASE_OK;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = gpumem_lease_await_record(slot, timeout_ns, releaser);
    Py_END_ALLOW_THREADS
    return status;
}

/* lease_await_record(segment_address, timeout_ns) -> (status, releaser): for a taker told
 * LEASE_OK_ORDER by the plain calls. */
PyObject *lease_await_record(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    lease_slot *slot;
    if (lease_args(args, nargs, 2, "lease_await_record(segment_address, timeout_ns)", &slot) < 0) return NULL;
    long long timeout_ns = PyLong_AsLongLong(args[1]);
    if (timeout_ns == -1 && PyErr_Occurred()) return NULL;
    uint32_t releaser = 0;
    int status = await_record(slot, (int64_t)timeout_ns, &releaser);
    return Py_BuildValue("(iI)", status, (unsigned int)releaser);
}

/* ==================================================================== IPC events */

/* The IPC-event calls at a lease handoff, into libcuda resolved at first use (the package
 * builds without CUDA headers, and runs where no driver exists). Each runs in the given
 * context, pushed only when the thread's current one differs: a process driving several
 * GPUs calls them from any device. Returns the CUresult (0 = success), or -1 when no
 * driver could be loaded. */
typedef int (*ctx_get_fn)(void **);
typedef int (*ctx_push_fn)(void *);
typedef int (*ctx_pop_fn)(void **);
typedef int (*event_record_fn)(void *, void *);
typedef int (*stream_wait_fn)(void *, void *, unsigned int);
typedef int (*error_name_fn)(int, const char **);

static struct {
    int loaded;
    ctx_get_fn get;
    ctx_push_fn push;
    ctx_pop_fn pop;
    event_record_fn record;
    stream_wait_fn wait;
    error_name_fn error_name;
} cu;

static int load_cuda(void) {
    if (cu.loaded) return cu.loaded > 0 ? 0 : -1;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib) {
        cu.get = (ctx_get_fn)dlsym(lib, "cuCtxGetCurrent");
        cu.push = (ctx_push_fn)dlsym(lib, "cuCtxPushCurrent_v2");
        cu.pop = (ctx_pop_fn)dlsym(lib, "cuCtxPopCurrent_v2");
        cu.record = (event_record_fn)dlsym(lib, "cuEventRecord");
        cu.wait = (stream_wait_fn)dlsym(lib, "cuStreamWaitEvent");
        cu.error_name = (error_name_fn)dlsym(lib, "cuGetErrorName");
    }
    cu.loaded = lib && cu.get && cu.push && cu.pop && cu.record && cu.wait && cu.error_name ? 1 : -1;
    return cu.loaded > 0 ? 0 : -1;
}

/* Every driver call below runs between these two: ``ctx`` made current, pushed only
 * when the thread's current context differs (*pushed: whether leave_context pops it). */
static int enter_context(void *ctx, int *pushed) {
    void *current = NULL;
    cu.get(&current);
    *pushed = current != ctx;
    return *pushed ? cu.push(ctx) : 0;
}

static void leave_context(int pushed) {
    void *popped;
    if (pushed) cu.pop(&popped);
}

static int in_context(void *ctx, int wait, void *event, void *stream) {
    int pushed, rc;
    if (load_cuda() < 0) return -1;
    if ((rc = enter_context(ctx, &pushed))) return rc;
    rc = wait ? cu.wait(stream, event, 0) : cu.record(event, stream);
    leave_context(pushed);
    return rc;
}

/* cuda_stream_wait(context, event, stream) -> CUresult: the first wait on a releaser's
 * event, once the client has looked it up (later ones are the ordered acquires'). */
PyObject *cuda_stream_wait(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "cuda_stream_wait(context, event, stream): handles as ints");
        return NULL;
    }
    void *ptr[3];
    for (int i = 0; i < 3; i++) {
        ptr[i] = PyLong_AsVoidPtr(args[i]);
        if (ptr[i] == NULL && PyErr_Occurred()) return NULL;
    }
    return PyLong_FromLong(in_context(ptr[0], 1, ptr[1], ptr[2]));
}

/* ========================================================= lease slots with GPU order */

/* A handoff on a shared pool in one call each side, with no Python between the lease
 * and its GPU order: the release records the holder's IPC event on its stream and frees
 * the slot; a take told LEASE_OK_ORDER makes the taker's stream wait on the releaser's
 * event before it returns. Each takes the session's device context (0: a backend whose
 * work is synchronous, where no driver call is made) and the lease's stream. A driver
 * failure leaves the lease not held (a release frees the slot without naming itself, so
 * nobody waits on an event that marks nothing) and raises the driver layer's DriverError,
 * worded as the driver's own calls word it. */

typedef struct {
    void *ctx;
    void *stream;
} gpu_order;

/* The clock the slot's waits use (CLOCK_MONOTONIC), for a deadline across two of them. */
static int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int order_args(PyObject *ctx, PyObject *stream, gpu_order *out) {
    uint64_t raw;
    out->ctx = PyLong_AsVoidPtr(ctx);
    if (out->ctx == NULL && PyErr_Occurred()) return -1;
    if (u64_arg(stream, &raw) < 0) return -1;
    out->stream = (void *)(uintptr_t)raw;
    return 0;
}

static int events_arg(PyObject *arg) {
    if (PyDict_Check(arg)) return 0;
    PyErr_SetString(PyExc_TypeError, "events: a dict of {24-bit session: event handle}");
    return -1;
}

/* gpumem_shared.driver.base.DriverError("<call> failed: <CUresult's name>"), the error
 * the driver's Python calls raise. */
static void raise_driver_error(const char *call, int rc) {
    PyObject *base = PyImport_ImportModule("gpumem_shared.driver.base");
    PyObject *error = base ? PyObject_GetAttrString(base, "DriverError") : NULL;
    Py_XDECREF(base);
    if (!error) return; /* the import's own exception stands */
    const char *name = NULL;
    if (rc < 0)
        PyErr_Format(error, "%s failed: libcuda could not be loaded", call);
    else if (cu.error_name(rc, &name) == 0 && name)
        PyErr_Format(error, "%s failed: %s", call, name);
    else
        PyErr_Format(error, "%s failed: CUresult %d", call, rc);
    Py_DECREF(error);
}

/* After a take that returned LEASE_OK_ORDER: once the last releaser's record landed, the
 * stream waits on its event if ``events`` has it (LEASE_OK_WAITED). LEASE_OK_ORDER stays
 * when it has not: the caller looks the event up (once) and waits itself. LEASE_OK when
 * there is nothing to wait on: the daemon forgot the releaser meanwhile, its record
 * failed, or it was this session. LEASE_RECORDING, the take undone, when the record did
 * not land within ``timeout_ns`` (what is left of the caller's wait; <= 0: it must have
 * landed already). -1 with an exception set, the take undone. */
static int wait_for_releaser(lease_slot *slot, uint64_t word, const gpu_order *order, PyObject *events, int64_t timeout_ns) {
    uint32_t releaser;
    if (await_record(slot, timeout_ns, &releaser) != LEASE_OK) {
        gpumem_lease_clear(slot, word);
        return LEASE_RECORDING;
    }
    if (!releaser || releaser == LEASE_SESSION_OF(word)) return LEASE_OK;
    PyObject *key = PyLong_FromUnsignedLong(releaser);
    PyObject *found = key ? PyDict_GetItemWithError(events, key) : NULL; /* borrowed */
    Py_XDECREF(key);
    if (!found) {
        if (PyErr_Occurred()) goto undo;
        return LEASE_OK_ORDER;
    }
    void *event = PyLong_AsVoidPtr(found);
    if (event == NULL && PyErr_Occurred()) goto undo;
    int rc = order->ctx ? in_context(order->ctx, 1, event, order->stream) : 0;
    if (rc) {
        raise_driver_error("cuStreamWaitEvent", rc);
        goto undo;
    }
    return LEASE_OK_WAITED;
undo:
    gpumem_lease_clear(slot, word);
    return -1;
}

/* The arguments the ordered takes share. */
typedef struct {
    lease_slot *slot;
    uint64_t word;
    uint32_t epoch;
    int64_t timeout_ns; /* an acquire's */
    char *label;
    Py_ssize_t len;
    gpu_order order;
} ordered_take;

/* A try's (segment_address, word, epoch, label: bytes, context, stream, ...). */
static int try_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage, ordered_take *t) {
    return lease_args(args, nargs, want, usage, &t->slot) < 0 || u64_arg(args[1], &t->word) < 0 ||
                   u32_arg(args[2], &t->epoch) < 0 || PyBytes_AsStringAndSize(args[3], &t->label, &t->len) < 0 ||
                   order_args(args[4], args[5], &t->order) < 0
               ? -1
               : 0;
}

/* An acquire's (segment_address, word, epoch, timeout_ns, label or None, context, stream, ...). */
static int acquire_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage, ordered_take *t) {
    if (lease_args(args, nargs, want, usage, &t->slot) < 0 || u64_arg(args[1], &t->word) < 0 || u32_arg(args[2], &t->epoch) < 0)
        return -1;
    long long timeout_ns = PyLong_AsLongLong(args[3]);
    if (timeout_ns == -1 && PyErr_Occurred()) return -1;
    t->timeout_ns = (int64_t)timeout_ns;
    t->label = NULL;
    t->len = 0;
    if (args[4] != Py_None && PyBytes_AsStringAndSize(args[4], &t->label, &t->len) < 0) return -1;
    return order_args(args[5], args[6], &t->order);
}

/* lease_acquire's take (the wait without the GIL): its status, and in *left what remains
 * of timeout_ns for the order's wait after it, so both waits together stay within it. */
static int take_within(const ordered_take *t, uint64_t *found, int64_t *left) {
    int64_t start = monotonic_ns();
    int64_t deadline = t->timeout_ns > INT64_MAX - start ? INT64_MAX : start + t->timeout_ns;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = gpumem_lease_acquire(t->slot, t->word, t->epoch, t->timeout_ns, found, t->label, (uint32_t)t->len);
    Py_END_ALLOW_THREADS
    *left = status == LEASE_OK_ORDER ? deadline - monotonic_ns() : 0;
    return status;
}

/* lease_try_ordered(segment_address, word, epoch, label: bytes, context, stream, events)
 * -> status: lease_try, then the wait on the releaser's event when told to order. A try
 * waits for nothing: a record still in flight gives the slot back (LEASE_RECORDING), and
 * a caller with time to wait goes on with lease_acquire_ordered. */
PyObject *lease_try_ordered(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    ordered_take t;
    if (try_args(args, nargs, 7, "lease_try_ordered(segment_address, word, epoch, label, context, stream, events)", &t) < 0 ||
        events_arg(args[6]) < 0)
        return NULL;
    int status = gpumem_lease_try(t.slot, t.word, t.epoch, t.label, (uint32_t)t.len);
    if (status == LEASE_OK_ORDER && (status = wait_for_releaser(t.slot, t.word, &t.order, args[6], 0)) < 0) return NULL;
    return PyLong_FromLong(status);
}

/* lease_acquire_ordered(segment_address, word, epoch, timeout_ns, label or None, context,
 * stream, events) -> (status, word found): lease_acquire (the wait without the GIL), then
 * the wait on the releaser's event when told to order. Both waits together stay within
 * timeout_ns: the record is waited for what the take left of it. */
PyObject *lease_acquire_ordered(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    ordered_take t;
    if (acquire_args(args, nargs, 8,
                     "lease_acquire_ordered(segment_address, word, epoch, timeout_ns, label or None, context, stream, events)",
                     &t) < 0 ||
        events_arg(args[7]) < 0)
        return NULL;
    uint64_t found = 0;
    int64_t left;
    int status = take_within(&t, &found, &left);
    if (status == LEASE_OK_ORDER && (status = wait_for_releaser(t.slot, t.word, &t.order, args[7], left)) < 0) return NULL;
    return Py_BuildValue("(iK)", status, (unsigned long long)found);
}

/* lease_release_ordered(segment_address, word, context, event, stream) -> status: a
 * holder's release; on a shared pool the slot names it the releaser to order after,
 * marked recording, is freed, and its event is recorded on the stream, the mark ended
 * (never LEASE_RECORD). A failed record ends the mark naming nobody. */
PyObject *lease_release_ordered(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    lease_slot *slot;
    uint64_t word;
    gpu_order order;
    if (lease_args(args, nargs, 5, "lease_release_ordered(segment_address, word, context, event, stream)", &slot) < 0 ||
        u64_arg(args[1], &word) < 0 || order_args(args[2], args[4], &order) < 0)
        return NULL;
    void *event = PyLong_AsVoidPtr(args[3]);
    if (event == NULL && PyErr_Occurred()) return NULL;
    int status = gpumem_lease_release(slot, word);
    if (status == LEASE_RECORD && (status = gpumem_lease_release_recording(slot, word)) == LEASE_OK) {
        int rc = order.ctx ? in_context(order.ctx, 0, event, order.stream) : 0;
        gpumem_lease_recorded(slot, LEASE_SESSION_OF(word), rc == 0);
        if (rc) {
            raise_driver_error("cuEventRecord", rc);
            return NULL;
        }
    }
    return PyLong_FromLong(status);
}

/* ================================================== memops ordering (lease_order.py) */

/* The 64-bit stream memory operations, resolved apart from load_cuda's calls: a driver
 * without them still serves IPC events (and gpumemd refuses memops on it at start). */
typedef int (*value_op_fn)(void *, uint64_t, uint64_t, unsigned int);
static struct {
    int loaded;
    value_op_fn write;
    value_op_fn wait;
} memops;

static int load_memops(void) {
    if (memops.loaded) return memops.loaded > 0 ? 0 : -1;
    void *lib = load_cuda() == 0 ? dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD) : NULL;
    if (lib) {
        memops.write = (value_op_fn)dlsym(lib, "cuStreamWriteValue64_v2");
        memops.wait = (value_op_fn)dlsym(lib, "cuStreamWaitValue64_v2");
    }
    memops.loaded = lib && memops.write && memops.wait ? 1 : -1;
    return memops.loaded > 0 ? 0 : -1;
}

/* In the context: the stream waits for ``before`` on the lane (0: nothing), then writes
 * ``value`` there (``write``) or waits for it. Flags 0: the write follows a memory
 * barrier (the stream's earlier writes are visible first); the wait is the cyclic >=. */
static int memops_in_context(void *ctx, void *stream, uint64_t lane, uint64_t before, uint64_t value, int write) {
    int pushed, rc;
    if (load_memops() < 0) return -1;
    if ((rc = enter_context(ctx, &pushed))) return rc;
    rc = before ? memops.wait(stream, lane, before, 0) : 0;
    if (!rc) rc = write ? memops.write(stream, lane, value, 0) : memops.wait(stream, lane, value, 0);
    leave_context(pushed);
    return rc;
}

static int lane_arg(PyObject *arg, uint64_t *out) {
    if (u64_arg(arg, out) < 0) return -1;
    if (*out == 0 || *out % sizeof(uint64_t)) {
        PyErr_Format(PyExc_ValueError, "%llu is not a sequence lane's address", (unsigned long long)*out);
        return -1;
    }
    return 0;
}

/* lease_release_memops(segment_address, word, context, lane, stream) -> status: a
 * holder's release under memops ordering, shaped as lease_release_ordered is; ``lane``
 * is the address of the session's lease_lane for the pool. On a shared pool the lane's
 * next (lane, value) pair is published, the slot freed naming the holder marked
 * recording (a waiter wakes meanwhile), the stream writes the value on the lane, and
 * the mark ends. First, on a stream other than the one that wrote the lane's last value,
 * the stream waits for that value: a lane's writes land in the order of its values.
 * Context 0 (work is synchronous): the value is stored at once. The lane counts a value
 * once its write is queued. A private slot is freed as lease_release frees it; another's
 * is left. A driver failure, or a lane out of values, ends the mark naming nobody (no
 * taker waits for a value nobody writes) and raises, the slot freed, nothing counted. */
PyObject *lease_release_memops(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    lease_slot *slot;
    uint64_t word;
    gpu_order order;
    if (lease_args(args, nargs, 5, "lease_release_memops(segment_address, word, context, lane, stream)", &slot) < 0 ||
        u64_arg(args[1], &word) < 0 || order_args(args[2], args[4], &order) < 0)
        return NULL;
    lease_lane *lane = PyLong_AsVoidPtr(args[3]);
    if (lane == NULL || (uintptr_t)lane % sizeof(uint64_t)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "lease_release_memops: not a lane's address");
        return NULL;
    }
    int status = gpumem_lease_release(slot, word);
    if (status != LEASE_RECORD) return PyLong_FromLong(status);
    uint64_t count = lane->last & LEASE_SEQ_MASK;
    uint64_t value = lane->last + 1;
    uint64_t before = count && (uint64_t)(uintptr_t)order.stream != lane->stream ? lane->last : 0;
    /* Written while the slot is ours; the free's store orders it before a taker reads it. */
    lease_order_pair *pair = (lease_order_pair *)((char *)slot + LEASE_ORDER_OFFSET);
    pair->lane = lane->lane;
    pair->value = value;
    if ((status = gpumem_lease_release_recording(slot, word)) != LEASE_OK) return PyLong_FromLong(status);
    int rc = 0;
    if (count == LEASE_SEQ_MASK)
        rc = -2;
    else if (order.ctx)
        rc = memops_in_context(order.ctx, order.stream, lane->word, before, value, 1);
    else
        __atomic_store_n((uint64_t *)(uintptr_t)lane->word, value, __ATOMIC_RELEASE);
    gpumem_lease_recorded(slot, LEASE_SESSION_OF(word), rc == 0);
    if (rc == -2) {
        PyErr_Format(PyExc_OverflowError, "lease ordering lane %u used all %llu values of its generation", lane->lane,
                     (unsigned long long)LEASE_SEQ_MASK);
        return NULL;
    }
    if (rc) {
        raise_driver_error("cuStreamWriteValue64", rc);
        return NULL;
    }
    lane->last = value;
    lane->stream = (uint64_t)(uintptr_t)order.stream;
    return PyLong_FromLong(LEASE_OK);
}

/* The sequence chunk as a taker names it: its address in this process, and its lanes. */
typedef struct {
    uint64_t address;
    uint32_t lanes;
} lane_chunk;

static int chunk_args(PyObject *address, PyObject *lanes, lane_chunk *out) {
    return lane_arg(address, &out->address) < 0 || u32_arg(lanes, &out->lanes) < 0 ? -1 : 0;
}

/* The value the last memops releaser published on ``slot``, and its lane's word in
 * ``chunk`` (*address). 0: nothing to wait for (none published, or a lane outside the
 * chunk, which no daemon grants: a forged pair names nothing). */
static uint64_t published(lease_slot *slot, const lane_chunk *chunk, uint64_t *address) {
    lease_order_pair *pair = (lease_order_pair *)((char *)slot + LEASE_ORDER_OFFSET);
    uint32_t lane = __atomic_load_n(&pair->lane, __ATOMIC_ACQUIRE);
    uint64_t value = __atomic_load_n(&pair->value, __ATOMIC_ACQUIRE);
    if (lane >= chunk->lanes) return 0;
    *address = chunk->address + (uint64_t)lane * sizeof(uint64_t);
    return value;
}

/* The stream waits until the word at ``address`` reaches ``value`` (*waited 1, once
 * queued). Context 0 (work is synchronous): *waited says whether the word has reached it
 * already (0: the caller polls it, within its bound). Returns the CUresult. */
static int wait_value(const gpu_order *order, uint64_t address, uint64_t value, int *waited) {
    if (!order->ctx) {
        uint64_t now = __atomic_load_n((uint64_t *)(uintptr_t)address, __ATOMIC_ACQUIRE);
        *waited = (int64_t)(now - value) >= 0;
        return 0;
    }
    *waited = 1;
    return memops_in_context(order->ctx, order->stream, address, 0, value, 0);
}

/* wait_for_releaser under memops ordering: once the last releaser's release is done (its
 * mark gone), the stream waits for the value it published (LEASE_OK_WAITED). Context 0:
 * LEASE_OK_WAITED when the word reached it already, LEASE_OK_ORDER when not (the caller
 * polls it within its bound). LEASE_OK when there is nothing to wait for: no releaser
 * named (the daemon forgot it, its write failed, or it was this session), or nothing
 * published. LEASE_RECORDING and -1 (an exception set), the take undone, as there. */
static int wait_for_lane(lease_slot *slot, uint64_t word, const gpu_order *order, const lane_chunk *chunk, int64_t timeout_ns) {
    uint32_t releaser;
    if (await_record(slot, timeout_ns, &releaser) != LEASE_OK) {
        gpumem_lease_clear(slot, word);
        return LEASE_RECORDING;
    }
    if (!releaser || releaser == LEASE_SESSION_OF(word)) return LEASE_OK;
    uint64_t address = 0;
    uint64_t value = published(slot, chunk, &address);
    if (!value) return LEASE_OK;
    int waited;
    int rc = wait_value(order, address, value, &waited);
    if (rc) {
        raise_driver_error("cuStreamWaitValue64", rc);
        gpumem_lease_clear(slot, word);
        return -1;
    }
    return waited ? LEASE_OK_WAITED : LEASE_OK_ORDER;
}

/* lease_try_memops(segment_address, word, epoch, label: bytes, context, stream,
 * lanes_address, lanes) -> status: lease_try_ordered under memops ordering, the chunk
 * mapped at lanes_address (its lanes counted) in place of the events. */
PyObject *lease_try_memops(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    ordered_take t;
    lane_chunk chunk;
    if (try_args(args, nargs, 8, "lease_try_memops(segment_address, word, epoch, label, context, stream, lanes_address, lanes)",
                 &t) < 0 ||
        chunk_args(args[6], args[7], &chunk) < 0)
        return NULL;
    int status = gpumem_lease_try(t.slot, t.word, t.epoch, t.label, (uint32_t)t.len);
    if (status == LEASE_OK_ORDER && (status = wait_for_lane(t.slot, t.word, &t.order, &chunk, 0)) < 0) return NULL;
    return PyLong_FromLong(status);
}

/* lease_acquire_memops(segment_address, word, epoch, timeout_ns, label or None, context,
 * stream, lanes_address, lanes) -> (status, word found): lease_acquire_ordered under
 * memops ordering. */
PyObject *lease_acquire_memops(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    ordered_take t;
    lane_chunk chunk;
    if (acquire_args(args, nargs, 9,
                     "lease_acquire_memops(segment_address, word, epoch, timeout_ns, label or None, context, stream, "
                     "lanes_address, lanes)",
                     &t) < 0 ||
        chunk_args(args[7], args[8], &chunk) < 0)
        return NULL;
    uint64_t found = 0;
    int64_t left;
    int status = take_within(&t, &found, &left);
    if (status == LEASE_OK_ORDER && (status = wait_for_lane(t.slot, t.word, &t.order, &chunk, left)) < 0) return NULL;
    return Py_BuildValue("(iK)", status, (unsigned long long)found);
}

/* lease_order_wait(segment_address, context, lanes_address, lanes, stream) -> (value,
 * waited): for a taker told LEASE_OK_ORDER by a take that did not wait (a plain one, or
 * a memops one on context 0), the stream waits for the value the last releaser
 * published on its lane. Value 0: nothing to wait for (see ``published``). Context 0:
 * waited is whether the word has reached it already (0: the caller polls it). */
PyObject *lease_order_wait(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    lease_slot *slot;
    lane_chunk chunk;
    gpu_order order;
    if (lease_args(args, nargs, 5, "lease_order_wait(segment_address, context, lanes_address, lanes, stream)", &slot) < 0 ||
        order_args(args[1], args[4], &order) < 0 || chunk_args(args[2], args[3], &chunk) < 0)
        return NULL;
    uint64_t address = 0;
    uint64_t value = published(slot, &chunk, &address);
    int waited = 0;
    int rc = value ? wait_value(&order, address, value, &waited) : 0;
    if (rc) {
        raise_driver_error("cuStreamWaitValue64", rc);
        return NULL;
    }
    return Py_BuildValue("(Ki)", (unsigned long long)value, waited);
}
