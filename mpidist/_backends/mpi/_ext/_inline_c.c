/* The 8-byte all_reduce's latency path, compiled: what mpidist._backends.mpi.collectives.all_reduce
 * runs for a call that continues the group's open run of identical calls ("going"), or repeats
 * the last call agreed on a group not checked, in C.
 *
 * all_reduce(tensor, op, g, async_op, algorithm) -> bool
 *
 * True: the call ran here, with the same effects as the Python latency path: the engine's
 * sequence number, the flight-recorder entry (the same 12 fields, mpidist._core.recorder),
 * the engine's current entry and decided number, MPI_Allreduce(MPI_IN_PLACE) on the array's
 * buffer with the GIL released, AVG's division, the entry completed. An MPI error calls the
 * Python ``failed(rec, ierr)`` given to setup(), which marks the entry failed and raises.
 *
 * False: nothing was changed and the caller takes the Python path. That is every call this
 * file does not know to be a continuation of the open run: not a numpy array, async_op not
 * False, another dtype/op/algorithm than the last one planned (collectives._last), not
 * C-contiguous and writable, a queued op, a byte count other than the run's or not below the
 * plan's MPI sizes, the sequence number at a multiple of the mismatch check's PERIOD (its
 * exchange is the Python path's), more than INT_MAX elements.
 *
 * MPI is reached through the MPI_Allreduce that mpi4py's extension module links (its address is
 * passed by setup()), with the handles mpi4py holds (the communicator's through mpi4py's C API,
 * PyMPIComm_Get; the plan's datatype and op by ``.handle``): int handles (MPICH, Intel MPI) or
 * pointer handles (Open MPI), by the handle size setup() is given. No MPI header is needed to
 * build it; numpy's headers give the array's fields. Attributes of the group and its engine are
 * read and written in their instance dicts (what Python's attribute access does for them, with
 * fewer lookups). mpidist/_backends/mpi/inline.py sets it up; docs/performance.md, "The
 * compiled latency path".
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/ndarraytypes.h>

#include <limits.h>
#include <stdint.h>
#include <time.h>

#define CARRAY (NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_WRITEABLE) /* what flags.c_contiguous and .writeable test */

typedef int (*allreduce_int)(const void *, void *, int, int, int, int);
typedef int (*allreduce_ptr)(const void *, void *, int, void *, void *, void *);

static void *mpi_allreduce;       /* MPI_Allreduce's address */
static int pointer_handles;       /* handles are pointers (else int) */
static void *in_place;            /* MPI_IN_PLACE */
static PyTypeObject *ndarray;     /* numpy.ndarray */
static PyObject *coll;            /* collectives' module dict (_last) */
static PyObject *recorder;        /* recorder's module dict (_append, timeout) */
static PyObject *checks;          /* mismatch's module dict (known) */
static PyObject *unchecked;       /* mismatch._UNCHECKED */
static PyObject *failed;          /* failed(rec, ierr): marks rec failed, raises */
static void *(*comm_get)(PyObject *); /* mpi4py's PyMPIComm_Get: a pointer to a Comm's handle */
static PyObject *avg;             /* ReduceOp.AVG */
static PyObject *op_name, *started, *completed, *minus_one, *zero_f;
static long long period_mask;     /* mismatch.PERIOD_MASK */
static Py_ssize_t t_end, state;   /* recorder.T_END, recorder.STATE */

/* the last plan's MPI handles (the plan held, so its identity stays its own) */
static PyObject *plan_seen;
static intptr_t dtype_handle, op_handle;
static Py_ssize_t dtype_size;

static PyObject *s_engine, *s_inline, *s_pending, *s_lat, *s_seq, *s_current, *s_decided,
    *s_comm, *s_handle, *s_timeout_s, *s_ranks, *s__last, *s__append, *s_timeout, *s_Get_size, *s_known, *s_itemsize;

