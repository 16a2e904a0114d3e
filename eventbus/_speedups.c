/* eventbus._speedups: the compiled hot path of record() and of a queued sink's enqueue.
 *
 * Optional by design: eventbus/bus.py and subscribers/queued.py are complete without it,
 * and this module only ever takes the common case. Everything unusual (a field to coerce,
 * a missing or unknown field, a type given by name, a queue that is full or closed) goes
 * to the pure-Python code, which stays the one place that decides, raises and explains.
 * So behaviour is the same with and without the module by construction; tests run both
 * (EVENTBUS_PURE_PYTHON=1 disables it).
 *
 * Why C at all: on CPython 3.11 a record() to one subscriber spent about 1.5 us above
 * what any snapshot event costs (docs/performance.md); the Python frame, the **fields
 * dict, a dozen attribute reads and the lock's `with` were most of it. Here a call with
 * keywords arrives as a vector (no dict is made for the keywords), the event's __dict__
 * is the only dict built, and no Python code runs between reading the subscribers and
 * calling them. One more property comes free: a Python signal handler runs only between
 * bytecodes, so none can interrupt the C parts below (docs/guarantees.md).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>

static PyObject *s_data, *s_timestamp, *s_context, *s_value, *s_empty_tuple;

/* ------------------------------------------------------------------------------------ */
/* Spec: what the fast path needs to know about one event class                         */
/* ------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyTypeObject *cls;     /* the event class */
    PyObject *names;       /* tuple of str: the required fields, then the optional ones */
    PyObject *kinds;       /* tuple of types, one per name */
    PyObject *nullable;    /* tuple of bools, one per name */
    Py_ssize_t n_required;
    PyObject *frozen;      /* the read-only dict class of this type's data */
    PyObject *empty;       /* the shared empty data */
    PyObject *snap;        /* snapshot(data): the Python copy, for non-atomic values */
    PyObject *atomic;      /* frozenset of the types that are stored as they are */
    PyObject *time;        /* time.time */
    PyObject *holder;      /* the context holder: .value is the current JobContext */
    PyObject *set_dict;    /* the classes' __dict__ descriptor: its setter installs __dict__ */
} SpecObject;

static int
spec_traverse(SpecObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->cls);
    Py_VISIT(self->names);
    Py_VISIT(self->kinds);
    Py_VISIT(self->nullable);
    Py_VISIT(self->frozen);
    Py_VISIT(self->empty);
    Py_VISIT(self->snap);
    Py_VISIT(self->atomic);
    Py_VISIT(self->time);
    Py_VISIT(self->holder);
    Py_VISIT(self->set_dict);
    return 0;
}

static int
spec_clear(SpecObject *self)
{
    Py_CLEAR(self->cls);
    Py_CLEAR(self->names);
    Py_CLEAR(self->kinds);
    Py_CLEAR(self->nullable);
    Py_CLEAR(self->frozen);
    Py_CLEAR(self->empty);
    Py_CLEAR(self->snap);
    Py_CLEAR(self->atomic);
    Py_CLEAR(self->time);
    Py_CLEAR(self->holder);
    Py_CLEAR(self->set_dict);
    return 0;
}

static void
spec_dealloc(SpecObject *self)
{
    PyObject_GC_UnTrack(self);
    spec_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
spec_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"cls", "names", "kinds", "nullable", "n_required", "empty",
                             "snap", "atomic", "time", "holder", "set_dict", NULL};
    PyObject *cls, *names, *kinds, *nullable, *empty, *snap, *atomic, *time, *holder,
        *set_dict;
    Py_ssize_t n_required;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O!nOOO!OOO:Spec", kwlist,
                                     &PyType_Type, &cls, &PyTuple_Type, &names,
                                     &PyTuple_Type, &kinds, &PyTuple_Type, &nullable,
                                     &n_required, &empty, &snap, &PyFrozenSet_Type, &atomic,
                                     &time, &holder, &set_dict))
        return NULL;
    if (Py_TYPE(set_dict)->tp_descr_set == NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "Spec: set_dict must be the event classes' __dict__ descriptor");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    if (PyTuple_GET_SIZE(kinds) != n || PyTuple_GET_SIZE(nullable) != n ||
        n_required < 0 || n_required > n) {
        PyErr_SetString(PyExc_ValueError,
                        "Spec: names, kinds and nullable must have one entry per field, "
                        "and n_required at most that many");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(names, i)) ||
            !PyType_Check(PyTuple_GET_ITEM(kinds, i))) {
            PyErr_SetString(PyExc_TypeError, "Spec: names must be str and kinds types");
            return NULL;
        }
    }
    if (!PyDict_Check(empty)) {
        PyErr_SetString(PyExc_TypeError, "Spec: empty must be the type's empty read-only dict");
        return NULL;
    }
    /* spec_snapshot takes the usual values without looking them up in `atomic`
       (eventbus.snapshot.ATOMIC, the one definition): that is only right while they are
       in it, so a Spec is refused, and every test with it, the day one is not. */
    PyObject *usual[] = {(PyObject *)&PyFloat_Type, (PyObject *)&PyLong_Type,
                         (PyObject *)&PyUnicode_Type, (PyObject *)&PyBool_Type,
                         (PyObject *)Py_TYPE(Py_None)};
    for (size_t i = 0; i < sizeof(usual) / sizeof(usual[0]); i++) {
        int found = PySet_Contains(atomic, usual[i]);
        if (found < 0)
            return NULL;
        if (!found) {
            PyErr_Format(PyExc_ValueError,
                         "Spec: atomic must hold %s (the compiled snapshot shares its "
                         "values without a lookup)", ((PyTypeObject *)usual[i])->tp_name);
            return NULL;
        }
    }
    SpecObject *self = (SpecObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    /* Field names interned, so that a call site's keyword (interned by the compiler)
       matches by identity. */
    PyObject *interned = PyTuple_New(n);
    if (interned == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        Py_INCREF(name);
        PyUnicode_InternInPlace(&name);
        PyTuple_SET_ITEM(interned, i, name);
    }
    self->cls = (PyTypeObject *)Py_NewRef(cls);
    self->names = interned;
    self->kinds = Py_NewRef(kinds);
    self->nullable = Py_NewRef(nullable);
    self->n_required = n_required;
    self->frozen = Py_NewRef((PyObject *)Py_TYPE(empty));
    self->empty = Py_NewRef(empty);
    self->snap = Py_NewRef(snap);
    self->atomic = Py_NewRef(atomic);
    self->time = Py_NewRef(time);
    self->holder = Py_NewRef(holder);
    self->set_dict = Py_NewRef(set_dict);
    return (PyObject *)self;
}

