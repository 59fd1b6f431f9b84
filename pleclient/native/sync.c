/* pleclient._sync: the binding of the channel's synchronization words
 * (protocol v2) to Python.
 *
 * A Words object wraps a writable buffer (a mapped channel segment) and
 * operates on the 32-bit words at byte offsets inside it. Each method parses
 * its arguments, checks its offsets at the door (4-byte aligned, inside the
 * buffer), releases the GIL around anything that can block, and calls the
 * plain C that does the work: eventcount.c (publish, wait, announce, wake),
 * doorbell.c (the doorbell scan), futex.c (the system calls). The single
 * atomics (load, store, exchange, add) are written here, each with its
 * ordering edge named as in eventcount.h:
 *
 *   W1  store: release store                  pairs with E2 (a load, a wait)
 *   X1  exchange: acq_rel                     pairs with W1, or the stream's
 *                                             fence before the rung word (G2)
 *   A1  add: acq_rel                          the loop's own wake counter
 *   (load is an E2: acquire, pairs with E1 and W1)
 *
 * Nothing here reads a layout owned by libc, and nothing aborts on what the
 * peer wrote: a word is only ever a number. Which word, which side, which
 * order: pleclient/protocol.py. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>

#include "doorbell.h"
#include "eventcount.h"
#include "futex.h"

#define MAX_TIMEOUT_S 86400.0

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;  /* view is valid */
    int busy;  /* calls running with the GIL released (guarded by the GIL) */
} Words;

/* The word at offset, after the door checks; NULL with an exception set. */
static atomic_uint *word_at(Words *self, Py_ssize_t offset)
{
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "the words were released (the channel is closed)");
        return NULL;
    }
    if (offset < 0 || offset % 4 != 0 || offset > self->view.len - 4) {
        PyErr_Format(PyExc_ValueError, "word offset %zd is not a 4-byte-aligned offset "
                     "inside the %zd-byte buffer", offset, self->view.len);
        return NULL;
    }
    char *at = (char *)self->view.buf + offset;
    if ((uintptr_t)at % _Alignof(atomic_uint) != 0) {
        PyErr_SetString(PyExc_ValueError, "the buffer is not 4-byte aligned");
        return NULL;
    }
    return (atomic_uint *)(void *)at;
}

static int to_timeout_ns(double seconds, const char *what, int64_t *out)
{
    if (!(seconds >= 0.0)) { /* NaN fails this too */
        PyErr_Format(PyExc_ValueError, "%s must be a number of seconds ≥ 0", what);
        return -1;
    }
    if (seconds > MAX_TIMEOUT_S)
        seconds = MAX_TIMEOUT_S;
    *out = (int64_t)(seconds * 1e9);
    return 0;
}

/* ------------------------------------------------------------- Words type */

static int Words_init(Words *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", NULL};
    PyObject *obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Words", kwlist, &obj))
        return -1;
    if (self->held) {
        PyErr_SetString(PyExc_ValueError, "Words are initialized once");
        return -1;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
        return -1;
    self->held = 1;
    return 0;
}

static void Words_dealloc(Words *self)
{
    if (self->held)
        PyBuffer_Release(&self->view);
    /* A heap type (the limited API has no static ones): each instance holds a
     * reference to it. */
    PyTypeObject *type = Py_TYPE((PyObject *)self);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

static PyObject *Words_release(Words *self, PyObject *Py_UNUSED(ignored))
{
    if (self->busy) {
        PyErr_SetString(PyExc_BufferError, "the words are in use by a waiting thread");
        return NULL;
    }
    if (self->held) {
        self->held = 0;
        PyBuffer_Release(&self->view);
    }
    Py_RETURN_NONE;
}

static PyObject *Words_load(Words *self, PyObject *arg)
{
    Py_ssize_t offset = PyLong_AsSsize_t(arg);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    atomic_uint *w = word_at(self, offset);
    if (!w)
        return NULL;
    /* E2: acquire, pairs with E1 and W1: what the peer stored before it
     * published this value is visible after this load. */
    return PyLong_FromUnsignedLong(atomic_load_explicit(w, memory_order_acquire));
}

static PyObject *Words_store(Words *self, PyObject *args)
{
    Py_ssize_t offset;
    unsigned int value;
    if (!PyArg_ParseTuple(args, "nI:store", &offset, &value))
        return NULL;
    atomic_uint *w = word_at(self, offset);
    if (!w)
        return NULL;
    /* W1: release, pairs with E2: every store before this one is visible to
     * an acquire load that sees this value. */
    atomic_store_explicit(w, value, memory_order_release);
    Py_RETURN_NONE;
}

static PyObject *Words_store_fenced(Words *self, PyObject *args)
{
    Py_ssize_t offset;
    unsigned int value;
    if (!PyArg_ParseTuple(args, "nI:store_fenced", &offset, &value))
        return NULL;
    atomic_uint *w = word_at(self, offset);
    if (!w)
        return NULL;
    ple_ec_announce(w, value); /* E5 */
    Py_RETURN_NONE;
}

static PyObject *Words_publish(Words *self, PyObject *args)
{
    Py_ssize_t offset, waiters_offset;
    unsigned int value;
    if (!PyArg_ParseTuple(args, "nIn:publish", &offset, &value, &waiters_offset))
        return NULL;
    atomic_uint *w = word_at(self, offset);
    atomic_uint *waiters = w ? word_at(self, waiters_offset) : NULL;
    if (!waiters)
        return NULL;
    /* E1, E3 (a wake call is a system call that does not block: the GIL
     * stays held). */
    return PyBool_FromLong(ple_ec_publish(w, value, waiters));
}

static PyObject *Words_wake(Words *self, PyObject *args)
{
    Py_ssize_t offset;
    int n = INT_MAX;
    if (!PyArg_ParseTuple(args, "n|i:wake", &offset, &n))
        return NULL;
    atomic_uint *w = word_at(self, offset);
    if (!w)
        return NULL;
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "wake needs n ≥ 1, not %d", n);
        return NULL;
    }
    int rc = ple_ec_wake(w, n);
    if (rc < 0) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(rc);
}