static double monotonic(void) {
    /* time.monotonic()'s clock on Linux and macOS (PEP 418) */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int handle_of(PyObject *obj, intptr_t *out) {
    PyObject *h = PyObject_GetAttr(obj, s_handle);
    if (h == NULL) return -1;
    /* mpi4py reports a handle as an unsigned 64-bit integer (an int handle sign-extended first):
     * its low bits are the handle, whichever the sign */
    *out = (intptr_t)PyLong_AsUnsignedLongLongMask(h);
    Py_DECREF(h);
    return PyErr_Occurred() ? -1 : 0;
}

/* the plan's MPI datatype and op handles, and its datatype's size: -1 when that is not the
 * numpy dtype's itemsize (then the byte count would be wrong) */
static int see_plan(PyObject *plan, PyObject *dtype) {
    if (plan == plan_seen) return 0;
    PyObject *dt = PyTuple_GET_ITEM(plan, 1), *op = PyTuple_GET_ITEM(plan, 2);
    intptr_t d, o;
    if (handle_of(dt, &d) < 0 || handle_of(op, &o) < 0) return -1;
    PyObject *size = PyObject_CallMethodNoArgs(dt, s_Get_size);
    if (size == NULL) return -1;
    Py_ssize_t n = PyLong_AsSsize_t(size);
    Py_DECREF(size);
    PyObject *itemsize = PyObject_GetAttr(dtype, s_itemsize);
    if (itemsize == NULL) return -1;
    Py_ssize_t m = PyLong_AsSsize_t(itemsize);
    Py_DECREF(itemsize);
    if (n <= 0 || n != m) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "the MPI datatype's size is not the itemsize");
        return -1;
    }
    Py_INCREF(plan);
    Py_XSETREF(plan_seen, plan);
    dtype_handle = d;
    op_handle = o;
    dtype_size = n;
    return 0;
}

/* obj's instance dict, borrowed (obj holds it); NULL, with no exception left, when it has none.
 * Reading and writing it is reading and writing obj's plain attributes, without the attribute
 * protocol's lookups (the groups' and engines' attributes read here are plain ones). */
static PyObject *dict_of(PyObject *obj) {
    PyObject *d = PyObject_GenericGetDict(obj, NULL);
    if (d == NULL || !PyDict_CheckExact(d)) {
        Py_XDECREF(d);
        PyErr_Clear();
        return NULL;
    }
    Py_DECREF(d);
    return d;
}

/* an exact int in [0, PY_SSIZE_T_MAX], else -1 */
static Py_ssize_t size_of(PyObject *v) {
    if (v == NULL || !PyLong_CheckExact(v)) return -1;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    if (n < 0) PyErr_Clear();
    return n < 0 ? -1 : n;
}

