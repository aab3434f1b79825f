/*
 * The lease calls that order a handoff on the GPU (lease_order.c), as module.c's method
 * table names them: the IPC-event calls and memops ordering, and the wait for a
 * releaser's record. Each is a METH_FASTCALL function.
 */
#ifndef GPUMEM_LEASE_ORDER_H
#define GPUMEM_LEASE_ORDER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Hidden, as they were when static: the .so exports only PyInit__native and the entry
 * points torch loads, and no other library's symbol of the same name stands in for one. */
#pragma GCC visibility push(hidden)
PyObject *lease_await_record(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *cuda_stream_wait(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *lease_try_ordered(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *lease_acquire_ordered(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *lease_release_ordered(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *lease_release_memops(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *lease_try_memops(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *lease_acquire_memops(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *lease_order_wait(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
#pragma GCC visibility pop

#endif
