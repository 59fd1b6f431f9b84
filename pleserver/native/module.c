/* pleserver._native: Python bindings of the native data plane.
 *
 * Every entry point reads the same way: check the arguments at the door
 * (types, buffer format, contiguity, size, writability), take a native
 * reference on the objects it uses, release the GIL, do the work, reacquire,
 * and report through raise_error, the one place that turns a ple_error into
 * an exception. Native objects are reference-counted, so close() in one
 * thread never frees memory another thread is using: it only drops the
 * Python object's reference. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "gather.h"
#include "probe.h"
#include "reads.h"
#include "rowcache.h"

static PyObject *ReadError;

static PyObject *raise_error(const ple_error *e)
{
    switch (e->kind) {
    case PLE_ERR_VALUE:
        PyErr_SetString(PyExc_ValueError, e->msg);
        break;
    case PLE_ERR_NOMEM:
        PyErr_SetString(PyExc_MemoryError, e->msg);
        break;
    default: {
        PyObject *type = e->kind == PLE_ERR_READ ? ReadError : PyExc_OSError;
        PyObject *exc = PyObject_CallFunction(type, "is", e->code, e->msg);
        if (exc) {
            PyErr_SetObject(type, exc);
            Py_DECREF(exc);
        }
    }
    }
    return NULL;
}

static int parse_kind(const char *kind, int *out)
{
    if (!strcmp(kind, "auto"))
        *out = PLE_KIND_AUTO;
    else if (!strcmp(kind, "io_uring"))
        *out = PLE_KIND_IO_URING;
    else if (!strcmp(kind, "threads"))
        *out = PLE_KIND_THREADS;
    else {
        PyErr_Format(PyExc_ValueError, "kind must be \"auto\", \"io_uring\" or \"threads\", "
                     "not \"%s\"", kind);
        return -1;
    }
    return 0;
}

static const char *kind_name(int kind)
{
    return kind == PLE_KIND_IO_URING ? "io_uring" : "threads";
}

/* ------------------------------------------------- limited-API helpers */

/* A TypeError "<fmt % type(obj).__qualname__>": tp_name is not in the
 * limited API. fmt has one %U. */
static void type_error(const char *fmt, PyObject *obj)
{
    PyObject *name = PyType_GetQualName(Py_TYPE(obj));
    if (name) {
        PyErr_Format(PyExc_TypeError, fmt, name);
        Py_DECREF(name);
    }
}

/* The items of an iterable argument as a new tuple, which holds each of
 * them while the caller reads them: a list's items, borrowed, could go away
 * under Python code that reading one of them runs (an fd's __index__, a
 * path's __fspath__ emptying the list). A TypeError names `what`. */
static PyObject *items_of(PyObject *obj, const char *what)
{
    PyObject *it = PyObject_GetIter(obj);
    if (!it) {
        if (PyErr_ExceptionMatches(PyExc_TypeError))
            PyErr_SetString(PyExc_TypeError, what);
        return NULL;
    }
    PyObject *items = PySequence_Tuple(it);
    Py_DECREF(it);
    return items;
}

/* The dealloc of a heap type (the limited API has no static ones): each
 * instance holds a reference to its type. */
static void free_instance(PyObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

/* ------------------------------------------------------------ buffers */

/* Format of one little-endian/native item: "B", "<q", "=l"... → "B", "q", "l". */
static const char *item_format(const Py_buffer *view)
{
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || *f == '<' || *f == '|')
        f++;
    return f;
}

