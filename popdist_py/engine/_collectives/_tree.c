/* A reduction tree's program over float arrays in pieces, compiled (reduce.py's Program).
 *
 * A fused gradient bucket reaches the reduction as many pieces, one per tensor, read in place.
 * In Python each piece costs one ufunc call per node of the tree (about 1.5 us a piece for 4
 * members), which for 16 KiB gradients is a third of the memory-bound work itself. Here the
 * whole program runs over every piece in one call, a cache-sized chunk at a time, without the GIL.
 *
 * Bits: each output element is the same sequence of IEEE additions as numpy's np.add over the
 * same slots (then the same IEEE division by the group size for a mean); elementwise addition
 * has no order to change, and nothing here contracts or reassociates (no fast-math). */
#pragma GCC optimize("fp-contract=off")
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "../../_kernel_args.h"

/* Elements per chunk: the tree's intermediates for a chunk stay in L1. */
#define CHUNK 2048

typedef struct {
    Py_buffer *views; /* one per piece (a list input) or one (an array input) */
    Py_ssize_t count; /* views held */
    int pieces;       /* 1: in pieces, indexed by piece; 0: one array, indexed by offset */
} input;

static void release(input *inputs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        for (Py_ssize_t k = 0; k < inputs[i].count; k++)
            PyBuffer_Release(&inputs[i].views[k]);
        free(inputs[i].views);
    }
    free(inputs);
}

/* Whether the kernel runs on a buffer: one of ``format`` (a native float: the output's), contiguous,
 * each item aligned to its size. The others are declined, and numpy runs the program. */
static int runs_on(const Py_buffer *view, char format, Py_ssize_t itemsize)
{
    return ka_code(view, itemsize) == format && PyBuffer_IsContiguous(view, 'C') && ka_aligned(view);
}

/* inputs[i] (piece k of it when it is a list: k >= 0) as a buffer the kernel runs on: 1; 0
 * (released, no exception) when it is another; -1, naming it, when it is no array at all. */
static int get_view(PyObject *obj, Py_buffer *view, char format, Py_ssize_t itemsize, Py_ssize_t i, Py_ssize_t k)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        if (k < 0)
            PyErr_Format(PyExc_TypeError, "add_tree: inputs[%zd] must be an array or a list of arrays, not %.100s",
                         i, Py_TYPE(obj)->tp_name);
        else
            PyErr_Format(PyExc_TypeError, "add_tree: inputs[%zd][%zd] must be an array, not %.100s", i, k,
                         Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (!runs_on(view, format, itemsize)) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* One clone per vector width, picked at load time: adds and divides are correctly rounded at any
 * width, so the clones give the same bits, and the wider ones keep up with numpy's own loops. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

#define DEFINE_RUN(T)                                                                             \
    CLONES static void run_##T(input *inputs, Py_ssize_t ninputs, const Py_ssize_t *ends,             \
                        Py_ssize_t npieces, const int *ops, Py_ssize_t nops, Py_ssize_t result,  \
                        const void **slots, T *out, T *temps, double divisor)                   \
    {                                                                                            \
        const T **slot = (const T **)slots;                                                      \
        T div = (T)divisor;                                                                      \
        Py_ssize_t start = 0;                                                                    \
        for (Py_ssize_t k = 0; k < npieces; start = ends[k], k++) {                              \
            for (Py_ssize_t c = start; c < ends[k]; c += CHUNK) {                                \
                Py_ssize_t n = ends[k] - c < CHUNK ? ends[k] - c : CHUNK;                        \
                for (Py_ssize_t i = 0; i < ninputs; i++)                                         \
                    slot[i] = inputs[i].pieces ? (const T *)inputs[i].views[k].buf + (c - start)  \
                                               : (const T *)inputs[i].views[0].buf + c;          \
                T *dst = out + c;                                                                \
                if (nops == 0)                                                                   \
                    memcpy(dst, slot[result], sizeof(T) * (size_t)n);                            \
                for (Py_ssize_t o = 0; o < nops; o++) {                                          \
                    int a = ops[3 * o], b = ops[3 * o + 1], d = ops[3 * o + 2];                  \
                    const T *x = a < 0 ? dst : a < ninputs ? slot[a] : temps + (a - ninputs) * CHUNK; \
                    const T *y = b < 0 ? dst : b < ninputs ? slot[b] : temps + (b - ninputs) * CHUNK; \
                    T *z = d < 0 ? dst : temps + (d - ninputs) * CHUNK;                          \
                    for (Py_ssize_t j = 0; j < n; j++)                                           \
                        z[j] = x[j] + y[j];                                                      \
                }                                                                                \
                if (divisor != 0)                                                                \
                    for (Py_ssize_t j = 0; j < n; j++)                                           \
                        dst[j] = dst[j] / div;                                                   \
            }                                                                                    \
        }                                                                                        \
    }

DEFINE_RUN(float)
DEFINE_RUN(double)

