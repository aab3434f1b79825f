/*
 * The argument checks every native call shares (module.c, lease_order.c): counts, integers
 * that must fit their C field, and the lease segment's address every lease call starts
 * with. Each raises the Python exception a caller sees and returns -1.
 *
 * static inline, so each file compiles its own copy: the lease fast path (lease_try,
 * lease_release) keeps its checks in line, as when one file held every call, with no
 * call across files.
 */
#ifndef GPUMEM_ARGS_H
#define GPUMEM_ARGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <stdint.h>

#include "lease_table.h"

static inline int count_args(Py_ssize_t nargs, Py_ssize_t want, const char *usage) {
    if (nargs == want) return 0;
    PyErr_SetString(PyExc_TypeError, usage);
    return -1;
}

static inline int u64_arg(PyObject *arg, uint64_t *out) {
    unsigned long long value = PyLong_AsUnsignedLongLong(arg);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)value;
    return 0;
}

/* Epochs, flags and session ids are 32-bit slot fields: a wider value would be cut. */
static inline int u32_arg(PyObject *arg, uint32_t *out) {
    unsigned long value = PyLong_AsUnsignedLong(arg);
    if (value == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (value > UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "%lu does not fit a 32-bit lease slot field", value);
        return -1;
    }
    *out = (uint32_t)value;
    return 0;
}

static inline int int_arg(PyObject *arg, int *out) {
    long value = PyLong_AsLong(arg);
    if (value == -1 && PyErr_Occurred()) return -1;
    if (value < INT_MIN || value > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "%ld does not fit a C int", value);
        return -1;
    }
    *out = (int)value;
    return 0;
}

static inline int size_arg(PyObject *arg, size_t *out) {
    size_t value = PyLong_AsSize_t(arg);
    if (value == (size_t)-1 && PyErr_Occurred()) return -1;
    *out = value;
    return 0;
}

/* The argument every lease call starts with: the address of a mapped lease segment,
 * where its slot lies. It cannot be checked against a mapping; a null or misaligned one
 * (never a segment: mappings are page-aligned) is refused. */
static inline int lease_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage, lease_slot **slot) {
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

#endif
