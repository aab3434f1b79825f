/*
 * The extension module gpumem_shared._native: every call Python makes into the native
 * library, as CPython functions (METH_FASTCALL), and the constants Python needs from it.
 *
 * - Lease slots (leases.c; the layout, statuses, kinds and flags in lease_table.h), one
 *   per graph pool in its own segment: the fast path a client takes on every step, the
 *   waiting acquire (without the GIL), and the daemon's writes. The constants and the
 *   slot's layout (each field's offset and size) are exported for
 *   gpumem_shared/lease_table.py, which states none of them.
 * - The allocator slots (allocator.c, allocator.h), by index; torch alone loads this
 *   file's gpumem_alloc_xx / gpumem_free_xx entry points by name.
 * - The IPC-event calls at a lease handoff, into libcuda resolved at first use, and the
 *   lease calls that make them in the same call as the compare-and-swap (shared pools).
 *
 * One binding style, with its argument checking here: a ctypes binding of the same file
 * restated every signature in Python, and a ctypes call costs more than the
 * compare-and-swap it wraps (1.9 us against 0.75 for a lease taken and given back on
 * the VM, 5.4 against 0.98 on the H200 machine).
 *
 * Only the stable ABI of Python 3.10 is used (setup.py defines Py_LIMITED_API), so one
 * abi3 wheel serves every supported Python: no macro that reads an object's struct
 * (PyTuple_GET_ITEM, PySequence_Fast_*), their function forms instead, off the lease
 * path. METH_FASTCALL joined the stable ABI in 3.10.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "allocator.h"
#include "lease_table.h"

static int count_args(Py_ssize_t nargs, Py_ssize_t want, const char *usage) {
    if (nargs == want) return 0;
    PyErr_SetString(PyExc_TypeError, usage);
    return -1;
}

static int u64_arg(PyObject *arg, uint64_t *out) {
    unsigned long long value = PyLong_AsUnsignedLongLong(arg);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)value;
    return 0;
}

/* Epochs, flags and session ids are 32-bit slot fields: a wider value would be cut. */
static int u32_arg(PyObject *arg, uint32_t *out) {
    unsigned long value = PyLong_AsUnsignedLong(arg);
    if (value == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (value > UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "%lu does not fit a 32-bit lease slot field", value);
        return -1;
    }
    *out = (uint32_t)value;
    return 0;
}

static int int_arg(PyObject *arg, int *out) {
    long value = PyLong_AsLong(arg);
    if (value == -1 && PyErr_Occurred()) return -1;
    if (value < INT_MIN || value > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "%ld does not fit a C int", value);
        return -1;
    }
    *out = (int)value;
    return 0;
}

static int size_arg(PyObject *arg, size_t *out) {
    size_t value = PyLong_AsSize_t(arg);
    if (value == (size_t)-1 && PyErr_Occurred()) return -1;
    *out = value;
    return 0;
}

/* ======================================================================== lease slots */

/* The argument every lease call starts with: the address of a mapped lease segment,
 * where its slot lies. It cannot be checked against a mapping; a null or misaligned one
 * (never a segment: mappings are page-aligned) is refused. */
static int lease_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage, lease_slot **slot) {
    if (count_args(nargs, want, usage) < 0) return -1;
    *slot = PyLong_AsVoidPtr(args[0]);
    if (*slot == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a lease segment's address is not 0");
        return -1;
    }
    if ((uintptr_t)*slot % sizeof(lease_slot)) {
        PyErr_Format(PyExc_ValueError, "%p is not a lease segment's address (not %zu-byte aligned)", (void *)*slot,
                     sizeof(lease_slot));
        return -1;
    }
    return 0;
}