static PyObject *all_reduce(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "all_reduce takes 5 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *t = args[0], *op = args[1], *g = args[2], *algorithm = args[4];
    if (Py_TYPE(t) != ndarray || args[3] != Py_False || mpi_allreduce == NULL) Py_RETURN_FALSE;
    /* Not taken unless every test passes; nothing is changed before "Taken" below, and every
     * reference until there is borrowed but last's and shape's. */
    PyObject *last = PyDict_GetItemWithError(coll, s__last);
    if (last == NULL || !PyTuple_CheckExact(last) || PyTuple_GET_SIZE(last) != 4) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    Py_INCREF(last); /* held, and with it the plan: a call below may run Python code that replaces _last */
    if (PyTuple_GET_ITEM(last, 1) != op || PyTuple_GET_ITEM(last, 2) != algorithm) goto not_taken;
    PyObject *plan = PyTuple_GET_ITEM(last, 3);
    if (!PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != 4) goto not_taken;
    PyObject *gd = dict_of(g), *eng = gd ? PyDict_GetItemWithError(gd, s_engine) : NULL;
    PyObject *ed = eng ? dict_of(eng) : NULL;
    if (ed == NULL) goto not_taken;
    PyObject *v = PyDict_GetItemWithError(ed, s_inline); /* the instance's, else the class's */
    if (v == NULL && (v = PyDict_GetItemWithError(Py_TYPE(eng)->tp_dict, s_inline)) == NULL) goto not_taken;
    if (v != Py_True || size_of(PyDict_GetItemWithError(ed, s_pending)) != 0) goto not_taken;
    /* going: the engine's note of the group's open run is this call's (plan, bytes); else, on a
     * group not checked (one rank, or checks off), the mismatch check's note of the last call
     * agreed: (plan, bytes, _UNCHECKED, key, group) */
    v = PyDict_GetItemWithError(ed, s_lat);
    int going = v != NULL && PyTuple_CheckExact(v) && PyTuple_GET_SIZE(v) >= 2 && PyTuple_GET_ITEM(v, 0) == plan;
    if (!going) {
        v = PyDict_GetItemWithError(checks, s_known);
        if (v == NULL || !PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) != 5 || PyTuple_GET_ITEM(v, 0) != plan ||
            PyTuple_GET_ITEM(v, 2) != unchecked || PyTuple_GET_ITEM(v, 4) != g)
            goto not_taken;
    }
    Py_ssize_t run_bytes = size_of(PyTuple_GET_ITEM(v, 1)), below = size_of(PyTuple_GET_ITEM(plan, 3));
    Py_ssize_t seq = size_of(PyDict_GetItemWithError(ed, s_seq));
    /* (below 0: the plan runs its body at every size, never MPI_Allreduce itself) */
    if (run_bytes < 0 || below <= 0 || seq < 0 || (going && !(seq & period_mask))) goto not_taken;
    PyObject *comm = PyDict_GetItemWithError(gd, s_comm), *limit = PyDict_GetItemWithError(gd, s_timeout_s);
    if (comm == NULL || limit == NULL) goto not_taken;
    int set = PyObject_IsTrue(limit);
    if (set < 0 || (!set && (limit = PyDict_GetItemWithError(recorder, s_timeout)) == NULL)) goto not_taken;
    PyObject *append = PyDict_GetItemWithError(recorder, s__append);
    if (append == NULL) goto not_taken;
    Py_ssize_t divisor = 0;
    if (op == avg && (divisor = PyObject_Length((v = PyDict_GetItemWithError(gd, s_ranks)) ? v : Py_None)) <= 0)
        goto not_taken; /* AVG: the sum, divided by the group's size */
    void *handle = comm_get(comm); /* a pointer to the communicator's handle; NULL when not a Comm */
    if (handle == NULL || see_plan(plan, PyTuple_GET_ITEM(last, 0)) < 0) goto not_taken;
    intptr_t comm_handle = pointer_handles ? (intptr_t) * (void **)handle : (intptr_t) * (int *)handle;

    /* the array's fields (numpy's ABI, the same in numpy 1 and 2): the numpy.ndarray type tested above */
    PyArrayObject *a = (PyArrayObject *)t;
    PyObject *dtype = (PyObject *)PyArray_DESCR(a), *rec = NULL, *shape = NULL;
    int ndim = PyArray_NDIM(a);
    npy_intp *dims = PyArray_DIMS(a), nbytes = dtype_size;
    if (dtype != PyTuple_GET_ITEM(last, 0) || (PyArray_FLAGS(a) & CARRAY) != CARRAY) goto not_taken;
    for (int i = 0; i < ndim; i++) nbytes *= dims[i];
    if (nbytes != run_bytes || nbytes >= below || nbytes / dtype_size > INT_MAX) goto not_taken;
    if ((shape = PyTuple_New(ndim)) == NULL) goto not_taken;
    for (int i = 0; i < ndim; i++) {
        if ((v = PyLong_FromSsize_t(dims[i])) == NULL) goto cleanup;
        PyTuple_SET_ITEM(shape, i, v);
    }
    Py_INCREF(dtype);

    /* Taken: from here on the call is this path's. */
    Py_INCREF(eng); /* (held: appending to the recorder may free an old entry) */
    PyObject *number = PyLong_FromSsize_t(seq), *next = PyLong_FromSsize_t(seq + 1);
    PyObject *now = PyFloat_FromDouble(monotonic());
    if (number == NULL || next == NULL || now == NULL || (rec = PyList_New(12)) == NULL) {
        Py_XDECREF(number);
        Py_XDECREF(next);
        Py_XDECREF(now);
        Py_DECREF(shape);
        Py_DECREF(dtype);
        goto error;
    }
    PyObject *fields[12] = {number, op_name, g, shape, dtype, minus_one, now, now, zero_f, started, limit, Py_None};
    for (int i = 0; i < 12; i++) {
        if (i != 0 && i != 3 && i != 4 && i != 7) Py_INCREF(fields[i]); /* the others' references move to rec */
        PyList_SET_ITEM(rec, i, fields[i]);
    }
    shape = dtype = NULL;
    int err = PyDict_SetItem(ed, s_seq, next);
    Py_DECREF(next);
    if (err < 0 || (v = PyObject_CallOneArg(append, rec)) == NULL) goto error;
    Py_DECREF(v);
    if (PyDict_SetItem(ed, s_current, rec) < 0 || (going && PyDict_SetItem(ed, s_decided, number) < 0)) goto error;
    Py_CLEAR(eng);

    int count = (int)(nbytes / dtype_size), ierr;
    void *buf = PyArray_DATA(a);
    intptr_t dt = dtype_handle, mop = op_handle; /* (another thread may see another plan meanwhile) */
    Py_BEGIN_ALLOW_THREADS;
    if (pointer_handles)
        ierr = ((allreduce_ptr)mpi_allreduce)(in_place, buf, count, (void *)dt, (void *)mop, (void *)comm_handle);
    else
        ierr = ((allreduce_int)mpi_allreduce)(in_place, buf, count, (int)dt, (int)mop, (int)comm_handle);
    Py_END_ALLOW_THREADS;
    if (ierr != 0) {
        v = PyObject_CallFunction(failed, "Oi", rec, ierr); /* raises */
        Py_XDECREF(v);
        goto error;
    }
    if (divisor > 0) {
        PyObject *n = PyLong_FromSsize_t(divisor);
        PyObject *r = n ? PyNumber_InPlaceTrueDivide(t, n) : NULL;
        Py_XDECREF(n);
        if (r == NULL) { /* the entry marked failed, the error kept */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            v = PyObject_CallFunction(failed, "Oi", rec, 0);
            Py_XDECREF(v);
            PyErr_Restore(type, value, tb);
            goto error;
        }
        Py_DECREF(r);
    }
    if ((now = PyFloat_FromDouble(monotonic())) == NULL) goto error;
    PyList_SetItem(rec, t_end, now);
    Py_INCREF(completed);
    PyList_SetItem(rec, state, completed);
    Py_DECREF(rec);
    Py_DECREF(last);
    Py_RETURN_TRUE;