static Py_ssize_t
spec_find(SpecObject *spec, PyObject *name)
{
    Py_ssize_t n = PyTuple_GET_SIZE(spec->names);
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyTuple_GET_ITEM(spec->names, i) == name)
            return i;
    /* A keyword that is not interned (record(**some_dict)): compare the text. */
    if (PyUnicode_CheckExact(name)) {
        for (Py_ssize_t i = 0; i < n; i++) {
            int eq = PyUnicode_Compare(PyTuple_GET_ITEM(spec->names, i), name);
            if (eq == 0)
                return i;
            if (eq == -1 && PyErr_Occurred())
                PyErr_Clear();
        }
    }
    return -1;
}

static int
is_data(PyObject *name)
{
    if (name == s_data)
        return 1;
    return PyUnicode_CheckExact(name) && PyUnicode_CompareWithASCIIString(name, "data") == 0;
}

/* The read-only copy of a plain dict `data` (FrozenData of the type), or NULL with an
   error: snapshot()'s common case (eventbus/snapshot.py), whose rules it reads rather
   than restates: a value whose class is in `atomic` (snapshot.ATOMIC) is shared, and any
   other sends the whole dict to `snap` (the Python snapshot itself). What is C's own:
   the usual classes tested first without the set lookup (spec_new checks they are in
   `atomic`), and the metaclass guard below. tests/test_compiled.py compares the two. */
static PyObject *
spec_snapshot(SpecObject *spec, PyObject *data, int *plain)
{
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    *plain = 0;
    int str_keys = 1;
    while (PyDict_Next(data, &pos, &key, &value)) {
        PyTypeObject *t = Py_TYPE(value);
        /* the usual values first, without the set lookup */
        if (t != &PyFloat_Type && t != &PyLong_Type && t != &PyUnicode_Type &&
            t != &PyBool_Type && value != Py_None) {
            /* Only a class whose metaclass is `type` is looked up: its hash runs no Python
               code, so nothing can change `data` while it is read (the atomic types are
               all such classes; anything else takes the Python copy). */
            if (!Py_IS_TYPE(t, &PyType_Type))
                return PyObject_CallOneArg(spec->snap, data);
            int atomic = PySet_Contains(spec->atomic, (PyObject *)t);
            if (atomic < 0)
                return NULL;
            if (!atomic)
                return PyObject_CallOneArg(spec->snap, data);
        }
        str_keys &= PyUnicode_CheckExact(key);
    }
    *plain = str_keys;
    PyTypeObject *frozen = (PyTypeObject *)spec->frozen;
    PyObject *copy = frozen->tp_new(frozen, s_empty_tuple, NULL);
    if (copy == NULL)
        return NULL;
    if (PyDict_Merge(copy, data, 1) < 0) {
        Py_DECREF(copy);
        return NULL;
    }
    return copy;
}

/* event.__dict__ = dict, through the classes' own __dict__ descriptor, as the generated
   code does. PyObject_GenericSetDict would only replace the dict pointer: on 3.13 an
   object whose attributes still live in its inline values would not see the new dict. */
static int
set_event_dict(SpecObject *spec, PyObject *event, PyObject *dict)
{
    return Py_TYPE(spec->set_dict)->tp_descr_set(spec->set_dict, event, dict);
}

/* An event whose fields, data keys and data values are all atomic (numbers, strings,
   bytes, None) cannot be part of a reference cycle: nothing it holds can refer back to
   it, and it is read-only. So it, its __dict__ and its data are taken out of the garbage
   collector's sight, as CPython itself does for tuples and dicts of atomic values. A
   queue of such events (a sink's backlog, the forwarder's batch) then costs the collector
   nothing: without this, every queued event was traversed by each young collection and
   pushed full collections of the whole heap (torch's, in a worker) to run mid-flood
   (docs/performance.md). Its context (a JobContext) stays tracked; a reference from an
   untracked object only keeps it alive, as any external reference does. */
static void
untrack_event(PyObject *event, PyObject *dict, PyObject *frozen)
{
    PyObject_GC_UnTrack(frozen);
    PyObject_GC_UnTrack(dict);
    PyObject_GC_UnTrack(event);
}

/* Match keyword values against the spec.
   Returns 1 when every field is of its exact kind (then *data is the `data` value or
   NULL and *data_pos its index or -1), 0 when the call is anything else (the Python
   path takes it; no error is set), -1 on an error. */
static int
spec_match(SpecObject *spec, PyObject *const *values, PyObject *kwnames,
           PyObject **data, Py_ssize_t *data_pos)
{
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    Py_ssize_t seen = 0;
    *data = NULL;
    *data_pos = -1;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        PyObject *value = values[i];
        if (name == s_data && *data_pos < 0) {
            *data = value;
            *data_pos = i;
            continue;
        }
        Py_ssize_t j = spec_find(spec, name);
        if (j < 0) {
            if (*data_pos < 0 && is_data(name)) {
                *data = value;
                *data_pos = i;
                continue;
            }
            return 0;
        }
        if ((PyObject *)Py_TYPE(value) != PyTuple_GET_ITEM(spec->kinds, j) &&
            !(value == Py_None && PyTuple_GET_ITEM(spec->nullable, j) == Py_True))
            return 0;
        if (j < spec->n_required)
            seen++;
    }
    if (seen != spec->n_required)
        return 0;
    if (*data == Py_None) {
        *data = NULL;
    }
    else if (*data != NULL && !PyDict_CheckExact(*data)) {
        return 0;
    }
    return 1;
}

/* time.time(), read as it reads the clock (nanoseconds, then seconds as a double), without
   the call; spec->time itself where there is no clock_gettime. */
static PyObject *
now_seconds(SpecObject *spec)
{
#if defined(CLOCK_REALTIME) && !defined(MS_WINDOWS)
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) == 0) {
        long long ns = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
        double seconds = ns % 1000000000LL == 0 ? (double)(ns / 1000000000LL)
                                                : (double)ns / 1e9;
        return PyFloat_FromDouble(seconds);
    }