/* lease_try(segment_address, word, epoch, label: bytes) -> status */
static PyObject *lease_try(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    lease_slot *slot;
    uint32_t epoch;
    uint64_t word;
    char *label;
    Py_ssize_t len;
    if (lease_args(args, nargs, 4, "lease_try(segment_address, word, epoch, label)", &slot) < 0 ||
        u64_arg(args[1], &word) < 0 || u32_arg(args[2], &epoch) < 0 || PyBytes_AsStringAndSize(args[3], &label, &len) < 0)
        return NULL;
    return PyLong_FromLong(gpumem_lease_try(slot, word, epoch, label, (uint32_t)len));
}

/* lease_acquire(segment_address, word, epoch, timeout_ns, label: bytes or None) ->
 * (status, word found); watches the word, then sleeps on the slot's futex, without the
 * GIL. The label, if any, is recorded once the lease is taken. */
static PyObject *lease_acquire(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    lease_slot *slot;
    uint32_t epoch;
    uint64_t word;
    char *label = NULL;
    Py_ssize_t len = 0;
    if (lease_args(args, nargs, 5, "lease_acquire(segment_address, word, epoch, timeout_ns, label or None)", &slot) < 0 ||
        u64_arg(args[1], &word) < 0 || u32_arg(args[2], &epoch) < 0)
        return NULL;
    long long timeout_ns = PyLong_AsLongLong(args[3]);
    if (timeout_ns == -1 && PyErr_Occurred()) return NULL;
    if (args[4] != Py_None && PyBytes_AsStringAndSize(args[4], &label, &len) < 0) return NULL;
    uint64_t found = 0;
    int status;
    /* The label's bytes object stays referenced by the caller's arguments meanwhile. */
    Py_BEGIN_ALLOW_THREADS
    status = gpumem_lease_acquire(slot, word, epoch, (int64_t)timeout_ns, &found, label, (uint32_t)len);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(iK)", status, (unsigned long long)found);
}

/* The calls that take (segment_address, word) and return a status. */
static inline PyObject *lease_word_call(PyObject *const *args, Py_ssize_t nargs, const char *usage,
                                        int (*call)(lease_slot *, uint64_t)) {
    lease_slot *slot;
    uint64_t word;
    if (lease_args(args, nargs, 2, usage, &slot) < 0 || u64_arg(args[1], &word) < 0) return NULL;
    return PyLong_FromLong(call(slot, word));
}

/* lease_release(segment_address, word) -> status */
static PyObject *lease_release(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return lease_word_call(args, nargs, "lease_release(segment_address, word)", gpumem_lease_release);
}

/* lease_release_recorded(segment_address, word) -> status */
static PyObject *lease_release_recorded(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return lease_word_call(args, nargs, "lease_release_recorded(segment_address, word)", gpumem_lease_release_recorded);
}

/* lease_clear(segment_address, word) -> status */
static PyObject *lease_clear(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return lease_word_call(args, nargs, "lease_clear(segment_address, word)", gpumem_lease_clear);
}

/* lease_clear_handoff(segment_address, seen) -> status */
static PyObject *lease_clear_handoff(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return lease_word_call(args, nargs, "lease_clear_handoff(segment_address, seen)", gpumem_lease_clear_handoff);
}

/* lease_peek(segment_address) -> word */
static PyObject *lease_peek(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    lease_slot *slot;
    if (lease_args(args, nargs, 1, "lease_peek(segment_address)", &slot) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(gpumem_lease_peek(slot));
}

/* The daemon's writes: (segment_address, a 32-bit field value) -> None. */
static PyObject *lease_set_call(PyObject *const *args, Py_ssize_t nargs, const char *usage,
                                void (*call)(lease_slot *, uint32_t)) {
    lease_slot *slot;
    uint32_t value;
    if (lease_args(args, nargs, 2, usage, &slot) < 0 || u32_arg(args[1], &value) < 0) return NULL;
    call(slot, value);
    Py_RETURN_NONE;
}

static PyObject *lease_set_epoch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return lease_set_call(args, nargs, "lease_set_epoch(segment_address, epoch)", gpumem_lease_set_epoch);
}

