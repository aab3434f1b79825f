/*
 * The extension module gpumem_shared._native. The allocator (allocator.c) and the lease
 * table (leases.c) are plain C that torch and ctypes load from this file by symbol;
 * the lease fast path is also offered here as CPython functions, because a ctypes call
 * costs more than the compare-and-swap it wraps, and an uncontended lease must stay
 * within a few microseconds. The lease table's constants and slot layout
 * (lease_table.h) are exported for gpumem_shared/lease_table.py, which states none of
 * them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

#include "lease_table.h"

static int slot_arg(PyObject *arg, uint32_t *out) {
    unsigned long index = PyLong_AsUnsignedLong(arg);
    if (index == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (index >= LEASE_SLOTS) {
        PyErr_Format(PyExc_ValueError, "lease slot %lu is outside the table (%d slots)", index, LEASE_SLOTS);
        return -1;
    }
    *out = (uint32_t)index;
    return 0;
}

/* The arguments every lease call starts with: (table_address, slot, word, ...), checked
 * for count and type; ``epoch`` too when asked for. */
static int lease_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage, lease_slot **table,
                      uint32_t *index, uint64_t *word, uint32_t *epoch) {
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    *table = PyLong_AsVoidPtr(args[0]);
    if ((*table == NULL && PyErr_Occurred()) || slot_arg(args[1], index) < 0) return -1;
    unsigned long long value = PyLong_AsUnsignedLongLong(args[2]);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *word = (uint64_t)value;
    if (epoch) {
        unsigned long e = PyLong_AsUnsignedLong(args[3]);
        if (e == (unsigned long)-1 && PyErr_Occurred()) return -1;
        *epoch = (uint32_t)e;
    }
    return 0;
}

/* lease_try(table_address, slot, word, epoch, label: bytes) -> status */
static PyObject *lease_try(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    lease_slot *table;
    uint32_t index, epoch;
    uint64_t word;
    char *label;
    Py_ssize_t len;
    if (lease_args(args, nargs, 5, "lease_try(table_address, slot, word, epoch, label)", &table, &index, &word, &epoch) < 0 ||
        PyBytes_AsStringAndSize(args[4], &label, &len) < 0)
        return NULL;
    return PyLong_FromLong(gpumem_lease_try(table, index, word, epoch, label, (uint32_t)len));
}

/* lease_release(table_address, slot, word) -> status */
static PyObject *lease_release(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    lease_slot *table;
    uint32_t index;
    uint64_t word;
    if (lease_args(args, nargs, 3, "lease_release(table_address, slot, word)", &table, &index, &word, NULL) < 0) return NULL;
    return PyLong_FromLong(gpumem_lease_release(table, index, word));
}

/* lease_release_recorded(table_address, slot, word) -> status */
static PyObject *lease_release_recorded(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    lease_slot *table;
    uint32_t index;
    uint64_t word;
    if (lease_args(args, nargs, 3, "lease_release_recorded(table_address, slot, word)", &table, &index, &word, NULL) < 0)
        return NULL;
    return PyLong_FromLong(gpumem_lease_release_recorded(table, index, word));
}

/* lease_acquire(table_address, slot, word, epoch, timeout_ns) -> (status, word found);
 * sleeps on the slot's futex without the GIL. */
static PyObject *lease_acquire(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    lease_slot *table;
    uint32_t index, epoch;
    uint64_t word;
    if (lease_args(args, nargs, 5, "lease_acquire(table_address, slot, word, epoch, timeout_ns)", &table, &index, &word, &epoch) < 0)
        return NULL;
    long long timeout_ns = PyLong_AsLongLong(args[4]);
    if (timeout_ns == -1 && PyErr_Occurred()) return NULL;
    uint64_t found = 0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = gpumem_lease_acquire(table, index, word, epoch, (int64_t)timeout_ns, &found);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(iK)", status, (unsigned long long)found);
}

/* IPC-event calls at a lease handoff, into libcuda resolved at first use (the package
 * builds without CUDA headers, and runs where no driver exists). Each runs in the given
 * context, pushed only when the thread's current one differs: a process driving several
 * GPUs calls them from any device. Returns the CUresult (0 = success), or -1 when no
 * driver could be loaded. */
typedef int (*ctx_get_fn)(void **);
typedef int (*ctx_push_fn)(void *);
typedef int (*ctx_pop_fn)(void **);
typedef int (*event_record_fn)(void *, void *);
typedef int (*stream_wait_fn)(void *, void *, unsigned int);

static struct {
    int loaded;
    ctx_get_fn get;
    ctx_push_fn push;
    ctx_pop_fn pop;
    event_record_fn record;
    stream_wait_fn wait;
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
    }
    cu.loaded = lib && cu.get && cu.push && cu.pop && cu.record && cu.wait ? 1 : -1;
    return cu.loaded > 0 ? 0 : -1;
}

static int in_context(void *ctx, int wait, void *event, void *stream) {
    if (load_cuda() < 0) return -1;
    void *current = NULL;
    cu.get(&current);
    int pushed = current != ctx;
    if (pushed) {
        int rc = cu.push(ctx);
        if (rc) return rc;
    }
    int rc = wait ? cu.wait(stream, event, 0) : cu.record(event, stream);
    if (pushed) cu.pop(&current);
    return rc;
}

