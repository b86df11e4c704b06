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
#include <stdlib.h>
#include <string.h>

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

/* A C-contiguous buffer of ``format``: 1; 0 (released, no exception) when it is another; -1 on error. */
static int get_view(PyObject *obj, Py_buffer *view, const char *format)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0)
        return -1;
    if (view->format == NULL || strcmp(view->format, format) != 0 || !PyBuffer_IsContiguous(view, 'C')) {
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

/* add_tree(inputs, ops, ntemp, result, out, divisor) -> bool; see the method table. */
static PyObject *add_tree(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *seq, *ops_obj, *out_obj;
    Py_ssize_t ntemp, result;
    Py_buffer out;
    double divisor;
    if (!PyArg_ParseTuple(args, "OOnnOd", &seq, &ops_obj, &ntemp, &result, &out_obj, &divisor))
        return NULL;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_RECORDS_RO) < 0)
        return NULL;
    if (out.readonly || !PyBuffer_IsContiguous(&out, 'C')) { /* not a case for this kernel */
        PyBuffer_Release(&out);
        Py_RETURN_FALSE;
    }
    PyObject *ret = NULL, *fast = NULL, *ops_fast = NULL;
    input *inputs = NULL;
    Py_ssize_t ninputs = 0, nops = 0, npieces = 1, *ends = NULL, cuts_from = -1;
    int *ops = NULL;
    void *temps = NULL;
    const void **slots = NULL;
    const char *format = out.format ? out.format : "B";
    int is_float = strcmp(format, "f") == 0, is_double = strcmp(format, "d") == 0;
    Py_ssize_t itemsize = is_float ? (Py_ssize_t)sizeof(float) : (Py_ssize_t)sizeof(double);
    if (!(is_float || is_double)) {
        ret = Py_False; /* not a case for this kernel: the caller runs the program in numpy */
        goto done;
    }
    Py_ssize_t m = out.len / itemsize;
    if (!(fast = PySequence_Fast(seq, "add_tree: inputs must be a sequence")) ||
        !(ops_fast = PySequence_Fast(ops_obj, "add_tree: ops must be a sequence")))
        goto done;
    ninputs = PySequence_Fast_GET_SIZE(fast);
    nops = PySequence_Fast_GET_SIZE(ops_fast);
    if (ninputs < 1 || ntemp < 0 || (nops == 0 && (result < 0 || result >= ninputs))) {
        PyErr_SetString(PyExc_ValueError, "add_tree: no inputs, a negative ntemp, or a result slot that is no input");
        goto done;
    }
    ops = (int *)calloc((size_t)(3 * nops + 1), sizeof(int));
    inputs = (input *)calloc((size_t)ninputs, sizeof(input));
    if (!ops || !inputs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t o = 0; o < nops; o++) {
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(ops_fast, o), "iii", &ops[3 * o], &ops[3 * o + 1],
                              &ops[3 * o + 2]))
            goto done;
        for (int s = 0; s < 3; s++) {
            int v = ops[3 * o + s];
            int ok = v == -1 || (v >= (s < 2 ? 0 : ninputs) && v < ninputs + ntemp);
            if (!ok) {
                PyErr_Format(PyExc_ValueError, "add_tree: op %zd names slot %d, outside the program's", o, v);
                goto done;
            }
        }
    }
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
            int got = get_view(is_list ? PyList_GET_ITEM(item, k) : item, &inputs[i].views[k], format);
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
    for (Py_ssize_t k = 0, at = 0; cuts_from >= 0 && k < npieces; k++)
        ends[k] = at += inputs[cuts_from].views[k].len / itemsize;
    if ((npieces ? ends[npieces - 1] : 0) != m) {
        PyErr_Format(PyExc_ValueError, "add_tree: the pieces hold %zd elements, the output %zd",
                     npieces ? ends[npieces - 1] : 0, m);
        goto done;
    }
    for (Py_ssize_t i = 0; i < ninputs; i++) {
        if (!inputs[i].pieces) {
            if (inputs[i].views[0].len != out.len) {
                PyErr_Format(PyExc_ValueError, "add_tree: input %zd has %zd elements, the output %zd", i,
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
    temps = malloc((size_t)(itemsize * CHUNK * (ntemp ? ntemp : 1)));
    slots = (const void **)malloc(sizeof(void *) * (size_t)ninputs);
    if (!temps || !slots) {
        PyErr_NoMemory();
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
     "contiguous, or the lists are cut differently."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tree", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tree(void) { return PyModule_Create(&module); }
