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
 * - The lease calls that order a handoff on the GPU (lease_order.c, lease_order.h): IPC events
 *   or memops, into libcuda resolved at first use, in the same call as the
 *   compare-and-swap (shared pools).
 *
 * One binding style, with its argument checking in args.h: a ctypes binding of the same
 * file restated every signature in Python, and a ctypes call costs more than the
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

#include <stddef.h>
#include <stdint.h>

#include "allocator.h"
#include "args.h"
#include "lease_table.h"
#include "lease_order.h"

/* ======================================================================== lease slots */

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
 * whole struct, so one added to lease_slot, lease_lane or lease_hold and not here fails it. */
#define FIELD(name) {#name, offsetof(lease_slot, name), sizeof(((lease_slot *)0)->name)}
static const slot_field lease_slot_fields[] = {
    FIELD(word), FIELD(futex), FIELD(waiters), FIELD(since_ns), FIELD(epoch),
    FIELD(flags), FIELD(handoff), FIELD(escaped), FIELD(label),
};
#undef FIELD
#define FIELD(name) {#name, offsetof(lease_lane, name), sizeof(((lease_lane *)0)->name)}
static const slot_field lease_lane_fields[] = {FIELD(word), FIELD(last), FIELD(stream), FIELD(lane), FIELD(pad)};
#undef FIELD
#define FIELD(name) {#name, offsetof(lease_hold, name), sizeof(((lease_hold *)0)->name)}
static const slot_field lease_hold_fields[] = {FIELD(typical_ns)};
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
 * LEASE_SLOT_FIELDS, LEASE_LANE_FIELDS, LEASE_HOLD_FIELDS. */
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
        PyModule_AddIntMacro(m, LEASE_ORDER_OFFSET) < 0 || PyModule_AddIntMacro(m, LEASE_HOLD_OFFSET) < 0 ||
        PyModule_AddIntMacro(m, LEASE_HOLD_MAX_NS) < 0 ||
        PyModule_AddIntConstant(m, "LEASE_HOLD_BYTES", (long)sizeof(lease_hold)) < 0 ||
        PyModule_AddIntConstant(m, "LEASE_SLOT_BYTES", (long)sizeof(lease_slot)) < 0 ||
        add_named(m, "LEASE_STATUSES", lease_statuses, COUNT(lease_statuses)) < 0 ||
        add_named(m, "LEASE_KINDS", lease_kinds, COUNT(lease_kinds)) < 0 ||
        add_named(m, "LEASE_FLAGS", lease_flags, COUNT(lease_flags)) < 0 ||
        add_fields(m, "LEASE_SLOT_FIELDS", lease_slot_fields, COUNT(lease_slot_fields)) < 0 ||
        add_fields(m, "LEASE_LANE_FIELDS", lease_lane_fields, COUNT(lease_lane_fields)) < 0 ||
        add_fields(m, "LEASE_HOLD_FIELDS", lease_hold_fields, COUNT(lease_hold_fields)) < 0 ||
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