#endif
    return PyObject_CallNoArgs(spec->time);
}

/* Build the event (a new reference), after spec_match returned 1. The event's __dict__
   holds the fields in call order, `data` where it was given (else after them), then
   timestamp and context, as the generated _build makes it. `timestamp` and `context`
   NULL: now, and the process's current context. */
static PyObject *
spec_build(SpecObject *spec, PyObject *const *values, PyObject *kwnames, PyObject *data,
           Py_ssize_t data_pos, PyObject *timestamp, PyObject *context)
{
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    PyObject *frozen = NULL, *dict = NULL, *event = NULL;
    int plain = 1;
    if (data == NULL) {
        frozen = Py_NewRef(spec->empty);
    }
    else {
        frozen = spec_snapshot(spec, data, &plain);
        if (frozen == NULL)
            return NULL;
    }
    dict = PyDict_New();
    if (dict == NULL)
        goto error;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        if (i == data_pos) {
            if (PyDict_SetItem(dict, s_data, frozen) < 0)
                goto error;
        }
        else if (PyDict_SetItem(dict, PyTuple_GET_ITEM(kwnames, i), values[i]) < 0) {
            goto error;
        }
    }
    if (data_pos < 0 && PyDict_SetItem(dict, s_data, frozen) < 0)
        goto error;
    if (timestamp == NULL) {
        PyObject *now = now_seconds(spec);
        if (now == NULL || PyDict_SetItem(dict, s_timestamp, now) < 0) {
            Py_XDECREF(now);
            goto error;
        }
        Py_DECREF(now);
    }
    else if (PyDict_SetItem(dict, s_timestamp, timestamp) < 0) {
        goto error;
    }
    if (context == NULL) {
        PyObject *current = PyObject_GetAttr(spec->holder, s_value);
        if (current == NULL || PyDict_SetItem(dict, s_context, current) < 0) {
            Py_XDECREF(current);
            goto error;
        }
        Py_DECREF(current);
    }
    else if (PyDict_SetItem(dict, s_context, context) < 0) {
        goto error;
    }
    /* object.__new__(cls), less its argument checks (there are no arguments) */
    event = spec->cls->tp_alloc(spec->cls, 0);
    if (event == NULL)
        goto error;
    if (set_event_dict(spec, event, dict) < 0)
        goto error;
    if (plain)
        untrack_event(event, dict, frozen);
    Py_DECREF(frozen);
    Py_DECREF(dict);
    return event;
error:
    Py_XDECREF(frozen);
    Py_XDECREF(dict);
    Py_XDECREF(event);
    return NULL;
}

/* Spec.decode(fields, timestamp, context): the receiver's decoder. `fields` (a plain dict,
   the wire's, that nobody else holds) becomes the event's __dict__, as in the generated
   _decode; None (and `fields` untouched) when it is anything but the common case. */
static PyObject *
spec_decode(SpecObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyDict_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "decode(fields: dict, timestamp, context)");
        return NULL;
    }
    PyObject *fields = args[0];
    Py_ssize_t pos = 0, seen = 0;
    PyObject *key, *value, *data = NULL;
    while (PyDict_Next(fields, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key))
            Py_RETURN_NONE;
        Py_ssize_t j = spec_find(self, key);
        if (j < 0) {
            if (data == NULL && is_data(key)) {
                data = value;
                continue;
            }
            Py_RETURN_NONE;
        }
        if ((PyObject *)Py_TYPE(value) != PyTuple_GET_ITEM(self->kinds, j) &&
            !(value == Py_None && PyTuple_GET_ITEM(self->nullable, j) == Py_True))
            Py_RETURN_NONE;
        if (j < self->n_required)
            seen++;
    }
    if (seen != self->n_required)
        Py_RETURN_NONE;
    PyObject *frozen;
    int plain = 1;
    if (data == NULL || data == Py_None) {
        frozen = Py_NewRef(self->empty);
    }
    else if (!PyDict_CheckExact(data)) {
        Py_RETURN_NONE;
    }
    else {
        frozen = spec_snapshot(self, data, &plain);
        if (frozen == NULL)
            return NULL;
    }
    PyObject *event = NULL;
    if (PyDict_SetItem(fields, s_data, frozen) < 0 ||
        PyDict_SetItem(fields, s_timestamp, args[1]) < 0 ||
        PyDict_SetItem(fields, s_context, args[2]) < 0)
        goto error;
    event = self->cls->tp_alloc(self->cls, 0);
    if (event == NULL || set_event_dict(self, event, fields) < 0)
        goto error;
    /* The timestamp is a float (the caller checked); the context a JobContext. */
    if (plain && PyFloat_CheckExact(args[1]))
        untrack_event(event, fields, frozen);
    Py_DECREF(frozen);
    return event;
error:
    Py_XDECREF(event);
    Py_DECREF(frozen);
    return NULL;
}

static PyMethodDef spec_methods[] = {
    {"decode", (PyCFunction)(void (*)(void))spec_decode, METH_FASTCALL,
     "decode(fields, timestamp, context): the event, or None for the Python path"},
    {NULL},
};

static PyTypeObject SpecType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "eventbus._speedups.Spec",
    .tp_basicsize = sizeof(SpecObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The fast path's description of one event class (see eventbus._codegen).",
    .tp_new = spec_new,
    .tp_traverse = (traverseproc)spec_traverse,
    .tp_clear = (inquiry)spec_clear,
    .tp_dealloc = (destructor)spec_dealloc,
    .tp_methods = spec_methods,
};

/* ------------------------------------------------------------------------------------ */
/* View: what record() reads of one event type's slot, one C field each                 */
/* ------------------------------------------------------------------------------------ */

/* The bus keeps one View per slot and writes it whenever the slot's subscribers or its
   generated code change (eventbus/bus.py, _refresh and _generated), so that record()
   reads four struct fields instead of looking up four attributes. */
typedef struct {
    PyObject_HEAD
    PyObject *slot;       /* the bus's _Slot (handed to its failure handler) */
    PyObject *spec;       /* its class's Spec, or None before the code is generated */
    PyObject *calls;      /* the dispatch snapshot: a tuple of callables */
    PyObject *published;  /* the slot's itertools.count (what the Python path counts) */
    Py_ssize_t count;     /* events the compiled path published (the bus adds the two) */
} ViewObject;