static PyObject *lease_set_flags(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return lease_set_call(args, nargs, "lease_set_flags(segment_address, flags)", gpumem_lease_set_flags);
}

static PyObject *lease_set_escaped(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return lease_set_call(args, nargs, "lease_set_escaped(segment_address, session)", gpumem_lease_set_escaped);
}

static PyObject *lease_forget_handoff(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return lease_set_call(args, nargs, "lease_forget_handoff(segment_address, session)", gpumem_lease_forget_handoff);
}

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
static PyObject *lease_await_record(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    lease_slot *slot;
    if (lease_args(args, nargs, 2, "lease_await_record(segment_address, timeout_ns)", &slot) < 0) return NULL;
    long long timeout_ns = PyLong_AsLongLong(args[1]);
    if (timeout_ns == -1 && PyErr_Occurred()) return NULL;
    uint32_t releaser = 0;
    int status = await_record(slot, (int64_t)timeout_ns, &releaser);
    return Py_BuildValue("(iI)", status, (unsigned int)releaser);
}

/* ==================================================================== allocator slots */

/* thread_virtual(on) -> the calling thread's previous setting */
static PyObject *thread_virtual(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int on;
    if (count_args(nargs, 1, "thread_virtual(on)") < 0 || int_arg(args[0], &on) < 0) return NULL;
    return PyLong_FromLong(gpumem_thread_virtual(on));
}

/* slot_acquire(device, alignment) -> slot index; -1: all slots taken, -2: the alignment
 * is not a power of two */
static PyObject *slot_acquire(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int device;
    size_t alignment;
    if (count_args(nargs, 2, "slot_acquire(device, alignment)") < 0 || int_arg(args[0], &device) < 0 ||
        size_arg(args[1], &alignment) < 0)
        return NULL;
    return PyLong_FromLong(gpumem_slot_acquire(device, alignment));
}

/* The calls on one slot, by index: (slot, ...). */
static int slot_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage, int *slot) {
    return count_args(nargs, want, usage) < 0 || int_arg(args[0], slot) < 0 ? -1 : 0;
}

/* slot_release(slot) -> None */
static PyObject *slot_release(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int slot;
    if (slot_args(args, nargs, 1, "slot_release(slot)", &slot) < 0) return NULL;
    gpumem_slot_release(slot);
    Py_RETURN_NONE;
}

/* A sequence of (address, size) tuples, at most ``max``, into base[] and size[]. */
static int ranges_arg(PyObject *arg, size_t max, const char *what, uint64_t *base, uint64_t *size, size_t *n) {
    PyObject *seq = PySequence_Check(arg) ? PySequence_Tuple(arg) : NULL;
    if (!seq) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "expected a sequence of (address, size) tuples");
        return -1;
    }
    Py_ssize_t len = PyTuple_Size(seq);
    int rc = 0;
    if ((size_t)len > max) {
        PyErr_Format(PyExc_ValueError, "%zd %s; a slot holds at most %zu", len, what, max);
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < len; i++) {
        PyObject *pair = PyTuple_GetItem(seq, i);
        if (!PyTuple_Check(pair) || PyTuple_Size(pair) != 2) {
            PyErr_Format(PyExc_TypeError, "%s are (address, size) tuples", what);
            rc = -1;
        } else if (u64_arg(PyTuple_GetItem(pair, 0), &base[i]) < 0 || u64_arg(PyTuple_GetItem(pair, 1), &size[i]) < 0) {
            rc = -1;
        }
    }
    Py_DECREF(seq);
    *n = (size_t)len;
    return rc;
}

/* slot_set_extents(slot, [(address, size), ...]) -> 0, or allocator.c's error code */
static PyObject *slot_set_extents(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int slot;
    uint64_t base[GPUMEM_MAX_EXTENTS], size[GPUMEM_MAX_EXTENTS];
    size_t n;
    if (slot_args(args, nargs, 2, "slot_set_extents(slot, extents)", &slot) < 0 ||
        ranges_arg(args[1], GPUMEM_MAX_EXTENTS, "extents", base, size, &n) < 0)
        return NULL;
    return PyLong_FromLong(gpumem_slot_set_extents(slot, base, size, n));
}