error: /* taken, then failed: the exception stands */
    Py_XDECREF(rec);
    Py_XDECREF(eng);
    Py_DECREF(last);
    return NULL;

cleanup: /* not taken: nothing changed, any error is the Python path's to find again */
    Py_XDECREF(shape);
not_taken:
    Py_DECREF(last);
    PyErr_Clear();
    Py_RETURN_FALSE;
}

static PyObject *setup(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *address, *place, *capsule, *type, *coll_dict, *rec_dict, *check_dict, *unchecked_state, *fail, *avg_op;
    int handle_size;
    long long mask;
    Py_ssize_t end, st;
    if (!PyArg_ParseTuple(args, "OOiOO!O!O!O!OOOLnn", &address, &place, &handle_size, &capsule, &PyType_Type, &type,
                          &PyDict_Type, &coll_dict, &PyDict_Type, &rec_dict, &PyDict_Type, &check_dict,
                          &unchecked_state, &fail, &avg_op, &mask, &end, &st))
        return NULL;
    if (handle_size != (int)sizeof(int) && handle_size != (int)sizeof(void *)) {
        PyErr_Format(PyExc_ValueError, "MPI handles of %d bytes", handle_size);
        return NULL;
    }
    void *fn = PyLong_AsVoidPtr(address), *ip = (void *)(intptr_t)PyLong_AsSsize_t(place);
    void *get = PyCapsule_GetPointer(capsule, PyCapsule_GetName(capsule));
    if (PyErr_Occurred()) return NULL;
    if (fn == NULL) {
        PyErr_SetString(PyExc_ValueError, "MPI_Allreduce's address is NULL");
        return NULL;
    }
    pointer_handles = handle_size == (int)sizeof(void *) && handle_size != (int)sizeof(int);
    in_place = ip;
    period_mask = mask;
    t_end = end;
    state = st;
    Py_INCREF(type);
    Py_XSETREF(ndarray, (PyTypeObject *)type);
    Py_INCREF(coll_dict);
    Py_XSETREF(coll, coll_dict);
    Py_INCREF(rec_dict);
    Py_XSETREF(recorder, rec_dict);
    Py_INCREF(check_dict);
    Py_XSETREF(checks, check_dict);
    Py_INCREF(unchecked_state);
    Py_XSETREF(unchecked, unchecked_state);
    Py_INCREF(fail);
    Py_XSETREF(failed, fail);
    Py_INCREF(avg_op);
    Py_XSETREF(avg, avg_op);
    Py_CLEAR(plan_seen);
    PyObject *s = PyDict_GetItemString(rec_dict, "STARTED"), *c = PyDict_GetItemString(rec_dict, "COMPLETED");
    if (s == NULL || c == NULL) {
        PyErr_SetString(PyExc_ValueError, "the recorder has no STARTED/COMPLETED");
        return NULL;
    }
    Py_INCREF(s);
    Py_XSETREF(started, s);
    Py_INCREF(c);
    Py_XSETREF(completed, c);
    comm_get = (void *(*)(PyObject *))get;
    mpi_allreduce = fn;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))all_reduce, METH_FASTCALL,
     "all_reduce(tensor, op, g, async_op, algorithm) -> bool: the latency path of one call (see the file)."},
    {"setup", setup, METH_VARARGS,
     "setup(MPI_Allreduce address, MPI_IN_PLACE, handle size, mpi4py's PyMPIComm_Get capsule, numpy.ndarray, collectives' globals, "
     "recorder's globals, mismatch's globals, mismatch._UNCHECKED, failed, ReduceOp.AVG, PERIOD_MASK, T_END, "
     "STATE)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, .m_name = "_inline_c", .m_doc = NULL, .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__inline_c(void) {
#define INTERN(var, text)                                         \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(s_engine, "engine") INTERN(s_inline, "inline")
    INTERN(s_pending, "pending") INTERN(s_lat, "lat") INTERN(s_seq, "seq") INTERN(s_current, "current")
    INTERN(s_decided, "decided") INTERN(s_comm, "comm") INTERN(s_handle, "handle") INTERN(s_timeout_s, "timeout_s")
    INTERN(s_ranks, "ranks") INTERN(s__last, "_last") INTERN(s__append, "_append") INTERN(s_timeout, "timeout")
    INTERN(s_Get_size, "Get_size") INTERN(s_known, "known") INTERN(s_itemsize, "itemsize") INTERN(op_name, "all_reduce")
#undef INTERN
    if ((minus_one = PyLong_FromLong(-1)) == NULL || (zero_f = PyFloat_FromDouble(0.0)) == NULL) return NULL;
    return PyModule_Create(&module_def);
}