static PyObject *Words_add(Words *self, PyObject *args)
{
    Py_ssize_t offset;
    int delta;
    if (!PyArg_ParseTuple(args, "ni:add", &offset, &delta))
        return NULL;
    atomic_uint *w = word_at(self, offset);
    if (!w)
        return NULL;
    /* A1: acq_rel, a read-modify-write that both publishes and observes (the
     * loop's own wake counter). Unsigned: wraps, never overflows. */
    unsigned int old = atomic_fetch_add_explicit(w, (unsigned int)delta, memory_order_acq_rel);
    return PyLong_FromUnsignedLong(old + (unsigned int)delta);
}

static PyObject *Words_exchange(Words *self, PyObject *args)
{
    Py_ssize_t offset;
    unsigned int value;
    if (!PyArg_ParseTuple(args, "nI:exchange", &offset, &value))
        return NULL;
    atomic_uint *w = word_at(self, offset);
    if (!w)
        return NULL;
    /* X1: acq_rel, pairs with W1 or with the stream's fence before the rung
     * word (G2, protocol.py): the value taken was published with release, so
     * what its writer stored before it is visible after this. Used to take a
     * GPU-driven channel's rung word back to IDLE before its doorbells are
     * read (D1, doorbell.c). */
    return PyLong_FromUnsignedLong(atomic_exchange_explicit(w, value, memory_order_acq_rel));
}

static PyObject *Words_scan(Words *self, PyObject *args)
{
    Py_ssize_t offset, stride;
    unsigned int count, value;
    if (!PyArg_ParseTuple(args, "nnII:scan", &offset, &stride, &count, &value))
        return NULL;
    if (count < 1 || count > PLE_DOORBELL_SCAN_MAX) {
        return PyErr_Format(PyExc_ValueError, "scan reads 1 to %d words, not %u",
                            PLE_DOORBELL_SCAN_MAX, count);
    }
    if (stride < 4 || stride % 4 != 0) {
        return PyErr_Format(PyExc_ValueError, "scan needs a stride that is a positive "
                            "multiple of 4 bytes, not %zd", stride);
    }
    /* The first word aligned and inside the buffer, and the last one inside
     * too (offset + (count - 1) * stride <= len - 4, checked without the
     * product, which could overflow): then every word between is. */
    if (!word_at(self, offset))
        return NULL;
    Py_ssize_t room = self->view.len - 4 - offset;
    if (count > 1 && stride > room / (Py_ssize_t)(count - 1)) {
        return PyErr_Format(PyExc_ValueError, "scan of %u words %zd bytes apart from offset "
                            "%zd runs past the %zd-byte buffer", count, stride, offset,
                            self->view.len);
    }
    uint64_t rung = ple_doorbell_scan((char *)self->view.buf + offset, (size_t)stride, count,
                                      value);
    return PyLong_FromUnsignedLongLong(rung);
}

