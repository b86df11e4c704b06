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

static PyObject *swap_pass(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer order, draws;
    if (!PyArg_ParseTuple(args, "w*y*", &order, &draws))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = order.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t m = draws.len / (Py_ssize_t)sizeof(uint64_t);
    if (order.len % (Py_ssize_t)sizeof(int64_t) || draws.len % (Py_ssize_t)sizeof(uint64_t) || m > n) {
        PyErr_SetString(PyExc_ValueError, "swap_pass: order must be n int64 values and draws at most n uint64");
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
     "(int64 order of n values, at most n uint64 draws)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_swaps", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__swaps(void) { return PyModule_Create(&module); }