/* slot_set_backing(slot, [(address, size), ...] or None: no check) -> 0, or an error code */
static PyObject *slot_set_backing(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int slot;
    uint64_t base[GPUMEM_MAX_BACKING], size[GPUMEM_MAX_BACKING];
    size_t n = 0;
    if (slot_args(args, nargs, 2, "slot_set_backing(slot, ranges)", &slot) < 0) return NULL;
    int enable = args[1] != Py_None;
    if (enable && ranges_arg(args[1], GPUMEM_MAX_BACKING, "backing ranges", base, size, &n) < 0) return NULL;
    return PyLong_FromLong(gpumem_slot_set_backing(slot, enable, base, size, n));
}

/* slot_bind_stream(slot, stream or None: any stream) -> 0, or -1 for a slot not in use */
static PyObject *slot_bind_stream(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int slot;
    uint64_t stream = 0;
    if (slot_args(args, nargs, 2, "slot_bind_stream(slot, stream)", &slot) < 0) return NULL;
    int bound = args[1] != Py_None;
    if (bound && u64_arg(args[1], &stream) < 0) return NULL;
    return PyLong_FromLong(gpumem_slot_bind_stream(slot, bound, stream));
}

/* slot_alloc(slot, nbytes, device, stream) -> address, 0 when nothing fits */
static PyObject *slot_alloc(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int slot, device;
    size_t nbytes;
    uint64_t stream;
    if (slot_args(args, nargs, 4, "slot_alloc(slot, nbytes, device, stream)", &slot) < 0 || size_arg(args[1], &nbytes) < 0 ||
        int_arg(args[2], &device) < 0 || u64_arg(args[3], &stream) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong((uintptr_t)gpumem_slot_alloc(slot, nbytes, device, stream));
}

/* slot_free(slot, address, nbytes, device, stream) -> None */
static PyObject *slot_free(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int slot, device;
    uint64_t address, stream;
    size_t nbytes;
    if (slot_args(args, nargs, 5, "slot_free(slot, address, nbytes, device, stream)", &slot) < 0 ||
        u64_arg(args[1], &address) < 0 || size_arg(args[2], &nbytes) < 0 || int_arg(args[3], &device) < 0 ||
        u64_arg(args[4], &stream) < 0)
        return NULL;
    gpumem_slot_free(slot, address, nbytes, device, stream);
    Py_RETURN_NONE;
}

/* slot_stats(slot) -> {counter: value} (gpumem_stats' fields), None for a slot not in use */
static PyObject *slot_stats(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int slot;
    gpumem_stats s;
    if (slot_args(args, nargs, 1, "slot_stats(slot)", &slot) < 0) return NULL;
    if (gpumem_slot_stats(slot, &s) != 0) Py_RETURN_NONE;
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsLsLsL}", "calls", (unsigned long long)s.calls, "failures",
                         (unsigned long long)s.failures, "frees", (unsigned long long)s.frees, "cursor_bytes",
                         (unsigned long long)s.cursor_bytes, "freed_bytes", (unsigned long long)s.freed_bytes,
                         "capacity_bytes", (unsigned long long)s.capacity_bytes, "largest_free",
                         (unsigned long long)s.largest_free, "last_failed", (unsigned long long)s.last_failed,
                         "last_fail_reason", (long long)s.last_fail_reason, "n_extents", (long long)s.n_extents, "device",
                         (long long)s.device);
}

/* slot_counters(slot) -> (failures, cursor_bytes, freed_bytes), None for a slot not in use:
 * what a borrow scope's entry reads on every step, without building slot_stats' dict */