static int get_ids(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        PyErr_Clear();
        type_error("ids must be a C-contiguous int64 array, not %U", obj);
        return -1;
    }
    const char *f = item_format(view);
    if (view->ndim != 1 || view->itemsize != 8 || (strcmp(f, "q") && strcmp(f, "l"))) {
        PyErr_Format(PyExc_TypeError, "ids must be a 1-D int64 array (got format '%s', "
                     "itemsize %zd, %d dimensions)", view->format ? view->format : "B",
                     view->itemsize, view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int get_out(PyObject *obj, Py_buffer *view, Py_ssize_t n, uint32_t row_bytes)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE)
        != 0) {
        PyErr_Clear();
        Py_buffer probe;
        if (PyObject_GetBuffer(obj, &probe, PyBUF_SIMPLE) == 0) {
            int readonly = probe.readonly;
            PyBuffer_Release(&probe);
            if (readonly) {
                PyErr_SetString(PyExc_ValueError, "out is read-only");
                return -1;
            }
        } else {
            PyErr_Clear();
        }
        type_error("out must be a writable C-contiguous uint8 array, not %U", obj);
        return -1;
    }
    if (view->itemsize != 1 || strcmp(item_format(view), "B")) {
        PyErr_Format(PyExc_TypeError, "out must be a uint8 array (got format '%s')",
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    if (view->len != n * (Py_ssize_t)row_bytes) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes; %zd rows of %u bytes need %zd",
                     view->len, n, row_bytes, n * (Py_ssize_t)row_bytes);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------- ReadEngine */

typedef struct {
    PyObject_HEAD
    ple_engine *eng;
    int kind;
    unsigned queue_depth, threads;
    PyObject *fallback_reason;
} EngineObject;

static int Engine_init(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"queue_depth", "kind", "threads", NULL};
    int queue_depth = 128, threads = 16, kind;
    const char *kind_s = "auto";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|isi", names, &queue_depth, &kind_s, &threads))
        return -1;
    if (parse_kind(kind_s, &kind) != 0)
        return -1;
    if (queue_depth < 1 || queue_depth > 4096 || threads < 1 || threads > 256) {
        PyErr_Format(PyExc_ValueError, "queue_depth must be in 1..4096 and threads in 1..256 "
                     "(got %d and %d)", queue_depth, threads);
        return -1;
    }
    if (self->eng) {
        PyErr_SetString(PyExc_RuntimeError, "ReadEngine is initialized already");
        return -1;
    }
    ple_error err = {0};
    char reason[256];
    ple_engine *eng;
    Py_BEGIN_ALLOW_THREADS
    eng = ple_engine_open((unsigned)queue_depth, kind, (unsigned)threads, reason,
                          sizeof reason, &err);
    Py_END_ALLOW_THREADS
    if (!eng) {
        raise_error(&err);
        return -1;
    }
    self->eng = eng;
    self->kind = ple_engine_kind(eng);
    self->queue_depth = (unsigned)queue_depth;
    self->threads = (unsigned)threads;
    PyObject *old = self->fallback_reason;
    self->fallback_reason = reason[0] ? PyUnicode_FromString(reason) : Py_NewRef(Py_None);
    Py_XDECREF(old);
    return self->fallback_reason ? 0 : -1;
}

static void Engine_dealloc(EngineObject *self)
{
    if (self->eng)
        ple_engine_unref(self->eng);
    Py_XDECREF(self->fallback_reason);
    free_instance((PyObject *)self);
}