static PyMemberDef view_members[] = {
    {"slot", T_OBJECT_EX, offsetof(ViewObject, slot), READONLY, NULL},
    {"spec", T_OBJECT_EX, offsetof(ViewObject, spec), 0, NULL},
    {"calls", T_OBJECT_EX, offsetof(ViewObject, calls), 0, NULL},
    {"published", T_OBJECT_EX, offsetof(ViewObject, published), READONLY, NULL},
    {"count", T_PYSSIZET, offsetof(ViewObject, count), READONLY,
     "events published through the compiled path (under the GIL: one C increment)"},
    {NULL},
};

static int
view_traverse(ViewObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->slot);
    Py_VISIT(self->spec);
    Py_VISIT(self->calls);
    Py_VISIT(self->published);
    return 0;
}

static int
view_clear(ViewObject *self)
{
    Py_CLEAR(self->slot);
    Py_CLEAR(self->spec);
    Py_CLEAR(self->calls);
    Py_CLEAR(self->published);
    return 0;
}

static void
view_dealloc(ViewObject *self)
{
    PyObject_GC_UnTrack(self);
    view_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
view_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"slot", "spec", "calls", "published", NULL};
    PyObject *slot, *spec, *calls, *published;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!O:View", kwlist, &slot, &spec,
                                     &PyTuple_Type, &calls, &published))
        return NULL;
    ViewObject *self = (ViewObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->slot = Py_NewRef(slot);
    self->spec = Py_NewRef(spec);
    self->calls = Py_NewRef(calls);
    self->published = Py_NewRef(published);
    return (PyObject *)self;
}

static PyTypeObject ViewType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "eventbus._speedups.View",
    .tp_basicsize = sizeof(ViewObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "What the compiled record() reads of one slot of a bus.",
    .tp_new = view_new,
    .tp_traverse = (traverseproc)view_traverse,
    .tp_clear = (inquiry)view_clear,
    .tp_dealloc = (destructor)view_dealloc,
    .tp_members = view_members,
};

/* ------------------------------------------------------------------------------------ */
/* Recorder: Bus.record's common case                                                   */
/* ------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *bus;       /* the Bus */
    PyObject *views;     /* event type key -> View, kept by the bus beside its _slots */
    PyObject *fallback;  /* Bus.record, the Python function: fallback(bus, ...) */
    PyObject *failed;    /* failed(slot, call, event, exc): the bus's failure handler */
} RecorderObject;

static PyObject *
recorder_fallback(RecorderObject *self, PyObject *const *args, Py_ssize_t nargs,
                  PyObject *kwnames)
{
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    Py_ssize_t total = 1 + nargs + nkw;
    PyObject *small[16];
    PyObject **stack = small;
    if (total > 16) {
        stack = PyMem_Malloc(total * sizeof(PyObject *));
        if (stack == NULL)
            return PyErr_NoMemory();
    }
    stack[0] = self->bus;
    for (Py_ssize_t i = 0; i < nargs + nkw; i++)
        stack[1 + i] = args[i];
    PyObject *result = PyObject_Vectorcall(self->fallback, stack, 1 + nargs, kwnames);
    if (stack != small)
        PyMem_Free(stack);
    return result;
}

/* A subscriber raised `Exception`: hand it to the bus's failure handler (the `failed`
   callable it passed in: failed(slot, call, event, exc)), which counts and reports it (or
   re-raises it on a strict bus). 0, or -1 with an error. */
static int
recorder_failed(RecorderObject *self, PyObject *slot, PyObject *call, PyObject *event)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
#else
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (tb != NULL) {
        PyException_SetTraceback(exc, tb);
        Py_DECREF(tb);
    }
    Py_XDECREF(type);
#endif
    if (exc == NULL)
        return 0;
    PyObject *r = PyObject_CallFunctionObjArgs(self->failed, slot, call, event, exc, NULL);
    Py_DECREF(exc);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Count the event and hand it to each call of the snapshot, in order: the compiled copy
   of Bus._deliver (eventbus/bus.py), the one delivery loop of record() and publish().
   Kept in step with it by tests/test_bus.py, which drives both with the same subscribers
   (raising, cancelling, strict, interrupting) and compares what they did. 0, or -1 with
   an error (a strict bus's re-raise, or a BaseException that is not an Exception, which
   goes straight out). */
static int
deliver(RecorderObject *self, ViewObject *view, PyObject *calls, PyObject *event)
{
    view->count++;
    Py_ssize_t ncalls = PyTuple_GET_SIZE(calls);
    for (Py_ssize_t i = 0; i < ncalls; i++) {
        PyObject *call = PyTuple_GET_ITEM(calls, i);
        PyObject *ret = PyObject_CallOneArg(call, event);
        if (ret != NULL) {
            Py_DECREF(ret);
            continue;
        }
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return -1;  /* KeyboardInterrupt, SystemExit: out, as from the Python loop */
        if (recorder_failed(self, view->slot, call, event) < 0)
            return -1;
    }
    return 0;
}

static PyObject *
recorder_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    RecorderObject *self = (RecorderObject *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1)
        return recorder_fallback(self, args, nargs, kwnames);
    PyObject *found = PyDict_GetItemWithError(self->views, args[0]);
    if (found == NULL || Py_TYPE(found) != &ViewType) {
        if (found == NULL && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError))
                return NULL;
            PyErr_Clear();  /* not hashable: the Python path names the problem */
        }
        return recorder_fallback(self, args, nargs, kwnames);
    }
    ViewObject *view = (ViewObject *)found;
    if (Py_TYPE(view->spec) != &SpecType || !PyTuple_CheckExact(view->calls))
        return recorder_fallback(self, args, nargs, kwnames);  /* not generated yet */
    /* The dispatch snapshot, read once: (un)subscribing meanwhile affects the next event.
       Held, with the view, until the last call returns: a subscriber may unsubscribe. */
    Py_INCREF(view);
    SpecObject *spec = (SpecObject *)Py_NewRef(view->spec);
    PyObject *calls = Py_NewRef(view->calls);
    PyObject *event = NULL, *result = NULL;
    PyObject *data;
    Py_ssize_t data_pos;
    int r = spec_match(spec, args + 1, kwnames, &data, &data_pos);
    if (r < 0)
        goto done;
    if (r == 0) {
        result = recorder_fallback(self, args, nargs, kwnames);
        goto done;
    }
    if (PyTuple_GET_SIZE(calls)) {
        event = spec_build(spec, args + 1, kwnames, data, data_pos, NULL, NULL);
        if (event == NULL)
            goto done;
    }
    if (deliver(self, view, calls, event) == 0)
        result = Py_NewRef(Py_None);