static PyObject *slot_counters(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int slot;
    gpumem_stats s;
    if (slot_args(args, nargs, 1, "slot_counters(slot)", &slot) < 0) return NULL;
    if (gpumem_slot_stats(slot, &s) != 0) Py_RETURN_NONE;
    return Py_BuildValue("(KKK)", (unsigned long long)s.failures, (unsigned long long)s.cursor_bytes,
                         (unsigned long long)s.freed_bytes);
}

/* Each growing slot's Python callback, called by the grow hook with the address a
 * request would end at; set and read with the GIL held. */
static PyObject *g_grow_callbacks[GPUMEM_MAX_SLOTS];

/* allocator.c's grow hook. torch calls the allocator from any thread, with or without
 * the GIL: take it to run the callback, which must not raise (its errors are the
 * caller's to keep); a truthy result means it backed more. */
static int grow_trampoline(int slot, uint64_t end) {
    if (slot < 0 || slot >= GPUMEM_MAX_SLOTS || !Py_IsInitialized()) return 0;
    PyGILState_STATE state = PyGILState_Ensure();
    int grew = 0;
    PyObject *callback = g_grow_callbacks[slot];
    if (callback) {
        Py_INCREF(callback);
        PyObject *result = PyObject_CallFunction(callback, "K", (unsigned long long)end);
        if (result) {
            grew = PyObject_IsTrue(result) == 1;
            Py_DECREF(result);
        } else {
            PyErr_WriteUnraisable(callback);
        }
        Py_DECREF(callback);
    }
    PyGILState_Release(state);
    return grew;
}

/* slot_set_grow(slot, callback or None) -> 0, or -1 for a slot not in use */
static PyObject *slot_set_grow(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int slot;
    if (slot_args(args, nargs, 2, "slot_set_grow(slot, callback)", &slot) < 0) return NULL;
    if (slot < 0 || slot >= GPUMEM_MAX_SLOTS) return PyLong_FromLong(-1);
    PyObject *callback = args[1] == Py_None ? NULL : args[1];
    if (callback && !PyCallable_Check(callback)) {
        PyErr_SetString(PyExc_TypeError, "slot_set_grow: the callback must be callable or None");
        return NULL;
    }
    int rc = gpumem_slot_set_growing(slot, callback != NULL);
    if (rc == 0) {
        PyObject *old = g_grow_callbacks[slot];
        Py_XINCREF(callback);
        g_grow_callbacks[slot] = callback;
        Py_XDECREF(old);
    }
    return PyLong_FromLong(rc);
}

