/*
 * The extension module gpumem_shared._native. The allocator (allocator.c) and the lease
 * table (leases.c) are plain C that torch and ctypes load from this file by symbol;
 * the lease fast path is also offered here as CPython functions, because a ctypes call
 * costs more than the compare-and-swap it wraps, and an uncontended lease must stay
 * within a few microseconds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#define LEASE_SLOTS 1024

int gpumem_lease_try(void *table, uint32_t index, uint64_t mine, uint32_t epoch, const char *label, uint32_t len);
int gpumem_lease_release(void *table, uint32_t index, uint64_t word);

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

/* lease_try(table_address, slot, word, epoch, label: bytes) -> status */
static PyObject *lease_try(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "lease_try(table_address, slot, word, epoch, label)");
        return NULL;
    }
    uint32_t index;
    void *table = PyLong_AsVoidPtr(args[0]);
    if ((table == NULL && PyErr_Occurred()) || slot_arg(args[1], &index) < 0) return NULL;
    unsigned long long word = PyLong_AsUnsignedLongLong(args[2]);
    if (word == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    unsigned long epoch = PyLong_AsUnsignedLong(args[3]);
    if (epoch == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    char *label;
    Py_ssize_t len;
    if (PyBytes_AsStringAndSize(args[4], &label, &len) < 0) return NULL;
    return PyLong_FromLong(gpumem_lease_try(table, index, (uint64_t)word, (uint32_t)epoch, label, (uint32_t)len));
}

/* lease_release(table_address, slot, word) -> status */
static PyObject *lease_release(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "lease_release(table_address, slot, word)");
        return NULL;
    }
    uint32_t index;
    void *table = PyLong_AsVoidPtr(args[0]);
    if ((table == NULL && PyErr_Occurred()) || slot_arg(args[1], &index) < 0) return NULL;
    unsigned long long word = PyLong_AsUnsignedLongLong(args[2]);
    if (word == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(gpumem_lease_release(table, index, (uint64_t)word));
}

static PyMethodDef native_methods[] = {
    {"lease_try", (PyCFunction)(void (*)(void))lease_try, METH_FASTCALL, "The uncontended lease acquire (see leases.c)."},
    {"lease_release", (PyCFunction)(void (*)(void))lease_release, METH_FASTCALL, "A holder's release (see leases.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "gpumem's native allocator and lease table (C in shared/csrc).",
    .m_size = -1,
    .m_methods = native_methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