done:
    Py_XDECREF(event);
    Py_DECREF(calls);
    Py_DECREF(spec);
    Py_DECREF(view);
    return result;
}

/* Bus.publish(event): an event built elsewhere (decoded from a worker, bridged from
   torch), delivered as it is. Anything but an event of a known type with its slot's view
   goes to the Python method. */
static PyObject *
publisher_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    RecorderObject *self = (RecorderObject *)op;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL)
        return recorder_fallback(self, args, PyVectorcall_NARGS(nargsf), kwnames);
    PyObject *event = args[0];
    PyObject *found = PyDict_GetItemWithError(self->views, (PyObject *)Py_TYPE(event));
    if (found == NULL || Py_TYPE(found) != &ViewType) {
        if (found == NULL && PyErr_Occurred())
            return NULL;
        return recorder_fallback(self, args, 1, NULL);
    }
    ViewObject *view = (ViewObject *)Py_NewRef(found);
    PyObject *calls = Py_NewRef(view->calls);
    PyObject *result = NULL;
    if (!PyTuple_CheckExact(calls))
        result = recorder_fallback(self, args, 1, NULL);
    else if (deliver(self, view, calls, event) == 0)
        result = Py_NewRef(Py_None);
    Py_DECREF(calls);
    Py_DECREF(view);
    return result;
}

static PyTypeObject PublisherType;

static int
recorder_traverse(RecorderObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->bus);
    Py_VISIT(self->views);
    Py_VISIT(self->fallback);
    Py_VISIT(self->failed);
    return 0;
}

static int
recorder_clear(RecorderObject *self)
{
    Py_CLEAR(self->bus);
    Py_CLEAR(self->views);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->failed);
    return 0;
}

static void
recorder_dealloc(RecorderObject *self)
{
    PyObject_GC_UnTrack(self);
    recorder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
recorder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"bus", "views", "fallback", "failed", NULL};
    PyObject *bus, *views, *fallback, *failed;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!OO:Recorder", kwlist, &bus,
                                     &PyDict_Type, &views, &fallback, &failed))
        return NULL;
    if (!PyCallable_Check(fallback) || !PyCallable_Check(failed)) {
        PyErr_SetString(PyExc_TypeError, "Recorder: fallback and failed must be callable");
        return NULL;
    }
    RecorderObject *self = (RecorderObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = type == &PublisherType ? publisher_vectorcall : recorder_vectorcall;
    self->bus = Py_NewRef(bus);
    self->views = Py_NewRef(views);
    self->fallback = Py_NewRef(fallback);
    self->failed = Py_NewRef(failed);
    return (PyObject *)self;
}

static PyObject *
recorder_repr(RecorderObject *self)
{
    return PyUnicode_FromFormat("<compiled %s() of %R>",
                                Py_TYPE(self) == &PublisherType ? "publish" : "record",
                                self->bus);
}

static PyObject *
recorder_get_self(RecorderObject *self, void *closure)
{
    return Py_NewRef(self->bus);
}

static PyObject *
recorder_get_func(RecorderObject *self, void *closure)
{
    return Py_NewRef(self->fallback);
}

static PyObject *
recorder_get_doc(RecorderObject *self, void *closure)
{
    return PyObject_GetAttrString(self->fallback, "__doc__");
}

static PyObject *
recorder_get_signature(RecorderObject *self, void *closure)
{
    /* inspect.signature(bus.record): the Python method's, bound to the bus. */
    PyObject *inspect = PyImport_ImportModule("inspect");
    if (inspect == NULL)
        return NULL;
    PyObject *bound = PyMethod_New(self->fallback, self->bus);
    PyObject *sig = NULL;
    if (bound != NULL)
        sig = PyObject_CallMethod(inspect, "signature", "O", bound);
    Py_XDECREF(bound);
    Py_DECREF(inspect);
    return sig;
}

static PyGetSetDef recorder_getset[] = {
    {"__self__", (getter)recorder_get_self, NULL, "the bus this record() publishes on"},
    {"__func__", (getter)recorder_get_func, NULL, "the pure-Python method"},
    {"__doc__", (getter)recorder_get_doc, NULL, NULL},
    {"__signature__", (getter)recorder_get_signature, NULL, NULL},
    {NULL},
};

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "eventbus._speedups.Recorder",
    .tp_basicsize = sizeof(RecorderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Bus.record's compiled common case; anything else goes to Bus.record.",
    .tp_new = recorder_new,
    .tp_traverse = (traverseproc)recorder_traverse,
    .tp_clear = (inquiry)recorder_clear,
    .tp_dealloc = (destructor)recorder_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(RecorderObject, vectorcall),
    .tp_repr = (reprfunc)recorder_repr,
    .tp_getset = recorder_getset,
};

static PyTypeObject PublisherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "eventbus._speedups.Publisher",
    .tp_basicsize = sizeof(RecorderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Bus.publish's compiled common case; anything else goes to Bus.publish.",
    .tp_new = recorder_new,
    .tp_traverse = (traverseproc)recorder_traverse,
    .tp_clear = (inquiry)recorder_clear,
    .tp_dealloc = (destructor)recorder_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(RecorderObject, vectorcall),
    .tp_repr = (reprfunc)recorder_repr,
    .tp_getset = recorder_getset,
};

/* ------------------------------------------------------------------------------------ */
/* Enqueuer: QueuedSink.__call__'s common case (subscribers/queued.py)                 */
/* ------------------------------------------------------------------------------------ */