/* ops[o], an (a, b, dst) triple of slots, into dst[0..2]: 0, or -1 naming it (TypeError when it
 * is no triple of ints, ValueError when a slot is outside the program's: inputs and temporaries
 * are read, temporaries and the output (-1) written). */
static int parse_op(PyObject *item, Py_ssize_t o, Py_ssize_t ninputs, Py_ssize_t ntemp, int *dst)
{
    PyObject *triple = PyTuple_Check(item) || PyList_Check(item) ? PySequence_Fast(item, "") : NULL;
    long long v[3] = {0, 0, 0};
    int ok = triple && PySequence_Fast_GET_SIZE(triple) == 3;
    for (int s = 0; ok && s < 3; s++) {
        PyObject *slot = PySequence_Fast_GET_ITEM(triple, s);
        int overflow = 0;
        v[s] = PyLong_Check(slot) ? PyLong_AsLongLongAndOverflow(slot, &overflow) : 0;
        ok = PyLong_Check(slot) && !(v[s] == -1 && PyErr_Occurred());
        if (overflow)
            v[s] = overflow > 0 ? LLONG_MAX : LLONG_MIN; /* outside every program: refused below */
    }
    Py_XDECREF(triple);
    if (!ok) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "add_tree: ops[%zd] must be an (a, b, dst) triple of ints", o);
        return -1;
    }
    for (int s = 0; s < 3; s++) {
        if (!(v[s] == -1 || (v[s] >= (s < 2 ? 0 : ninputs) && v[s] < ninputs + ntemp))) {
            PyErr_Format(PyExc_ValueError, "add_tree: ops[%zd] names slot %lld, outside the program's (-1 to %zd)",
                         o, v[s], ninputs + ntemp - 1);
            return -1;
        }
        dst[s] = (int)v[s];
    }
    return 0;
}

/* add_tree(inputs, ops, ntemp, result, out, divisor) -> bool; see the method table. Everything is
 * checked, and every size computed with checked arithmetic, before anything is allocated. */