static PyObject *Engine_close(EngineObject *self, PyObject *unused)
{
    (void)unused;
    if (self->eng) {
        ple_engine *eng = self->eng;
        self->eng = NULL;
        Py_BEGIN_ALLOW_THREADS
        ple_engine_unref(eng);  /* the last one joins the pool's threads */
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_get_kind(EngineObject *self, void *closure)
{
    (void)closure;
    return PyUnicode_FromString(kind_name(self->kind));
}

static PyObject *Engine_get_reason(EngineObject *self, void *closure)
{
    (void)closure;
    return Py_NewRef(self->fallback_reason ? self->fallback_reason : Py_None);
}

static PyObject *Engine_in_flight(EngineObject *self, PyObject *unused)
{
    (void)unused;
    if (!self->eng) {
        PyErr_SetString(PyExc_ValueError, "the ReadEngine is closed");
        return NULL;
    }
    unsigned now, peak, reserve;
    ple_engine_in_flight(self->eng, &now, &peak, &reserve);
    return Py_BuildValue("{sIsIsI}", "in_flight", now, "peak_in_flight", peak,
                         "small_reserve", reserve);
}

static PyObject *Engine_get_depth(EngineObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(self->queue_depth);
}

static PyMethodDef Engine_methods[] = {
    {"in_flight", (PyCFunction)Engine_in_flight, METH_NOARGS,
     "Reads in flight now, every batch together, their peak since the engine opened, and "
     "the reserve small batches (≤ 64 reads) may use beyond queue_depth, as a dict."},
    {"close", (PyCFunction)Engine_close, METH_NOARGS,
     "Release the engine (its rings or threads go when the last table using it goes)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Engine_getset[] = {
    {"kind", (getter)Engine_get_kind, NULL, "\"io_uring\" or \"threads\": what is in use", NULL},
    {"fallback_reason", (getter)Engine_get_reason, NULL,
     "None, or why io_uring is not used", NULL},
    {"queue_depth", (getter)Engine_get_depth, NULL,
     "reads in flight at most, every request together (small ones: and the reserve)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Engine_slots[] = {
    {Py_tp_doc, "ReadEngine(queue_depth=128, kind=\"auto\", threads=16): the miss engine "
                "(io_uring, else a pool of pread threads)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, (initproc)Engine_init},
    {Py_tp_dealloc, (destructor)Engine_dealloc},
    {Py_tp_methods, Engine_methods},
    {Py_tp_getset, Engine_getset},
    {0, NULL},
};

static PyType_Spec Engine_spec = {
    .name = "pleserver._native.ReadEngine",
    .basicsize = sizeof(EngineObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Engine_slots,
};

/* Made from Engine_spec at import. */
static PyObject *EngineType;

/* The engine of an open ReadEngine, with a reference for the caller (who
 * unrefs it); NULL with ValueError once closed. */
static ple_engine *engine_use(EngineObject *self)
{
    if (!self->eng) {
        PyErr_SetString(PyExc_ValueError, "ReadEngine is closed");
        return NULL;
    }
    ple_engine_ref(self->eng);
    return self->eng;
}

/* ------------------------------------------------------------ RowCache */

typedef struct {
    PyObject_HEAD
    ple_cache *cache;
} CacheObject;

static ple_cache *cache_use(CacheObject *self)
{
    if (!self->cache) {
        PyErr_SetString(PyExc_ValueError, "RowCache is closed");
        return NULL;
    }
    ple_cache_ref(self->cache);
    return self->cache;
}

static int Cache_init(CacheObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"budget_bytes", "slot_bytes", "hugepages", "mlock", NULL};
    unsigned long long budget;
    unsigned int slot_bytes;
    int hugepages = 1, lock_memory = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KI|pp", names, &budget, &slot_bytes,
                                     &hugepages, &lock_memory))
        return -1;
    if (slot_bytes == 0 || slot_bytes > PLE_ROW_BYTES_MAX) {
        PyErr_Format(PyExc_ValueError, "slot_bytes must be in 1..%u, not %u",
                     PLE_ROW_BYTES_MAX, slot_bytes);
        return -1;
    }
    if (self->cache) {
        PyErr_SetString(PyExc_RuntimeError, "RowCache is initialized already");
        return -1;
    }
    ple_error err = {0};
    ple_cache *cache;
    Py_BEGIN_ALLOW_THREADS
    cache = ple_cache_open(budget, slot_bytes, hugepages, lock_memory, &err);
    Py_END_ALLOW_THREADS
    if (!cache) {
        raise_error(&err);
        return -1;
    }
    self->cache = cache;
    return 0;
}

static void Cache_dealloc(CacheObject *self)
{
    if (self->cache)
        ple_cache_unref(self->cache);
    free_instance((PyObject *)self);
}

static PyObject *Cache_close(CacheObject *self, PyObject *unused)
{
    (void)unused;
    if (self->cache) {
        ple_cache *cache = self->cache;
        self->cache = NULL;
        Py_BEGIN_ALLOW_THREADS
        ple_cache_unref(cache);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *Cache_stats(CacheObject *self, PyObject *unused)
{
    (void)unused;
    ple_cache *cache = cache_use(self);
    if (!cache)
        return NULL;
    ple_cache_stats st;
    Py_BEGIN_ALLOW_THREADS
    ple_cache_get_stats(cache, &st);
    ple_cache_unref(cache);
    Py_END_ALLOW_THREADS
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:O,s:s,s:O,s:s,s:I}",
        "capacity_rows", st.capacity_rows, "used_rows", st.used_rows, "hits", st.hits,
        "misses", st.misses, "inserts", st.inserts, "evictions", st.evictions,
        "reserved_bytes", st.reserved_bytes, "populated_bytes", st.populated_bytes,
        "hugepages", (st.hugetlb || st.thp) ? Py_True : Py_False,
        "hugepage_kind", st.hugetlb ? "hugetlb" : st.thp ? "thp" : "none",
        "mlocked", st.mlocked ? Py_True : Py_False, "policy", ple_cache_policy(),
        "shards", st.shards);
}

static PyObject *Cache_keys(CacheObject *self, PyObject *unused)
{
    (void)unused;
    ple_cache *cache = cache_use(self);
    if (!cache)
        return NULL;
    uint64_t *keys = NULL;
    int64_t n;
    Py_BEGIN_ALLOW_THREADS
    n = ple_cache_keys(cache, &keys);
    ple_cache_unref(cache);
    Py_END_ALLOW_THREADS
    if (n < 0)
        return PyErr_NoMemory();
    PyObject *bytes = PyByteArray_FromStringAndSize((const char *)keys,
                                                    (Py_ssize_t)n * (Py_ssize_t)sizeof *keys);
    free(keys);
    if (!bytes)
        return NULL;
    PyObject *numpy = PyImport_ImportModule("numpy");
    PyObject *array = numpy ? PyObject_CallMethod(numpy, "frombuffer", "Os", bytes, "<u8")
                            : NULL;
    Py_XDECREF(numpy);
    Py_DECREF(bytes);
    return array;
}

static PyObject *Cache_get_capacity(CacheObject *self, void *closure)
{
    (void)closure;
    if (!self->cache) {
        PyErr_SetString(PyExc_ValueError, "RowCache is closed");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(ple_cache_capacity(self->cache));
}

static PyMethodDef Cache_methods[] = {
    {"stats", (PyCFunction)Cache_stats, METH_NOARGS, "Counters and settings, as a dict."},
    {"keys", (PyCFunction)Cache_keys, METH_NOARGS,
     "The keys cached now ((table_key << 40) | row), as a numpy uint64 array."},
    {"close", (PyCFunction)Cache_close, METH_NOARGS,
     "Release the cache (its memory goes when the last table using it goes)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Cache_getset[] = {
    {"capacity_rows", (getter)Cache_get_capacity, NULL, "rows the budget holds", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Cache_slots[] = {
    {Py_tp_doc, "RowCache(budget_bytes, slot_bytes, hugepages=True, mlock=False): the row "
                "cache (SIEVE eviction, sharded)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, (initproc)Cache_init},
    {Py_tp_dealloc, (destructor)Cache_dealloc},
    {Py_tp_methods, Cache_methods},
    {Py_tp_getset, Cache_getset},
    {0, NULL},
};

static PyType_Spec Cache_spec = {
    .name = "pleserver._native.RowCache",
    .basicsize = sizeof(CacheObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Cache_slots,
};

/* Made from Cache_spec at import. */
static PyObject *CacheType;

/* --------------------------------------------------------- TableSource */

typedef struct {
    PyObject_HEAD
    ple_source *src;
    uint32_t row_bytes;
    uint64_t rows;
} SourceObject;

static ple_source *source_use(SourceObject *self)
{
    if (!self->src) {
        PyErr_SetString(PyExc_ValueError, "TableSource is closed");
        return NULL;
    }
    ple_source_ref(self->src);
    return self->src;
}

static void free_shards(ple_shard_spec *specs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        PyMem_Free((char *)specs[i].path);
    PyMem_Free(specs);
}

/* The shards' specs, each path a copy of its own (free_shards frees them):
 * a path string lives only as long as its tuple, which nothing keeps once
 * the items are released when the argument was a generator. */
static int parse_shards(PyObject *arg, ple_shard_spec **out, Py_ssize_t *count)
{
    PyObject *items = items_of(arg, "shards must be a sequence of tuples");
    if (!items)
        return -1;
    Py_ssize_t n = PyTuple_Size(items);
    if (n < 1 || n > 1 << 20) {
        PyErr_Format(PyExc_ValueError, "a table needs 1..%d shards, not %zd", 1 << 20, n);
        Py_DECREF(items);
        return -1;
    }
    ple_shard_spec *specs = PyMem_Calloc((size_t)n, sizeof *specs);
    if (!specs) {
        Py_DECREF(items);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long offset, rows, map;
        const char *path;
        if (!PyArg_ParseTuple(PyTuple_GetItem(items, i), "iKKsK;shard: (fd, "
                              "file_offset, rows, path, map_address)", &specs[i].fd, &offset,
                              &rows, &path, &map))
            goto fail;
        size_t size = strlen(path) + 1;
        char *copy = PyMem_Malloc(size);
        if (!copy) {
            PyErr_NoMemory();
            goto fail;
        }
        specs[i].path = memcpy(copy, path, size);
        specs[i].file_offset = offset;
        specs[i].rows = rows;
        specs[i].map = (const unsigned char *)(uintptr_t)map;
    }
    Py_DECREF(items);
    *out = specs;
    *count = n;
    return 0;
fail:
    free_shards(specs, n);  /* the paths not copied yet are NULL */
    Py_DECREF(items);
    return -1;
}

/* The ints of a sequence of at most PLE_SEGMENTS_MAX into out: their number
 * (past PLE_SEGMENTS_MAX: the number, none read, for the caller's words), or
 * -1 with an exception set (`what`: the TypeError's message). */
static Py_ssize_t segment_ints(PyObject *obj, const char *what,
                               unsigned long out[PLE_SEGMENTS_MAX])
{
    PyObject *items = items_of(obj, what);
    if (!items)
        return -1;
    Py_ssize_t n = PyTuple_Size(items);
    for (Py_ssize_t i = 0; n <= (Py_ssize_t)PLE_SEGMENTS_MAX && i < n; i++) {
        out[i] = PyLong_AsUnsignedLong(PyTuple_GetItem(items, i));
        if (out[i] == (unsigned long)-1 && PyErr_Occurred()) {
            n = -1;
            break;
        }
    }
    Py_DECREF(items);
    return n;
}

static int Source_init(SourceObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"table_key", "row_bytes", "shard_size", "shards", "cache",
                            "engine", "direct", "segments", "resident", NULL};
    unsigned int table_key, row_bytes;
    unsigned long long shard_size;
    PyObject *shards_obj, *cache_obj, *engine_obj, *segments_obj = Py_None;
    PyObject *resident_obj = Py_None;
    int direct;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "IIKOOOp|OO", names, &table_key, &row_bytes,
                                     &shard_size, &shards_obj, &cache_obj, &engine_obj, &direct,
                                     &segments_obj, &resident_obj))
        return -1;
    /* Segments served from memory (ple_source_keep_resident), by index. */
    unsigned long resident[PLE_SEGMENTS_MAX];
    Py_ssize_t nresident = 0;
    if (resident_obj != Py_None) {
        nresident = segment_ints(resident_obj, "resident must be a sequence of segment "
                                 "indices", resident);
        if (nresident < 0)
            return -1;
        if (nresident > (Py_ssize_t)PLE_SEGMENTS_MAX) {
            PyErr_Format(PyExc_ValueError, "at most %u resident segments, not %zd",
                         PLE_SEGMENTS_MAX, nresident);
            return -1;
        }
    }
    /* Row segments: byte widths, in row order (None: one segment). */
    uint32_t seg_bytes[PLE_SEGMENTS_MAX];
    unsigned nsegs = 0;
    if (segments_obj != Py_None) {
        unsigned long widths[PLE_SEGMENTS_MAX];
        Py_ssize_t ns = segment_ints(segments_obj, "segments must be a sequence of ints", widths);
        if (ns < 0)
            return -1;
        if (ns < 1 || ns > (Py_ssize_t)PLE_SEGMENTS_MAX) {
            PyErr_Format(PyExc_ValueError, "a row has 1..%u segments, not %zd",
                         PLE_SEGMENTS_MAX, ns);
            return -1;
        }
        for (Py_ssize_t g = 0; g < ns; g++) {
            if (widths[g] == 0 || widths[g] > PLE_ROW_BYTES_MAX) {
                PyErr_Format(PyExc_ValueError, "segment %zd: %lu bytes (1..%u)", g, widths[g],
                             PLE_ROW_BYTES_MAX);
                return -1;
            }
            seg_bytes[g] = (uint32_t)widths[g];
        }
        nsegs = (unsigned)ns;
    }
    if (cache_obj != Py_None && !PyObject_TypeCheck(cache_obj, (PyTypeObject *)CacheType)) {
        PyErr_SetString(PyExc_TypeError, "cache must be a RowCache or None");
        return -1;
    }
    if (engine_obj != Py_None && !PyObject_TypeCheck(engine_obj, (PyTypeObject *)EngineType)) {
        PyErr_SetString(PyExc_TypeError, "engine must be a ReadEngine or None");
        return -1;
    }
    if (self->src) {
        PyErr_SetString(PyExc_RuntimeError, "TableSource is initialized already");
        return -1;
    }
    /* Each held until the source took its own reference (or failed to open). */
    ple_cache *cache = NULL;
    ple_engine *engine = NULL;
    ple_shard_spec *specs = NULL;
    Py_ssize_t n = 0;
    ple_source *src;
    ple_error err = {0};
    int rc = -1;
    if (cache_obj != Py_None && !(cache = cache_use((CacheObject *)cache_obj)))
        goto out;
    if (engine_obj != Py_None && !(engine = engine_use((EngineObject *)engine_obj)))
        goto out;
    if (parse_shards(shards_obj, &specs, &n) != 0)
        goto out;
    src = ple_source_open(table_key, row_bytes, shard_size, specs, (unsigned)n,
                          nsegs ? seg_bytes : NULL, nsegs, cache, engine, direct, &err);
    free_shards(specs, n);
    if (!src) {
        raise_error(&err);
        goto out;
    }
    /* Before anyone else can see the source (keep_resident's rule); the
     * reads of a resident segment can take seconds: without the GIL. */
    int kept = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < nresident && kept == 0; k++)  /* (an index past it: refused) */
        kept = ple_source_keep_resident(src, resident[k] > UINT_MAX ? UINT_MAX
                                                                    : (unsigned)resident[k],
                                        &err);
    Py_END_ALLOW_THREADS
    if (kept != 0) {
        Py_BEGIN_ALLOW_THREADS
        ple_source_unref(src);
        Py_END_ALLOW_THREADS
        raise_error(&err);
        goto out;
    }
    self->src = src;
    self->row_bytes = row_bytes;
    self->rows = ple_source_rows(src);
    rc = 0;
out:
    /* Without the GIL: parse_shards ran Python code, so a close elsewhere may
     * have left this the last reference (an engine's joins its threads). */
    if (cache || engine) {
        Py_BEGIN_ALLOW_THREADS
        if (cache)
            ple_cache_unref(cache);
        if (engine)
            ple_engine_unref(engine);
        Py_END_ALLOW_THREADS
    }
    return rc;
}

static void Source_dealloc(SourceObject *self)
{
    if (self->src)
        ple_source_unref(self->src);
    free_instance((PyObject *)self);
}

static PyObject *Source_close(SourceObject *self, PyObject *unused)
{
    (void)unused;
    if (self->src) {
        ple_source *src = self->src;
        self->src = NULL;
        Py_BEGIN_ALLOW_THREADS
        ple_source_unref(src);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

enum { OP_GATHER, OP_GATHER_HITS, OP_FILL, OP_CACHED };

/* The lookups share their door: ids (and out: rows, or OP_CACHED's one byte an
 * id) checked, GIL released. */
static PyObject *source_lookup(SourceObject *self, int op, PyObject *ids_obj,
                               PyObject *out_obj, int threads)
{
    if (threads < 1 || threads > 256) {
        PyErr_Format(PyExc_ValueError, "threads must be in 1..256, not %d", threads);
        return NULL;
    }
    Py_buffer ids, out = {0};
    if (get_ids(ids_obj, &ids) != 0)
        return NULL;
    Py_ssize_t n = ids.shape[0];
    if (out_obj && get_out(out_obj, &out, n, op == OP_CACHED ? 1 : self->row_bytes) != 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    ple_source *src = source_use(self);
    if (!src) {
        PyBuffer_Release(&ids);
        if (out_obj)
            PyBuffer_Release(&out);
        return NULL;
    }
    ple_error err = {0};
    int64_t result = 0;
    Py_BEGIN_ALLOW_THREADS
    if (op == OP_GATHER)
        result = ple_source_gather(src, ids.buf, (size_t)n, out.buf, (unsigned)threads, &err);
    else if (op == OP_GATHER_HITS)
        result = ple_source_gather_hits(src, ids.buf, (size_t)n, out.buf, &err);
    else if (op == OP_CACHED)
        result = ple_source_cached(src, ids.buf, (size_t)n, out.buf, &err);
    else
        result = ple_source_fill(src, ids.buf, (size_t)n, &err);
    ple_source_unref(src);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ids);
    if (out_obj)
        PyBuffer_Release(&out);
    if (result < 0)
        return raise_error(&err);
    if (op == OP_GATHER)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(result);
}

static PyObject *Source_gather(SourceObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"ids", "out", "threads", NULL};
    PyObject *ids, *out;
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|i", names, &ids, &out, &threads))
        return NULL;
    return source_lookup(self, OP_GATHER, ids, out, threads);
}

static PyObject *Source_gather_hits(SourceObject *self, PyObject *args)
{
    PyObject *ids, *out;
    if (!PyArg_ParseTuple(args, "OO", &ids, &out))
        return NULL;
    return source_lookup(self, OP_GATHER_HITS, ids, out, 1);
}

static PyObject *Source_cached(SourceObject *self, PyObject *args)
{
    PyObject *ids, *out;
    if (!PyArg_ParseTuple(args, "OO", &ids, &out))
        return NULL;
    return source_lookup(self, OP_CACHED, ids, out, 1);
}

static PyObject *Source_fill(SourceObject *self, PyObject *ids)
{
    return source_lookup(self, OP_FILL, ids, NULL, 1);
}

static PyObject *Source_stats(SourceObject *self, PyObject *unused)
{
    (void)unused;
    ple_source *src = source_use(self);
    if (!src)
        return NULL;
    ple_source_stats st;
    ple_source_get_stats(src, &st);
    ple_source_unref(src);
    /* The read latency histogram, bucket by bucket (gather.h says which
     * nanoseconds each holds), for the metrics endpoint's histogram. */
    PyObject *hist = PyTuple_New(PLE_READ_HIST_BUCKETS);
    if (!hist)
        return NULL;
    for (unsigned b = 0; b < PLE_READ_HIST_BUCKETS; b++) {
        PyObject *n = PyLong_FromUnsignedLongLong(st.read_ns_hist[b]);
        if (!n || PyTuple_SetItem(hist, b, n) < 0) {  /* steals n, even on failure */
            Py_DECREF(hist);
            return NULL;
        }
    }
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:N,s:K}", "hits", st.hits,
                         "misses", st.misses, "reads", st.reads, "read_bytes", st.read_bytes,
                         "read_errors", st.read_errors, "read_ns_p50", st.read_ns_p50,
                         "read_ns_p99", st.read_ns_p99, "evictions", st.evictions,
                         "read_ns_sum", st.read_ns_sum, "read_ns_buckets", hist,
                         "resident_bytes", st.resident_bytes);
}

static PyObject *Source_get_rows(SourceObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->rows);
}

static PyObject *Source_get_row_bytes(SourceObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(self->row_bytes);
}

static PyObject *Source_get_scratch(SourceObject *self, void *closure)
{
    ple_source *src = source_use(self);
    if (!src)
        return NULL;
    size_t bytes = closure ? ple_source_fill_scratch_bytes(src) : ple_source_scratch_bytes(src);
    ple_source_unref(src);
    return PyLong_FromSize_t(bytes);
}

static PyMethodDef Source_methods[] = {
    {"gather", (PyCFunction)(void (*)(void))Source_gather, METH_VARARGS | METH_KEYWORDS,
     "gather(ids, out, threads=1): the rows of ids (int64) into out (uint8 [n, row_bytes]); "
     "raises ReadError when a read fails."},
    {"gather_hits", (PyCFunction)Source_gather_hits, METH_VARARGS,
     "gather_hits(ids, out) -> int: cache hits only, no I/O; the number of ids not served "
     "(0: every row is in out)."},
    {"cached", (PyCFunction)Source_cached, METH_VARARGS,
     "cached(ids, out) -> int: out[i] = 1 where row ids[i] is in the row cache, else 0 "
     "(out: uint8 [n]); no I/O, no counters; the number cached."},
    {"fill", (PyCFunction)Source_fill, METH_O,
     "fill(ids) -> int: read the rows into the cache only; the number inserted."},
    {"stats", (PyCFunction)Source_stats, METH_NOARGS, "This table's counters, as a dict."},
    {"close", (PyCFunction)Source_close, METH_NOARGS, "Release the table's fds and references."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Source_getset[] = {
    {"rows", (getter)Source_get_rows, NULL, "rows in the table", NULL},
    {"row_bytes", (getter)Source_get_row_bytes, NULL, "bytes per row", NULL},
    {"scratch_bytes", (getter)Source_get_scratch, NULL,
     "heap one thread holds at most while it gathers from this table (read buffers aside)",
     NULL},
    {"fill_scratch_bytes", (getter)Source_get_scratch, NULL,
     "what a thread that fills the cache holds at most besides scratch_bytes", (void *)1},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Source_slots[] = {
    {Py_tp_doc, "TableSource(table_key, row_bytes, shard_size, shards, cache, engine, direct, "
                "segments=None): row lookup for one table. shards: (fd, file_offset, rows, path, "
                "map_address) per shard; with segments (byte widths adding up to row_bytes, in "
                "row order) one per segment of every shard, shard-major."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, (initproc)Source_init},
    {Py_tp_dealloc, (destructor)Source_dealloc},
    {Py_tp_methods, Source_methods},
    {Py_tp_getset, Source_getset},
    {0, NULL},
};

static PyType_Spec Source_spec = {
    .name = "pleserver._native.TableSource",
    .basicsize = sizeof(SourceObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Source_slots,
};

/* Made from Source_spec at import. */
static PyObject *SourceType;

/* --------------------------------------------------------------- probe */

static PyObject *probe_random_reads(PyObject *module, PyObject *args, PyObject *kw)
{
    (void)module;
    static char *names[] = {"paths", "block", "queue_depth", "seconds", "direct", "kind", NULL};
    PyObject *paths_obj;
    unsigned int block = 4096;
    int queue_depth = 128, direct = 1, kind;
    double seconds = 2.0;
    const char *kind_s = "auto";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|Iidps", names, &paths_obj, &block,
                                     &queue_depth, &seconds, &direct, &kind_s))
        return NULL;
    if (parse_kind(kind_s, &kind) != 0)
        return NULL;
    if (block < 512 || block > (1u << 20) || (block & (block - 1))
        || (direct && block % PLE_BLOCK)) {
        PyErr_Format(PyExc_ValueError, "block must be a power of two in 512..1 MiB (a "
                     "multiple of 4096 with direct), not %u", block);
        return NULL;
    }
    if (queue_depth < 1 || queue_depth > 4096 || !(seconds > 0 && seconds <= 3600)) {
        PyErr_Format(PyExc_ValueError, "queue_depth must be in 1..4096 and seconds in "
                     "(0, 3600] (got %d, %g)", queue_depth, seconds);
        return NULL;
    }
    PyObject *items = items_of(paths_obj, "paths must be a sequence of paths");
    if (!items)
        return NULL;
    Py_ssize_t n = PyTuple_Size(items);
    PyObject **encoded = PyMem_Calloc((size_t)n + 1, sizeof *encoded);
    const char **paths = PyMem_Calloc((size_t)n + 1, sizeof *paths);
    PyObject *result = NULL;
    if (!encoded || !paths) {
        PyErr_NoMemory();
        goto out;
    }
    if (n < 1 || n > 65536) {
        PyErr_Format(PyExc_ValueError, "paths: 1..65536 files, not %zd", n);
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_FSConverter(PyTuple_GetItem(items, i), &encoded[i]))
            goto out;
        paths[i] = PyBytes_AsString(encoded[i]);
    }
    ple_error err = {0};
    ple_probe_result res = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ple_probe_random_reads(paths, (unsigned)n, block, (unsigned)queue_depth, seconds,
                                direct, kind, &res, &err);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        raise_error(&err);
        goto out;
    }
    result = Py_BuildValue("{s:K,s:d,s:d,s:s,s:i,s:I,s:O}", "reads", res.reads,
                           "seconds", res.seconds,
                           "reads_per_s", res.seconds > 0 ? (double)res.reads / res.seconds : 0.0,
                           "kind", kind_name(res.kind), "queue_depth", queue_depth,
                           "block", block, "direct", direct ? Py_True : Py_False);
out:
    if (encoded)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(encoded[i]);
    PyMem_Free(encoded);
    PyMem_Free(paths);
    Py_DECREF(items);
    return result;
}

/* -------------------------------------------------------- read memory */

static PyObject *set_read_memory(PyObject *module, PyObject *arg)
{
    (void)module;
    Py_ssize_t bytes = PyLong_AsSsize_t(arg);
    if (bytes == -1 && PyErr_Occurred())
        return NULL;
    if (bytes < 0) {
        PyErr_Format(PyExc_ValueError, "a bound on the read buffers is a number of bytes, "
                     "0 or more, not %zd", bytes);
        return NULL;
    }
    ple_error err = {0};
    if (ple_set_read_memory((size_t)bytes, &err) != 0)
        return raise_error(&err);
    Py_RETURN_NONE;
}

static PyObject *read_memory(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    ple_read_memory st;
    Py_BEGIN_ALLOW_THREADS  /* (the pool's lock is taken by gathering threads) */
    ple_get_read_memory(&st);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("{s:n,s:n,s:n,s:K,s:K,s:n}", "limit_bytes", (Py_ssize_t)st.limit,
                         "charged_bytes", (Py_ssize_t)st.charged, "peak_bytes",
                         (Py_ssize_t)st.peak, "waits", (unsigned long long)st.waits,
                         "returned_bytes", (unsigned long long)st.returned,
                         "round_blocks", (Py_ssize_t)st.round_blocks);
}

/* -------------------------------------------------------------- module */

static PyMethodDef module_methods[] = {
    {"probe_random_reads", (PyCFunction)(void (*)(void))probe_random_reads,
     METH_VARARGS | METH_KEYWORDS,
     "probe_random_reads(paths, block=4096, queue_depth=128, seconds=2.0, direct=True, "
     "kind=\"auto\") -> dict: random aligned reads over the files at that queue depth; "
     "reads, seconds, reads_per_s, kind, queue_depth, block, direct."},
    {"set_read_memory", set_read_memory, METH_O,
     "set_read_memory(bytes): bound the bytes the miss path's read buffers may hold in "
     "memory, every table and thread together (0: no bound); a round that would pass it "
     "waits for buffers given back, and rounds shrink to fit a bound below READ_ROUND_BYTES. "
     "ValueError below READ_MEMORY_MIN."},
    {"read_memory", read_memory, METH_NOARGS,
     "read_memory() -> dict: the read buffers' limit_bytes (0: none), charged_bytes (what "
     "they may hold in memory now), peak_bytes (since the bound was set), waits (rounds "
     "that waited for room), returned_bytes (the charges of buffers given back to the "
     "kernel since the start: at most the pages later rounds fault in again) and "
     "round_blocks (blocks a round may read)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pleserver._native",
    .m_doc = "The native data plane: row cache, miss engine, gather, disk probe.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    EngineType = PyType_FromSpec(&Engine_spec);
    CacheType = EngineType ? PyType_FromSpec(&Cache_spec) : NULL;
    SourceType = CacheType ? PyType_FromSpec(&Source_spec) : NULL;
    if (!SourceType)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    ReadError = PyErr_NewExceptionWithDoc(
        "pleserver._native.ReadError",
        "A read of a checkpoint file failed or came back short; the message names the "
        "file, the offset and the error.", PyExc_OSError, NULL);
    if (!ReadError || PyModule_AddObjectRef(m, "ReadError", ReadError) < 0
        || PyModule_AddObjectRef(m, "ReadEngine", EngineType) < 0
        || PyModule_AddObjectRef(m, "RowCache", CacheType) < 0
        || PyModule_AddObjectRef(m, "TableSource", SourceType) < 0
        || PyModule_AddIntConstant(m, "READ_ROUND_BYTES", (long)ple_read_round_bytes()) < 0
        || PyModule_AddIntConstant(m, "READ_MEMORY_MIN", (long)ple_read_memory_min()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