/* The same steps as the Python method, in the same order: the size estimate, the lock,
   the kick, the byte sum, the two appends. Anything unusual is the Python method's: a
   value whose size is not a plain int, a queue that is full, closed or over its bytes
   (the `overflow` callable the sink hands over), a sink not synced yet.

   The size estimate is estimate_size()'s (subscribers/queued.py), whose rules this reads
   rather than restates: the sink hands over BASE_BYTES, PER_KEY_BYTES, the classes whose
   values cost nothing more (FREE_VALUE_TYPES) and _value_size() for any other value. Only
   the walk over `data` is written here (a Python call per event would cost what this
   module saves); tests/test_compiled.py compares its sizes with estimate_size()'s.

   Nothing here looks up a private name: what the sink's methods do (start or wake its
   thread; take a full, closed or too large case) comes in as callables at construction,
   and the one attribute read and written per event is the sink's public `queued_bytes`
   (its documented contract: the estimated bytes queued now, kept by the sink).

   What changes rarely the sink hands over with sync(): its queue, its sizes, its lock,
   the admitted count (_limit: max_events, or 0 once closed), max_bytes and the length
   that kicks its thread. QueuedSink calls sync() wherever those change (its state's
   reset, its thread's start, close), with its lock held, so an enqueue, which takes the
   same lock, never sees them half changed. The byte count changes with every batch the
   sink's thread takes, so it is read from the sink's __dict__ each time.

   The lock is the sink's RLock, taken and released around the locked part as `with`
   does. No Python code runs between the two except the sink's kick (before the byte sum
   and the appends) or overflow, as in the Python method, so no signal handler can
   interrupt the byte sum or the appends (handlers run only between bytecodes). The kick
   comes when the queue is empty (start or wake the sink's thread) and when this event
   fills a batch (kick_at). */

static PyObject *s_queued_bytes, *s_append, *s_acquire, *s_release;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *sink;
    PyObject *fallback;    /* QueuedSink.__call__, the Python function: fallback(sink, e) */
    PyObject *value_size;  /* queued._value_size: a value's bytes beyond its key's */
    Py_ssize_t base_size;  /* queued.BASE_BYTES */
    Py_ssize_t per_key;    /* queued.PER_KEY_BYTES */
    PyObject *free_types;  /* queued.FREE_VALUE_TYPES: a tuple of exact classes */
    PyObject *kick;        /* kick(): start or wake the sink's thread (lock held), called
                              before an event goes into an empty queue or fills a batch */
    PyObject *overflow;    /* overflow(event, size): the unusual case (lock held) */
    /* the synced state (NULL until the first sync) */
    PyObject *queue, *queue_append, *sizes_append, *acquire, *release;
    long long limit, max_bytes, kick_at;
    /* The last size made into an int: a stream of like events reuses it. */
    long long last_size;
    PyObject *last_size_obj;
    /* count_into(): the record counter, 8 bytes of a writable buffer (a shared mmap the
       sink's owner made), added to once per event queued here; count_buf.obj NULL: none */
    Py_buffer count_buf;
    unsigned long long *counter;
} EnqueuerObject;

static PyObject *
enqueuer_fallback(EnqueuerObject *self, PyObject *event)
{
    return PyObject_CallFunctionObjArgs(self->fallback, self->sink, event, NULL);
}

/* The estimate_size of the event (>= 0), -1 with an error, or -2: not the common case. */
static long long
enqueuer_size(EnqueuerObject *self, PyObject *event)
{
    /* event.data: an event's own __dict__ holds it (eventbus.events: every field, data,
       timestamp and context); anything else is read as an attribute. */
    PyObject *data = NULL;
    PyObject *own = PyObject_GenericGetDict(event, NULL);
    if (own != NULL && PyDict_CheckExact(own)) {
        data = PyDict_GetItemWithError(own, s_data);
        Py_XINCREF(data);
    }
    Py_XDECREF(own);
    if (data == NULL) {
        if (PyErr_Occurred())
            PyErr_Clear();
        data = PyObject_GetAttr(event, s_data);
    }
    if (data == NULL)
        return -1;
    long long size = self->base_size;
    if (!PyDict_Check(data)) {
        Py_DECREF(data);
        return -2;
    }
    Py_ssize_t n = PyDict_GET_SIZE(data);
    if (n) {
        size += (long long)self->per_key * (long long)n;
        Py_ssize_t pos = 0, nfree = PyTuple_GET_SIZE(self->free_types);
        PyObject *key, *value;
        while (PyDict_Next(data, &pos, &key, &value)) {
            PyObject *t = (PyObject *)Py_TYPE(value);
            int is_free = 0;
            for (Py_ssize_t i = 0; i < nfree && !is_free; i++)
                is_free = PyTuple_GET_ITEM(self->free_types, i) == t;
            if (is_free)
                continue;
            Py_INCREF(value);
            PyObject *extra = PyObject_CallOneArg(self->value_size, value);
            Py_DECREF(value);
            if (extra == NULL) {
                Py_DECREF(data);
                return -1;
            }
            long long more = PyLong_CheckExact(extra) ? PyLong_AsLongLong(extra) : -1;
            Py_DECREF(extra);
            if (more < 0) {
                Py_DECREF(data);
                if (PyErr_Occurred())
                    PyErr_Clear();
                return -2;
            }
            size += more;
            if (PyDict_GET_SIZE(data) != n) {  /* changed under us: leave it to Python */
                Py_DECREF(data);
                return -2;
            }
        }
    }
    Py_DECREF(data);
    return size;
}

/* The locked part: 1 enqueued, 2 not the common case (nothing changed: the Python method
   is to take it once the lock is released), 0 with an error. */