static PyObject *add_tree(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *seq, *ops_obj, *out_obj;
    Py_ssize_t ntemp, result;
    Py_buffer out;
    double divisor;
    if (!PyArg_ParseTuple(args, "OOnnOd", &seq, &ops_obj, &ntemp, &result, &out_obj, &divisor))
        return NULL;
    if (ka_get(out_obj, &out, "add_tree", "out") < 0)
        return NULL;
    char format = ka_code(&out, sizeof(float)) == 'f' ? 'f' : ka_code(&out, sizeof(double)) == 'd' ? 'd' : 0;
    if (!format || out.readonly || !runs_on(&out, format, out.itemsize)) {
        PyBuffer_Release(&out); /* not a case for this kernel: the caller runs the program in numpy */
        Py_RETURN_FALSE;
    }
    PyObject *ret = NULL, *fast = NULL, *ops_fast = NULL;
    input *inputs = NULL;
    Py_ssize_t ninputs = 0, nops = 0, npieces = 1, *ends = NULL, cuts_from = -1;
    int *ops = NULL;
    void *temps = NULL;
    const void **slots = NULL;
    int is_float = format == 'f';
    Py_ssize_t itemsize = out.itemsize, m = out.len / itemsize, temp_bytes;
    if (!(fast = PySequence_Fast(seq, "add_tree: inputs must be a sequence")) ||
        !(ops_fast = PySequence_Fast(ops_obj, "add_tree: ops must be a sequence")))
        goto done;
    ninputs = PySequence_Fast_GET_SIZE(fast);
    nops = PySequence_Fast_GET_SIZE(ops_fast);
    if (ninputs < 1) {
        PyErr_SetString(PyExc_ValueError, "add_tree: no inputs: a program reads at least one");
        goto done;
    }
    if (ntemp < 0 || ntemp > nops) { /* each temporary is some op's dst */
        PyErr_Format(PyExc_ValueError, "add_tree: ntemp is %zd; a program of %zd ops writes 0 to %zd temporaries",
                     ntemp, nops, nops);
        goto done;
    }
    if (ninputs > INT_MAX - ntemp) { /* slots are ints */
        PyErr_Format(PyExc_ValueError, "add_tree: %zd inputs and %zd temporaries: more slots than a program has",
                     ninputs, ntemp);
        goto done;
    }
    if (nops == 0 && (result < 0 || result >= ninputs)) {
        PyErr_Format(PyExc_ValueError, "add_tree: result slot %zd is no input (0 to %zd)", result, ninputs - 1);
        goto done;
    }
    temp_bytes = ka_mul(ka_mul(itemsize, CHUNK), ntemp ? ntemp : 1);
    if (temp_bytes < 0) {
        PyErr_Format(PyExc_MemoryError, "add_tree: ntemp %zd temporaries would not fit in the address space", ntemp);
        goto done;
    }
    ops = (int *)calloc((size_t)nops * 3 + 1, sizeof(int));
    inputs = (input *)calloc((size_t)ninputs, sizeof(input));
    if (!ops || !inputs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t o = 0; o < nops; o++)
        if (parse_op(PySequence_Fast_GET_ITEM(ops_fast, o), o, ninputs, ntemp, &ops[3 * o]) < 0)
            goto done;
    for (Py_ssize_t i = 0; i < ninputs; i++) { /* every input's views */
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        int is_list = PyList_Check(item);
        Py_ssize_t count = is_list ? PyList_GET_SIZE(item) : 1;
        inputs[i].pieces = is_list;
        inputs[i].views = (Py_buffer *)calloc((size_t)(count ? count : 1), sizeof(Py_buffer));
        if (!inputs[i].views) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t k = 0; k < count; k++) {
            int got = get_view(is_list ? PyList_GET_ITEM(item, k) : item, &inputs[i].views[k], format, itemsize, i,
                               is_list ? k : -1);
            if (got <= 0) {
                ret = got < 0 ? NULL : Py_False;
                goto done;
            }
            inputs[i].count++;
        }
        if (is_list && cuts_from < 0)
            cuts_from = i;
    }
    /* the cut points: the first list input's piece ends (every other list must share them) */
    npieces = cuts_from < 0 ? 1 : inputs[cuts_from].count;
    ends = (Py_ssize_t *)malloc(sizeof(Py_ssize_t) * (size_t)(npieces ? npieces : 1));
    if (!ends) {
        PyErr_NoMemory();
        goto done;
    }
    if (cuts_from < 0)
        ends[0] = m;
    for (Py_ssize_t k = 0, at = 0; cuts_from >= 0 && k < npieces; k++) {
        Py_ssize_t len = inputs[cuts_from].views[k].len / itemsize;
        if (len > m - at) { /* more than out holds (and no sum that could overflow) */
            PyErr_Format(PyExc_ValueError, "add_tree: the pieces of inputs[%zd] hold more elements than out's %zd",
                         cuts_from, m);
            goto done;
        }
        ends[k] = at += len;
    }
    if ((npieces ? ends[npieces - 1] : 0) != m) {
        PyErr_Format(PyExc_ValueError, "add_tree: the pieces of inputs[%zd] hold %zd elements, out %zd", cuts_from,
                     npieces ? ends[npieces - 1] : 0, m);
        goto done;
    }
    for (Py_ssize_t i = 0; i < ninputs; i++) {
        if (!inputs[i].pieces) {
            if (inputs[i].views[0].len != out.len) {
                PyErr_Format(PyExc_ValueError, "add_tree: inputs[%zd] has %zd elements, out %zd", i,
                             inputs[i].views[0].len / itemsize, m);
                goto done;
            }
            continue;
        }
        if (inputs[i].count != npieces) {
            ret = Py_False; /* cut elsewhere: the caller's blocks handle it */
            goto done;
        }
        for (Py_ssize_t k = 0, start = 0; k < npieces; start = ends[k], k++)
            if (inputs[i].views[k].len / itemsize != ends[k] - start) {
                ret = Py_False;
                goto done;
            }
    }
    temps = malloc((size_t)temp_bytes);
    slots = (const void **)malloc(sizeof(void *) * (size_t)ninputs);
    if (!temps || !slots) {
        PyErr_Format(PyExc_MemoryError, "add_tree: no memory for ntemp %zd temporaries (%zd bytes)", ntemp, temp_bytes);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    if (is_float)
        run_float(inputs, ninputs, ends, npieces, ops, nops, result, slots, (float *)out.buf, (float *)temps, divisor);
    else
        run_double(inputs, ninputs, ends, npieces, ops, nops, result, slots, (double *)out.buf, (double *)temps, divisor);
    Py_END_ALLOW_THREADS
    ret = Py_True;
done:
    PyBuffer_Release(&out);
    Py_XDECREF(fast);
    Py_XDECREF(ops_fast);
    free(ops);
    free(ends);
    free(temps);
    free((void *)slots);
    if (inputs)
        release(inputs, ninputs);
    Py_XINCREF(ret);
    return ret;
}

static PyMethodDef methods[] = {
    {"add_tree", add_tree, METH_VARARGS,
     "add_tree(inputs, ops, ntemp, result, out, divisor) -> bool: run a reduction program of additions "
     "into out (float32 or float64, C-contiguous). inputs: arrays of out's length, or lists of pieces "
     "cut at the same places; ops: (a, b, dst) slot triples (slots 0.. the inputs, then ntemp "
     "temporaries, dst -1 the output); with no ops, out is a copy of input result. divisor: 0, or "
     "out is divided by it. False, with nothing written, when a buffer is of another dtype, not "
     "contiguous or misaligned, out is read-only, or the lists are cut differently. A malformed "
     "argument (no array, a slot outside the program, ntemp past the ops) raises, naming it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tree", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tree(void) { return PyModule_Create(&module); }
