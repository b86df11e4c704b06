/* The instance shim as its program's "child subreaper" (Linux prctl PR_SET_CHILD_SUBREAPER).
 *
 * A daemon started by the program (fork, setsid, fork) leaves the program's process group and
 * session; with an empty environment nothing it inherited says whose it is either. Orphaned, it
 * would be adopted by init and outlive the job. With the shim as subreaper it is adopted by the
 * shim instead, so the shim can still find it among its own descendants when the job ends
 * (poprun_py/shared/sweep.py). A tiny extension, not ctypes: the shim sets this before it starts the
 * program, on every launch's critical path, where importing ctypes costs about 3.5 ms.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifdef __linux__
#include <sys/prctl.h>
#endif

static PyObject *become(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
#if defined(__linux__) && defined(PR_SET_CHILD_SUBREAPER)
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"become", become, METH_NOARGS,
     "Make this process the subreaper of its descendants; whether this system can (Linux >= 3.4)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_subreaper", NULL, 0, methods};

PyMODINIT_FUNC PyInit__subreaper(void) { return PyModule_Create(&module); }