static int
enqueuer_locked(EnqueuerObject *self, PyObject *dict, PyObject *event, long long size,
                PyObject *size_obj)
{
    PyObject *value = PyDict_GetItemWithError(dict, s_queued_bytes);
    if (value == NULL || !PyLong_CheckExact(value))
        return PyErr_Occurred() ? 0 : 2;
    int overflow;
    long long bytes = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow)
        return 2;
    /* Own references: an enqueue nested in this one (a finalizer that records, run by
       an allocation below) may sync new ones. */
    PyObject *queue = Py_NewRef(self->queue);
    PyObject *queue_append = Py_NewRef(self->queue_append);
    PyObject *sizes_append = Py_NewRef(self->sizes_append);
    long long limit = self->limit, max_bytes = self->max_bytes, kick_at = self->kick_at;
    int ok = 0;
    Py_ssize_t n = PyObject_Size(queue);
    if (n >= 0 && n < limit && bytes + size <= max_bytes) {
        /* The kick first, as in the Python method: a signal handler that raises inside it
           (it is Python code) loses this event with its wake-up, never leaves the event
           queued with no wake-up on its way. The byte count is read again after it: an
           enqueue nested in the kick may have added to it. */
        int kicked = 1;
        if (n == 0 || n + 1 == kick_at) {
            PyObject *k = PyObject_CallNoArgs(self->kick);
            kicked = k != NULL;
            Py_XDECREF(k);
            if (kicked) {
                value = PyDict_GetItemWithError(dict, s_queued_bytes);
                kicked = value != NULL && PyLong_CheckExact(value);
                if (kicked) {
                    bytes = PyLong_AsLongLongAndOverflow(value, &overflow);
                    kicked = !overflow && !PyErr_Occurred();
                }
                if (!kicked && !PyErr_Occurred())
                    PyErr_SetString(PyExc_RuntimeError, "queued_bytes is not an int");
            }
        }
        PyObject *total = kicked ? PyLong_FromLongLong(bytes + size) : NULL;
        PyObject *r1 = NULL, *r2 = NULL;
        if (total != NULL && PyDict_SetItem(dict, s_queued_bytes, total) == 0 &&
            (r1 = PyObject_CallOneArg(queue_append, event)) != NULL &&
            (r2 = PyObject_CallOneArg(sizes_append, size_obj)) != NULL) {
            ok = 1;
            if (self->counter != NULL)  /* queued: counted before record() returns */
                (*self->counter)++;
        }
        Py_XDECREF(total);
        Py_XDECREF(r1);
        Py_XDECREF(r2);
    }
    else if (n >= 0) {
        PyObject *r = PyObject_CallFunctionObjArgs(self->overflow, event, size_obj, NULL);
        ok = r != NULL;
        Py_XDECREF(r);
    }
    Py_DECREF(queue);
    Py_DECREF(queue_append);
    Py_DECREF(sizes_append);
    return ok;
}

static PyObject *
enqueuer_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    EnqueuerObject *self = (EnqueuerObject *)op;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "a queued sink takes one event");
        return NULL;
    }
    PyObject *event = args[0];
    if (self->queue == NULL)  /* not synced yet */
        return enqueuer_fallback(self, event);
    long long size = enqueuer_size(self, event);
    if (size == -1)
        return NULL;
    if (size == -2)
        return enqueuer_fallback(self, event);
    if (self->last_size_obj == NULL || self->last_size != size) {
        PyObject *made = PyLong_FromLongLong(size);
        if (made == NULL)
            return NULL;
        Py_XSETREF(self->last_size_obj, made);
        self->last_size = size;
    }
    PyObject *dict = PyObject_GenericGetDict(self->sink, NULL);
    if (dict == NULL)
        return NULL;
    PyObject *size_obj = Py_NewRef(self->last_size_obj);
    PyObject *acquire = Py_NewRef(self->acquire);
    PyObject *release = Py_NewRef(self->release);
    PyObject *result = NULL;
    PyObject *got = PyObject_CallNoArgs(acquire);
    if (got != NULL) {
        Py_DECREF(got);
        int ok = enqueuer_locked(self, dict, event, size, size_obj);
        PyObject *released;
        if (ok) {
            released = PyObject_CallNoArgs(release);
        }
        else {  /* release, keeping the locked part's error */
#if PY_VERSION_HEX >= 0x030C0000
            PyObject *exc = PyErr_GetRaisedException();
            released = PyObject_CallNoArgs(release);
            if (released != NULL)
                PyErr_SetRaisedException(exc);
            else
                Py_XDECREF(exc);
#else
            PyObject *et, *exc, *tb;
            PyErr_Fetch(&et, &exc, &tb);
            released = PyObject_CallNoArgs(release);
            if (released != NULL) {
                PyErr_Restore(et, exc, tb);
            }
            else {
                Py_XDECREF(et);
                Py_XDECREF(exc);
                Py_XDECREF(tb);
            }
#endif
        }
        if (released != NULL) {
            Py_DECREF(released);
            if (ok == 1)
                result = Py_NewRef(Py_None);
            else if (ok == 2)
                result = enqueuer_fallback(self, event);
        }
    }
    Py_DECREF(acquire);
    Py_DECREF(release);
    Py_DECREF(size_obj);
    Py_DECREF(dict);
    return result;
}

/* sync(queue, sizes, lock, limit, max_bytes, kick_at): the sink's state, as it is now. */
static PyObject *
enqueuer_sync(EnqueuerObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "sync(queue, sizes, lock, limit, max_bytes, kick_at)");
        return NULL;
    }
    long long counts[3];
    for (int i = 0; i < 3; i++) {
        int overflow;
        if (!PyLong_Check(args[3 + i])) {
            PyErr_SetString(PyExc_TypeError, "sync: limit, max_bytes and kick_at are ints");
            return NULL;
        }
        counts[i] = PyLong_AsLongLongAndOverflow(args[3 + i], &overflow);
        if (overflow)
            counts[i] = overflow > 0 ? LLONG_MAX : LLONG_MIN;
        else if (counts[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    PyObject *queue_append = PyObject_GetAttr(args[0], s_append);
    PyObject *sizes_append = queue_append ? PyObject_GetAttr(args[1], s_append) : NULL;
    PyObject *acquire = sizes_append ? PyObject_GetAttr(args[2], s_acquire) : NULL;
    PyObject *release = acquire ? PyObject_GetAttr(args[2], s_release) : NULL;
    if (release == NULL) {
        Py_XDECREF(queue_append);
        Py_XDECREF(sizes_append);
        Py_XDECREF(acquire);
        return NULL;
    }
    Py_XSETREF(self->queue, Py_NewRef(args[0]));
    Py_XSETREF(self->queue_append, queue_append);
    Py_XSETREF(self->sizes_append, sizes_append);
    Py_XSETREF(self->acquire, acquire);
    Py_XSETREF(self->release, release);
    self->limit = counts[0];
    self->max_bytes = counts[1];
    self->kick_at = counts[2];
    Py_RETURN_NONE;
}

static void
enqueuer_uncount(EnqueuerObject *self)
{
    self->counter = NULL;
    if (self->count_buf.obj != NULL)
        PyBuffer_Release(&self->count_buf);
}

/* count_into(buffer or None): count each event queued here into the buffer's first 8
   bytes (aligned, writable), as QueuedSink.count_into says; None stops counting. */
static PyObject *
enqueuer_count_into(EnqueuerObject *self, PyObject *arg)
{
    if (arg == Py_None) {
        enqueuer_uncount(self);
        Py_RETURN_NONE;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (view.len < 8 || ((uintptr_t)view.buf % 8) != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError,
                        "count_into: the buffer must hold 8 bytes, aligned to 8");
        return NULL;
    }
    enqueuer_uncount(self);
    self->count_buf = view;
    self->counter = (unsigned long long *)view.buf;
    Py_RETURN_NONE;
}

static PyMethodDef enqueuer_methods[] = {
    {"sync", (PyCFunction)(void (*)(void))enqueuer_sync, METH_FASTCALL,
     "sync(queue, sizes, lock, limit, max_bytes, kick_at): the sink's state as it is now"},
    {"count_into", (PyCFunction)enqueuer_count_into, METH_O,
     "count_into(buffer or None): count each event queued into the buffer's first 8 bytes"},
    {NULL},
};

static int
enqueuer_traverse(EnqueuerObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->sink);
    Py_VISIT(self->fallback);
    Py_VISIT(self->value_size);
    Py_VISIT(self->free_types);
    Py_VISIT(self->kick);
    Py_VISIT(self->overflow);
    Py_VISIT(self->queue);
    Py_VISIT(self->queue_append);
    Py_VISIT(self->sizes_append);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    Py_VISIT(self->count_buf.obj);
    return 0;
}

static int
enqueuer_clear(EnqueuerObject *self)
{
    Py_CLEAR(self->sink);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->value_size);
    Py_CLEAR(self->free_types);
    Py_CLEAR(self->kick);
    Py_CLEAR(self->overflow);
    Py_CLEAR(self->queue);
    Py_CLEAR(self->queue_append);
    Py_CLEAR(self->sizes_append);
    Py_CLEAR(self->acquire);
    Py_CLEAR(self->release);
    Py_CLEAR(self->last_size_obj);
    enqueuer_uncount(self);
    return 0;
}