/* slot_rounded(slot, nbytes) -> bytes the request takes from an extent (0: slot not in use) */
static PyObject *slot_rounded(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    int slot;
    size_t nbytes;
    if (slot_args(args, nargs, 2, "slot_rounded(slot, nbytes)", &slot) < 0 || size_arg(args[1], &nbytes) < 0) return NULL;
    return PyLong_FromSize_t(gpumem_slot_rounded(slot, nbytes));
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
static PyObject *cuda_stream_wait(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *lease_try_ordered(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *lease_acquire_ordered(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *lease_release_ordered(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *lease_release_memops(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *lease_try_memops(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *lease_acquire_memops(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *lease_order_wait(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
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

/* ==================================================================== the module */

#define FASTCALL(name, doc) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, doc}

static PyMethodDef native_methods[] = {
    FASTCALL(lease_try, "The uncontended lease acquire (see leases.c)."),
    FASTCALL(lease_acquire, "Take a lease, waiting up to a timeout."),
    FASTCALL(lease_release, "A holder's release (see leases.c)."),
    FASTCALL(lease_release_recorded, "A holder's release after recording its IPC event (see leases.c)."),
    FASTCALL(lease_clear, "Free a slot that holds a word, without ordering: the daemon's sweep."),
    FASTCALL(lease_peek, "A slot's word."),
    FASTCALL(lease_set_epoch, "The daemon: a slot's lease epoch (0: retired)."),
    FASTCALL(lease_set_flags, "The daemon: a slot's LEASE_FLAGS."),
    FASTCALL(lease_set_escaped, "The daemon: a slot's escape mark (a session, 0: none)."),
    FASTCALL(lease_await_record, "Wait for the last releaser's event record to land (see leases.c)."),
    FASTCALL(lease_forget_handoff, "The daemon: forget a slot's last releaser if it is this session."),
    FASTCALL(lease_clear_handoff, "The daemon: clear a slot's handoff if it still holds this value."),
    FASTCALL(thread_virtual, "Let this thread's requests land on unbacked space (1) or not (0)."),
    FASTCALL(slot_acquire, "An allocator slot bound to a device."),
    FASTCALL(slot_release, "Give an allocator slot back."),
    FASTCALL(slot_set_extents, "Replace a slot's extents; reset its cursors and byte counters."),
    FASTCALL(slot_set_backing, "The mapped ranges a slot serves requests in (None: no check)."),
    FASTCALL(slot_bind_stream, "Serve only one stream's requests (None: any stream)."),
    FASTCALL(slot_alloc, "An address, as torch would get it (0: nothing fits)."),
    FASTCALL(slot_free, "A free, as torch reports it (counted, not reused)."),
    FASTCALL(slot_stats, "A slot's counters."),
    FASTCALL(slot_counters, "A slot's failures, cursor and freed bytes (a borrow scope's entry)."),
    FASTCALL(slot_rounded, "Bytes a request takes from an extent."),
    FASTCALL(slot_set_grow, "Offer a slot's unbacked space to a callback before a request fails (None: never)."),
    FASTCALL(lease_try_ordered, "lease_try, and the stream's wait on the last releaser's event."),
    FASTCALL(lease_acquire_ordered, "lease_acquire, and the stream's wait on the last releaser's event."),
    FASTCALL(lease_release_ordered, "A holder's release, its event recorded first on a shared pool."),
    FASTCALL(cuda_stream_wait, "cuStreamWaitEvent in a context."),
    FASTCALL(lease_release_memops, "A holder's release under memops ordering (lease_order.py)."),
    FASTCALL(lease_try_memops, "lease_try, and the stream's wait on the last memops releaser's value."),
    FASTCALL(lease_acquire_memops, "lease_acquire, and the stream's wait on the last memops releaser's value."),
    FASTCALL(lease_order_wait, "A taker's stream waits for the last memops releaser's value."),
    {NULL, NULL, 0, NULL},
};

typedef struct {
    const char *name;
    long value;
} named_value;

typedef struct {
    const char *name;
    size_t offset, size;
} slot_field;

#define NAMED(name, value) {#name, value},
static const named_value lease_statuses[] = {LEASE_STATUSES(NAMED)};
static const named_value lease_kinds[] = {LEASE_KINDS(NAMED)};
static const named_value lease_flags[] = {LEASE_FLAGS(NAMED)};
#undef NAMED

/* Only the names are listed here; a unit test checks that the fields exported tile the
 * whole struct, so one added to lease_slot or lease_lane and not here fails it. */
#define FIELD(name) {#name, offsetof(lease_slot, name), sizeof(((lease_slot *)0)->name)}
static const slot_field lease_slot_fields[] = {
    FIELD(word), FIELD(futex), FIELD(waiters), FIELD(since_ns), FIELD(epoch),
    FIELD(flags), FIELD(handoff), FIELD(escaped), FIELD(label),
};
#undef FIELD
#define FIELD(name) {#name, offsetof(lease_lane, name), sizeof(((lease_lane *)0)->name)}
static const slot_field lease_lane_fields[] = {FIELD(word), FIELD(last), FIELD(stream), FIELD(lane), FIELD(pad)};
#undef FIELD

#define COUNT(array) (sizeof(array) / sizeof(*(array)))

/* A tuple of (name, value) pairs as the module attribute ``attr``. */
static int add_named(PyObject *module, const char *attr, const named_value *values, size_t n) {
    PyObject *pairs = PyTuple_New((Py_ssize_t)n);
    if (!pairs) return -1;
    for (size_t i = 0; i < n; i++) {
        PyObject *pair = Py_BuildValue("(sl)", values[i].name, values[i].value);
        if (!pair || PyTuple_SetItem(pairs, (Py_ssize_t)i, pair) < 0) { /* SetItem takes pair, even on failure */
            Py_DECREF(pairs);
            return -1;
        }
    }
    int rc = PyModule_AddObjectRef(module, attr, pairs);
    Py_DECREF(pairs);
    return rc;
}

/* ((name, offset, size), ...) in the struct's order, as the module attribute ``attr``:
 * LEASE_SLOT_FIELDS, LEASE_LANE_FIELDS. */
static int add_fields(PyObject *module, const char *attr, const slot_field *list, size_t n) {
    PyObject *fields = PyTuple_New((Py_ssize_t)n);
    if (!fields) return -1;
    for (size_t i = 0; i < n; i++) {
        const slot_field *f = &list[i];
        PyObject *entry = Py_BuildValue("(snn)", f->name, (Py_ssize_t)f->offset, (Py_ssize_t)f->size);
        if (!entry || PyTuple_SetItem(fields, (Py_ssize_t)i, entry) < 0) {
            Py_DECREF(fields);
            return -1;
        }
    }
    int rc = PyModule_AddObjectRef(module, attr, fields);
    Py_DECREF(fields);
    return rc;
}

static int add_constants(PyObject *m) {
    if (PyModule_AddIntMacro(m, LEASE_SEGMENT_BYTES) < 0 || PyModule_AddIntMacro(m, LEASE_LABEL_BYTES) < 0 ||
        PyModule_AddIntMacro(m, LEASE_HANDOFF_RECORDING) < 0 || PyModule_AddIntMacro(m, LEASE_HANDOFF_SESSION) < 0 ||
        PyModule_AddIntMacro(m, LEASE_ORDER_OFFSET) < 0 ||
        PyModule_AddIntConstant(m, "LEASE_SLOT_BYTES", (long)sizeof(lease_slot)) < 0 ||
        add_named(m, "LEASE_STATUSES", lease_statuses, COUNT(lease_statuses)) < 0 ||
        add_named(m, "LEASE_KINDS", lease_kinds, COUNT(lease_kinds)) < 0 ||
        add_named(m, "LEASE_FLAGS", lease_flags, COUNT(lease_flags)) < 0 ||
        add_fields(m, "LEASE_SLOT_FIELDS", lease_slot_fields, COUNT(lease_slot_fields)) < 0 ||
        add_fields(m, "LEASE_LANE_FIELDS", lease_lane_fields, COUNT(lease_lane_fields)) < 0 ||
        PyModule_AddIntConstant(m, "LEASE_LANE_BYTES", (long)sizeof(lease_lane)) < 0 || PyModule_AddIntMacro(m, LEASE_SEQ_BITS) < 0)
        return -1;
    if (PyModule_AddIntMacro(m, GPUMEM_MAX_SLOTS) < 0 || PyModule_AddIntMacro(m, GPUMEM_MAX_EXTENTS) < 0 ||
        PyModule_AddIntMacro(m, GPUMEM_FAIL_NONE) < 0 ||
        PyModule_AddIntMacro(m, GPUMEM_FAIL_FULL) < 0 || PyModule_AddIntMacro(m, GPUMEM_FAIL_UNBACKED) < 0 ||
        PyModule_AddIntMacro(m, GPUMEM_FAIL_DEVICE) < 0 || PyModule_AddIntMacro(m, GPUMEM_FAIL_STREAM) < 0)
        return -1;
    return 0;
}

static struct PyModuleDef native_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "gpumem's native allocator and lease slots (C in gpumem_shared/csrc).",
    .m_size = -1,
    .m_methods = native_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&native_module);
    if (m && add_constants(m) < 0) Py_CLEAR(m);
    if (m) gpumem_set_grow_hook(grow_trampoline);
    return m;
}
