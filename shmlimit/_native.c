/* shmlimit._native: the native atomic backend.
 *
 * NativeCells(buffer, size) wraps the first `size` bytes of a writable buffer
 * (the segment's mmap) and offers the same operations as the Python reference
 * backend in cells.py: load, store, fetch_add, cas on aligned unsigned 64-bit
 * words, plus the hot path's composites grab and try_grab.  All arithmetic
 * wraps modulo 2**64; every operation is sequentially consistent.
 *
 * Invariant: no operation touches memory outside [base, base + size).  Every
 * offset is checked (8-aligned, 0 <= off <= size - 8) before any access, and
 * the buffer stays exported (so the mmap cannot be closed or resized) until
 * close() or deallocation.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    char *base;
    Py_ssize_t size;
    int open;
} NativeCells;

static int
check_open(NativeCells *self)
{
    if (!self->open) {
        PyErr_SetString(PyExc_ValueError, "cells are closed");
        return 0;
    }
    return 1;
}

/* The word at `off`, or NULL with IndexError set. */
static uint64_t *
word(NativeCells *self, PyObject *arg)
{
    Py_ssize_t off = PyLong_AsSsize_t(arg);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    if (off < 0 || (off & 7) || off > self->size - 8) {
        PyErr_Format(PyExc_IndexError,
                     "cell offset %zd outside the mapping of %zd bytes (must be 8-aligned, < %zd)",
                     off, self->size, self->size - 7);
        return NULL;
    }
    return (uint64_t *)(self->base + off);
}

/* A value in [0, 2**64), or -1 with OverflowError/TypeError set (check PyErr_Occurred). */
static int
u64(PyObject *arg, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *out = (uint64_t)v;
    return 1;
}

static int
nargs(Py_ssize_t n, Py_ssize_t want, const char *name)
{
    if (n != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", name, want, n);
        return 0;
    }
    return 1;
}

static PyObject *
cells_load(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    if (!nargs(n, 1, "load") || !check_open(self))
        return NULL;
    uint64_t *w = word(self, args[0]);
    if (!w)
        return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(w, __ATOMIC_SEQ_CST));
}