static void
enqueuer_dealloc(EnqueuerObject *self)
{
    PyObject_GC_UnTrack(self);
    enqueuer_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
enqueuer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"sink", "fallback", "value_size", "base_size", "per_key",
                             "free_types", "kick", "overflow", NULL};
    PyObject *sink, *fallback, *value_size, *free_types, *kick, *overflow;
    Py_ssize_t base_size, per_key;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOnnO!OO:Enqueuer", kwlist, &sink,
                                     &fallback, &value_size, &base_size, &per_key,
                                     &PyTuple_Type, &free_types, &kick, &overflow))
        return NULL;
    if (!PyCallable_Check(fallback) || !PyCallable_Check(value_size) ||
        !PyCallable_Check(kick) || !PyCallable_Check(overflow)) {
        PyErr_SetString(PyExc_TypeError,
                        "Enqueuer: fallback, value_size, kick and overflow must be callable");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(free_types); i++) {
        if (!PyType_Check(PyTuple_GET_ITEM(free_types, i))) {
            PyErr_SetString(PyExc_TypeError, "Enqueuer: free_types must be a tuple of classes");
            return NULL;
        }
    }
    if (base_size < 0 || per_key < 0) {
        PyErr_SetString(PyExc_ValueError, "Enqueuer: base_size and per_key must be >= 0");
        return NULL;
    }
    EnqueuerObject *self = (EnqueuerObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = enqueuer_vectorcall;
    self->sink = Py_NewRef(sink);
    self->fallback = Py_NewRef(fallback);
    self->value_size = Py_NewRef(value_size);
    self->base_size = base_size;
    self->per_key = per_key;
    self->free_types = Py_NewRef(free_types);
    self->kick = Py_NewRef(kick);
    self->overflow = Py_NewRef(overflow);
    return (PyObject *)self;
}

static PyObject *
enqueuer_repr(EnqueuerObject *self)
{
    return PyUnicode_FromFormat("<compiled enqueue of %R>", self->sink);
}

static PyObject *
enqueuer_get_self(EnqueuerObject *self, void *closure)
{
    return Py_NewRef(self->sink);
}

static PyGetSetDef enqueuer_getset[] = {
    {"__self__", (getter)enqueuer_get_self, NULL, "the sink this enqueues into"},
    {NULL},
};

static PyTypeObject EnqueuerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "eventbus._speedups.Enqueuer",
    .tp_basicsize = sizeof(EnqueuerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "QueuedSink.__call__'s compiled common case.",
    .tp_new = enqueuer_new,
    .tp_traverse = (traverseproc)enqueuer_traverse,
    .tp_clear = (inquiry)enqueuer_clear,
    .tp_dealloc = (destructor)enqueuer_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(EnqueuerObject, vectorcall),
    .tp_repr = (reprfunc)enqueuer_repr,
    .tp_getset = enqueuer_getset,
    .tp_methods = enqueuer_methods,
};

/* ------------------------------------------------------------------------------------ */

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "eventbus._speedups",
    .m_doc = "The compiled hot path of record() (optional; see eventbus/bus.py).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
#define INTERN(var, text)                                 \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return NULL;
    INTERN(s_data, "data");
    INTERN(s_timestamp, "timestamp");
    INTERN(s_context, "context");
    INTERN(s_value, "value");
    INTERN(s_queued_bytes, "queued_bytes");
    INTERN(s_append, "append");
    INTERN(s_acquire, "acquire");
    INTERN(s_release, "release");
#undef INTERN
    if ((s_empty_tuple = PyTuple_New(0)) == NULL)
        return NULL;
    if (PyType_Ready(&SpecType) < 0 || PyType_Ready(&ViewType) < 0 ||
        PyType_Ready(&RecorderType) < 0 || PyType_Ready(&PublisherType) < 0 ||
        PyType_Ready(&EnqueuerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&speedups_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Spec", (PyObject *)&SpecType) < 0 ||
        PyModule_AddObjectRef(m, "View", (PyObject *)&ViewType) < 0 ||
        PyModule_AddObjectRef(m, "Recorder", (PyObject *)&RecorderType) < 0 ||
        PyModule_AddObjectRef(m, "Publisher", (PyObject *)&PublisherType) < 0 ||
        PyModule_AddObjectRef(m, "Enqueuer", (PyObject *)&EnqueuerType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
