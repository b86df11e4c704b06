/* Argument checks shared by the compiled kernels (_batch_invariant.c, _tree.c, _swaps.c).
 *
 * Every entry point checks what it is given (an array at all, its dtype, shape, layout,
 * alignment, writability and the sizes it implies) before it allocates or touches memory, and
 * refuses with an exception that names the argument: a kernel that trusted a size computed from
 * a broadcast (stride 0) input, or a count it was passed, wrote past what it had allocated. The
 * checks are O(ndim) per argument. Header-only: each extension is a shared object of its own. */
#ifndef POPDIST_KERNEL_ARGS_H
#define POPDIST_KERNEL_ARGS_H
#include <Python.h>
#include <stdint.h>

/* Argument `name` of `func` as a buffer with strides and format (read-only allowed): 0, or -1
 * with a TypeError naming it when it exports no buffer (or only one with indirections). */
static inline int ka_get(PyObject *obj, Py_buffer *buf, const char *func, const char *name)
{
    if (PyObject_GetBuffer(obj, buf, PyBUF_RECORDS_RO) == 0)
        return 0;
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s: %s must be an array (an object with a strided buffer), not %.100s", func,
                 name, Py_TYPE(obj)->tp_name);
    return -1;
}

/* The struct code of a buffer of native-order single items ('f', 'd', 'l', 'q', ...) whose item
 * size is `itemsize`, or 0: another byte order, a record, or a size that is not this code's. */
static inline char ka_code(const Py_buffer *buf, Py_ssize_t itemsize)
{
    const char *f = buf->format ? buf->format : "B";
#if PY_LITTLE_ENDIAN
    if (*f == '@' || *f == '=' || *f == '<')
#else
    if (*f == '@' || *f == '=' || *f == '>')
#endif
        f++;
    return f[0] && !f[1] && buf->itemsize == itemsize ? f[0] : 0;
}

/* The format for messages: the buffer's own, "B" (bytes) when it gives none. */
static inline const char *ka_format(const Py_buffer *buf) { return buf->format ? buf->format : "B"; }

/* Whether every item the buffer holds is aligned to its size: the start, and the stride of every
 * axis that has more than one item (the kernels load whole items through typed pointers). */
static inline int ka_aligned(const Py_buffer *buf)
{
    Py_ssize_t size = buf->itemsize;
    if (size <= 1)
        return 1;
    for (int d = 0; d < buf->ndim; d++)
        if (buf->shape && buf->shape[d] == 0)
            return 1; /* no items: nothing is loaded */
    if ((uintptr_t)buf->buf % (uintptr_t)size)
        return 0;
    for (int d = 0; d < buf->ndim && buf->strides; d++)
        if (buf->shape[d] > 1 && buf->strides[d] % size)
            return 0;
    return 1;
}

/* a * b, or -1 when either is negative or the product exceeds PY_SSIZE_T_MAX: sizes are
 * multiplied through this before anything is allocated. */
static inline Py_ssize_t ka_mul(Py_ssize_t a, Py_ssize_t b)
{
    Py_ssize_t r;
    if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r))
        return -1;
    return r;
}

#endif