static PyObject *cuda_event_call(PyObject *const *args, Py_ssize_t nargs, int wait) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "(context, event, stream) handles as ints");
        return NULL;
    }
    void *ptr[3];
    for (int i = 0; i < 3; i++) {
        ptr[i] = PyLong_AsVoidPtr(args[i]);
        if (ptr[i] == NULL && PyErr_Occurred()) return NULL;
    }
    return PyLong_FromLong(in_context(ptr[0], wait, ptr[1], ptr[2]));
}

/* cuda_event_record(context, event, stream) -> CUresult */
static PyObject *cuda_event_record(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return cuda_event_call(args, nargs, 0);
}

/* cuda_stream_wait(context, event, stream) -> CUresult */
static PyObject *cuda_stream_wait(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return cuda_event_call(args, nargs, 1);
}

static PyMethodDef native_methods[] = {
    {"cuda_event_record", (PyCFunction)(void (*)(void))cuda_event_record, METH_FASTCALL, "cuEventRecord in a context."},
    {"cuda_stream_wait", (PyCFunction)(void (*)(void))cuda_stream_wait, METH_FASTCALL, "cuStreamWaitEvent in a context."},
    {"lease_try", (PyCFunction)(void (*)(void))lease_try, METH_FASTCALL, "The uncontended lease acquire (see leases.c)."},
    {"lease_release", (PyCFunction)(void (*)(void))lease_release, METH_FASTCALL, "A holder's release (see leases.c)."},
    {"lease_release_recorded", (PyCFunction)(void (*)(void))lease_release_recorded, METH_FASTCALL,
     "A holder's release after recording its IPC event (see leases.c)."},
    {"lease_acquire", (PyCFunction)(void (*)(void))lease_acquire, METH_FASTCALL, "Take a slot, waiting up to a timeout."},
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
 * whole slot, so one added to lease_slot and not here fails it. */
#define FIELD(name) {#name, offsetof(lease_slot, name), sizeof(((lease_slot *)0)->name)}
static const slot_field lease_slot_fields[] = {
    FIELD(word), FIELD(futex), FIELD(waiters), FIELD(since_ns), FIELD(epoch),
    FIELD(flags), FIELD(handoff), FIELD(escaped), FIELD(label),
};
#undef FIELD

#define COUNT(array) (sizeof(array) / sizeof(*(array)))

/* A tuple of (name, value) pairs as the module attribute ``attr``. */
static int add_named(PyObject *module, const char *attr, const named_value *values, size_t n) {
    PyObject *pairs = PyTuple_New((Py_ssize_t)n);
    if (!pairs) return -1;
    for (size_t i = 0; i < n; i++) {
        PyObject *pair = Py_BuildValue("(sl)", values[i].name, values[i].value);
        if (!pair) {
            Py_DECREF(pairs);
            return -1;
        }
        PyTuple_SET_ITEM(pairs, (Py_ssize_t)i, pair);
    }
    int rc = PyModule_AddObjectRef(module, attr, pairs);
    Py_DECREF(pairs);
    return rc;
}

/* LEASE_SLOT_FIELDS: ((name, offset, size), ...) in the struct's order. */
static int add_slot_fields(PyObject *module) {
    size_t n = COUNT(lease_slot_fields);
    PyObject *fields = PyTuple_New((Py_ssize_t)n);
    if (!fields) return -1;
    for (size_t i = 0; i < n; i++) {
        const slot_field *f = &lease_slot_fields[i];
        PyObject *entry = Py_BuildValue("(snn)", f->name, (Py_ssize_t)f->offset, (Py_ssize_t)f->size);
        if (!entry) {
            Py_DECREF(fields);
            return -1;
        }
        PyTuple_SET_ITEM(fields, (Py_ssize_t)i, entry);
    }
    int rc = PyModule_AddObjectRef(module, "LEASE_SLOT_FIELDS", fields);
    Py_DECREF(fields);
    return rc;
}

static int add_constants(PyObject *m) {
    if (PyModule_AddIntMacro(m, LEASE_SLOTS) < 0 || PyModule_AddIntMacro(m, LEASE_LABEL_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "LEASE_SLOT_BYTES", (long)sizeof(lease_slot)) < 0 ||
        add_named(m, "LEASE_STATUSES", lease_statuses, COUNT(lease_statuses)) < 0 ||
        add_named(m, "LEASE_KINDS", lease_kinds, COUNT(lease_kinds)) < 0 ||
        add_named(m, "LEASE_FLAGS", lease_flags, COUNT(lease_flags)) < 0 || add_slot_fields(m) < 0)
        return -1;
    return 0;
}

static struct PyModuleDef native_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "gpumem's native allocator and lease table (C in shared/csrc).",
    .m_size = -1,
    .m_methods = native_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&native_module);
    if (m && add_constants(m) < 0) Py_CLEAR(m);
    return m;
}