static PyObject *Words_wait_while(Words *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"offset", "value", "waiters_offset", "timeout", "spin", NULL};
    Py_ssize_t offset, waiters_offset;
    unsigned int value;
    double timeout_s, spin_s = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nInd|d:wait_while", kwlist, &offset, &value,
                                     &waiters_offset, &timeout_s, &spin_s))
        return NULL;
    atomic_uint *w = word_at(self, offset);
    atomic_uint *waiters = w ? word_at(self, waiters_offset) : NULL;
    int64_t timeout_ns, spin_ns;
    if (!waiters || to_timeout_ns(timeout_s, "timeout", &timeout_ns) != 0
        || to_timeout_ns(spin_s, "spin", &spin_ns) != 0)
        return NULL;
    uint32_t seen;
    int rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    rc = ple_ec_wait_while(w, value, waiters, timeout_ns, spin_ns, &seen); /* E2, E4 */
    Py_END_ALLOW_THREADS
    self->busy--;
    if (rc != 0) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLong(seen);
}

static PyObject *Words_len(Words *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->held ? self->view.len : 0);
}

static PyMethodDef Words_methods[] = {
    {"load", (PyCFunction)Words_load, METH_O,
     "load(offset) -> int: the word, read with acquire ordering."},
    {"store", (PyCFunction)Words_store, METH_VARARGS,
     "store(offset, value): write the word with release ordering."},
    {"store_fenced", (PyCFunction)Words_store_fenced, METH_VARARGS,
     "store_fenced(offset, value): write the word, then a full (seq_cst) fence."},
    {"publish", (PyCFunction)Words_publish, METH_VARARGS,
     "publish(offset, value, waiters_offset) -> bool: release-store the word, fence, "
     "and wake its sleepers if the waiters word is non-zero (True if it was)."},
    {"wake", (PyCFunction)Words_wake, METH_VARARGS,
     "wake(offset, n=all) -> int: wake up to n sleepers on the word."},
    {"add", (PyCFunction)Words_add, METH_VARARGS,
     "add(offset, delta) -> int: atomically add delta (mod 2**32); the new value."},
    {"exchange", (PyCFunction)Words_exchange, METH_VARARGS,
     "exchange(offset, value) -> int: atomically replace the word (acq_rel); the old value."},
    {"scan", (PyCFunction)Words_scan, METH_VARARGS,
     "scan(offset, stride, count, value) -> int: a bitmask, bit i set where the word at "
     "offset + i*stride equals value (1 <= count <= 64; each read with acquire)."},
    {"wait_while", (PyCFunction)(void (*)(void))Words_wait_while, METH_VARARGS | METH_KEYWORDS,
     "wait_while(offset, value, waiters_offset, timeout, spin=0.0) -> int: wait until the "
     "word differs from value (spinning up to spin seconds first, then sleeping on the "
     "futex, counted in the waiters word); the word's value, still value on timeout. "
     "Releases the GIL."},
    {"release", (PyCFunction)Words_release, METH_NOARGS,
     "release(): let go of the buffer; later calls raise ValueError."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Words_getset[] = {
    {"nbytes", (getter)Words_len, NULL, "bytes of the buffer (0 once released)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Words_slots[] = {
    {Py_tp_doc, "Words(buffer): atomic 32-bit words and futexes inside a writable buffer."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, (initproc)Words_init},
    {Py_tp_dealloc, (destructor)Words_dealloc},
    {Py_tp_methods, Words_methods},
    {Py_tp_getset, Words_getset},
    {0, NULL},
};

static PyType_Spec Words_spec = {
    .name = "pleclient._sync.Words",
    .basicsize = sizeof(Words),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Words_slots,
};

/* Made from Words_spec at import. */
static PyObject *WordsType;

/* Item i of a PySequence_Fast result (a list or a tuple), borrowed: the
 * PySequence_Fast_GET_ITEM macro is not in the limited API. */
static PyObject *fast_item(PyObject *fast, Py_ssize_t i)
{
    return PyList_Check(fast) ? PyList_GetItem(fast, i) : PyTuple_GetItem(fast, i);
}

/* ---------------------------------------------------------- futex_waitv */

/* Parse up to max (Words, offset, value) tuples of seq into words[] and
 * values[], each Words kept in owners[]; the count, or -1 with an exception. */
static Py_ssize_t parse_word_tuples(PyObject *seq, const char *what, Py_ssize_t min,
                                    Py_ssize_t max, atomic_uint **words, unsigned int *values,
                                    Words **owners)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast)
        return -1;
    Py_ssize_t n = PySequence_Size(fast);
    if (n < min || n > max) {
        PyErr_Format(PyExc_ValueError, "%s: %zd to %zd words, not %zd", what, min, max, n);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = fast_item(fast, i);
        PyObject *obj;
        Py_ssize_t offset;
        unsigned int value;
        if (!PyTuple_Check(item)
            || !PyArg_ParseTuple(item, "O!nI", (PyTypeObject *)WordsType, &obj, &offset,
                                 &value)) {
            PyErr_Clear(); /* (a parse error names no entry) */
            PyErr_Format(PyExc_TypeError, "%s: entry %zd is not a "
                         "(Words, offset, value) tuple", what, i);
            Py_DECREF(fast);
            return -1;
        }
        words[i] = word_at((Words *)obj, offset);
        if (!words[i]) {
            Py_DECREF(fast);
            return -1;
        }
        values[i] = value;
        owners[i] = (Words *)obj;
    }
    Py_DECREF(fast); /* the caller's sequences keep every Words alive */
    return n;
}

static PyObject *sync_futex_waitv(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"", "", "polled", "poll", NULL};
    PyObject *seq, *polled_seq = NULL;
    double timeout_s, poll_s = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Od|$Od:futex_waitv", kwlist, &seq,
                                     &timeout_s, &polled_seq, &poll_s))
        return NULL;
    int64_t timeout_ns, poll_ns = 0;
    if (to_timeout_ns(timeout_s, "timeout", &timeout_ns) != 0)
        return NULL;
    atomic_uint *words[2 * PLE_FUTEX_WAITV_MAX];
    unsigned int values[2 * PLE_FUTEX_WAITV_MAX];
    Words *owners[2 * PLE_FUTEX_WAITV_MAX];
    Py_ssize_t n = parse_word_tuples(seq, "futex_waitv's entries", 1, PLE_FUTEX_WAITV_MAX,
                                     words, values, owners);
    if (n < 0)
        return NULL;
    Py_ssize_t m = 0;
    if (polled_seq && polled_seq != Py_None) {
        m = parse_word_tuples(polled_seq, "futex_waitv's polled words", 0, PLE_FUTEX_WAITV_MAX,
                              words + n, values + n, owners + n);
        if (m < 0)
            return NULL;
        if (to_timeout_ns(poll_s, "poll", &poll_ns) != 0)
            return NULL;
        if (m > 0 && poll_ns <= 0)
            return PyErr_Format(PyExc_ValueError, "poll must be > 0 s with polled words");
    }
    ple_futex_wait_entry entries[PLE_FUTEX_WAITV_MAX];
    ple_polled_word polled[PLE_FUTEX_WAITV_MAX];
    for (Py_ssize_t i = 0; i < n; i++) {
        entries[i].word = (const uint32_t *)words[i];
        entries[i].expected = values[i];
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        polled[j].word = (const _Atomic uint32_t *)words[n + j];
        polled[j].idle = values[n + j];
    }
    /* busy keeps every buffer held while the GIL is released. */
    for (Py_ssize_t i = 0; i < n + m; i++)
        owners[i]->busy++;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = m > 0 ? ple_futex_waitv_polling(entries, (size_t)n, polled, (size_t)m, poll_ns,
                                         timeout_ns)
               : ple_futex_waitv(entries, (size_t)n, timeout_ns);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n + m; i++)
        owners[i]->busy--;
    if (rc >= 0)
        return PyLong_FromLong(rc);
    if (rc == -EAGAIN || rc == -ETIMEDOUT || rc == -EINTR)
        return PyLong_FromLong(-1);
    errno = -rc;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyMethodDef sync_methods[] = {
    {"futex_waitv", (PyCFunction)(void (*)(void))sync_futex_waitv,
     METH_VARARGS | METH_KEYWORDS,
     "futex_waitv(entries, timeout, *, polled=(), poll=0.0) -> int: sleep until one of "
     "the words, given as (Words, offset, expected) tuples, differs from its expected "
     "value or is woken, at most timeout seconds. polled: (Words, offset, idle) words no "
     "one wakes a futex on (a GPU stream writes them), looked at every poll seconds "
     "without a return to Python; len(entries) + j when polled word j left its idle "
     "value. The index woken, or -1 (timeout, a word already differed, or a signal: "
     "check the words). OSError(ENOSYS) where the kernel lacks the call "
     "(see HAVE_FUTEX_WAITV). Releases the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sync_module = {
    PyModuleDef_HEAD_INIT, "pleclient._sync",
    "The channel's synchronization words: atomics and futexes (see pleclient.protocol).",
    -1, sync_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__sync(void)
{
    WordsType = PyType_FromSpec(&Words_spec);
    if (!WordsType)
        return NULL;
    PyObject *m = PyModule_Create(&sync_module);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "Words", WordsType) < 0
        || PyModule_AddIntConstant(m, "HAVE_FUTEX_WAITV", ple_futex_waitv_available()) < 0
        || PyModule_AddIntConstant(m, "FUTEX_WAITV_MAX", PLE_FUTEX_WAITV_MAX) < 0
        || PyModule_AddIntConstant(m, "SCAN_MAX", PLE_DOORBELL_SCAN_MAX) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