static PyObject *
cells_store(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t v;
    if (!nargs(n, 2, "store") || !check_open(self))
        return NULL;
    uint64_t *w = word(self, args[0]);
    if (!w || !u64(args[1], &v))
        return NULL;
    __atomic_store_n(w, v, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *
cells_fetch_add(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t d;
    if (!nargs(n, 2, "fetch_add") || !check_open(self))
        return NULL;
    uint64_t *w = word(self, args[0]);
    if (!w || !u64(args[1], &d))
        return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_fetch_add(w, d, __ATOMIC_SEQ_CST));
}

static PyObject *
cells_cas(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t expected, desired;
    if (!nargs(n, 3, "cas") || !check_open(self))
        return NULL;
    uint64_t *w = word(self, args[0]);
    if (!w || !u64(args[1], &expected) || !u64(args[2], &desired))
        return NULL;
    if (__atomic_compare_exchange_n(w, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

/* The grab itself, on validated words: fetch-add the tail; if the head covers the new tail,
 * count `ops` in the grants cell and return None, else return the ticket to wait for. */
static PyObject *
do_grab(uint64_t *tail, uint64_t *head, uint64_t *grants, uint64_t amount, uint64_t ops)
{
    uint64_t ticket = __atomic_fetch_add(tail, amount, __ATOMIC_SEQ_CST) + amount;
    if ((int64_t)(__atomic_load_n(head, __ATOMIC_SEQ_CST) - ticket) < 0)
        return PyLong_FromUnsignedLongLong(ticket);
    __atomic_fetch_add(grants, ops, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* grab(tail, head, amount, grants, ops): fetch-add the tail; None if the head covers the
 * new tail (and `ops` is added to the grants cell), else the ticket to wait for. */
static PyObject *
cells_grab(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t amount, ops;
    if (!nargs(n, 5, "grab") || !check_open(self))
        return NULL;
    uint64_t *tail = word(self, args[0]);
    uint64_t *head = tail ? word(self, args[1]) : NULL;
    uint64_t *grants = head ? word(self, args[3]) : NULL;
    if (!grants || !u64(args[2], &amount) || !u64(args[4], &ops))
        return NULL;
    return do_grab(tail, head, grants, amount, ops);
}

/* grab_if(seq, expected, tail, head, amount, grants, ops): grab, unless the word `seq` no
 * longer holds `expected` (the config changed): then False, with nothing touched. */
static PyObject *
cells_grab_if(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t expected;
    if (!nargs(n, 7, "grab_if") || !check_open(self))
        return NULL;
    uint64_t *seq = word(self, args[0]);
    if (!seq || !u64(args[1], &expected))
        return NULL;
    /* check every offset before the first access */
    uint64_t *tail = word(self, args[2]);
    uint64_t *head = tail ? word(self, args[3]) : NULL;
    uint64_t *grants = head ? word(self, args[5]) : NULL;
    uint64_t amount, ops;
    if (!grants || !u64(args[4], &amount) || !u64(args[6], &ops))
        return NULL;
    if (__atomic_load_n(seq, __ATOMIC_SEQ_CST) != expected)
        Py_RETURN_FALSE;
    return do_grab(tail, head, grants, amount, ops);
}

/* try_grab(tail, head, amount, grants, ops): advance the tail by CAS only if the head covers
 * it; never queue.  False leaves every word unchanged. */
static PyObject *
cells_try_grab(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t amount, ops;
    if (!nargs(n, 5, "try_grab") || !check_open(self))
        return NULL;
    uint64_t *tail = word(self, args[0]);
    uint64_t *head = tail ? word(self, args[1]) : NULL;
    if (!head || !u64(args[2], &amount))
        return NULL;
    uint64_t *grants = word(self, args[3]);
    if (!grants || !u64(args[4], &ops))
        return NULL;
    uint64_t t = __atomic_load_n(tail, __ATOMIC_SEQ_CST);
    for (;;) {
        uint64_t want = t + amount;
        if ((int64_t)(__atomic_load_n(head, __ATOMIC_SEQ_CST) - want) < 0)
            Py_RETURN_FALSE;
        if (__atomic_compare_exchange_n(tail, &t, want, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            break; /* on failure `t` holds the current tail: try again from there */
    }
    __atomic_fetch_add(grants, ops, __ATOMIC_SEQ_CST);
    Py_RETURN_TRUE;
}

/* Grabber: grab_if with its arguments bound and validated once, called with none.  It holds a
 * reference to its cells (so the mapping outlives it) and refuses to run once they are closed. */
typedef struct {
    PyObject_HEAD
    NativeCells *cells;
    uint64_t *seq, *tail, *head, *grants;
    uint64_t expected, amount, ops;
} Grabber;

static PyObject *
grabber_call(Grabber *self, PyObject *args, PyObject *kwds)
{
    if (!check_open(self->cells))
        return NULL;
    if (__atomic_load_n(self->seq, __ATOMIC_SEQ_CST) != self->expected)
        Py_RETURN_FALSE;
    return do_grab(self->tail, self->head, self->grants, self->amount, self->ops);
}

static void
grabber_dealloc(Grabber *self)
{
    Py_XDECREF(self->cells);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject GrabberType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmlimit._native.Grabber",
    .tp_basicsize = sizeof(Grabber),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "grab_if with bound arguments: call it with none.",
    .tp_call = (ternaryfunc)grabber_call,
    .tp_dealloc = (destructor)grabber_dealloc,
};

static PyObject *
cells_grabber(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    if (!nargs(n, 7, "grabber") || !check_open(self))
        return NULL;
    uint64_t *seq = word(self, args[0]);
    uint64_t *tail = seq ? word(self, args[2]) : NULL;
    uint64_t *head = tail ? word(self, args[3]) : NULL;
    uint64_t *grants = head ? word(self, args[5]) : NULL;
    uint64_t expected, amount, ops;
    if (!grants || !u64(args[1], &expected) || !u64(args[4], &amount) || !u64(args[6], &ops))
        return NULL;
    Grabber *g = PyObject_New(Grabber, &GrabberType);
    if (!g)
        return NULL;
    Py_INCREF(self);
    g->cells = self;
    g->seq = seq;
    g->tail = tail;
    g->head = head;
    g->grants = grants;
    g->expected = expected;
    g->amount = amount;
    g->ops = ops;
    return (PyObject *)g;
}

static void
release_view(NativeCells *self)
{
    if (self->open) {
        self->open = 0;
        PyBuffer_Release(&self->view);
    }
}

static PyObject *
cells_close(NativeCells *self, PyObject *Py_UNUSED(ignored))
{
    release_view(self);
    Py_RETURN_NONE;
}

static int
cells_init(NativeCells *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "size", NULL};
    PyObject *buffer;
    Py_ssize_t size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "On", kwlist, &buffer, &size))
        return -1;
    release_view(self);
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE) < 0)
        return -1;
    if (size < 8 || size > self->view.len || ((uintptr_t)self->view.buf & 7)) {
        PyErr_Format(PyExc_ValueError, "size must be between 8 and the buffer's %zd bytes, on an 8-aligned buffer; got %zd",
                     self->view.len, size);
        PyBuffer_Release(&self->view);
        return -1;
    }
    self->base = (char *)self->view.buf;
    self->size = size;
    self->open = 1;
    return 0;
}

static void
cells_dealloc(NativeCells *self)
{
    release_view(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
cells_backend(NativeCells *self, void *closure)
{
    return PyUnicode_FromString("native");
}

static PyObject *
cells_get_size(NativeCells *self, void *closure)
{
    return PyLong_FromSsize_t(self->size);
}

static PyMethodDef cells_methods[] = {
    {"load", (PyCFunction)(void (*)(void))cells_load, METH_FASTCALL, "load(off) -> the word at byte offset off"},
    {"store", (PyCFunction)(void (*)(void))cells_store, METH_FASTCALL, "store(off, value)"},
    {"fetch_add", (PyCFunction)(void (*)(void))cells_fetch_add, METH_FASTCALL,
     "fetch_add(off, delta) -> previous value (wraps modulo 2**64)"},
    {"cas", (PyCFunction)(void (*)(void))cells_cas, METH_FASTCALL,
     "cas(off, expected, desired) -> True if the word was expected and is now desired"},
    {"grab", (PyCFunction)(void (*)(void))cells_grab, METH_FASTCALL,
     "grab(tail, head, amount, grants, ops) -> None if granted at once, else the ticket"},
    {"grab_if", (PyCFunction)(void (*)(void))cells_grab_if, METH_FASTCALL,
     "grab_if(seq, expected, tail, head, amount, grants, ops) -> False if the seq word changed, else as grab"},
    {"grabber", (PyCFunction)(void (*)(void))cells_grabber, METH_FASTCALL,
     "grabber(seq, expected, tail, head, amount, grants, ops) -> a callable doing grab_if with these"},
    {"try_grab", (PyCFunction)(void (*)(void))cells_try_grab, METH_FASTCALL,
     "try_grab(tail, head, amount, grants, ops) -> True if taken; False changes nothing"},
    {"close", (PyCFunction)cells_close, METH_NOARGS, "release the buffer; later calls raise ValueError"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef cells_getset[] = {
    {"backend", (getter)cells_backend, NULL, "the backend's name: 'native'", NULL},
    {"size", (getter)cells_get_size, NULL, "bytes of the mapping the cells may touch", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject NativeCellsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmlimit._native.NativeCells",
    .tp_basicsize = sizeof(NativeCells),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Atomic 64-bit cells over a writable buffer (bounds-checked).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)cells_init,
    .tp_dealloc = (destructor)cells_dealloc,
    .tp_methods = cells_methods,
    .tp_getset = cells_getset,
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "shmlimit._native", "Native atomic backend of shmlimit.", -1, NULL,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    if (PyType_Ready(&NativeCellsType) < 0 || PyType_Ready(&GrabberType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (!m)
        return NULL;
    Py_INCREF(&NativeCellsType);
    if (PyModule_AddObject(m, "NativeCells", (PyObject *)&NativeCellsType) < 0) {
        Py_DECREF(&NativeCellsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
