/* The swap pass of torch's CPU randperm, compiled (popdist_py/data.py's torch_randperm).
 *
 * Fisher-Yates as torch runs it: for i = 0, 1, ..., order[i] is swapped with order[j], where
 * j = i + draws[i] % (n - i) and draws are its generator's 32-bit outputs. Every swap depends on
 * the ones before it, so numpy cannot do the pass as array operations; a Python loop takes about
 * 7 s for n = 10**7, this about 0.1 s.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_kernel_args.h"

/* Argument `name` as a 1-d C-contiguous buffer of aligned 8-byte integers (`signedness`: "int64"
 * or "uint64", the struct codes `codes`), writable when `writable`; -1 naming it otherwise. */
static int get_integers(PyObject *obj, Py_buffer *buf, const char *name, const char *signedness, const char *codes,
                        int writable)
{
    if (ka_get(obj, buf, "swap_pass", name) < 0)
        return -1;
    char code = ka_code(buf, 8);
    if (!code || !strchr(codes, code))
        PyErr_Format(PyExc_TypeError, "swap_pass: %s must be %s, got buffer format '%s' of %zd bytes", name, signedness,
                     ka_format(buf), buf->itemsize);
    else if (buf->ndim != 1)
        PyErr_Format(PyExc_ValueError, "swap_pass: %s must be 1-d, got %d-d", name, buf->ndim);
    else if (!PyBuffer_IsContiguous(buf, 'C'))
        PyErr_Format(PyExc_ValueError, "swap_pass: %s must be contiguous", name);
    else if (!ka_aligned(buf))
        PyErr_Format(PyExc_ValueError, "swap_pass: %s's items are not aligned to their 8 bytes", name);
    else if (writable && buf->readonly)
        PyErr_Format(PyExc_ValueError, "swap_pass: %s is read-only", name);
    else
        return 0;
    PyBuffer_Release(buf);
    return -1;
}

static PyObject *swap_pass(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *order_obj, *draws_obj;
    Py_buffer order, draws;
    if (!PyArg_ParseTuple(args, "OO", &order_obj, &draws_obj))
        return NULL;
    if (get_integers(order_obj, &order, "order", "int64", "lq", 1) < 0)
        return NULL;
    if (get_integers(draws_obj, &draws, "draws", "uint64", "LQ", 0) < 0) {
        PyBuffer_Release(&order);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = order.shape[0], m = draws.shape[0];
    if (m > n) {
        PyErr_Format(PyExc_ValueError, "swap_pass: draws has %zd values, more than order's %zd", m, n);
        goto done;
    }
    int64_t *r = (int64_t *)order.buf;
    const uint64_t *w = (const uint64_t *)draws.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_ssize_t j = i + (Py_ssize_t)(w[i] % (uint64_t)(n - i));
        int64_t kept = r[i];
        r[i] = r[j];
        r[j] = kept;
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&order);
    PyBuffer_Release(&draws);
    return result;
}

static PyMethodDef methods[] = {
    {"swap_pass", swap_pass, METH_VARARGS,
     "swap_pass(order, draws): for each i in turn, swap order[i] with order[i + draws[i] % (n - i)] "
     "(a 1-d int64 order of n values, at most n 1-d uint64 draws; each refused, named, otherwise)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_swaps", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__swaps(void) { return PyModule_Create(&module); }
