/* shmlimit.shm._native: the native atomic backend.
 *
 * NativeCells(buffer, size) wraps the first `size` bytes of a writable buffer
 * (the segment's mmap) and offers the same operations as the Python reference
 * (composites.py, and the atomics backend in atomics_cells.py): load, store,
 * fetch_add, cas on aligned unsigned 64-bit words, plus the hot path's
 * composites grab and try_grab.  All arithmetic
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
#include <time.h>
#include <string.h>
#include <limits.h>

/* The clock of Python's time.monotonic_ns, in ns: every deadline and stamp the package passes in
 * was read from it. */
static inline uint64_t
monotonic_ns(void)
{
    struct timespec ts;
#ifdef __APPLE__
    clock_gettime(CLOCK_UPTIME_RAW, &ts); /* the clock of Python's time.monotonic_ns there */
#else
    clock_gettime(CLOCK_MONOTONIC, &ts);
#endif
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ns (an instant on that clock, or a duration) as a timespec. */
static inline struct timespec
ns_timespec(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
    return ts;
}

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    char *base;
    Py_ssize_t size;
    int open;
    /* Waiters (see WAITER) run without the GIL: close() wakes them (`closing`, a futex word) and
     * waits until `busy`, the callers inside, is 0 before it lets the mapping go. */
    uint32_t closing;
    /* Bumped by wake_waiters() (the head skipped a range given back: giveback) and by close(): the
     * waiters of this process sleep on it, from the value they read before the step that chose
     * their sleep, so a wake between that step and the sleep is not missed. */
    uint32_t skips;
    int busy;
    unsigned long busy_gen;
    /* FED WAIT: the shared word fed waiters of this process sleep on (NULL: none made), woken by close() too */
    uint32_t *fed_word;
} NativeCells;

/* HANDED: the queued ticket the last fast-path call of this thread returned to Python (a recorded
 * Grabber's, a Gate's grab_within, an Acquirer's call or take, the slow path's take_tail), kept
 * until Python takes it back (cells.handed()).  A signal handler may raise at the interpreter's
 * check that ends the CALL, after the return and before the caller stores the value: the caller's
 * except clause then finds the ticket here and gives it back.  Written on the queued branch only:
 * a grant writes nothing. */
static _Thread_local struct {
    const NativeCells *cells;
    uint64_t ticket;
} handed;

/* `ticket` as an int, left in HANDED first for `cells` (queued, recorded: see HANDED). */
static PyObject *
hand_ticket(const NativeCells *cells, uint64_t ticket)
{
    handed.cells = cells;
    handed.ticket = ticket;
    return PyLong_FromUnsignedLongLong(ticket);
}

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

/* A method's arguments, as `kinds` spells them, one letter each: 'w' a word (its offset checked),
 * 'u' an unsigned 64-bit value, '.' one the caller reads itself.  The words land in `words` and
 * the values in `values`, each in order.  Every offset is checked before any value is read, and
 * all before the caller's first access; 0 with the exception set if any is bad or the cells are
 * closed. */
static int
parse_args(NativeCells *self, PyObject *const *args, Py_ssize_t n, const char *name, const char *kinds,
           uint64_t **words, uint64_t *values)
{
    Py_ssize_t want = (Py_ssize_t)strlen(kinds);
    if (!nargs(n, want, name) || !check_open(self))
        return 0;
    for (Py_ssize_t i = 0; i < want; i++)
        if (kinds[i] == 'w' && !(*words++ = word(self, args[i])))
            return 0;
    for (Py_ssize_t i = 0; i < want; i++)
        if (kinds[i] == 'u' && !u64(args[i], values++))
            return 0;
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

/* load_many(offsets) -> a tuple of the words at these offsets, each loaded as load() does (one
 * sequentially consistent load per word, not a snapshot of them together); every offset is checked
 * before any is read.  A scan of many words (the filler's look at every ticket record) in one call. */
static PyObject *
cells_load_many(NativeCells *self, PyObject *arg)
{
    if (!check_open(self))
        return NULL;
    if (!PyTuple_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "load_many: offsets must be a tuple of ints");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(arg);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!word(self, PyTuple_GET_ITEM(arg, i)))
            return NULL;
    PyObject *out = PyTuple_New(n);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t *w = word(self, PyTuple_GET_ITEM(arg, i));
        PyObject *v = PyLong_FromUnsignedLongLong(__atomic_load_n(w, __ATOMIC_SEQ_CST));
        if (!v) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
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

/* Tokens the queue may hold at most (TAIL - HEAD): far below 2**63, so that every signed
 * comparison of rovers holds whatever is queued (see MAX_QUEUE_TOKENS in config.py). */
#define MAX_QUEUE ((uint64_t)1 << 62)

/* The grab itself, on validated words: advance the tail by CAS unless that would queue more than
 * MAX_QUEUE tokens (then False, nothing touched); if the head covers the new tail, count `ops` in
 * the grants cell and return None, else return the ticket to wait for.  The head only grows, so a
 * depth measured against a head read before the CAS is never smaller than the true one. */
static PyObject *
do_grab(uint64_t *tail, uint64_t *head, uint64_t *grants, uint64_t amount, uint64_t ops)
{
    uint64_t t = __atomic_load_n(tail, __ATOMIC_SEQ_CST), ticket;
    for (;;) {
        ticket = t + amount;
        int64_t depth = (int64_t)(ticket - __atomic_load_n(head, __ATOMIC_SEQ_CST));
        if (depth > (int64_t)MAX_QUEUE)
            Py_RETURN_FALSE;
        if (__atomic_compare_exchange_n(tail, &t, ticket, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            break; /* on failure `t` holds the current tail: try again from there */
    }
    if ((int64_t)(__atomic_load_n(head, __ATOMIC_SEQ_CST) - ticket) < 0)
        return PyLong_FromUnsignedLongLong(ticket);
    __atomic_fetch_add(grants, ops, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* grab(tail, head, amount, grants, ops): advance the tail; None if the head covers the new tail
 * (and `ops` is added to the grants cell), False if the queue is full (nothing touched), else
 * the ticket to wait for. */
static PyObject *
cells_grab(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t *w[3], v[2]; /* tail, head, grants; amount, ops */
    if (!parse_args(self, args, n, "grab", "wwuwu", w, v))
        return NULL;
    return do_grab(w[0], w[1], w[2], v[0], v[1]);
}

/* grab_if(seq, expected, tail, head, amount, grants, ops): grab, unless the word `seq` no
 * longer holds `expected` (the config changed): then False, with nothing touched. */
#define GRAB_IF_ARGS "wuwwuwu" /* seq, expected, tail, head, amount, grants, ops */

static PyObject *
cells_grab_if(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t *w[4], v[3]; /* seq, tail, head, grants; expected, amount, ops */
    if (!parse_args(self, args, n, "grab_if", GRAB_IF_ARGS, w, v))
        return NULL;
    if (__atomic_load_n(w[0], __ATOMIC_SEQ_CST) != v[0])
        Py_RETURN_FALSE;
    return do_grab(w[1], w[2], w[3], v[1], v[2]);
}

/* try_grab(tail, head, amount, grants, ops): advance the tail by CAS only if the head covers
 * it; never queue.  False leaves every word unchanged. */
static PyObject *
cells_try_grab(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t *w[3], v[2];
    if (!parse_args(self, args, n, "try_grab", "wwuwu", w, v))
        return NULL;
    uint64_t *tail = w[0], *head = w[1], *grants = w[2], amount = v[0], ops = v[1];
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

/* Every object bound to cells (Grabber, Gate, KeyedTable, Waiter, FedWaiter) begins with these
 * fields: it holds a reference to its cells, so that the mapping outlives it, and refuses to run
 * once they are closed; bound_dealloc serves them all. */
#define BOUND_FIELDS \
    PyObject_HEAD    \
    NativeCells *cells;

typedef struct {
    BOUND_FIELDS
} Bound;

static void
bound_dealloc(Bound *self)
{
    Py_XDECREF(self->cells);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- ticket records: no queued ticket without one ---------------------------------------------
 *
 * A process slot's ticket records (layout.ticket_records): pairs of words TICKET, LEN, LEN being 0
 * when free, REC_BUSY while claimed.  A grab bound to records (`recorded`) queues only once it holds
 * one: before the CAS that takes a ticket it claims a free record (LEN 0 -> BUSY) and writes the
 * ticket it is about to take there; after the CAS it writes LEN, the exact tokens it took.  When
 * every record is in use it takes nothing and answers as an undecided call does (the slow path,
 * which naps and tries again).  So every ticket such a grab hands out is recorded; only a process
 * that dies between the CAS and the LEN store (a few instructions) leaves a BUSY record, which a
 * reap cannot tell from a claim whose CAS failed and leaves queued (see giveback). */
#define MAX_RECS 8
#define REC_BUSY ((uint64_t)1 << 63)

/* A free record claimed (LEN 0 -> BUSY), `ticket` written in its TICKET word: its LEN word, or
 * NULL when every one is in use. */
static uint64_t *
claim_record(uint64_t *const *recs, int nrec, uint64_t ticket)
{
    for (int i = 0; i < nrec; i++) {
        uint64_t zero = 0;
        if (__atomic_load_n(recs[i], __ATOMIC_SEQ_CST) == 0 &&
            __atomic_compare_exchange_n(recs[i], &zero, REC_BUSY, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            __atomic_store_n(recs[i] - 1, ticket, __ATOMIC_SEQ_CST);
            return recs[i];
        }
    }
    return NULL;
}

/* A granted ticket's record freed (LEN `amount` -> 0): the one whose TICKET word is `ticket`.  A
 * ticket ends where no other range ends (the tail never moves backwards), so that record is the
 * grab's own (Attachment.find_record); only its waiter frees it, so it cannot be reclaimed
 * between the two loads (a claim needs LEN 0). */
static void
free_record(uint64_t *const *recs, int nrec, uint64_t ticket, uint64_t amount)
{
    for (int i = 0; i < nrec; i++) {
        uint64_t len = amount;
        if (__atomic_load_n(recs[i] - 1, __ATOMIC_SEQ_CST) == ticket &&
            __atomic_compare_exchange_n(recs[i], &len, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return;
    }
}

/* A records argument: a tuple of ticket records' LEN offsets, at most `max` of them, into
 * recs[0..*nrec).  Each offset is checked as any word's and must leave room for its TICKET word just
 * before it (claim_record writes recs[i] - 1); all are checked before the caller touches any.
 * `what` names the call in the errors; 0 with the exception set otherwise. */
static int
records_from_tuple(NativeCells *self, PyObject *arg, const char *what, Py_ssize_t max, uint64_t **recs,
                   Py_ssize_t *nrec)
{
    if (!PyTuple_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "%s: records must be a tuple of LEN offsets", what);
        return 0;
    }
    if (PyTuple_GET_SIZE(arg) > max) {
        PyErr_Format(PyExc_TypeError, "%s: records must be a tuple of at most %zd LEN offsets", what, max);
        return 0;
    }
    *nrec = PyTuple_GET_SIZE(arg);
    for (Py_ssize_t i = 0; i < *nrec; i++) {
        if (!(recs[i] = word(self, PyTuple_GET_ITEM(arg, i))))
            return 0;
        if ((char *)recs[i] - self->base < 8) {
            PyErr_SetString(PyExc_IndexError, "a record's LEN offset must have its TICKET word before it");
            return 0;
        }
    }
    return 1;
}

/* close() began (leave_waiters): a grab bound to its process slot's records takes nothing from now
 * on, so none writes a record once the slot is left.  Such a grab runs whole under the GIL, and
 * close sets `closing` under it before it leaves the slot: one that loaded its fast path before and
 * calls it after is the only one that could come late, and it sees the flag. */
static inline int
records_left(NativeCells *c)
{
    return __atomic_load_n(&c->closing, __ATOMIC_SEQ_CST) != 0;
}

/* The records of a grab (Grabber, Gate): at most MAX_RECS, into the caller's array. */
static int
parse_records(NativeCells *self, PyObject *arg, const char *what, uint64_t **recs, int *nrec)
{
    Py_ssize_t n;
    if (!records_from_tuple(self, arg, what, MAX_RECS, recs, &n))
        return 0;
    *nrec = (int)n;
    return 1;
}

/* Every ticket record of a segment (clamp_words, a Waiter): any number of them, in a new PyMem
 * array the caller frees with PyMem_Free; NULL with the exception set otherwise. */
static uint64_t **
records_new(NativeCells *self, PyObject *arg, const char *what, Py_ssize_t *nrecs)
{
    Py_ssize_t n = PyTuple_Check(arg) ? PyTuple_GET_SIZE(arg) : 0;
    uint64_t **recs = PyMem_New(uint64_t *, n > 0 ? n : 1);
    if (!recs)
        return (uint64_t **)PyErr_NoMemory();
    if (!records_from_tuple(self, arg, what, n, recs, nrecs)) {
        PyMem_Free(recs);
        return NULL;
    }
    return recs;
}

/* What grab_recorded did: granted (ops counted), queued (a ticket, recorded), or nothing taken. */
#define GRAB_GRANTED 0
#define GRAB_QUEUED 1
#define GRAB_NONE 2 /* the queue is full, or it would queue and every record is in use */

/* The grab of a grab bound to records (see above), on validated words: GRAB_QUEUED with the ticket
 * in *ticket_out and its record's LEN word (holding `amount`) in *rec_out; else *rec_out is NULL.
 * The Acquirer (WAITER) runs it too, before its wait: one protocol for both. */
static int
grab_recorded(uint64_t *tail, uint64_t *head, uint64_t *grants, uint64_t amount, uint64_t ops,
              uint64_t *const *recs, int nrec, uint64_t *ticket_out, uint64_t **rec_out)
{
    uint64_t t = __atomic_load_n(tail, __ATOMIC_SEQ_CST), ticket;
    uint64_t *rec = NULL;
    *rec_out = NULL;
    for (;;) {
        ticket = t + amount;
        int64_t depth = (int64_t)(ticket - __atomic_load_n(head, __ATOMIC_SEQ_CST));
        if (depth > (int64_t)MAX_QUEUE)
            goto refuse;
        if (depth > 0) { /* it would queue: not without a record holding the ticket it takes */
            if (!rec && !(rec = claim_record(recs, nrec, ticket)))
                return GRAB_NONE;
            __atomic_store_n(rec - 1, ticket, __ATOMIC_SEQ_CST);
        }
        if (__atomic_compare_exchange_n(tail, &t, ticket, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            break; /* on failure `t` holds the current tail: try again from there */
    }
    if ((int64_t)(__atomic_load_n(head, __ATOMIC_SEQ_CST) - ticket) < 0) {
        /* uncovered now, so it was at the last read before the CAS (the head only grows): recorded.
         * Only a head moved back by a writer of the words finds no record here (covered at that
         * read): one is claimed now, or, none free, the taken ticket counts as granted (the tail
         * cannot be given back), never a NULL record stored to. */
        if (!rec && !(rec = claim_record(recs, nrec, ticket)))
            goto granted;
        __atomic_store_n(rec, amount, __ATOMIC_SEQ_CST);
        *ticket_out = ticket;
        *rec_out = rec;
        return GRAB_QUEUED;
    }
    if (rec)
        __atomic_store_n(rec, 0, __ATOMIC_SEQ_CST); /* covered after all: the record is free again */
granted:
    __atomic_fetch_add(grants, ops, __ATOMIC_SEQ_CST);
    return GRAB_GRANTED;
refuse:
    if (rec)
        __atomic_store_n(rec, 0, __ATOMIC_SEQ_CST);
    return GRAB_NONE;
}

/* do_grab for a grab bound to records: False, taking nothing, also when it would queue and every
 * record is in use. */
static PyObject *
do_grab_recorded(const NativeCells *cells, uint64_t *tail, uint64_t *head, uint64_t *grants, uint64_t amount,
                 uint64_t ops, uint64_t *const *recs, int nrec)
{
    uint64_t ticket, *rec;
    switch (grab_recorded(tail, head, grants, amount, ops, recs, nrec, &ticket, &rec)) {
    case GRAB_GRANTED:
        Py_RETURN_NONE;
    case GRAB_QUEUED:
        return hand_ticket(cells, ticket);
    default:
        Py_RETURN_FALSE;
    }
}

/* take_tail(tail, head, grants, records, expected, ticket, amount, ops): the slow path's take
 * (Bucket.take_within bound to records), one try of its CAS of the tail from `expected` to `ticket`
 * by the grab's record protocol, in one call: a record claimed (ticket written) before the CAS
 * when the head is short of `ticket`, LEN stored after it, the queued ticket left in HANDED.  So no
 * claim outlives the call, and no ticket it takes leaves it unrecorded or out of HANDED: a handler
 * raising as it returns finds the ticket there (the request's `end` gives it back).  Answers False
 * (the tail was no longer `expected`: nothing taken, the record freed again), 0 (it would queue
 * and every record is in use: nothing taken), None (covered: `ops` counted in `grants`, the record
 * freed), True (queued without a record: only on words that went back), else the LEN offset of the
 * record holding the queued ticket. */
static PyObject *
cells_take_tail(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t *w[3], v[4], *recs[MAX_RECS];
    int nrec;
    if (!nargs(n, 8, "take_tail") || !check_open(self))
        return NULL;
    for (int i = 0; i < 3; i++)
        if (!(w[i] = word(self, args[i])))
            return NULL;
    if (!parse_records(self, args[3], "take_tail", recs, &nrec))
        return NULL;
    for (int i = 0; i < 4; i++)
        if (!u64(args[4 + i], &v[i]))
            return NULL;
    uint64_t *tail = w[0], *head = w[1], *grants = w[2];
    uint64_t expected = v[0], ticket = v[1], amount = v[2], ops = v[3];
    uint64_t *rec = NULL;
    PyObject *off = NULL;
    if ((int64_t)(ticket - __atomic_load_n(head, __ATOMIC_SEQ_CST)) > 0) {
        if (!(rec = claim_record(recs, nrec, ticket)))
            return PyLong_FromLong(0);
        if (!(off = PyLong_FromSsize_t((char *)rec - self->base))) { /* before the CAS: nothing taken */
            __atomic_store_n(rec, 0, __ATOMIC_SEQ_CST);
            return NULL;
        }
    }
    if (!__atomic_compare_exchange_n(tail, &expected, ticket, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        if (rec)
            __atomic_store_n(rec, 0, __ATOMIC_SEQ_CST);
        Py_XDECREF(off);
        Py_RETURN_FALSE;
    }
    if ((int64_t)(__atomic_load_n(head, __ATOMIC_SEQ_CST) - ticket) >= 0) { /* covered: granted */
        if (rec)
            __atomic_store_n(rec, 0, __ATOMIC_SEQ_CST);
        __atomic_fetch_add(grants, ops, __ATOMIC_SEQ_CST);
        Py_XDECREF(off);
        Py_RETURN_NONE;
    }
    if (!rec) /* short now, not at the claim: the head went back (corrupt words) */
        Py_RETURN_TRUE;
    __atomic_store_n(rec, amount, __ATOMIC_SEQ_CST);
    handed.cells = self; /* still held: see HANDED */
    handed.ticket = ticket;
    return off;
}

/* What a Grabber and a Gate bind once, validated: their cells, and grab_if's words and values.
 * A Gate's struct begins with these fields, so bind_grab serves both. */
#define GRAB_FIELDS                           \
    BOUND_FIELDS                              \
    uint64_t *seq, *tail, *head, *grants;     \
    uint64_t expected, amount, ops;           \
    uint64_t *recs[MAX_RECS];                 \
    int nrec, recorded;

/* Grabber: grab_if with its arguments bound and validated once, called with none. */
typedef struct {
    GRAB_FIELDS
} Grabber;

/* A new object of `type` (a Grabber, or a Gate) bound to these cells and grab_if's arguments. */
static Grabber *
bind_grab(NativeCells *self, PyTypeObject *type, uint64_t *seq, uint64_t *tail, uint64_t *head, uint64_t *grants,
          uint64_t expected, uint64_t amount, uint64_t ops)
{
    Grabber *g = PyObject_New(Grabber, type);
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
    g->nrec = 0;
    g->recorded = 0;
    return g;
}

/* The slots every type of this module shares. */
#define NATIVE_TYPE(name, ctype, doc)                                                                  \
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmlimit.shm._native." name, .tp_basicsize = sizeof(ctype), \
    .tp_flags = Py_TPFLAGS_DEFAULT, .tp_doc = doc

static PyObject *
grabber_call(Grabber *self, PyObject *args, PyObject *kwds)
{
    if (!check_open(self->cells))
        return NULL;
    if (__atomic_load_n(self->seq, __ATOMIC_SEQ_CST) != self->expected)
        Py_RETURN_FALSE;
    if (self->recorded) {
        if (records_left(self->cells))
            Py_RETURN_FALSE; /* the slot is being left (close): taking nothing, the slow path refuses */
        return do_grab_recorded(self->cells, self->tail, self->head, self->grants, self->amount, self->ops,
                                self->recs, self->nrec);
    }
    return do_grab(self->tail, self->head, self->grants, self->amount, self->ops);
}

static PyTypeObject GrabberType = {
    NATIVE_TYPE("Grabber", Grabber, "grab_if with bound arguments: call it with none."),
    .tp_call = (ternaryfunc)grabber_call,
    .tp_dealloc = (destructor)bound_dealloc,
};

static PyObject *
cells_grabber(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t *w[4], v[3], *recs[MAX_RECS];
    int nrec = 0, recorded = n == 8;
    if (!parse_args(self, args, recorded ? 7 : n, "grabber", GRAB_IF_ARGS, w, v))
        return NULL;
    if (recorded && !parse_records(self, args[7], "grabber", recs, &nrec))
        return NULL;
    Grabber *g = bind_grab(self, &GrabberType, w[0], w[1], w[2], w[3], v[0], v[1], v[2]);
    if (g && recorded) {
        g->recorded = 1;
        g->nrec = nrec;
        memcpy(g->recs, recs, sizeof(recs[0]) * (size_t)nrec);
    }
    return (PyObject *)g;
}


/* ======================================================================================
 * KEYED TABLE: lookup + insert + exact eviction of per-key slots, and the GCRA step.
 *
 * The reference version of every step below is shmlimit/keyed/cells.py (built from the four
 * primitives); the two must stay step-for-step equivalent, and tests/test_keyed_table.py runs
 * the same property test against both.  Layout and protocol: shmlimit/keyed/layout.py and
 * docs/design.md ("Keyed limits").
 *
 * A slot is one 64-byte line: CTRL, D0, D1 (the key's 128-bit keyed digest), V0..V4 (the value
 * kind's words).  CTRL = state | owner pid << 8 | generation << 40.  The slot protocol knows
 * one thing about values: V0 is the expiry word -- a slot whose V0 <= now holds no information
 * and may be evicted (V0's top bit, DEAD, marks it evicted and keeps the value below it), and
 * the values V0 takes over a slot's whole life only ever increase, so a stale CAS on V0 can
 * never land on a later tenant.
 * ====================================================================================== */
#include <signal.h>
#include <errno.h>
#include <sched.h>
#include <time.h>

#define KS_EMPTY 0u
#define KS_BUSY 1u  /* claimed by owner; digest not yet valid */
#define KS_PEND 2u  /* digest valid; owner checking for a concurrent insert of the same key */
#define KS_LIVE 3u
#define KS_TOMB 4u
#define KT_DEAD (UINT64_C(1) << 63) /* V0's eviction flag; the value below it is kept */
#define KT_NEVER (-(INT64_C(1) << 62))
#define KT_FULL (KT_NEVER - 1)
#define KT_WORN (KT_NEVER - 4) /* keyed_cells.WORN: no slot but for its BASE (NEVER - 3: KT_ERROR) */
#define KT_MAX_WAIT (UINT64_C(1) << 60)
#define KT_KEY_MAX 4096
#define KT_TICK_SHIFT 4
/* A farther PEND of the same key whose live owner has not moved it for this long (ns) is stopped
 * (SIGSTOP, a frozen container) or was written by hand: the inserter that waits for it gives way
 * and answers KT_BUSY instead of waiting without end (keyed_cells.PEND_NS). */
#define KT_PEND_NS 200000000u

/* word offsets inside a slot line */
#define KW_CTRL 0
#define KW_D0 1
#define KW_D1 2
#define KW_V0 3
#define KW_V1 4
#define KW_BASE 5 /* the tenant's offset: V0 is stored plus BASE (keyed_cells.SlotTable) */
#define KW_DISP 6 /* V3 V4: the key's first bytes, for display only, when stored (store_keys) */
#define KT_BASE_MAX (UINT64_C(1) << 61) /* keyed_layout.BASE_MAX */
/* keyed_layout.MAX_TICKS: V0 less BASE is a key's TAT under this burst, whatever its price (its TAT
 * under its own TAU is that less MAX_TICKS - TAU: keyed_cells) */
#define KT_MAX_TICKS (UINT64_C(1) << 60)
#define KT_FLAG_EVICT 1u /* when a window is full, evict its least valuable key (keyed_cells) */
#define KT_FLAG_STORE_KEYS 2u
/* override entry: CTRL (state in its low byte: 0 empty, 1 live, 2 tomb, 3 claimed), D0 D1 */
#define KO_LINES 3 /* an override entry: CTRL D0 D1, then its banks A and B (keyed_layout) */
#define KO_EMPTY 0u
#define KO_LIVE 1u /* in CTRL's low byte; the rest is an owner and a tag (keyed_layout.o_ctrl) */
#define KT_DEFAULT_BACKUP_LINES 7 /* the default's bank B, lines after CFG_SEQ's */

static inline uint64_t kt_state(uint64_t c) { return c & 0xff; }
static inline uint64_t kt_pid(uint64_t c) { return (c >> 8) & 0xffffffffu; }
static inline uint64_t kt_gen(uint64_t c) { return c >> 40; }
static inline uint64_t kt_ctrl(uint64_t state, uint64_t pid, uint64_t gen)
{
    return state | (pid & 0xffffffffu) << 8 | (gen & 0xffffffu) << 40;
}

/* SipHash-2-4 with a 128-bit output (Aumasson & Bernstein), little-endian throughout. */
#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                                   \
    do {                                                                                           \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);                                  \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                                                     \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                                                     \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);                                  \
    } while (0)

static void
siphash128(const unsigned char *in, size_t len, uint64_t k0, uint64_t k1, uint64_t out[2])
{
    uint64_t v0 = UINT64_C(0x736f6d6570736575) ^ k0, v1 = UINT64_C(0x646f72616e646f6d) ^ k1;
    uint64_t v2 = UINT64_C(0x6c7967656e657261) ^ k0, v3 = UINT64_C(0x7465646279746573) ^ k1;
    v1 ^= 0xee;
    const unsigned char *end = in + len - (len % 8);
    for (; in != end; in += 8) {
        uint64_t m;
        memcpy(&m, in, 8); /* x86-64 and aarch64 Linux are little-endian */
        v3 ^= m; SIPROUND; SIPROUND; v0 ^= m;
    }
    uint64_t b = ((uint64_t)len) << 56;
    switch (len & 7) {
    case 7: b |= ((uint64_t)in[6]) << 48; /* fall through */
    case 6: b |= ((uint64_t)in[5]) << 40; /* fall through */
    case 5: b |= ((uint64_t)in[4]) << 32; /* fall through */
    case 4: b |= ((uint64_t)in[3]) << 24; /* fall through */
    case 3: b |= ((uint64_t)in[2]) << 16; /* fall through */
    case 2: b |= ((uint64_t)in[1]) << 8; /* fall through */
    case 1: b |= ((uint64_t)in[0]); break;
    case 0: break;
    }
    v3 ^= b; SIPROUND; SIPROUND; v0 ^= b;
    v2 ^= 0xee;
    SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    out[0] = v0 ^ v1 ^ v2 ^ v3;
    v1 ^= 0xdd;
    SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    out[1] = v0 ^ v1 ^ v2 ^ v3;
}

typedef struct {
    BOUND_FIELDS
    uint64_t *cfg;        /* CFG_SEQ, then the default's bank A; its bank B 7 lines on */
    uint64_t *ovr_live;   /* live overrides: the override table is probed only when nonzero */
    uint64_t *ovr;        /* override table: novr entries of KO_LINES lines */
    uint64_t *slots;      /* key slots: nslots lines */
    uint64_t *keys_live, *evicted, *refused, *grants, *cut;
    uint64_t novr, nslots, probe, k0, k1, pid, flags;
    /* 1: a window counter's slots (FIXED WINDOWS below), whose V0 less BASE is its own expiry; no
     * config, no overrides, no grants word (cfg, ovr_live, ovr and grants are NULL) */
    int windows;
} KeyedTable;

#define LINEW 8 /* words per line */

static inline uint64_t ld(uint64_t *w) { return __atomic_load_n(w, __ATOMIC_SEQ_CST); }
static inline void st(uint64_t *w, uint64_t v) { __atomic_store_n(w, v, __ATOMIC_SEQ_CST); }
static inline int cas(uint64_t *w, uint64_t e, uint64_t d)
{
    return __atomic_compare_exchange_n(w, &e, d, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
static inline void add(uint64_t *w, uint64_t d) { __atomic_fetch_add(w, d, __ATOMIC_SEQ_CST); }

static inline uint64_t
kt_now(void)
{
    return monotonic_ns() << KT_TICK_SHIFT;
}

/* Whether an inserter may still be running: keyed.cells.alive(owner, mine), called back -- the
 * package decides liveness in one place (shm.table: a zombie is dead, another PID namespace's
 * inserter counts as alive), and this is no copy of it.  It is asked only about a slot another
 * process left BUSY or PEND, never on a grant's path.  The call may release the GIL (it reads
 * /proc), so the cells are checked still open after it.  1 alive, 0 dead, -1 with an exception. */
static int
kt_alive(KeyedTable *t, uint64_t owner)
{
    static PyObject *alive = NULL;
    if (!alive) {
        PyObject *m = PyImport_ImportModule("shmlimit.keyed.cells");
        if (!m)
            return -1;
        alive = PyObject_GetAttrString(m, "alive");
        Py_DECREF(m);
        if (!alive)
            return -1;
    }
    PyObject *r = PyObject_CallFunction(alive, "KK", (unsigned long long)owner, (unsigned long long)t->pid);
    if (!r)
        return -1;
    int a = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (a >= 0 && !check_open(t->cells))
        return -1;
    return a;
}

static inline uint64_t *kt_slot(KeyedTable *t, uint64_t home, uint64_t i)
{
    uint64_t idx = home + i;
    if (idx >= t->nslots)
        idx -= t->nslots;
    return t->slots + idx * LINEW;
}

/* Yield the CPU with the GIL released (a thread of ours may be the inserter we wait for), then
 * check the cells are still open: another thread may have closed them, and with them the
 * mapping our pointers point into.  0 with ValueError set if so. */
static int
kt_yield(KeyedTable *t)
{
    Py_BEGIN_ALLOW_THREADS
    sched_yield();
    Py_END_ALLOW_THREADS
    return check_open(t->cells);
}

/* The checksum of one config bank (layout.config_sum over GEN and D0 D1 T TAU RATE PER BURST). */
static uint64_t
kt_bank_sum(uint64_t gen, const uint64_t v[7])
{
    uint64_t h = gen * UINT64_C(0x9E3779B97F4A7C15) + UINT64_C(0x632BE59BD9B4E019);
    for (int i = 0; i < 7; i++) {
        h ^= v[i];
        h *= UINT64_C(0xFF51AFD7ED558CCD);
        h ^= h >> 33;
    }
    return h;
}

/* What the i-th value word of a bank of generation gen is stored XOR-ed with (keyed_layout.bank_mask:
 * layout.config_sum over gen and the one value i). */
static uint64_t
kt_bank_mask(uint64_t gen, uint64_t i)
{
    uint64_t h = gen * UINT64_C(0x9E3779B97F4A7C15) + UINT64_C(0x632BE59BD9B4E019);
    h ^= i;
    h *= UINT64_C(0xFF51AFD7ED558CCD);
    h ^= h >> 33;
    return h;
}

/* One config bank, words 1..7 of `line`: RATE PER BURST T TAU (each stored masked by its generation),
 * GEN, SUM (keyed_gcra).  Its age (CFG_SEQ s1 less its generation, modulo 2**64), T and TAU; 0 if
 * its checksum does not hold. */
static int
kt_bank(const uint64_t *line, const uint64_t d[2], uint64_t s1, uint64_t *age, uint64_t *T, uint64_t *tau)
{
    uint64_t gen = ld((uint64_t *)line + 6);
    uint64_t rate = ld((uint64_t *)line + 1) ^ kt_bank_mask(gen, 0), per = ld((uint64_t *)line + 2) ^ kt_bank_mask(gen, 1);
    uint64_t burst = ld((uint64_t *)line + 3) ^ kt_bank_mask(gen, 2);
    uint64_t tt = ld((uint64_t *)line + 4) ^ kt_bank_mask(gen, 3), ta = ld((uint64_t *)line + 5) ^ kt_bank_mask(gen, 4);
    uint64_t sum = ld((uint64_t *)line + 7);
    const uint64_t v[7] = {d[0], d[1], tt, ta, rate, per, burst};
    if (sum != kt_bank_sum(gen, v))
        return 0;
    *age = s1 - gen;
    *T = tt;
    *tau = ta;
    return 1;
}

/* (T, TAU) of the valid bank of the newest generation of the two; 0 if neither is valid. */
static int
kt_pick(const uint64_t *a, const uint64_t *b, const uint64_t d[2], uint64_t s1, uint64_t *T, uint64_t *tau)
{
    uint64_t aa, at, atau, ba, bt, btau;
    int va = kt_bank(a, d, s1, &aa, &at, &atau), vb = kt_bank(b, d, s1, &ba, &bt, &btau);
    if (va && (!vb || aa <= ba)) {
        *T = at;
        *tau = atau;
    } else if (vb) {
        *T = bt;
        *tau = btau;
    }
    return va || vb;
}

/* SegmentError (shmlimit.errors) with msg; 0 */
static int
kt_segment_error(const char *msg)
{
    PyObject *m = PyImport_ImportModule("shmlimit.errors");
    PyObject *exc = m ? PyObject_GetAttrString(m, "SegmentError") : NULL;
    Py_XDECREF(m);
    if (exc) {
        PyErr_SetString(exc, msg);
        Py_DECREF(exc);
    }
    return 0;
}

/* The GCRA parameters for digest d under a consistent config: the key's override if it has one
 * (LIVE, its newest valid bank's T nonzero), else the default, each from its valid bank of the
 * newest generation (keyed_gcra: a config writer taken over writes at most one bank, older than
 * the newer writer's).  A writer holds CFG_SEQ odd for microseconds; one that stays odd for
 * KT_LOCK_NS (its writer died) is closed by CAS to the next even value, as keyed_gcra.ConfigLock
 * would take it over.  No valid bank under a CFG_SEQ that stayed even: SegmentError, 0.  *seq: the
 * CFG_SEQ they were read under; *dflt: 1 if they are the default's. */
#define KT_LOCK_NS 200000000u
static int
kt_params(KeyedTable *t, const uint64_t d[2], uint64_t *T, uint64_t *tau, uint64_t *seq, int *dflt)
{
    static const uint64_t none[2] = {0, 0};
    uint64_t seen = 0, since = 0;
    for (;;) {
        uint64_t s1 = ld(t->cfg);
        if (s1 & 1) {
            uint64_t now = kt_now() >> KT_TICK_SHIFT;
            if (s1 != seen) {
                seen = s1;
                since = now;
            } else if (now - since > KT_LOCK_NS) {
                cas(t->cfg, s1, s1 + 1);
            }
            if (!kt_yield(t))
                return 0;
            continue;
        }
        uint64_t tt = 0, ta = 0;
        int found = 0, corrupt = 0;
        if (t->novr && ld(t->ovr_live)) {
            uint64_t home = (uint64_t)(((unsigned __int128)d[1] * t->novr) >> 64);
            uint64_t lim = t->probe < t->novr ? t->probe : t->novr;
            for (uint64_t i = 0; i < lim; i++) {
                uint64_t idx = home + i;
                if (idx >= t->novr)
                    idx -= t->novr;
                uint64_t *e = t->ovr + idx * KO_LINES * LINEW;
                uint64_t c = ld(e);
                if (c == KO_EMPTY)
                    break;
                if ((c & 0xFF) == KO_LIVE && ld(e + 1) == d[0] && ld(e + 2) == d[1]) {
                    corrupt = !kt_pick(e + LINEW, e + 2 * LINEW, d, s1, &tt, &ta);
                    found = !corrupt && tt != 0; /* T == 0: the override was removed */
                    break;
                }
            }
        }
        if (!found && !corrupt)
            corrupt = !kt_pick(t->cfg, t->cfg + KT_DEFAULT_BACKUP_LINES * LINEW, none, s1, &tt, &ta);
        if (ld(t->cfg) == s1) {
            if (corrupt)
                return kt_segment_error("keyed segment is corrupt: no copy of its config passes its checksum");
            *T = tt ? tt : 1;
            *tau = ta < KT_MAX_TICKS ? ta : KT_MAX_TICKS; /* a segment written by hand: a smaller burst */
            *seq = s1;
            *dflt = !found;
            return 1;
        }
    }
}

/* Find the LIVE slot of digest d (V0 not DEAD); its CTRL in *ctrl.  NULL if absent. */
static uint64_t *
kt_find(KeyedTable *t, const uint64_t d[2], uint64_t home, uint64_t *ctrl)
{
    for (uint64_t i = 0; i < t->probe; i++) {
        uint64_t *s = kt_slot(t, home, i);
        uint64_t c = ld(s + KW_CTRL);
        uint64_t state = kt_state(c);
        if (state == KS_EMPTY)
            return NULL; /* the end of the chain: no key is ever placed beyond an empty slot */
        if (state == KS_LIVE && ld(s + KW_D0) == d[0] && ld(s + KW_D1) == d[1] && !(ld(s + KW_V0) & KT_DEAD)) {
            *ctrl = c;
            return s;
        }
    }
    return NULL;
}

/* A GCRA key's TAT under its own burst, from V0 less BASE (v) and slack = MAX_TICKS - TAU; 0 when
 * it lies before the clock's zero, where the reference's is negative: either is below every now.
 * (It does after a cut of the burst while the clock reads less than the old one: CLOCK_MONOTONIC
 * counts from boot.  Taken modulo 2**64 it lay for ever in the future.) */
static inline uint64_t
kt_tat(uint64_t v, uint64_t slack)
{
    return v > slack ? v - slack : 0;
}

/* When slot s's key (value v, V0 less BASE, just loaded) expires: its TAT under its own price, read
 * after v (keyed_cells.KeyedTable.expiry).  0 with an exception set on an error. */
static int
kt_expiry(KeyedTable *t, uint64_t *s, uint64_t v, uint64_t *at)
{
    uint64_t d[2] = {ld(s + KW_D0), ld(s + KW_D1)}, T, tau, seq;
    int dflt;
    if (!kt_params(t, d, &T, &tau, &seq, &dflt))
        return 0;
    *at = kt_tat(v, KT_MAX_TICKS - tau);
    return 1;
}

/* Whether a slot whose last word was floor (DEAD or not) would lift the BASE of a tenant whose values
 * are all at least low past KT_BASE_MAX: such a slot is passed by (keyed_cells._worn). */
static inline int
kt_worn(uint64_t floor, uint64_t low)
{
    floor &= ~KT_DEAD;
    return floor >= low && floor - low >= KT_BASE_MAX;
}

/* Insert digest d (absent when we looked) with its first grant already in its values: V0 =
 * v0 (the TAT after the grant, as V0 holds it: >= low, the least value the key ever takes), stored plus the BASE that lifts it above every word the
 * slot held before (keyed_cells.SlotTable.insert), V1 = v1.  Returns the slot with *ctrl its LIVE
 * word when we published it (the grant is made), *ctrl 0 when the caller must look again (another
 * inserter or evictor won a race), or NULL when the window has no free or expired slot and
 * eviction is off (the table is full there); NULL with *err 3 when its only slots to be had would
 * lift BASE past KT_BASE_MAX (kt_worn: such a slot is passed by for the next); NULL with *err 1 on
 * an error (set), with *err 2 when a farther PEND of the same key stayed unchanged under a live
 * owner for KT_PEND_NS (we gave way: nothing of ours is left). */
static uint64_t *
kt_insert(KeyedTable *t, const uint64_t d[2], uint64_t home, uint64_t now, uint64_t v0, uint64_t low,
          uint64_t v1, const uint64_t disp[2], uint64_t seq, uint64_t slack, uint64_t *ctrl, int *err)
{
    *ctrl = 0;
    *err = 0;
    uint64_t *cand, cc, pos, cv;
    uint64_t *victim, vc, vpos, vv, least;
    int worn;
    /* seq, slack: the default's price as the caller read it (slack 0: it did not).  It judges every
     * slot's expiry if, after the scan (after every V0 was loaded), CFG_SEQ still holds seq and no
     * override is live: the price of each key when its V0 was loaded, as kt_expiry would read it */
    int quick = slack != 0;
scan:
    cand = NULL; cc = 0; pos = 0; cv = 0;
    victim = NULL; vc = 0; vpos = 0; vv = 0; least = 0; worn = 0;
    for (uint64_t i = 0; i < t->probe; i++) {
        uint64_t *s = kt_slot(t, home, i);
        uint64_t c = ld(s + KW_CTRL);
        uint64_t state = kt_state(c);
        if (state == KS_LIVE && ld(s + KW_D0) == d[0] && ld(s + KW_D1) == d[1] && !(ld(s + KW_V0) & KT_DEAD))
            return s; /* inserted meanwhile: *ctrl 0 makes the caller look it up again */
        if (cand) {
            if (state == KS_EMPTY)
                break;
            continue; /* keep scanning for the key itself */
        }
        if (state == KS_LIVE) {
            uint64_t base = ld(s + KW_BASE), v = ld(s + KW_V0), at = 0;
            if (ld(s + KW_CTRL) != c)
                return s; /* it changed tenant while we read it: look again */
            if (t->windows) /* a window counter's V0 is its own expiry (keyed.windows); below
                               * BASE (forged) it is negative to the reference: expired */
                at = v >= base ? v - base : 0;
            else if (quick)
                at = kt_tat(v - base, slack);
            else if (!(v & KT_DEAD) && !kt_expiry(t, s, v - base, &at)) {
                *err = 1;
                return NULL;
            }
            if (v & KT_DEAD || at <= now) {
                if (kt_worn(v, low))
                    worn = 1;
                else {
                    cand = s; cc = c; pos = i; cv = v;
                }
            } else if ((t->flags & KT_FLAG_EVICT) && (!victim || v - base < least)) {
                if (kt_worn(v, low))
                    worn = 1;
                else {
                    victim = s; vc = c; vpos = i; vv = v; least = v - base;
                }
            }
        } else {
            /* EMPTY, TOMB, or BUSY / PEND: a candidate if its inserter is dead -- unless its floor
             * would lift BASE too far */
            int a = 0;
            if (state != KS_EMPTY && state != KS_TOMB && (a = kt_alive(t, kt_pid(c))) < 0) {
                *err = 1;
                return NULL;
            }
            if (!a) {
                if (kt_worn(ld(s + KW_V0), low))
                    worn = 1;
                else {
                    cand = s; cc = c; pos = i;
                }
            }
        }
        if (state == KS_EMPTY)
            break;
    }
    if (quick && (ld(t->cfg) != seq || (t->novr && ld(t->ovr_live)))) {
        quick = 0; /* a price changed, or some key has its own: each slot's, read after its V0 */
        goto scan;
    }
    int limited = 0;
    if (!cand) {
        /* full: the least valuable live key gives up its slot; *err 3 (WORN): a slot could be
         * had but for its BASE */
        if (!victim) {
            *err = worn ? 3 : 0;
            return NULL;
        }
        cand = victim; cc = vc; pos = vpos; cv = vv;
        limited = 1;
    }
    uint64_t state = kt_state(cc), gen = kt_gen(cc) + 1;
    if (state == KS_LIVE && !(cv & KT_DEAD) && !cas(cand + KW_V0, cv, cv | KT_DEAD))
        return cand; /* it was used meanwhile: look again */
    uint64_t mine = kt_ctrl(KS_BUSY, t->pid, gen);
    if (!cas(cand + KW_CTRL, cc, mine))
        return cand; /* another inserter took it: retry */
    if (state == KS_LIVE) {
        __atomic_fetch_sub(t->keys_live, 1, __ATOMIC_SEQ_CST);
        add(t->evicted, 1);
        if (limited)
            add(t->cut, 1);
    }
    st(cand + KW_D0, d[0]);
    st(cand + KW_D1, d[1]);
    st(cand + KW_V1, v1);
    for (int k = 0; k < 2; k++)
        st(cand + KW_DISP + k, disp[k]);
    /* BASE lifts every stored word of the new tenant (its values are >= low) above the slot's
     * floor, the last word it held; the values themselves start from the clock, so a new key
     * never starts from an evicted key's or a dead inserter's state (keyed_cells.SlotTable) */
    uint64_t floor = ld(cand + KW_V0) & ~KT_DEAD;
    if (kt_worn(floor, low)) { /* a floor the scan did not see (written by hand): passed by next */
        st(cand + KW_V0, floor | KT_DEAD);
        cas(cand + KW_CTRL, mine, kt_ctrl(KS_TOMB, 0, gen));
        return cand;
    }
    uint64_t base = floor >= low ? floor + 1 - low : 0;
    st(cand + KW_BASE, base);
    st(cand + KW_V0, v0 + base);
    uint64_t pend = kt_ctrl(KS_PEND, t->pid, gen);
    if (!cas(cand + KW_CTRL, mine, pend))
        return cand; /* taken for dead */
    /* a concurrent insert of the same key: the later PEND always sees the earlier one */
    for (uint64_t i = 0; i < t->probe; i++) {
        if (i == pos)
            continue;
        uint64_t *s = kt_slot(t, home, i);
        uint64_t seen = 0, since = 0;
        for (;;) {
            uint64_t c = ld(s + KW_CTRL), st8 = kt_state(c);
            if (st8 == KS_EMPTY)
                goto publish;
            if ((st8 != KS_LIVE && st8 != KS_PEND) || ld(s + KW_D0) != d[0] || ld(s + KW_D1) != d[1])
                break;
            if (st8 == KS_LIVE) {
                if (ld(s + KW_V0) & KT_DEAD)
                    break;
                goto abort;
            }
            int a = kt_alive(t, kt_pid(c));
            if (a < 0) {
                *err = 1;
                if (!t->cells->open)
                    return NULL; /* unmapped under us: nothing to write to */
                goto abort;      /* nothing of ours left behind */
            }
            if (!a) { /* (its slot may be worn out) */
                cas(s + KW_CTRL, c, kt_ctrl(KS_TOMB, 0, kt_gen(c)));
                continue;
            }
            if (i < pos) { /* PEND nearer the home slot wins: ours gives way */
                st(cand + KW_V0, floor | KT_DEAD); /* never published: the floor is enough */
                cas(cand + KW_CTRL, pend, kt_ctrl(KS_TOMB, 0, gen));
                /* wait, holding nothing, until it moves (its owner publishes within microseconds),
                 * but at most KT_PEND_NS: an owner that never runs again would have every insert of
                 * the key give way and try again without end (keyed_cells._await_move) */
                uint64_t from = kt_now() >> KT_TICK_SHIFT;
                while (ld(s + KW_CTRL) == c) {
                    if ((kt_now() >> KT_TICK_SHIFT) - from > KT_PEND_NS) {
                        *err = 2;
                        return NULL;
                    }
                    if (!kt_yield(t)) {
                        *err = 1;
                        return NULL;
                    }
                }
                return cand;
            }
            /* it will see ours and give way -- unless its owner never runs again: bounded */
            uint64_t t_ns = kt_now() >> KT_TICK_SHIFT;
            if (c != seen) {
                seen = c;
                since = t_ns;
            } else if (t_ns - since > KT_PEND_NS) {
                *err = 2;
                st(cand + KW_V0, floor | KT_DEAD); /* never published: the floor is enough */
                cas(cand + KW_CTRL, pend, kt_ctrl(KS_TOMB, 0, gen));
                return NULL;
            }
            if (!kt_yield(t)) {
                *err = 1;
                return NULL;
            }
        }
    }
publish:
    if (!cas(cand + KW_CTRL, pend, kt_ctrl(KS_LIVE, 0, gen)))
        return cand;
    add(t->keys_live, 1);
    *ctrl = kt_ctrl(KS_LIVE, 0, gen);
    return cand;
abort:
    st(cand + KW_V0, floor | KT_DEAD); /* never published: the floor is enough */
    cas(cand + KW_CTRL, pend, kt_ctrl(KS_TOMB, 0, gen));
    return cand;
}

static int
kt_key(PyObject *key, const char **buf, Py_ssize_t *len)
{
    if (PyUnicode_Check(key)) {
        *buf = PyUnicode_AsUTF8AndSize(key, len);
        if (!*buf) { /* a lone surrogate: protocol.py's NOT_UTF8, word for word */
            if (PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
                PyErr_Clear();
                PyErr_SetString(PyExc_ValueError,
                                "key must be bytes or a str encodable as UTF-8 (no lone surrogate)");
            }
            return 0;
        }
    } else if (PyBytes_Check(key)) {
        *buf = PyBytes_AS_STRING(key);
        *len = PyBytes_GET_SIZE(key);
    } else {
        PyErr_Format(PyExc_TypeError, "key must be a str or bytes, not %.100s", Py_TYPE(key)->tp_name);
        return 0;
    }
    if (*len > KT_KEY_MAX) {
        PyErr_Format(PyExc_ValueError, "key must be at most %d bytes (UTF-8), got %zd", KT_KEY_MAX, *len);
        return 0;
    }
    return 1;
}

/* V3 V4 of a key stored for display (keyed_cells.display_words): its length + 1 (at most 255),
 * then its first 15 bytes. */
static void
kt_display(const char *buf, Py_ssize_t len, uint64_t disp[2])
{
    unsigned char b[16] = {0};
    size_t k = len > 15 ? 15 : (size_t)len;
    b[0] = (unsigned char)((len > 254 ? 254 : len) + 1);
    memcpy(b + 1, buf, k);
    memcpy(disp, b, 16);
}

/* The keyed composite: find or insert key's slot, then one GCRA step.  Returns the wait in ticks
 * (>= 0: taken -- or, peeking (mw < 0), what a take would wait), KT_REFUSED (the wait exceeds mw;
 * nothing written), KT_NEVER (n above the burst), KT_FULL (no slot for a new key), KT_BUSY (a
 * stalled insert of the same key by a live process: nothing taken); KT_ERROR with an exception set. */
#define KT_REFUSED (-1)
#define KT_BUSY (KT_NEVER - 2) /* another live process's insert of this key has not moved for KT_PEND_NS */
#define KT_ERROR (KT_NEVER - 3)
/* What a take wrote, for its undo: the slot's index, its CTRL, the TAT set, the cost. */
static void
kt_taken(KeyedTable *t, uint64_t *taken, uint64_t *s, uint64_t tat, uint64_t cost)
{
    taken[0] = (uint64_t)(s - t->slots) / LINEW;
    taken[1] = ld(s + KW_CTRL);
    taken[2] = tat;
    taken[3] = cost;
}

static int64_t
kt_step(KeyedTable *t, PyObject *key, PyObject *nobj, long long mw, int own_clock, uint64_t now, uint64_t *taken)
{
    if (!check_open(t->cells))
        return KT_ERROR;
    const char *buf;
    Py_ssize_t len;
    if (!kt_key(key, &buf, &len))
        return KT_ERROR;
    if (PyBool_Check(nobj) || !PyLong_Check(nobj)) {
        PyErr_Format(PyExc_TypeError, "n must be a positive int (ops), not %.100s", Py_TYPE(nobj)->tp_name);
        return KT_ERROR;
    }
    long long n = PyLong_AsLongLong(nobj);
    if (n == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        n = LLONG_MAX;
    }
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "n must be a positive int (ops), got %lld", n);
        return KT_ERROR;
    }
    /* A clock read here may go stale while this thread is preempted: keys inserted meanwhile by
     * others look in use against it.  Before refusing a new key for a full table it is read once
     * more (a later `now` only ever makes a grant later, never earlier). */
    int reread = 0;
    if (own_clock)
        now = kt_now();
    uint64_t d[2], T, tau, seq;
    int dflt;
    siphash128((const unsigned char *)buf, (size_t)len, t->k0, t->k1, d);
    if (!kt_params(t, d, &T, &tau, &seq, &dflt))
        return KT_ERROR;
    if ((uint64_t)n > tau / T) /* more than the burst: never grantable */
        return KT_NEVER;
    uint64_t cost = (uint64_t)n * T;
    uint64_t slack = KT_MAX_TICKS - tau; /* V0 less BASE is the TAT under a burst of MAX_TICKS */
    uint64_t maxw = mw < 0 ? 0 : ((uint64_t)mw > KT_MAX_WAIT ? KT_MAX_WAIT : (uint64_t)mw);
    uint64_t home = (uint64_t)(((unsigned __int128)d[0] * t->nslots) >> 64);
    uint64_t disp[2] = {0, 0};
    int displayed = 0;
    for (;;) {
        uint64_t c, *s = kt_find(t, d, home, &c);
        if (!s) {
            if (mw < 0)
                return 0; /* absent: a full bucket */
            if (!displayed && (t->flags & KT_FLAG_STORE_KEYS)) {
                kt_display(buf, len, disp);
                displayed = 1;
            }
            /* a new key's bucket is full: n <= burst is granted at once, by the insert itself */
            int err;
            s = kt_insert(t, d, home, now, now + cost + slack, now + slack, (uint64_t)n, disp, seq,
                          dflt ? slack : 0, &c, &err);
            if (err == 1 || err == 2)
                return err == 2 ? KT_BUSY : KT_ERROR;
            if (!s) { /* full, or worn (err 3): refused as full */
                if (own_clock && !reread) {
                    reread = 1;
                    uint64_t later = kt_now();
                    if (later > now) {
                        now = later;
                        continue;
                    }
                }
                add(t->refused, 1);
                return KT_FULL;
            }
            if (c) {
                add(t->grants, (uint64_t)n);
                if (taken) /* BASE is the tenant's, fixed while it holds the slot */
                    kt_taken(t, taken, s, now + cost + slack + ld(s + KW_BASE), cost);
                return 0;
            }
            if (!kt_yield(t)) /* lost a race (often to an insert of the same key): let it finish */
                return KT_ERROR;
            continue;
        }
        for (;;) {
            uint64_t off = ld(s + KW_BASE), raw = ld(s + KW_V0);
            if (raw & KT_DEAD || ld(s + KW_CTRL) != c)
                break; /* evicted or reused: look again */
            uint64_t tat = kt_tat(raw - off, slack);
            uint64_t base = tat > now ? tat : now;
            uint64_t wait = base + cost - now; /* > 0 */
            wait = wait > tau ? wait - tau : 0;
            if (mw < 0)
                return (int64_t)wait;
            if (wait > maxw)
                return KT_REFUSED;
            if (cas(s + KW_V0, raw, base + cost + slack + off)) {
                add(s + KW_V1, (uint64_t)n);
                add(t->grants, (uint64_t)n);
                if (taken)
                    kt_taken(t, taken, s, base + cost + slack + off, cost);
                return (int64_t)wait;
            }
        }
    }
}

/* The `now` argument of acquire and take (args[3], ticks): 1 when absent or None (the step reads its
 * own clock), else 0 with *now set -- any tick count, 0 included (a clock that starts at 0; it once
 * meant "none" and was refused, where the reference serves it); -1 with an exception set. */
static int
kt_own_clock(PyObject *const *args, Py_ssize_t n, uint64_t *now)
{
    if (n < 4 || args[3] == Py_None)
        return 1;
    return u64(args[3], now) ? 0 : -1;
}

/* acquire(key, n, max_wait, now=None) -> int: see keyed_cells.KeyedTable.acquire. */
static PyObject *
kt_acquire(KeyedTable *t, PyObject *const *args, Py_ssize_t nargs_)
{
    if (nargs_ < 3 || nargs_ > 4) {
        PyErr_SetString(PyExc_TypeError, "acquire(key, n, max_wait, now=None)");
        return NULL;
    }
    long long mw = PyLong_AsLongLong(args[2]); /* ticks; < 0: peek (take nothing, insert nothing) */
    if (mw == -1 && PyErr_Occurred())
        return NULL;
    uint64_t now = 0;
    int own = kt_own_clock(args, nargs_, &now);
    if (own < 0)
        return NULL;
    int64_t r = kt_step(t, args[0], args[1], mw, own, now, NULL);
    if (r == KT_ERROR)
        return NULL;
    return PyLong_FromLongLong(r);
}

/* take(key, n, max_wait, now=None) -> acquire's answer, and when taken (>= 0) what the undo needs:
 * (wait, slot, ctrl, tat, cost); a refusal is acquire's code (an int < 0).  Never peeks. */
static PyObject *
kt_take(KeyedTable *t, PyObject *const *args, Py_ssize_t nargs_)
{
    if (nargs_ < 3 || nargs_ > 4) {
        PyErr_SetString(PyExc_TypeError, "take(key, n, max_wait, now=None)");
        return NULL;
    }
    long long mw = PyLong_AsLongLong(args[2]);
    if (mw == -1 && PyErr_Occurred())
        return NULL;
    if (mw < 0) {
        PyErr_SetString(PyExc_ValueError, "take: max_wait must be >= 0 ticks (a peek is acquire's)");
        return NULL;
    }
    uint64_t now = 0, taken[4];
    int own = kt_own_clock(args, nargs_, &now);
    if (own < 0)
        return NULL;
    int64_t r = kt_step(t, args[0], args[1], mw, own, now, taken);
    if (r == KT_ERROR)
        return NULL;
    if (r < 0)
        return PyLong_FromLongLong(r);
    return Py_BuildValue("(LKKKK)", (long long)r, (unsigned long long)taken[0], (unsigned long long)taken[1],
                         (unsigned long long)taken[2], (unsigned long long)taken[3]);
}

/* undo(slot, ctrl, tat, cost, n) -> bool: give a take back, exactly, if no one took the key since
 * (its TAT still the one the take set, its slot still the take's tenant): the TAT goes back to
 * where the take found it (max(TAT, now) then, which serves every later call as the TAT before
 * it did) and the counts lose n.  False changes nothing: the take stays spent (time lost, never
 * an extra grant; handing it back behind a later take would let that one's successor in early).
 * A later tenant of the slot never holds `tat` (its values start above the instant the take's
 * TAT had expired), so a stale undo never lands on it. */
static PyObject *
kt_undo(KeyedTable *t, PyObject *const *args, Py_ssize_t n)
{
    uint64_t v[5];
    if (!nargs(n, 5, "undo") || !check_open(t->cells))
        return NULL;
    for (int i = 0; i < 5; i++)
        if (!u64(args[i], &v[i]))
            return NULL;
    if (v[0] >= t->nslots || v[3] > v[2] || !v[3]) {
        PyErr_SetString(PyExc_ValueError, "undo: slot must be below the table's slots, 0 < cost <= tat");
        return NULL;
    }
    uint64_t *s = t->slots + v[0] * LINEW;
    if (ld(s + KW_CTRL) != v[1] || !cas(s + KW_V0, v[2], v[2] - v[3]))
        Py_RETURN_FALSE;
    add(s + KW_V1, (uint64_t)0 - v[4]);
    add(t->grants, (uint64_t)0 - v[4]);
    Py_RETURN_TRUE;
}

/* try_acquire(key, n=1) -> bool: the hot path, one call from Python to the answer. */
static PyObject *
kt_try_acquire(KeyedTable *t, PyObject *const *args, Py_ssize_t nargs_)
{
    static PyObject *one = NULL;
    if (!one && !(one = PyLong_FromLong(1)))
        return NULL;
    if (nargs_ < 1 || nargs_ > 2) {
        PyErr_SetString(PyExc_TypeError, "try_acquire(key, n=1)");
        return NULL;
    }
    int64_t r = kt_step(t, args[0], nargs_ == 2 ? args[1] : one, 0, 1, 0, NULL);
    if (r == KT_ERROR)
        return NULL;
    if (r >= 0)
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

/* rebind(grants, pid): after fork, count this process's grants in its own word, insert as itself. */
static PyObject *
kt_rebind(KeyedTable *t, PyObject *const *args, Py_ssize_t n)
{
    uint64_t g, pid;
    if (!nargs(n, 2, "rebind") || !check_open(t->cells) || !u64(args[0], &g) || !u64(args[1], &pid))
        return NULL;
    if (g % 8 || g > (uint64_t)t->cells->size - 8) {
        PyErr_SetString(PyExc_IndexError, "rebind: the grants word lies outside the mapping");
        return NULL;
    }
    t->grants = (uint64_t *)(t->cells->base + g);
    t->pid = pid;
    Py_RETURN_NONE;
}

static PyObject *
kt_digest(KeyedTable *t, PyObject *key)
{
    const char *buf;
    Py_ssize_t len;
    if (!kt_key(key, &buf, &len))
        return NULL;
    uint64_t d[2];
    siphash128((const unsigned char *)buf, (size_t)len, t->k0, t->k1, d);
    return Py_BuildValue("(KK)", (unsigned long long)d[0], (unsigned long long)d[1]);
}

static PyMethodDef kt_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))kt_acquire, METH_FASTCALL,
     "acquire(key, n, max_wait_ticks, now_ticks=None) -> wait ticks (>= 0, taken), or a refusal code (< 0)"},
    {"try_acquire", (PyCFunction)(void (*)(void))kt_try_acquire, METH_FASTCALL,
     "try_acquire(key, n=1) -> True if n ops were taken now for key; False changes nothing"},
    {"take", (PyCFunction)(void (*)(void))kt_take, METH_FASTCALL,
     "take(key, n, max_wait_ticks, now_ticks=None) -> (wait, slot, ctrl, tat, cost) when taken, else acquire's code"},
    {"undo", (PyCFunction)(void (*)(void))kt_undo, METH_FASTCALL,
     "undo(slot, ctrl, tat, cost, n) -> True if a take no one followed was given back exactly"},
    {"rebind", (PyCFunction)(void (*)(void))kt_rebind, METH_FASTCALL, "rebind(grants_offset, pid)"},
    {"digest", (PyCFunction)kt_digest, METH_O, "digest(key) -> (d0, d1), the key's keyed 128-bit digest"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject KeyedTableType = {
    NATIVE_TYPE("KeyedTable", KeyedTable,
                "The keyed slot table's lookup, insert, eviction and GCRA step (see keyed_cells.py)."),
    .tp_methods = kt_methods,
    .tp_dealloc = (destructor)bound_dealloc,
};

/* keyed_table(cfg, ovr_live, ovr, novr, slots, nslots, probe, k0, k1, keys_live, evicted,
 *             refused, grants, pid, cut, flags): every region checked against the mapping once, here. */
static PyObject *
cells_keyed_table(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    if (!nargs(n, 16, "keyed_table") || !check_open(self))
        return NULL;
    uint64_t v[16];
    for (int i = 0; i < 16; i++)
        if (!u64(args[i], &v[i]))
            return NULL;
    uint64_t size = (uint64_t)self->size;
    /* a region of `lines` 64-byte lines at offset off must lie inside the mapping */
#define REGION_OK(off, lines) ((off) % 8 == 0 && (lines) <= size / 64 && (off) <= size - (lines) * 64)
    if (!REGION_OK(v[0], KT_DEFAULT_BACKUP_LINES + 1) || !REGION_OK(v[1], 0) || v[1] > size - 8 ||
        v[3] > size / (64 * KO_LINES) || !REGION_OK(v[2], v[3] * KO_LINES) ||
        !REGION_OK(v[4], v[5]) || v[5] == 0 || v[6] == 0 || v[6] > v[5] || v[9] > size - 8 ||
        v[10] > size - 8 || v[11] > size - 8 || v[12] > size - 8 || v[14] > size - 8 ||
        (v[9] | v[10] | v[11] | v[12] | v[14]) % 8) {
        PyErr_SetString(PyExc_IndexError, "keyed_table: a region lies outside the mapping");
        return NULL;
    }
#undef REGION_OK
    KeyedTable *t = PyObject_New(KeyedTable, &KeyedTableType);
    if (!t)
        return NULL;
    Py_INCREF(self);
    t->cells = self;
    char *b = self->base;
    t->cfg = (uint64_t *)(b + v[0]);
    t->ovr_live = (uint64_t *)(b + v[1]);
    t->ovr = (uint64_t *)(b + v[2]);
    t->novr = v[3];
    t->slots = (uint64_t *)(b + v[4]);
    t->nslots = v[5];
    t->probe = v[6];
    t->k0 = v[7];
    t->k1 = v[8];
    t->keys_live = (uint64_t *)(b + v[9]);
    t->evicted = (uint64_t *)(b + v[10]);
    t->refused = (uint64_t *)(b + v[11]);
    t->grants = (uint64_t *)(b + v[12]);
    t->pid = v[13];
    t->cut = (uint64_t *)(b + v[14]);
    t->flags = v[15];
    t->windows = 0;
    return (PyObject *)t;
}

/* ---- FIXED WINDOWS: keyed.windows' fixed-window step on the slot protocol -----------------------
 *
 * The reference is WindowCounters.incr in shmlimit/keyed/windows.py (the portable backend's path);
 * the two must stay step-for-step equivalent: tests/test_window_counters.py runs them side by side
 * on the same words.  A key's slot holds V0 = end << 25 | count (ms; stored plus BASE), changed
 * only by CAS: within the window the count grows, once end <= now a new window starts with
 * end = now + W + 1 ms.  Its digest is that of "F" + the key's bytes. */
#define WC_TSHIFT 25
#define WC_CMAX ((UINT64_C(1) << 24) - 1)                       /* keyed.windows.CMAX */
#define WC_FLAG (UINT64_C(1) << 24)                              /* keyed.windows.FLAG */
#define WC_OVER (UINT64_C(1) << 62)                              /* keyed.windows.OVER */
#define WC_MAX_WINDOW_MS (UINT64_C(1) << 35)                     /* keyed.windows.MAX_WINDOW_MS */
#define WC_MAX_NOW (((UINT64_C(1) << 38) - 1) - 2 * WC_MAX_WINDOW_MS - 2) /* keyed.windows._now's */

/* incr(key, window_ms, amount, now_ms) -> the count after adding amount to key's window (OVER once
 * it would pass CMAX), or KT_FULL (no slot: counted in refused) or KT_BUSY (a stalled insert of the
 * key by a live process); nothing counted then.  The caller validated its arguments (ValueError
 * here only for a call that skipped that). */
static PyObject *
fw_incr(KeyedTable *t, PyObject *const *args, Py_ssize_t n)
{
    const char *buf;
    Py_ssize_t len;
    uint64_t w, amount, now;
    if (!nargs(n, 4, "incr") || !check_open(t->cells) || !kt_key(args[0], &buf, &len) ||
        !u64(args[1], &w) || !u64(args[2], &amount) || !u64(args[3], &now))
        return NULL;
    if (!w || w > WC_MAX_WINDOW_MS || amount > WC_CMAX || now > WC_MAX_NOW) {
        PyErr_SetString(PyExc_ValueError, "incr: window_ms must be from 1 to 2**35, amount at most "
                                          "2**24 - 1, now_ms within what a window counter holds");
        return NULL;
    }
    unsigned char kb[1 + KT_KEY_MAX];
    kb[0] = 'F';
    memcpy(kb + 1, buf, (size_t)len);
    uint64_t d[2], disp[2] = {0, 0};
    siphash128(kb, (size_t)len + 1, t->k0, t->k1, d);
    uint64_t home = (uint64_t)(((unsigned __int128)d[0] * t->nslots) >> 64);
    /* pack(now, CMAX, True): the insert's now, above no value a window at or after now takes; the
     * new key's first value v0 is the least it ever takes: its BASE is charged from there (a window
     * of the same length that ended no later takes nothing from BASE_MAX: WindowCounters._visit) */
    uint64_t low = now << WC_TSHIFT | WC_FLAG | WC_CMAX, v0 = (now + w + 1) << WC_TSHIFT | amount;
    int displayed = 0;
    for (;;) {
        uint64_t c, *s = kt_find(t, d, home, &c);
        if (!s) {
            if (!displayed && (t->flags & KT_FLAG_STORE_KEYS)) {
                kt_display(buf, len, disp);
                displayed = 1;
            }
            int err;
            s = kt_insert(t, d, home, low, v0, v0, 0, disp, 0, 0, &c, &err);
            if (err == 1 || err == 2)
                return err == 2 ? PyLong_FromLongLong(KT_BUSY) : NULL;
            if (!s) {
                add(t->refused, 1);
                return PyLong_FromLongLong(err == 3 ? KT_WORN : KT_FULL);
            }
            if (c)
                return PyLong_FromUnsignedLongLong(amount);
            if (!kt_yield(t)) /* lost a race (often to an insert of the same key): let it finish */
                return NULL;
            continue;
        }
        for (;;) {
            uint64_t off = ld(s + KW_BASE), raw = ld(s + KW_V0);
            if (raw & KT_DEAD || ld(s + KW_CTRL) != c)
                break; /* evicted or reused: look again */
            /* a word below BASE (only a forged one) is a negative value to the reference: a
             * window that ended, not one taken modulo 2**64 to end far in the future */
            uint64_t v = raw - off, end = raw < off ? 0 : (v & ~KT_DEAD) >> WC_TSHIFT,
                     cnt = v & WC_CMAX, nw, ret;
            if (end <= now) { /* a new window, never shorter than asked */
                uint64_t e = now + w + 1 > end + 1 ? now + w + 1 : end + 1;
                nw = e << WC_TSHIFT | amount;
                ret = amount;
            } else if (cnt + amount > WC_CMAX) { /* saturated: above every limit */
                nw = end << WC_TSHIFT | WC_CMAX;
                ret = WC_OVER;
            } else {
                nw = end << WC_TSHIFT | (cnt + amount);
                ret = cnt + amount;
            }
            if (cas(s + KW_V0, raw, nw + off))
                return PyLong_FromUnsignedLongLong(ret);
        }
    }
}

/* rebind(pid): after fork, insert as this process (its owner field: keyed.layout.owner). */
static PyObject *
fw_rebind(KeyedTable *t, PyObject *const *args, Py_ssize_t n)
{
    uint64_t pid;
    if (!nargs(n, 1, "rebind") || !check_open(t->cells) || !u64(args[0], &pid))
        return NULL;
    t->pid = pid;
    Py_RETURN_NONE;
}

static PyMethodDef fw_methods[] = {
    {"incr", (PyCFunction)(void (*)(void))fw_incr, METH_FASTCALL,
     "incr(key, window_ms, amount, now_ms) -> the window's count after it (OVER when saturated), or "
     "keyed.cells.FULL / BUSY"},
    {"rebind", (PyCFunction)(void (*)(void))fw_rebind, METH_FASTCALL, "rebind(pid_owner)"},
    {NULL, NULL, 0, NULL},
};

static PyObject *
fw_pid(KeyedTable *t, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(t->pid);
}

static PyGetSetDef fw_getset[] = {
    {"pid", (getter)fw_pid, NULL, "the owner field this process inserts as (rebind sets it)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FixedWindowsType = {
    NATIVE_TYPE("FixedWindows", KeyedTable,
                "The fixed-window step over a window table's slots (see keyed/windows.py)."),
    .tp_methods = fw_methods,
    .tp_getset = fw_getset,
    .tp_dealloc = (destructor)bound_dealloc,
};
/* ======================================================================================
 * END KEYED TABLE
 * ====================================================================================== */

/* ---- Gate: try_acquire and a timed acquire in one call ------------------------------------
 *
 * A Gate holds the words and the config of one limiter's fast path, validated once.  Its two
 * methods answer True (granted now, `ops` counted), False (refused for certain, nothing
 * touched), or None (undecided: the config changed, or a replenish might grant; the caller
 * takes the slow path, which replenishes and tries again).  grab_within may also answer a
 * ticket: queued, and the caller waits for it as for any ticket.
 *
 * A refusal is certain when even every token the next replenish could add -- the time since
 * REPL_TS, times TPN, times the catch-up ratio rounded up -- would not change the answer: the
 * slow path would then refuse too, having only done more work.  That bound only over-estimates
 * (the replenish also clamps to the capacity), so a certain refusal is never a wrong one; an
 * over-estimate merely sends a caller down the slow path.
 *
 * "Now" is CLOCK_MONOTONIC, read only when a refusal is weighed; a caller on an injected clock
 * (an attachment's `clock`, a test's) passes its reading instead as the last argument, now_ns
 * (>= 1), and the gate decides at that instant, as the slow path would on that clock.  A refusal
 * replenishes nothing, on either clock: the filler's replenishes follow the real clock, and a caller
 * on an injected one does the slow path's replenish after a certain refusal (attachment.OnClock).
 */
typedef struct {
    GRAB_FIELDS /* first: a Gate is bound as a Grabber is */
    uint64_t *ceil, *repl_ts;
    uint64_t tpn, pend_mul;
    double max_reserved_ns; /* +inf when the limiter has no max_reserved */
    int capped;
    uint64_t *fence_hint; /* FENCE_HINT (layout.fence_offset), or NULL: a queued grab is undecided while a
                           * reservation's fence may be in force (the slow path counts it: Schedule.wait_ns) */
} Gate;

/* At most how many tokens a replenish starting at `now` (0: the clock, read here) could add
 * (saturating). */
static uint64_t
gate_pending(Gate *g, uint64_t now)
{
    uint64_t ts = __atomic_load_n(g->repl_ts, __ATOMIC_SEQ_CST);
    if (now == 0)
        now = monotonic_ns();
    uint64_t p;
    if ((int64_t)(now - ts) <= 0)
        return 0;
    if (__builtin_mul_overflow(now - ts, g->tpn, &p) || __builtin_mul_overflow(p, g->pend_mul, &p))
        return UINT64_MAX;
    return p;
}

/* The optional last argument now_ns of a gate's call, args[at] if there are `at` + 1 of them: 1
 * with *now set (0 when absent or None: the caller reads the clock), else 0 with the exception
 * set.  No work on the real clock's path but the count's comparison. */
static int
gate_now(PyObject *const *args, Py_ssize_t n, Py_ssize_t at, const char *name, uint64_t *now)
{
    *now = 0;
    if (n == at || (n == at + 1 && args[at] == Py_None))
        return 1;
    if (n != at + 1) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd or %zd arguments (%zd given)", name, at, at + 1, n);
        return 0;
    }
    if (!PyLong_CheckExact(args[at]) || !u64(args[at], now) || *now == 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: now_ns must be an int from 1 to 2**64 - 1 (a CLOCK_MONOTONIC reading)",
                     name);
        return 0;
    }
    return 1;
}

/* Advance the tail from `t` to `want` by CAS; on failure `t` holds the current tail. */
static int
gate_take(Gate *g, uint64_t *t, uint64_t want)
{
    return __atomic_compare_exchange_n(g->tail, t, want, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

static PyObject *
gate_try_grab(Gate *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t now;
    if (!gate_now(args, n, 0, "try_grab", &now) || !check_open(self->cells))
        return NULL;
    if (__atomic_load_n(self->seq, __ATOMIC_SEQ_CST) != self->expected)
        Py_RETURN_NONE;
    uint64_t t = __atomic_load_n(self->tail, __ATOMIC_SEQ_CST);
    for (;;) {
        uint64_t want = t + self->amount;
        int64_t short_ = (int64_t)(want - __atomic_load_n(self->head, __ATOMIC_SEQ_CST));
        if (short_ > 0) {
            if ((uint64_t)short_ > gate_pending(self, now))
                Py_RETURN_FALSE;
            Py_RETURN_NONE;
        }
        if (gate_take(self, &t, want))
            break; /* on failure `t` holds the current tail: try again from there */
    }
    __atomic_fetch_add(self->grants, self->ops, __ATOMIC_SEQ_CST);
    Py_RETURN_TRUE;
}

/* The timeout argument as seconds, or -1 when it is not a plain finite number >= 0 (the slow
 * path then validates it and raises, or treats +inf as no timeout). */
static double
gate_timeout(PyObject *arg)
{
    double t;
    if (PyFloat_CheckExact(arg)) {
        t = PyFloat_AS_DOUBLE(arg);
    } else if (PyLong_CheckExact(arg)) {
        t = PyLong_AsDouble(arg);
        if (t == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
    } else {
        return -1;
    }
    if (!(t >= 0) || t == HUGE_VAL)
        return -1;
    return t;
}

/* Would `short_` tokens (> 0) take longer than `max_wait_ns`?  The slow path's own comparison
 * (bucket.try_grab_within), with the common timeout of 0 spared its division. */
static inline int
wait_exceeds(uint64_t short_, double tpn, double max_wait_ns)
{
    return max_wait_ns == 0 ? 1 : (double)short_ / tpn > max_wait_ns;
}

static PyObject *
gate_grab_within(Gate *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t now;
    if (n < 1) {
        PyErr_SetString(PyExc_TypeError, "grab_within() takes 1 or 2 arguments (0 given)");
        return NULL;
    }
    if (!gate_now(args, n, 1, "grab_within", &now) || !check_open(self->cells))
        return NULL;
    double timeout = gate_timeout(args[0]);
    if (timeout < 0 || __atomic_load_n(self->seq, __ATOMIC_SEQ_CST) != self->expected)
        Py_RETURN_NONE;
    double max_wait_ns = timeout * 1e9;
    if (self->max_reserved_ns < max_wait_ns)
        max_wait_ns = self->max_reserved_ns;
    double tpn = (double)self->tpn;
    uint64_t t = __atomic_load_n(self->tail, __ATOMIC_SEQ_CST);
    uint64_t *rec = NULL; /* the record claimed for the ticket, once it would queue */
    for (;;) {
        uint64_t want = t + self->amount;
        int64_t short_ = (int64_t)(want - __atomic_load_n(self->head, __ATOMIC_SEQ_CST));
        if (short_ > 0) {
            if (wait_exceeds((uint64_t)short_, tpn, max_wait_ns)) {
                uint64_t pend = gate_pending(self, now);
                if (rec)
                    __atomic_store_n(rec, 0, __ATOMIC_SEQ_CST);
                if ((uint64_t)short_ > pend && wait_exceeds((uint64_t)short_ - pend, tpn, max_wait_ns))
                    Py_RETURN_FALSE;
                Py_RETURN_NONE;
            }
            if (self->fence_hint && __atomic_load_n(self->fence_hint, __ATOMIC_SEQ_CST)
                                        > __atomic_load_n(self->repl_ts, __ATOMIC_SEQ_CST)) {
                if (rec)
                    __atomic_store_n(rec, 0, __ATOMIC_SEQ_CST);
                Py_RETURN_NONE;
            }
            /* beyond the released budget a wait is not computable, and no replenish moves CEIL */
            if (self->capped && (int64_t)(want - __atomic_load_n(self->ceil, __ATOMIC_SEQ_CST)) > 0)
                goto refuse;
            if (self->recorded) { /* no queued ticket without a record: see claim_record */
                if (!rec && (records_left(self->cells) || !(rec = claim_record(self->recs, self->nrec, want))))
                    Py_RETURN_NONE; /* all in use, or the slot is being left (close): the slow path */
                __atomic_store_n(rec - 1, want, __ATOMIC_SEQ_CST);
            }
            if (gate_take(self, &t, want)) {
                if (!rec)
                    return PyLong_FromUnsignedLongLong(want);
                __atomic_store_n(rec, self->amount, __ATOMIC_SEQ_CST);
                return hand_ticket(self->cells, want);
            }
        } else if (gate_take(self, &t, want)) {
            if (rec)
                __atomic_store_n(rec, 0, __ATOMIC_SEQ_CST);
            __atomic_fetch_add(self->grants, self->ops, __ATOMIC_SEQ_CST);
            Py_RETURN_TRUE;
        }
    }
refuse:
    if (rec)
        __atomic_store_n(rec, 0, __ATOMIC_SEQ_CST);
    Py_RETURN_FALSE;
}

static PyMethodDef gate_methods[] = {
    {"try_grab", (PyCFunction)(void (*)(void))gate_try_grab, METH_FASTCALL,
     "try_grab([now_ns]) -> True if granted now, False if refused for certain (nothing touched), None if "
     "undecided; judged at now_ns if given (an injected clock's reading), else now"},
    {"grab_within", (PyCFunction)(void (*)(void))gate_grab_within, METH_FASTCALL,
     "grab_within(timeout[, now_ns]) -> True if granted now, a ticket if queued within timeout seconds, "
     "False if refused for certain (nothing touched), None if undecided"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GateType = {
    NATIVE_TYPE("Gate", Gate, "try_acquire and timed acquire of one config, in one call each."),
    .tp_dealloc = (destructor)bound_dealloc,
    .tp_methods = gate_methods,
};

/* gate(seq, expected, tail, head, ceil, repl_ts, grants, amount, ops, tpn, pend_mul, capped,
 * max_reserved_ns) -> a Gate (see above). */
static PyObject *
cells_gate(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t *w[6], v[5]; /* seq, tail, head, ceil, repl_ts, grants; expected, amount, ops, tpn, pend_mul */
    uint64_t *recs[MAX_RECS];
    /* a 14th argument: the records a queued ticket must hold one of (None: none); a 15th: FENCE_HINT */
    int nrec = 0, recorded = n >= 14 && args[13] != Py_None;
    uint64_t *fence_hint = NULL;
    if (n > 15) {
        PyErr_SetString(PyExc_TypeError, "gate() takes 13 to 15 arguments");
        return NULL;
    }
    if (!parse_args(self, args, n > 13 ? 13 : n, "gate", "wuwwwwwuuuu..", w, v))
        return NULL;
    if (recorded && !parse_records(self, args[13], "gate", recs, &nrec))
        return NULL;
    if (n == 15 && !(fence_hint = word(self, args[14])))
        return NULL;
    uint64_t amount = v[1], tpn = v[3], pend_mul = v[4];
    int capped = PyObject_IsTrue(args[11]);
    double max_reserved_ns = PyFloat_AsDouble(args[12]);
    if (capped < 0 || (max_reserved_ns == -1.0 && PyErr_Occurred()))
        return NULL;
    if (tpn < 1 || pend_mul < 1 || amount < 1 || amount > ((uint64_t)1 << 62) || !(max_reserved_ns >= 0)) {
        PyErr_SetString(PyExc_ValueError, "gate: tpn, pend_mul and amount must be >= 1 (amount < 2**62), "
                                          "max_reserved_ns >= 0");
        return NULL;
    }
    Gate *g = (Gate *)bind_grab(self, &GateType, w[0], w[1], w[2], w[5], v[0], amount, v[2]);
    if (!g)
        return NULL;
    g->ceil = w[3];
    g->repl_ts = w[4];
    g->tpn = tpn;
    g->pend_mul = pend_mul;
    g->capped = capped;
    g->max_reserved_ns = max_reserved_ns;
    g->fence_hint = fence_hint;
    if (recorded) {
        g->recorded = 1;
        g->nrec = nrec;
        memcpy(g->recs, recs, sizeof(recs[0]) * (size_t)nrec);
    }
    return (PyObject *)g;
}

/* ---- MultiGate: one try over several rates, all or nothing, in one call -------------------
 *
 * Several rates (each its own segment and Gate) taken together, as the reference
 * composites.MultiGate does from its gates' steps.  A try first looks at every rate (its config
 * unchanged, room for its amount now) and touches nothing unless all have room; only then does
 * it take each by CAS, in order.  A race (another caller took a later rate's room between the
 * look and the take) gives back to the rates already taken what it took, less what their heads
 * gained since it read them, and never beyond tail + capacity: the bucket is never left fuller
 * than had the tokens never been taken (Bucket.give_back).  Every rate's grants are counted
 * only once all have granted.  A try never queues, so it never passes a ticket already queued
 * on any rate (FIFO), and each rate's tail advances only over tokens its head covers, so each
 * keeps its own window bound.
 *
 * Answers: True (granted on every rate, counted), False (refused for certain on some rate,
 * nothing touched; only when bound with decide=True), None (undecided: a config changed, a
 * replenish might grant, or a race gave back -- the caller takes the slow path).
 */
#define MULTI_MAX 16

typedef struct {
    PyObject_HEAD
    PyObject *gates; /* a tuple of Gates, kept alive (each keeps its cells) */
    PyObject *names; /* a tuple of the rates' names (costs given by name), or NULL */
    Py_ssize_t n;
    int decide;
    Gate *g[MULTI_MAX];
    uint64_t cap[MULTI_MAX]; /* each rate's capacity in tokens (the give-back clamp) */
} MultiGate;

/* Return `amount` tokens taken from g when its head was `head_then`, unused (Bucket.give_back):
 * `amount` less what the head gained since, never beyond tail + cap.  The gain is computed again
 * from the head every failed CAS leaves in `head`: a replenish that landed meanwhile counts
 * against what goes back, so the head ends at most at max(head, head_then + amount), never the
 * tokens taken on top of what the replenish added (past a fence it kept: design.md, "Reservation
 * fences").  composites.Gate.give_back is the same loop. */
static void
multi_give_back(Gate *g, uint64_t cap, uint64_t amount, uint64_t head_then)
{
    uint64_t head = __atomic_load_n(g->head, __ATOMIC_SEQ_CST);
    for (;;) {
        int64_t gained = (int64_t)(head - head_then);
        if (gained > 0 && (uint64_t)gained >= amount)
            return;
        uint64_t back = gained > 0 ? amount - (uint64_t)gained : amount;
        uint64_t tail = __atomic_load_n(g->tail, __ATOMIC_SEQ_CST);
        int64_t room = (int64_t)(tail + cap - head);
        if (room <= 0)
            return;
        uint64_t add = (uint64_t)room < back ? (uint64_t)room : back;
        if (__atomic_compare_exchange_n(g->head, &head, head + add, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return; /* on failure `head` holds the current head: its gain and clamp again */
    }
}

/* The try itself: mult[i] ops on rate i (0: the rate is not touched), a refusal judged at `now`
 * (0: the clock, read only then). */
static PyObject *
multi_try(MultiGate *self, const uint64_t *mult, uint64_t now)
{
    Py_ssize_t n = self->n, i;
    uint64_t amount[MULTI_MAX], head_then[MULTI_MAX];
    int short_any = 0, certain = 0;
    for (i = 0; i < n; i++)
        if (!check_open(self->g[i]->cells))
            return NULL;
    for (i = 0; i < n; i++) { /* look: touch nothing unless every rate has room now */
        if (!mult[i])
            continue;
        Gate *g = self->g[i];
        if (__atomic_load_n(g->seq, __ATOMIC_SEQ_CST) != g->expected)
            Py_RETURN_NONE;
        amount[i] = g->amount * mult[i]; /* <= cap < 2**62: checked by the callers */
        uint64_t t = __atomic_load_n(g->tail, __ATOMIC_SEQ_CST);
        int64_t short_ = (int64_t)(t + amount[i] - __atomic_load_n(g->head, __ATOMIC_SEQ_CST));
        if (short_ > 0) {
            short_any = 1;
            if ((uint64_t)short_ > gate_pending(g, now))
                certain = 1;
        }
    }
    if (short_any) {
        if (certain && self->decide)
            Py_RETURN_FALSE;
        Py_RETURN_NONE;
    }
    for (i = 0; i < n; i++) { /* take, in order; a race gives the earlier rates back */
        if (!mult[i])
            continue;
        Gate *g = self->g[i];
        head_then[i] = __atomic_load_n(g->head, __ATOMIC_SEQ_CST);
        uint64_t t = __atomic_load_n(g->tail, __ATOMIC_SEQ_CST);
        for (;;) {
            uint64_t want = t + amount[i];
            if ((int64_t)(want - __atomic_load_n(g->head, __ATOMIC_SEQ_CST)) > 0) {
                for (Py_ssize_t j = 0; j < i; j++)
                    if (mult[j])
                        multi_give_back(self->g[j], self->cap[j], amount[j], head_then[j]);
                Py_RETURN_NONE;
            }
            if (gate_take(g, &t, want))
                break; /* on failure `t` holds the current tail: try again from there */
        }
    }
    for (i = 0; i < n; i++)
        if (mult[i])
            __atomic_fetch_add(self->g[i]->grants, self->g[i]->ops * mult[i], __ATOMIC_SEQ_CST);
    Py_RETURN_TRUE;
}

static PyObject *
multi_try_grab(MultiGate *self, PyObject *const *args, Py_ssize_t n)
{
    static const uint64_t ones[MULTI_MAX] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    uint64_t now;
    if (!gate_now(args, n, 0, "try_grab", &now))
        return NULL;
    return multi_try(self, ones, now);
}

/* One count of ops as a multiplier of rate i, or 0 with *ok cleared when the slow path must
 * decide: not a plain int >= 0, or more tokens than the rate's capacity (never granted by a try;
 * the slow path queues it or raises). */
static uint64_t
multi_ops(MultiGate *self, Py_ssize_t i, PyObject *o, int *ok)
{
    if (!PyLong_CheckExact(o)) {
        *ok = 0;
        return 0;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || v < 0 || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *ok = 0;
        return 0;
    }
    if ((uint64_t)v > self->cap[i] / self->g[i]->amount) {
        *ok = 0;
        return 0;
    }
    return (uint64_t)v;
}

/* try_grab_ops(ops): ops per rate -- a tuple of one int per rate (0: not touched), a dict of
 * them by the rates' names (those not named: 0), or one int for every rate.  None, touching
 * nothing, for anything but plain ints >= 0 with one > 0, or a name not a rate's (the slow path
 * raises what it must). */
static PyObject *
multi_try_grab_ops(MultiGate *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t mult[MULTI_MAX], now;
    int ok = 1, any = 0;
    Py_ssize_t i;
    if (n < 1) {
        PyErr_SetString(PyExc_TypeError, "try_grab_ops() takes 1 or 2 arguments (0 given)");
        return NULL;
    }
    if (!gate_now(args, n, 1, "try_grab_ops", &now))
        return NULL;
    PyObject *arg = args[0];
    if (PyTuple_CheckExact(arg)) {
        if (PyTuple_GET_SIZE(arg) != self->n)
            Py_RETURN_NONE;
        for (i = 0; i < self->n; i++)
            mult[i] = multi_ops(self, i, PyTuple_GET_ITEM(arg, i), &ok);
    } else if (PyDict_CheckExact(arg)) {
        Py_ssize_t found = 0;
        if (!self->names)
            Py_RETURN_NONE;
        for (i = 0; i < self->n; i++) {
            PyObject *v = PyDict_GetItemWithError(arg, PyTuple_GET_ITEM(self->names, i));
            if (!v) {
                if (PyErr_Occurred())
                    return NULL;
                mult[i] = 0;
                continue;
            }
            found++;
            mult[i] = multi_ops(self, i, v, &ok);
        }
        if (found != PyDict_GET_SIZE(arg))
            Py_RETURN_NONE; /* a name not a rate's */
    } else {
        for (i = 0; i < self->n; i++)
            mult[i] = multi_ops(self, i, arg, &ok);
    }
    for (i = 0; i < self->n; i++)
        any |= mult[i] != 0;
    if (!ok || !any)
        Py_RETURN_NONE;
    return multi_try(self, mult, now);
}

static void
multi_dealloc(MultiGate *self)
{
    Py_XDECREF(self->gates);
    Py_XDECREF(self->names);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef multi_methods[] = {
    {"try_grab", (PyCFunction)(void (*)(void))multi_try_grab, METH_FASTCALL,
     "try_grab([now_ns]) -> one op on every rate: True if granted on all (counted), False if refused for certain "
     "(nothing touched), None if undecided; judged at now_ns if given (an injected clock's reading)"},
    {"try_grab_ops", (PyCFunction)(void (*)(void))multi_try_grab_ops, METH_FASTCALL,
     "try_grab_ops(ops[, now_ns]) -> as try_grab, for ops per rate (a tuple, 0 for a rate not taken; a dict by "
     "the rates' names) or one int for all"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MultiGateType = {
    NATIVE_TYPE("MultiGate", MultiGate, "one try over several rates' Gates, all or nothing, in one call."),
    .tp_dealloc = (destructor)multi_dealloc,
    .tp_methods = multi_methods,
};

/* multi_gate(gates, caps, decide, names) -> a MultiGate over a tuple of 1..16 Gates, each with
 * its capacity in tokens (>= its amount, < 2**62); names: a tuple of one str per gate, or None. */
static PyObject *
native_multi_gate(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[1])
        || (args[3] != Py_None && !PyTuple_Check(args[3]))) {
        PyErr_SetString(PyExc_TypeError,
                        "multi_gate(gates, caps, decide, names): a tuple of Gates, a tuple of ints, a bool, "
                        "a tuple of str or None");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
    if (n < 1 || n > MULTI_MAX || PyTuple_GET_SIZE(args[1]) != n
        || (args[3] != Py_None && PyTuple_GET_SIZE(args[3]) != n)) {
        PyErr_SetString(PyExc_ValueError, "multi_gate: 1 to 16 gates, and one capacity (and name) per gate");
        return NULL;
    }
    if (args[3] != Py_None)
        for (Py_ssize_t i = 0; i < n; i++)
            if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(args[3], i))) {
                PyErr_SetString(PyExc_TypeError, "multi_gate: each name must be a str");
                return NULL;
            }
    int decide = PyObject_IsTrue(args[2]);
    if (decide < 0)
        return NULL;
    MultiGate *m = PyObject_New(MultiGate, &MultiGateType);
    if (!m)
        return NULL;
    m->n = n;
    m->decide = decide;
    m->gates = NULL;
    m->names = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *g = PyTuple_GET_ITEM(args[0], i);
        if (Py_TYPE(g) != &GateType) {
            PyErr_SetString(PyExc_TypeError, "multi_gate: every gate must be a native Gate");
            Py_DECREF(m);
            return NULL;
        }
        unsigned long long cap = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args[1], i));
        if (cap == (unsigned long long)-1 && PyErr_Occurred()) {
            Py_DECREF(m);
            return NULL;
        }
        m->g[i] = (Gate *)g;
        m->cap[i] = cap;
        if (cap < m->g[i]->amount || cap >= ((uint64_t)1 << 62)) {
            PyErr_SetString(PyExc_ValueError, "multi_gate: each capacity must be >= its gate's amount and < 2**62");
            Py_DECREF(m);
            return NULL;
        }
    }
    Py_INCREF(args[0]);
    m->gates = args[0];
    if (args[3] != Py_None) {
        Py_INCREF(args[3]);
        m->names = args[3];
    }
    return (PyObject *)m;
}

static void
release_view(NativeCells *self)
{
    if (self->open) {
        self->open = 0;
        PyBuffer_Release(&self->view);
    }
}

/* defined in WAITER below */
static void waiters_leave(NativeCells *self);
static PyObject *cells_waiter(NativeCells *self, PyObject *const *args, Py_ssize_t n);
static PyObject *cells_clamp_words(NativeCells *self, PyObject *const *args, Py_ssize_t n);
static PyObject *cells_fence_scan(NativeCells *self, PyObject *const *args, Py_ssize_t n);
/* defined in FED WAIT below */
static PyObject *cells_futex_wait(NativeCells *self, PyObject *const *args, Py_ssize_t n);
static PyObject *cells_futex_wake(NativeCells *self, PyObject *const *args, Py_ssize_t n);
static PyObject *cells_fed_waiter(NativeCells *self, PyObject *const *args, Py_ssize_t n);

/* leave_waiters(): close()'s first half -- every waiter of this process leaves its native loop and
 * none is granted there from now on (`closing` stays set), the mapping kept: a closing attachment
 * then records its waiters' tickets as given back, none of which a native loop may still grant. */
static void waiters_leave(NativeCells *self);
static void waiters_wake(NativeCells *self);

static PyObject *
cells_leave_waiters(NativeCells *self, PyObject *Py_UNUSED(ignored))
{
    waiters_leave(self);
    Py_RETURN_NONE;
}

/* wake_waiters(): every native wait of this process on these cells steps again now (giveback: the
 * head skipped a range given back, so the waiters behind it are due sooner than they sleep to). */
static PyObject *
cells_wake_waiters(NativeCells *self, PyObject *Py_UNUSED(ignored))
{
    waiters_wake(self);
    Py_RETURN_NONE;
}

static PyObject *
cells_close(NativeCells *self, PyObject *Py_UNUSED(ignored))
{
    waiters_leave(self);
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
    /* Initialised once, for life: grabbers hold raw pointers into the first buffer, so
     * re-pointing the object (releasing that buffer) would leave them on freed memory. */
    if (self->base != NULL) {
        PyErr_SetString(PyExc_TypeError, "NativeCells cannot be re-initialised");
        return -1;
    }
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

/* handed() -> the queued ticket a fast-path call of this thread on these cells returned last, if no
 * call took it since (see HANDED), else None; it is no longer there after. */
static PyObject *
cells_handed(NativeCells *self, PyObject *unused)
{
    (void)unused;
    if (handed.cells != self)
        Py_RETURN_NONE;
    handed.cells = NULL;
    return PyLong_FromUnsignedLongLong(handed.ticket);
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
    {"handed", (PyCFunction)cells_handed, METH_NOARGS,
     "handed() -> the queued ticket this thread's last fast-path call on these cells returned, once; else None"},
    {"store", (PyCFunction)(void (*)(void))cells_store, METH_FASTCALL, "store(off, value)"},
    {"load_many", (PyCFunction)cells_load_many, METH_O,
     "load_many(offsets) -> a tuple of the words at these byte offsets (each loaded as load does)"},
    {"fetch_add", (PyCFunction)(void (*)(void))cells_fetch_add, METH_FASTCALL,
     "fetch_add(off, delta) -> previous value (wraps modulo 2**64)"},
    {"cas", (PyCFunction)(void (*)(void))cells_cas, METH_FASTCALL,
     "cas(off, expected, desired) -> True if the word was expected and is now desired"},
    {"grab", (PyCFunction)(void (*)(void))cells_grab, METH_FASTCALL,
     "grab(tail, head, amount, grants, ops) -> None if granted at once, False if the queue is full, else the ticket"},
    {"grab_if", (PyCFunction)(void (*)(void))cells_grab_if, METH_FASTCALL,
     "grab_if(seq, expected, tail, head, amount, grants, ops) -> False if the seq word changed, else as grab"},
    {"grabber", (PyCFunction)(void (*)(void))cells_grabber, METH_FASTCALL,
     "grabber(seq, expected, tail, head, amount, grants, ops[, records]) -> a callable doing grab_if with these "
     "(with records, a tuple of LEN offsets: it queues only holding one of them)"},
    {"gate", (PyCFunction)(void (*)(void))cells_gate, METH_FASTCALL,
     "gate(seq, expected, tail, head, ceil, repl_ts, grants, amount, ops, tpn, pend_mul, capped, max_reserved_ns"
     "[, records or None[, fence_hint]]) -> try_grab() and grab_within(timeout) bound to these"},
    {"take_tail", (PyCFunction)(void (*)(void))cells_take_tail, METH_FASTCALL,
     "take_tail(tail, head, grants, records, expected, ticket, amount, ops) -> False (the tail moved), 0 (no "
     "record free), None (covered, counted), True (queued unrecorded) or the LEN offset recording the ticket"},
    {"try_grab", (PyCFunction)(void (*)(void))cells_try_grab, METH_FASTCALL,
     "try_grab(tail, head, amount, grants, ops) -> True if taken; False changes nothing"},
    {"keyed_table", (PyCFunction)(void (*)(void))cells_keyed_table, METH_FASTCALL,
     "keyed_table(cfg, ovr_live, ovr, novr, slots, nslots, probe, k0, k1, keys_live, evicted, refused, grants, pid)"},
    {"clamp_words", (PyCFunction)(void (*)(void))cells_clamp_words, METH_FASTCALL,
     "clamp_words(head_off, head, tail, records) -> (base, end, next) or None (bucket.clamp_words)"},
    {"fence_scan", (PyCFunction)(void (*)(void))cells_fence_scan, METH_FASTCALL,
     "fence_scan(hint_off, first, count, ts, now, tpn, head, ticket) -> (room, due) or None (words.fence_scan)"},
    {"waiter", (PyCFunction)(void (*)(void))cells_waiter, METH_FASTCALL,
     "waiter(words, expected, grants, waiting, tpn, cap, slack_ns, records, fences) -> Waiter"},
    {"futex_wait", (PyCFunction)(void (*)(void))cells_futex_wait, METH_FASTCALL,
     "futex_wait(off, expected, bitset, deadline_ns) -> False once the deadline passed, else True (look again)"},
    {"futex_wake", (PyCFunction)(void (*)(void))cells_futex_wake, METH_FASTCALL,
     "futex_wake(off, bitset) -> sleepers woken (any process)"},
    {"fed_waiter", (PyCFunction)(void (*)(void))cells_fed_waiter, METH_FASTCALL,
     "fed_waiter(seq, expected, head, lease, grants, waiting, wake, next_ns, cost, tpn, grace_ns) -> FedWaiter"},
    {"leave_waiters", (PyCFunction)cells_leave_waiters, METH_NOARGS,
     "every native wait of this process returns, and any later one at once (before close)"},
    {"wake_waiters", (PyCFunction)cells_wake_waiters, METH_NOARGS,
     "every native wait of this process on these cells steps again now (a given-back range was skipped)"},
    {"close", (PyCFunction)cells_close, METH_NOARGS, "release the buffer; later calls raise ValueError"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef cells_getset[] = {
    {"backend", (getter)cells_backend, NULL, "the backend's name: 'native'", NULL},
    {"size", (getter)cells_get_size, NULL, "bytes of the mapping the cells may touch", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject NativeCellsType = {
    NATIVE_TYPE("NativeCells", NativeCells, "Atomic 64-bit cells over a writable buffer (bounds-checked)."),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)cells_init,
    .tp_dealloc = (destructor)cells_dealloc,
    .tp_methods = cells_methods,
    .tp_getset = cells_getset,
};

/* ---- precise sleeping for waiters ------------------------------------------------------------
 *
 * sleep_until(deadline_ns, slack_ns): sleep, without the GIL, until CLOCK_MONOTONIC (Python's
 * time.monotonic_ns) reaches deadline_ns, with the calling thread's timer slack lowered to
 * slack_ns for this sleep only (Linux; restored after).  The default slack of 50 us would let
 * the kernel end the sleep that much late, to batch wake-ups; an absolute deadline also keeps
 * the time spent getting here from adding to the sleep.  Returns None; an interrupted sleep
 * returns early (the caller re-checks its condition anyway).
 */
#ifdef __linux__
#include <linux/futex.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sched.h>
#endif
#include <errno.h>
#include <unistd.h>

/* A waiting thread's scheduler request, its slice (ns): the shortest the kernel takes (EEVDF clamps
 * sched_attr.sched_runtime of a fair task to 0.1-100 ms since Linux 6.12).
 *
 * Why: a waiter's lateness is the time from its deadline until it runs again, and on a busy CPU
 * that is the running task's request, about 1.4 ms by default (the base slice scaled by the CPU
 * count), so a busy machine made waiters a millisecond late at the 99th percentile (8 waiters at
 * 1 000/s: their deadlines exact to the ns, the wake itself up to 1-2 ms late).  A task whose slice
 * is shorter than the running task's preempts it on its wake-up (the kernel's PREEMPT_SHORT), and
 * a slice changes no share of the CPU: only how long a request lasts, so how soon a woken task
 * gets its turn.  A waiter runs a few µs per wake, far within 0.1 ms, so it is never cut short.
 *
 * It is set once per thread, on the first wait or precise sleep that sleeps, and kept: restoring it
 * after every wait would cost two sched_setattr calls (~2 us each), as much again as the whole
 * native part of a wake.  It is set with the reset-on-fork flag, so that the threads and processes
 * the waiting thread starts afterwards begin with the kernel's default slice, not with the short
 * one (a forked child's thread asks again at its own first wait: the at-fork handler clears its
 * once-per-thread mark).  Only a thread of the normal policy (SCHED_OTHER) at a nice value of 0 or
 * more, on a kernel that tells its slice (sched_getattr answers a non-zero sched_runtime) and
 * whose slice is longer, is changed; its policy and nice value are written back as read, so the
 * call needs no privilege (the same policy, no lower nice), and a thread the user scheduled
 * otherwise keeps it.  A refusal (a seccomp filter) changes nothing and is not tried again. */
#define WAIT_SLICE_NS 100000u

static __thread int wait_slice_tried;
#if defined(__linux__) && defined(SYS_sched_getattr) && defined(SYS_sched_setattr)
struct wait_sched_attr { /* the kernel's struct sched_attr, its first version (56 bytes) */
    uint32_t size, policy;
    uint64_t flags;
    int32_t nice;
    uint32_t priority;
    uint64_t runtime, deadline, period;
    uint32_t util_min, util_max;
};
#define WAIT_SCHED_RESET_ON_FORK 1u /* SCHED_FLAG_RESET_ON_FORK */
static void
wait_short_slice(void)
{
    if (wait_slice_tried)
        return;
    wait_slice_tried = 1;
    struct wait_sched_attr a;
    memset(&a, 0, sizeof a);
    if (syscall(SYS_sched_getattr, 0, &a, (unsigned)sizeof a, 0) != 0)
        return;
    if (a.policy != SCHED_OTHER || a.nice < 0 || a.runtime <= WAIT_SLICE_NS)
        return; /* another policy, a raised priority, no slice told (an older kernel), or as short already */
    a.size = sizeof a;
    a.runtime = WAIT_SLICE_NS;
    a.flags = WAIT_SCHED_RESET_ON_FORK; /* nothing else: no utilization clamps, policy and nice as read */
    a.util_min = a.util_max = 0;
    (void)syscall(SYS_sched_setattr, 0, &a, 0);
}
#else
static void wait_short_slice(void) {}
#endif

/* Bumped by wake_sleepers() (giveback: the head skipped a range given back): a sleep_until given
 * `seen` (wakes(), read before the step that chose its deadline) sleeps on it, so it ends at the
 * first bump since, as the native waits end on their cells' `skips`. */
static uint32_t sleep_wakes;

static PyObject *
native_wakes(PyObject *mod, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLong(__atomic_load_n(&sleep_wakes, __ATOMIC_SEQ_CST));
}

static PyObject *
native_wake_sleepers(PyObject *mod, PyObject *Py_UNUSED(ignored))
{
    __atomic_fetch_add(&sleep_wakes, 1, __ATOMIC_SEQ_CST);
#ifdef __linux__
    syscall(SYS_futex, &sleep_wakes, FUTEX_WAKE | FUTEX_PRIVATE_FLAG, INT_MAX, NULL, NULL, 0);
#endif
    Py_RETURN_NONE;
}

static PyObject *
native_sleep_until(PyObject *mod, PyObject *const *args, Py_ssize_t n)
{
    if (n != 3 && !nargs(n, 2, "sleep_until"))
        return NULL;
    long long deadline = PyLong_AsLongLong(args[0]);
    long long slack = PyLong_AsLongLong(args[1]);
    long long seen = n == 3 ? PyLong_AsLongLong(args[2]) : -1;
    if ((deadline == -1 || slack == -1 || seen == -1) && PyErr_Occurred())
        return NULL;
    if (deadline < 0 || slack < 1 || seen > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError,
                        "sleep_until: deadline_ns must be >= 0, slack_ns >= 1 and seen < 2**32 (or -1)");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    wait_short_slice();
#ifdef __linux__
    int old = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    if (old > 0 && old != slack)
        prctl(PR_SET_TIMERSLACK, (unsigned long)slack, 0, 0, 0);
    struct timespec ts = ns_timespec((uint64_t)deadline);
    if (seen < 0)
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
    else /* until the deadline or a wake_sleepers() since `seen` (an absolute CLOCK_MONOTONIC wait) */
        syscall(SYS_futex, &sleep_wakes, FUTEX_WAIT_BITSET | FUTEX_PRIVATE_FLAG, (uint32_t)seen, &ts, NULL,
                FUTEX_BITSET_MATCH_ANY);
    if (old > 0 && old != slack)
        prctl(PR_SET_TIMERSLACK, (unsigned long)old, 0, 0, 0);
#else
    uint64_t now = monotonic_ns();
    if ((uint64_t)deadline > now) {
        uint64_t d = (uint64_t)deadline - now;
        struct timespec ts = ns_timespec(d);
        nanosleep(&ts, NULL);
    }
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* timerfd() -> fd and timerfd_arm(fd, deadline_ns) (Linux): a CLOCK_MONOTONIC timerfd
 * (non-blocking, close-on-exec), armed at an absolute deadline (0 disarms).  An event loop
 * watches it to wake a coroutine at that instant (sleep.sleep_until_async): a timerfd's kernel
 * timer has no slack, and its readiness wakes the loop's selector whatever the selector's own
 * millisecond timeout. */
#ifdef __linux__
#include <sys/timerfd.h>

static PyObject *
native_timerfd(PyObject *mod, PyObject *unused)
{
    (void)mod;
    (void)unused;
    int fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (fd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(fd);
}

static PyObject *
native_timerfd_arm(PyObject *mod, PyObject *const *args, Py_ssize_t n)
{
    (void)mod;
    if (!nargs(n, 2, "timerfd_arm"))
        return NULL;
    int fd = PyLong_AsLong(args[0]);
    long long deadline = PyLong_AsLongLong(args[1]);
    if ((fd == -1 || deadline == -1) && PyErr_Occurred())
        return NULL;
    if (fd < 0 || deadline < 0) {
        PyErr_SetString(PyExc_ValueError, "timerfd_arm: fd and deadline_ns must be >= 0");
        return NULL;
    }
    struct itimerspec its = {{0, 0}, ns_timespec((uint64_t)deadline)};
    if (timerfd_settime(fd, TFD_TIMER_ABSTIME, &its, NULL) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}
#endif

/* ======================================================================================
 * WAITER: a queued caller's whole wait in one call, without the GIL
 * ======================================================================================
 *
 * A Waiter holds the words and the config of one limiter's wait for a ticket, validated once
 * (like a Gate).  wait(ticket, ops, until_ns) runs, without the GIL, the same loop as the
 * acquisition core's TICKET state (acquisition.Request._wait_ticket): granted once the head
 * covers the ticket (`ops` counted, as the caller's grant); otherwise sleep to the instant the
 * ticket is due (REPL_TS plus its deficiency at the rate: exact) as an absolute CLOCK_MONOTONIC
 * deadline with a low timer slack; then replenish (the lazy refill: nothing waits for the
 * filler) and look again, or, still short, look again RETRY_NS later.  So a waiter wakes once
 * per grant and never returns to Python between its naps.
 *
 * It only ever decides what the Python loop would: the replenish is bucket.Bucket.replenish
 * (claim, then apply) for the one case a Waiter is made for -- fed by the clock, not stopped,
 * no catch-up (ratio 1) -- and the config is compared with the one it was bound to before
 * every step (a changed config, a stop or a rate change, ends the call: the caller goes back to
 * the Python loop, which reloads it).  It also ends at `until_ns`, on a signal (EINTR: Python
 * runs its handlers) and when a replenish of ours landed while the config changed (the caller
 * must burn down to the capacity in force, as Bucket.apply does).
 *
 * With count_waiting, the caller counts in its process's WAITING word (bound once, or none) for
 * the duration of the call.  wait answers an int: bit 0 (WAIT_GRANTED) granted and counted; else the caller continues in
 * Python; bit 1 (WAIT_NUDGE) we replenished and the filler lease is free or expired (the caller
 * nudges its filler); bit 2 (WAIT_BURN) our add raced a config change (the caller burns).
 * replenish(now_ns) is the same replenish at a given clock reading, for tests; refill() is it now,
 * for the filler's ticks.
 * Every word is touched here with sequentially consistent atomics, like everything in cells.
 */
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#include <pthread.h>
#include <unistd.h>

#define WAIT_GRANTED 1
#define WAIT_NUDGE 2
#define WAIT_BURN 4
#define WAIT_RETRY_NS 20000u /* acquisition.RETRY_NS */
#define WAIT_STOP_LEAD_NS 100000u /* sleep.STOP_LEAD_NS */
#define WAIT_LEASE_SLOT_BITS 12 /* layout.LEASE_SLOT_BITS */

/* Both waiter types (Waiter, FedWaiter below) begin with these fields, so that one constructor
 * half (wait_bind, wait_new), one wait() call (wait_call) and one `naps` getter serve both through
 * WaitBase: what a wait() does around its loop -- parse, the grant without leaving the GIL, the
 * `busy` and WAITING counts, the GIL released -- is the same for both; only the loop differs.
 * Invariant: `seq`, `head` and `grants` are words of `cells` (bound by word(), so inside the
 * mapping), `waiting` one or NULL; `expected` is the config the waiter was bound to. */
#define WAIT_FIELDS                                                                                     \
    BOUND_FIELDS                                                                                        \
    uint64_t *seq, *head, *grants;                                                                      \
    uint64_t *waiting; /* this process's WAITING word, or NULL (unregistered) */                        \
    uint64_t expected;                                                                                  \
    uint64_t naps; /* sleeps taken by this waiter's calls (this process's, for tests and tools) */  \
    uint32_t stop; /* set by interrupt(): a filler span in progress (fill, deliver) ends at once, and  \
                    * every later one */

typedef struct {
    WAIT_FIELDS
} WaitBase;

typedef struct {
    WAIT_FIELDS
    uint64_t *tail, *repl_ts, *snap_head, *snap_tail, *lease, *lost;
    uint64_t *snap_base, *snap_end, *snap_next; /* the clamp words (layout.SNAP_BASE) */
    uint64_t **recs; /* every ticket record's LEN word in the segment (PyMem), nrecs of them */
    Py_ssize_t nrecs;
    uint64_t *fence_hint, *fence_first; /* the reservation fences (layout.fence_offset): FENCE_HINT, the first record */
    Py_ssize_t fence_count;
    uint64_t tpn, cap;
    long slack_ns;
} Waiter;

static inline uint64_t wld(uint64_t *w) { return __atomic_load_n(w, __ATOMIC_SEQ_CST); }
static inline int wcas(uint64_t *w, uint64_t e, uint64_t d)
{
    return __atomic_compare_exchange_n(w, &e, d, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

/* The steps every wait loop shares, inline: no call, no clock read, no syscall of their own (a
 * wait's CPU per grant is what the native loops are for). */

/* Must the loop go back to Python (close() began, or the config it was bound to changed)?  Looked
 * at before every step and after every sleep: close() relies on it to drain `busy`. */
static inline int
wait_leaving(WaitBase *w)
{
    return __atomic_load_n(&w->cells->closing, __ATOMIC_SEQ_CST) || wld(w->seq) != w->expected;
}

/* Must a filler span (fill, deliver) go back to Python: interrupt(), close() began, or the config
 * it was bound to changed? */
static inline int
span_leaving(WaitBase *w)
{
    return __atomic_load_n(&w->stop, __ATOMIC_SEQ_CST) || wait_leaving(w);
}

/* How many tokens the head is still short of `ticket` (<= 0: covered), wrap-safe. */
static inline int64_t
wait_short(WaitBase *w, uint64_t ticket)
{
    return (int64_t)(ticket - wld(w->head));
}

/* A covered ticket's grant: its ops counted in GRANTS, the flags with WAIT_GRANTED. */
static inline int
wait_grant(WaitBase *w, uint64_t ops, int flags)
{
    __atomic_fetch_add(w->grants, ops, __ATOMIC_SEQ_CST);
    return flags | WAIT_GRANTED;
}

/* A computed wake-up instant as a deadline: `until` if it is not before it, else the instant
 * truncated to whole ns plus `round_up` (1 where waking in the ns before the instant would be
 * early).  The comparison is in double, as the instant was computed, so a value that would
 * round to `until` caps at `until`. */
static inline uint64_t
wait_deadline(double at, uint64_t until, uint64_t round_up)
{
    return at >= (double)until ? until : (uint64_t)at + round_up;
}

#ifndef __linux__
/* Without futexes: a plain relative sleep to the CLOCK_MONOTONIC instant `at`; 0 if a signal cut it. */
static int
wait_plain_sleep(uint64_t at)
{
    uint64_t now = monotonic_ns();
    if (at > now) {
        struct timespec ts = ns_timespec(at - now);
        return nanosleep(&ts, NULL) == 0;
    }
    return 1;
}
#endif

/* The clamp a snapshot (head, tail) leaves the next replenish: bucket.clamp_words, word for word.
 * out = {base, end, next}: the next replenish may bring the head to min(max(base + cap, end), next)
 * (clamp_limit).  Invariant: base is the start of the waiter's request the head stands in (read
 * from the ticket records, where every queued waiter's ticket is), end its end, both the head
 * outside any recorded request; there next is where the records let the head go: a token short
 * of the end of the first recorded request after it, or the tail, whichever is nearest (a record
 * being written tells no range).  Not queued, the
 * tail is a boundary and no record is read.  0 when the head moved during the read (a request
 * around the head may have been granted and its record freed): the older words stay. */
#define REC_GIVEN ((uint64_t)1 << 62)
#define CLAMP_FAR ((uint64_t)1 << 62)
#define SPAN_MAX ((uint64_t)1 << 60) /* config.MAX_SPAN_TOKENS */
static int
clamp_words(uint64_t *const *recs, Py_ssize_t nrecs, uint64_t *headw, uint64_t head, uint64_t tail,
            uint64_t out[3])
{
    if ((int64_t)(head - tail) >= 0) {
        out[0] = out[1] = tail;
        out[2] = tail + CLAMP_FAR;
        return 1;
    }
    uint64_t base = head, end = head, next = tail;
    for (Py_ssize_t i = 0; i < nrecs; i++) {
        uint64_t v = __atomic_load_n(recs[i], __ATOMIC_SEQ_CST);
        if (v == 0)
            continue;
        uint64_t e = __atomic_load_n(recs[i] - 1, __ATOMIC_SEQ_CST);
        if ((v & REC_BUSY) || __atomic_load_n(recs[i], __ATOMIC_SEQ_CST) != v)
            continue; /* being written, or changed under us: its range is told by no record */
        uint64_t n = v & ~REC_GIVEN;
        if (n == 0 || n > SPAN_MAX)
            continue; /* corrupt: no range */
        uint64_t st = e - n;
        if ((int64_t)(head - st) >= 0 && (int64_t)(e - head) > 0 && (int64_t)(tail - e) >= 0) {
            /* (the head stands in it, taken: a range ending past the tail no grab took, and words
             * naming it allow nothing, ever) */
            base = st;
            end = e;
        } else if ((int64_t)(st - head) > 0 && (int64_t)(e - head) <= (int64_t)(next - head)) {
            next = e - 1; /* into the request, not to its end */
        }
    }
    if (__atomic_load_n(headw, __ATOMIC_SEQ_CST) != head)
        return 0;
    if (base != end) /* in a recorded request: it alone decides */
        next = head + CLAMP_FAR;
    out[0] = base;
    out[1] = end;
    out[2] = next;
    return 1;
}

/* words.clamp_sane: words a snapshot at or before (head, tail) could have left (tail read after
 * them): base not above the head (within CLAMP_FAR), end at most SPAN_MAX past base and not past
 * the tail, next not below a request's end.  Others (a corrupt or hostile segment) allow nothing
 * and are never kept: lost time, one interval, never a grant. */
static inline int
clamp_sane(uint64_t base, uint64_t end, uint64_t next, uint64_t head, uint64_t tail)
{
    int64_t d = (int64_t)(head - base);
    if (d < 0 || (uint64_t)d > CLAMP_FAR)
        return 0;
    int64_t span = (int64_t)(end - base);
    if (span < 0 || (uint64_t)span > SPAN_MAX || (int64_t)(tail - end) < 0)
        return 0;
    return span == 0 || (int64_t)(next - end) >= 0;
}

/* words.clamp_limit: min(max(base + room, end), next); the head (nothing added) when base is not
 * below it (words that predate the clamp words: zero) or no snapshot could have left the words. */
static inline uint64_t
clamp_limit(uint64_t base, uint64_t end, uint64_t next, uint64_t room, uint64_t head, uint64_t tail)
{
    if (!clamp_sane(base, end, next, head, tail))
        return head;
    uint64_t limit = base + room;
    if ((int64_t)(end - limit) > 0)
        limit = end;
    if ((int64_t)(next - limit) < 0)
        limit = next;
    return limit;
}

/* cells.clamp_words(head_off, head, tail, records) -> (base, end, next), or None when the head moved
 * during the read: bucket.clamp_words for the Python replenish on this backend (one call, the
 * records' offsets checked as records_from_tuple does). */
static PyObject *
cells_clamp_words(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t head, tail, out[3];
    if (!nargs(n, 4, "clamp_words") || !check_open(self))
        return NULL;
    uint64_t *headw = word(self, args[0]);
    if (!headw || !u64(args[1], &head) || !u64(args[2], &tail))
        return NULL;
    Py_ssize_t nrecs;
    uint64_t **recs = records_new(self, args[3], "clamp_words", &nrecs);
    if (!recs)
        return NULL;
    int ok = clamp_words(recs, nrecs, headw, head, tail, out);
    PyMem_Free(recs);
    if (!ok)
        Py_RETURN_NONE;
    return Py_BuildValue("(KKK)", (unsigned long long)out[0], (unsigned long long)out[1],
                         (unsigned long long)out[2]);
}

/* words.fence_scan, word for word, in one loop: the reservation fences in force for a claim of
 * [ts, now] (a record whose DUE is after ts), read only when FENCE_HINT (`hint`, the latest DUE ever
 * stored) is after ts.  `first`: the first record's START word, `count` records FENCE_STRIDE bytes
 * apart (START, LIMIT, DUE, TOKENS).  *room: the least LIMIT + max(0, now - DUE) * tpn less `head` (at most
 * FENCE_NONE; negative: the head is past it); *due: the latest DUE + (ticket - LIMIT) / tpn over
 * those whose LIMIT is before `ticket` (0: none).  A LIMIT more than CLAMP_FAR from the head, or a
 * DUE beyond fence_horizon_ns from now, no reservation left: ignored.  Answers whether one is in
 * force.  Invariant: `first` .. the last record's DUE are inside the mapping (checked by callers). */
#define FENCE_STRIDE_W 4 /* words.FENCE_STRIDE / 8 */
#define FENCE_NONE ((int64_t)1 << 62)
static inline uint64_t
fence_horizon_ns(uint64_t tpn)
{
    return 2 * (((uint64_t)1 << 62) / (tpn ? tpn : 1)) + 10000000000ull;
}

/* words.fences_in_force for one record: record k of those from `first` when it is in force for a
 * claim of [ts, ...] (its DUE after ts and not beyond `horizon`, its LIMIT within CLAMP_FAR of
 * `head`), with *due and *lim read; NULL otherwise.  Every native reader of the fences asks it. */
static inline uint64_t *
fence_in_force(uint64_t *first, Py_ssize_t k, uint64_t ts, uint64_t horizon, uint64_t head, uint64_t *due,
               uint64_t *lim)
{
    uint64_t *rec = first + k * FENCE_STRIDE_W;
    *due = __atomic_load_n(rec + 2, __ATOMIC_SEQ_CST);
    if (*due <= ts || *due > horizon)
        return NULL;
    *lim = __atomic_load_n(rec + 1, __ATOMIC_SEQ_CST);
    int64_t rel = (int64_t)(*lim - head);
    return rel < -(int64_t)CLAMP_FAR || rel > (int64_t)CLAMP_FAR ? NULL : rec;
}

static int
fence_scan(uint64_t *hint, uint64_t *first, Py_ssize_t count, uint64_t ts, uint64_t now, uint64_t tpn,
           uint64_t head, uint64_t ticket, int64_t *room, double *due)
{
    *room = FENCE_NONE;
    *due = 0;
    if (__atomic_load_n(hint, __ATOMIC_SEQ_CST) <= ts)
        return 0;
    uint64_t horizon = now + fence_horizon_ns(tpn);
    int found = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        uint64_t d, lim;
        if (!fence_in_force(first, k, ts, horizon, head, &d, &lim))
            continue;
        int64_t rel = (int64_t)(lim - head);
        found = 1;
        uint64_t late = now > d ? now - d : 0;
        /* min(rel + late * tpn, FENCE_NONE), exact as words.fence_scan's: the gain is not clamped
         * before it is added (a LIMIT 2**62 behind the head with a gain past 2**62 has room left) */
        unsigned __int128 gain = (unsigned __int128)late * tpn; /* < 2**128: no overflow */
        /* rel is within CLAMP_FAR of 0, so FENCE_NONE - rel is positive and below 2**63 */
        int64_t r = gain >= (unsigned __int128)(FENCE_NONE - rel) ? FENCE_NONE : rel + (int64_t)gain;
        if (r < *room)
            *room = r;
        int64_t ahead = (int64_t)(ticket - lim);
        if (ahead > 0) {
            double at = (double)d + (double)ahead / (double)tpn;
            if (at > *due)
                *due = at;
        }
    }
    return found;
}

/* words.callers_between over Schedule.granting's ranges, word for word: whether a recorded request
 * the head grants by reaching it (taken: ending at or before `tail`; not given back) lies between
 * `head` and `start`; one whose record is being written, changed under the read or of a corrupt
 * length counts if it ends past the head. */
static int
callers_between(uint64_t *const *recs, Py_ssize_t nrecs, uint64_t head, uint64_t start, uint64_t tail)
{
    for (Py_ssize_t i = 0; i < nrecs; i++) {
        uint64_t v = __atomic_load_n(recs[i], __ATOMIC_SEQ_CST);
        if (v == 0)
            continue;
        uint64_t e = __atomic_load_n(recs[i] - 1, __ATOMIC_SEQ_CST);
        if ((int64_t)(e - tail) > 0)
            continue;
        uint64_t n = v & ~REC_GIVEN;
        if ((v & REC_BUSY) || __atomic_load_n(recs[i], __ATOMIC_SEQ_CST) != v || n == 0 || n > SPAN_MAX) {
            if ((int64_t)(e - head) > 0)
                return 1;
        } else if (!(v & REC_GIVEN) && (int64_t)(e - head) > 0 && (int64_t)(start - (e - v)) > 0) {
            return 1;
        }
    }
    return 0;
}

/* words.fence_reserved and words.mark_late, word for word: the tokens of a claim of [ts, now]
 * owned by reservations the head runs late for (none of them added), the records found late first
 * marked (TOKENS's FENCE_LATE bit, then DUE moved n / tpn on, then FENCE_HINT raised) before the
 * claim's CAS.  `reach`, `base`, `cap`: words.Claim's; `recs`, `nrecs`, `tail`: the ticket records
 * (callers_between).  Records as fence_scan reads them: (START, LIMIT, DUE, TOKENS). */
#define FENCE_LATE ((uint64_t)1 << 63)
#define LATE_SLACK_NS 1000000ull /* words.LATE_SLACK_NS */
static uint64_t
fence_reserved(uint64_t *hint, uint64_t *first, Py_ssize_t count, uint64_t ts, uint64_t now, uint64_t tpn,
               uint64_t head, uint64_t reach, uint64_t base, uint64_t cap, uint64_t *const *recs, Py_ssize_t nrecs,
               uint64_t tail)
{
    if (__atomic_load_n(hint, __ATOMIC_SEQ_CST) <= ts)
        return 0;
    uint64_t horizon = now + fence_horizon_ns(tpn);
    unsigned __int128 reserved = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        uint64_t due, lim, *rec = fence_in_force(first, k, ts, horizon, head, &due, &lim);
        if (!rec)
            continue;
        uint64_t start = __atomic_load_n(rec, __ATOMIC_SEQ_CST);
        uint64_t word = __atomic_load_n(rec + 3, __ATOMIC_SEQ_CST);
        uint64_t tokens = word & ~FENCE_LATE;
        int64_t ahead = (int64_t)(start - head);
        if (tokens == 0 || tokens > SPAN_MAX || ahead <= (int64_t)tpn || (uint64_t)ahead > CLAMP_FAR)
            continue; /* (the head is at or past START, or within a ns of it: nobody ahead is late) */
        uint64_t span = tokens / tpn;
        uint64_t back = (word & FENCE_LATE) ? 2 * span : span;
        uint64_t opens = due - (back < due ? back : due), ends = due;
        if (opens >= now)
            continue;
        if (!(word & FENCE_LATE)) {
            uint64_t lands = now - opens;
            unsigned __int128 got = (unsigned __int128)(opens > ts ? opens - ts : 0) * tpn;
            if (got > reach)
                got = reach;
            /* lands * tpn + (start - base) <= cap, exact as words.late_window's */
            __int128 fill = (__int128)lands * tpn + (__int128)(int64_t)(start - base);
            if (lands <= LATE_SLACK_NS && got + tpn >= (unsigned __int128)ahead && fill <= (__int128)cap)
                continue; /* landing within a tick of its time, on its schedule */
            if (!callers_between(recs, nrecs, head, start, tail))
                continue; /* only ranges that grant no one ahead: late costs nobody a grant */
            ends = due + span;
            if (__atomic_compare_exchange_n(rec + 3, &word, word | FENCE_LATE, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)
                && __atomic_compare_exchange_n(rec + 2, &due, ends, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
                uint64_t h = __atomic_load_n(hint, __ATOMIC_SEQ_CST);
                while (h < ends
                       && !__atomic_compare_exchange_n(hint, &h, ends, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
                    ;
            }
        }
        /* landing within its time: the whole interval (its tokens would be granted within it);
         * after it: the part within it */
        uint64_t from = now <= ends ? ts : (ts > opens ? ts : opens), to = now <= ends ? now : ends;
        reserved += (unsigned __int128)(to - from) * tpn;
    }
    return reserved > UINT64_MAX ? UINT64_MAX : (uint64_t)reserved;
}

/* cells.fence_scan(hint_off, first, count, ts, now, tpn, head, ticket) -> (room, due) or None:
 * words.fence_scan for the Python replenish and schedule on this backend (one call). */
static PyObject *
cells_fence_scan(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t cnt, ts, now, tpn, head, ticket;
    if (!nargs(n, 8, "fence_scan") || !check_open(self))
        return NULL;
    uint64_t *hint = word(self, args[0]);
    uint64_t *first = hint ? word(self, args[1]) : NULL;
    if (!first || !u64(args[2], &cnt) || !u64(args[3], &ts) || !u64(args[4], &now) || !u64(args[5], &tpn)
        || !u64(args[6], &head) || !u64(args[7], &ticket))
        return NULL;
    if (tpn == 0 || cnt > 4096) {
        PyErr_SetString(PyExc_ValueError, "fence_scan: tpn must be >= 1 and count at most 4096");
        return NULL;
    }
    if (cnt > 0 && (Py_ssize_t)((char *)first - self->base) + (Py_ssize_t)((cnt - 1) * 32 + 16) > self->size - 8) {
        PyErr_SetString(PyExc_IndexError, "fence_scan: the records run past the mapping");
        return NULL;
    }
    int64_t room;
    double due;
    if (!fence_scan(hint, first, (Py_ssize_t)cnt, ts, now, tpn, head, ticket, &room, &due))
        Py_RETURN_NONE;
    return Py_BuildValue("(Ld)", (long long)room, due);
}

/* One claim and add of Bucket.replenish at clock reading `now` (0: read here), for a Waiter's
 * config: the tokens added.  *burn is set when the config changed between the claim and the add
 * (Bucket.apply then burns). */
static uint64_t
waiter_replenish_once(Waiter *w, uint64_t now, int *burn, int *cut_short)
{
    *cut_short = 0;
    /* claim: the config first (one load), then the words, then the clock (read by the caller
     * before this call would make the snapshot newer than the interval: it is read here) */
    if (wld(w->seq) != w->expected)
        return 0;
    uint64_t ts = wld(w->repl_ts);
    uint64_t snap_head = wld(w->snap_head);
    uint64_t snap_tail = wld(w->snap_tail);
    uint64_t base = wld(w->snap_base), end = wld(w->snap_end), next = wld(w->snap_next);
    uint64_t head = wld(w->head);
    uint64_t tail = wld(w->tail);
    if (now == 0)
        now = monotonic_ns();
    int64_t elapsed = (int64_t)(now - ts);
    if (elapsed < 0) {
        /* a REPL_TS ahead of the clock is corrupt: restart the clock, grant nothing for the past */
        wcas(w->repl_ts, ts, now);
        return 0;
    }
    if (elapsed == 0)
        return 0;
    uint64_t extra;
    if (__builtin_mul_overflow((uint64_t)elapsed, w->tpn, &extra))
        extra = UINT64_MAX;
    /* invariant 1 (bucket.py): a capacity from the start of the request the previous snapshot's
     * head stood in, never past the next boundary the records told */
    uint64_t limit = clamp_limit(base, end, next, w->cap, head, tail);
    /* the reservation fences in force for [ts, now] (Bucket.claim: read after the clamp words and
     * before the claim's CAS): no further than a fence, and none of the time a reservation the
     * head runs late for owns */
    int64_t fence_room;
    double fence_due;
    if (fence_scan(w->fence_hint, w->fence_first, w->fence_count, ts, now, w->tpn, head, head, &fence_room,
                   &fence_due)) {
        if (fence_room < (int64_t)(limit - head))
            limit = head + (uint64_t)fence_room;
        /* words.claim_of: the capacity's reach from the head (words.clamp_reach: its stop at a
         * recorded request not counted, as a promise counts it) and the start of the request the
         * head stands in (the head itself for words no snapshot could have left) */
        uint64_t reach = 0, from = head;
        if (clamp_sane(base, end, next, head, tail)) {
            uint64_t far = base + w->cap;
            if ((int64_t)(end - far) > 0)
                far = end;
            reach = (int64_t)(far - head) > 0 ? far - head : 0;
            from = base;
        }
        uint64_t owned = fence_reserved(w->fence_hint, w->fence_first, w->fence_count, ts, now, w->tpn, head, reach,
                                        from, w->cap, (uint64_t *const *)w->recs, w->nrecs, tail);
        extra = owned < extra ? extra - owned : 0;
    }
    if (!wcas(w->repl_ts, ts, now))
        return 0;
    __atomic_store_n(w->snap_head, head, __ATOMIC_SEQ_CST);
    __atomic_store_n(w->snap_tail, tail, __ATOMIC_SEQ_CST);
    /* new words (Bucket.claim), unless the older ones name a recorded request the head still
     * stands in: the records would name it again (never words no snapshot leaves) */
    if ((int64_t)(head - tail) >= 0 || base == end || (int64_t)(head - base) < 0 || (int64_t)(end - head) <= 0
        || !clamp_sane(base, end, next, head, tail)) {
        uint64_t words[3];
        if (clamp_words(w->recs, w->nrecs, w->head, head, tail, words)) {
            __atomic_store_n(w->snap_base, words[0], __ATOMIC_SEQ_CST);
            __atomic_store_n(w->snap_end, words[1], __ATOMIC_SEQ_CST);
            __atomic_store_n(w->snap_next, words[2], __ATOMIC_SEQ_CST);
        }
    }
    /* apply: add min(extra, limit - head) by CAS; another interval landed first: on top of it */
    uint64_t total;
    for (;;) {
        int64_t room = (int64_t)(limit - head);
        total = room <= 0 ? 0 : ((uint64_t)room < extra ? (uint64_t)room : extra);
        if (total == 0 || wcas(w->head, head, head + total))
            break;
        head = wld(w->head);
    }
    /* Bucket.apply's cut_short: the head moved to the clamp's limit (the add cut short there, or
     * just filling it: a crossing at its due instant), which only a snapshot taken there passes */
    /* or past the end of the request the words name (clamp.left_named): words of a granted
     * request would stop the next one inside it when it is the longer */
    uint64_t named_base = wld(w->snap_base), named_end = wld(w->snap_end);
    *cut_short = total > 0
                 && (head + total == limit
                     || ((int64_t)(named_end - named_base) > 0 && (int64_t)(head + total - named_end) >= 0));
    if (total < extra && (int64_t)(snap_tail - snap_head) > 0) {
        /* Bucket.apply: clamped time that callers queued from the interval's start were owed
         * (the head, after our add, still short of the tail), in whole ns rounded down */
        uint64_t after = head + total;
        int64_t owed = (int64_t)(wld(w->tail) - after);
        if (owed > 0) {
            uint64_t dropped = extra - total;
            uint64_t ns = ((uint64_t)owed < dropped ? (uint64_t)owed : dropped) / w->tpn;
            if (ns > 0)
                __atomic_fetch_add(w->lost, ns, __ATOMIC_SEQ_CST);
        }
    }
    if (total > 0 && wld(w->seq) != w->expected)
        *burn = 1;
    return total;
}

/* Bucket.replenish: one that added over a quarter of the capacity, or whose add the clamp cut short
 * (the head stopped at a boundary, which only a snapshot taken at it lets the next replenish pass),
 * or that left the request the clamp words name,
 * claims again at once, so that the next replenish clamps against the head it left.  `now` 0: the
 * clock, read at each claim.  At a given clock reading (tests) the second claim is made at the
 * reading `again` (an injected clock that moves between readings, as Bucket.replenish's does), or
 * skipped when `again` is 0: it would find nothing elapsed, as Bucket.replenish on a still fake
 * clock does. */
static uint64_t
waiter_replenish(Waiter *w, uint64_t now, uint64_t again, int *burn)
{
    int cut_short;
    uint64_t added = waiter_replenish_once(w, now, burn, &cut_short);
    if ((now == 0 || again != 0) && (added > w->cap / 4 || cut_short) && !*burn)
        added += waiter_replenish_once(w, again, burn, &cut_short);
    return added;
}

/* Is the filler lease free or expired (a waiter that replenished then nudges its filler)? */
static int
waiter_lease_lapsed(Waiter *w, uint64_t now)
{
    uint64_t l = wld(w->lease);
    return l == 0 || (l >> WAIT_LEASE_SLOT_BITS) <= now / 1000u;
}

/* Sleep to the CLOCK_MONOTONIC instant `at`, or until `skips` moves from `seen` (read before the
 * step that chose `at`: a skip or a close); 0 if interrupted by a signal or by close().  On Linux
 * the sleep is a private futex wait with an absolute CLOCK_MONOTONIC deadline (FUTEX_WAIT_BITSET)
 * on this process's `skips` word, so wake_waiters() and close() wake every waiter at once. */
static int
waiter_sleep(Waiter *w, uint64_t at, uint32_t seen)
{
#ifdef __linux__
    struct timespec ts = ns_timespec(at);
    long r = syscall(SYS_futex, &w->cells->skips, FUTEX_WAIT_BITSET | FUTEX_PRIVATE_FLAG, seen, &ts, NULL,
                     FUTEX_BITSET_MATCH_ANY);
    if (__atomic_load_n(&w->cells->closing, __ATOMIC_SEQ_CST))
        return 0;
    return r == 0 || errno != EINTR; /* woken (a skip: step again), the deadline, or `skips` moved */
#else
    (void)seen;
    return wait_plain_sleep(at);
#endif
}

/* A waiting thread's timer slack (ns), lowered at its first wait that sleeps and kept, as its slice
 * is: 0 until then.  Lowering it around every sleep and restoring it after cost three prctl calls
 * per wait (about 1.5 µs of CPU a grant, measured: 5-6 % of a grant's CPU at 10 000/s), and a
 * thread that waits once usually waits again.  The cost of keeping it: the thread's other timed
 * sleeps and timeouts end within 1 µs of their deadline instead of the default 50 µs (the kernel
 * batches fewer of its wake-ups), and the threads it starts afterwards begin with it (the kernel
 * copies the slack).  A forked child's thread gets the slack it had before back (the at-fork
 * handler: there is no reset-on-fork for the slack as there is for the slice), and lowers it
 * again at its own first wait.  A thread whose slack cannot be read (a seccomp filter) is not
 * tried again.  `wait_slack_orig`: the slack it had before (0: none to give back). */
static __thread long wait_slack_kept, wait_slack_orig;

static void
wait_low_slack(long slack)
{
#ifdef __linux__
    if (wait_slack_kept == slack)
        return;
    long old = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    if (!wait_slack_kept)
        wait_slack_orig = 0;
    if (old > 0 && old != slack && prctl(PR_SET_TIMERSLACK, (unsigned long)slack, 0, 0, 0) == 0 && !wait_slack_orig)
        wait_slack_orig = old; /* (a second waiter's other slack: the first one's original stays) */
    wait_slack_kept = slack;
#else
    (void)slack;
#endif
}

/* The loop of wait(), without the GIL. */
/* Does the head stop at `ticket`, so that a replenish that covers it late loses the time since it
 * fell due (the clamp cuts its add short there: Bucket.apply, counted starved)?  Always, when the
 * request alone fills the capacity (`tokens` >= cap: no snapshot, from its start or before, lets the
 * head past its end: min(max(base + cap, end), next) <= its end); else when the clamp words now
 * name it as the limit.  `tokens`: the request's length, 0 when unknown. */
static inline int
waiter_stops_at(Waiter *w, uint64_t ticket, uint64_t tokens)
{
    if (tokens >= w->cap)
        return 1;
    uint64_t head = wld(w->head);
    uint64_t base = wld(w->snap_base), end = wld(w->snap_end), next = wld(w->snap_next);
    return clamp_limit(base, end, next, w->cap, head, wld(w->tail)) == ticket; /* the tail after the words */
}

/* Stay awake until the CLOCK_MONOTONIC instant `due` (at most WAIT_STOP_LEAD_NS away): a sleep would
 * end tens of microseconds after it, and at a stop that lateness is lost to every request behind.
 * Leaves early on close() or a config change (the loop then returns). */
static void
waiter_spin(WaitBase *base, double due)
{
    while ((double)monotonic_ns() < due && !wait_leaving(base)) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#endif
    }
}

/* What one step of a Waiter's wait decided: the wait is over (*flags says how: WAIT_GRANTED among
 * them if granted and counted; without it the caller goes on in Python), or sleep to *at and step
 * again. */
#define STEP_DONE 0
#define STEP_SLEEP 1

/* One step of a Waiter's wait, never sleeping (at a stop it stays awake for the last
 * WAIT_STOP_LEAD_NS at most): wait()'s loop (waiter_loop) is these steps with a sleep to *at
 * between them, and an Acquirer's step() on an event loop is one of them, so both decide alike.
 * *flags gathers what the caller must act on (WAIT_NUDGE, WAIT_BURN) and WAIT_GRANTED. */
static inline int
waiter_step(Waiter *w, uint64_t ticket, uint64_t ops, uint64_t tokens, uint64_t until, int *flags, uint64_t *at_out)
{
    WaitBase *base = (WaitBase *)w;
    int burn = 0;
    double tpn = (double)w->tpn;
    for (;;) {
        if (wait_leaving(base))
            return STEP_DONE;
        /* the head first, then REPL_TS: read across a replenish, the pair can only make the
         * due time later, never earlier (Bucket.due_ns) */
        int64_t short_ = wait_short(base, ticket);
        if (short_ <= 0) {
            *flags = wait_grant(base, ops, *flags);
            return STEP_DONE;
        }
        uint64_t ts = wld(w->repl_ts);
        uint64_t now = monotonic_ns();
        double due = (double)ts + (double)short_ / tpn;
        int64_t fence_room;
        double fence_due;
        /* a reservation's fence before the ticket: the head gets there no sooner than its DUE and the
         * time from its LIMIT on at the rate (Bucket.due_ns); woken before, it would replenish in vain.
         * The horizon from now, as a claim counts it (only the due is used here) */
        if (fence_scan(w->fence_hint, w->fence_first, w->fence_count, ts, now > ts ? now : ts, w->tpn, wld(w->head), ticket, &fence_room,
                       &fence_due) && fence_due > due)
            due = fence_due;
        uint64_t at;
        if (due > (double)now) { /* not our turn yet: no replenish can help, sleep until it */
            double wake = due;
            if (waiter_stops_at(w, ticket, tokens)) {
                /* the head stops at our ticket: the replenish that covers it must come at `due`, not
                 * a wake's lateness after it (lost there, and to every request behind: each would
                 * wake for a turn that came later, and sleep again).  Sleep until a little before,
                 * and stay awake for the rest; never replenish before `due` (nothing early). */
                if (due - (double)now > (double)WAIT_STOP_LEAD_NS) {
                    wake = due - (double)WAIT_STOP_LEAD_NS;
                } else if (due <= (double)until) {
                    waiter_spin(base, due);
                    continue;
                } /* else: the wait ends at `until` first, asleep */
            }
            at = wait_deadline(wake, until, 1); /* the ns after `wake`: never before it */
        } else {
            /* our turn: replenishing adds whatever time has passed */
            if (waiter_replenish(w, 0, 0, &burn) > 0) {
                if (burn) {
                    *flags |= WAIT_BURN;
                    return STEP_DONE;
                }
                if (waiter_lease_lapsed(w, now))
                    *flags |= WAIT_NUDGE;
                if (wait_short(base, ticket) <= 0)
                    continue; /* covered: granted at the top (after the config check) */
            }
            /* due, yet short (another process's replenish in flight): look again soon, or when
             * the shortfall could have arrived */
            short_ = wait_short(base, ticket);
            double later = short_ > 0 ? (double)short_ / tpn : 0;
            at = now + (later > WAIT_RETRY_NS ? (uint64_t)later : WAIT_RETRY_NS);
            if (at > until)
                at = until;
        }
        *at_out = at;
        return STEP_SLEEP;
    }
}

static int
waiter_loop(WaitBase *base, uint64_t ticket, uint64_t ops, uint64_t tokens, uint64_t until)
{
    Waiter *w = (Waiter *)base;
    int flags = 0;
    uint64_t at;
    uint32_t seen = __atomic_load_n(&w->cells->skips, __ATOMIC_SEQ_CST); /* before the step's look */
    while (waiter_step(w, ticket, ops, tokens, until, &flags, &at) == STEP_SLEEP) {
        wait_short_slice();
        wait_low_slack(w->slack_ns);
        __atomic_fetch_add(&w->naps, 1, __ATOMIC_RELAXED);
        if (!waiter_sleep(w, at, seen) || at >= until)
            break;
        seen = __atomic_load_n(&w->cells->skips, __ATOMIC_SEQ_CST);
    }
    return flags;
}

/* Bumped in a forked child: the waiters counted in `busy` before the fork were the parent's
 * threads, which do not exist in the child. */
static unsigned long waiter_fork_gen = 1;
static void
waiter_atfork_child(void)
{
    waiter_fork_gen++;
    wait_slice_tried = 0; /* the kernel reset the slice of the child's thread (reset-on-fork) */
#ifdef __linux__
    /* the slack the forking thread had before its first wait (wait_low_slack), unless it is no
     * longer the one the wait set (the thread set its own since: that one stays) */
    if (wait_slack_orig > 0 && prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0) == wait_slack_kept)
        prctl(PR_SET_TIMERSLACK, (unsigned long)wait_slack_orig, 0, 0, 0);
#endif
    wait_slack_kept = wait_slack_orig = 0;
}

/* One more caller inside a loop that runs without the GIL (a wait, a fill): the mapping must
 * outlive it, and close() waits while `busy` counts any (it wakes them first).  After fork the
 * count is the parent's, whose other threads do not exist here: a process starts its own count.
 * The GIL held; the caller leaves with cells_leave. */
static void
cells_enter(NativeCells *c)
{
    if (c->busy_gen != waiter_fork_gen) {
        c->busy_gen = waiter_fork_gen;
        __atomic_store_n(&c->busy, 0, __ATOMIC_SEQ_CST);
    }
    __atomic_fetch_add(&c->busy, 1, __ATOMIC_SEQ_CST);
}

static void
cells_leave(NativeCells *c)
{
    __atomic_fetch_sub(&c->busy, 1, __ATOMIC_SEQ_CST);
}

/* A waiter type's loop, run without the GIL: the flags wait() answers. */
typedef int (*wait_loop_fn)(WaitBase *w, uint64_t ticket, uint64_t ops, uint64_t tokens, uint64_t until);

/* Everything a wait does around `loop`, the GIL held on entry and on return: the grant without
 * leaving the GIL when the ticket is covered already, the `busy` and WAITING (`waiting`, NULL: not
 * counted) counts, the GIL released.  `amount`: the ticket's request
 * length in tokens (0: unknown); `rec`: the LEN word of the ticket's record (holding `amount`),
 * freed at its grant (NULL: none), while `busy` still keeps the mapping. */
static int
wait_run(WaitBase *self, uint64_t ticket, uint64_t ops, uint64_t until, uint64_t *waiting, wait_loop_fn loop,
         uint64_t *rec, uint64_t amount)
{
    /* covered already (a fill or a batch came first): granted without leaving the GIL */
    if (wld(self->seq) == self->expected && wait_short(self, ticket) <= 0) {
        int granted = wait_grant(self, ops, 0);
        if (rec)
            wcas(rec, amount, 0); /* giveback.clear: the record is free (unless taken meanwhile) */
        return granted;
    }
    int rc;
    NativeCells *c = self->cells;
    cells_enter(c); /* the mapping outlives the loop */
    Py_INCREF(self);
    if (waiting) /* while it waits, the caller counts among its process's queued callers */
        __atomic_fetch_add(waiting, 1, __ATOMIC_SEQ_CST);
    Py_BEGIN_ALLOW_THREADS
    rc = loop(self, ticket, ops, amount, until);
    if (rec && (rc & WAIT_GRANTED))
        wcas(rec, amount, 0);
    if (waiting)
        __atomic_fetch_sub(waiting, 1, __ATOMIC_SEQ_CST);
    cells_leave(c);
    Py_END_ALLOW_THREADS
    Py_DECREF(self);
    return rc;
}

/* wait(ticket, ops, until_ns, count_waiting[, tokens]) of both waiter types: wait_run, without a
 * record; `tokens` the request's length (0, the default: unknown). */
static PyObject *
wait_call(WaitBase *self, PyObject *const *args, Py_ssize_t n, wait_loop_fn loop)
{
    uint64_t ticket, ops, until, tokens = 0;
    if (n != 5 && !nargs(n, 4, "wait"))
        return NULL;
    if (!check_open(self->cells))
        return NULL;
    if (!u64(args[0], &ticket) || !u64(args[1], &ops) || !u64(args[2], &until) || (n == 5 && !u64(args[4], &tokens)))
        return NULL;
    int count = PyObject_IsTrue(args[3]);
    if (count < 0)
        return NULL;
    return PyLong_FromLong(wait_run(self, ticket, ops, until, count ? self->waiting : NULL, loop, NULL, tokens));
}

static PyObject *
waiter_wait(Waiter *self, PyObject *const *args, Py_ssize_t n)
{
    return wait_call((WaitBase *)self, args, n, waiter_loop);
}

/* (tokens added, burn), the answer of replenish() and refill() on both waiter types. */
static PyObject *
replenish_result(uint64_t added, int burn)
{
    return Py_BuildValue("(KO)", (unsigned long long)added, burn ? Py_True : Py_False);
}

/* replenish(now_ns[, again_ns]): the first claim at the reading now_ns; the second, if the first
 * asks for it, at again_ns (after now_ns), else none. */
static PyObject *
waiter_replenish_at(Waiter *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t now, again = 0;
    if (n < 1 || n > 2) {
        PyErr_SetString(PyExc_TypeError, "replenish(now_ns[, again_ns]) takes one or two arguments");
        return NULL;
    }
    if (!check_open(self->cells) || !u64(args[0], &now) || (n == 2 && !u64(args[1], &again)))
        return NULL;
    if (now == 0) {
        PyErr_SetString(PyExc_ValueError, "replenish: now_ns must be >= 1");
        return NULL;
    }
    if (n == 2 && (int64_t)(again - now) <= 0) {
        PyErr_SetString(PyExc_ValueError, "replenish: again_ns must be after now_ns");
        return NULL;
    }
    int burn = 0;
    return replenish_result(waiter_replenish(self, now, again, &burn), burn);
}

/* refill() -> (tokens added, burn): Bucket.replenish now, the clock read after the words as in
 * wait() -- a filler's tick in one call. */
static PyObject *
waiter_refill(Waiter *self, PyObject *unused)
{
    (void)unused;
    if (!check_open(self->cells))
        return NULL;
    int burn = 0;
    return replenish_result(waiter_replenish(self, 0, 0, &burn), burn);
}

/* fill(period_ns, until_ns, lease_word, renewed_ns, renew_every_ns, lease_us, mark_ts, mark_head,
 * backed_off) -> (flags, fills, lease_word, renewed_ns, mark_ts, mark_head): the elected filler's
 * ticks at a pace its Python pacing (filler.ClockFeed) chose and would keep, without the GIL and
 * without returning to Python between them (ClockFeed.span).  Each step: sleep `period_ns` (as
 * the filler thread's time.sleep after a tick), renew the lease when `renew_every_ns` passed since
 * `renewed_ns` (a CAS from `lease_word` to the lease word of expiry now + `lease_us` and the same
 * slot bits: filler.Lease.renew), then refill (the tick's refill(), word for word) and leave
 * (REPL_TS, HEAD) after it as the mark, as a tick does.  With `backed_off` (the pace is the one the
 * filler backs off to while queued waiters refill at their turns: ClockFeed.queued) it keeps the
 * pace only while it sees what the Python tick needs to keep it: someone else refilled since the
 * mark, and the head gained every token of the time refilled since but `slack_ns` (default 0; the
 * stops' own ns: filler.slack_ns, a share of the usual pace; more is time lost to the clamp);
 * otherwise it leaves, before refilling when the others' refills already tell, the mark as it was
 * (FILL_PACE), so that the Python tick that follows judges the same interval.  It also ends at the
 * first of its instants at or past `until_ns` (that sleep is a whole pace too, and it leaves without
 * refilling: the Python tick that follows refills at the pace: FILL_UNTIL), when the queue is gone after a
 * refill (FILL_IDLE), when a renewal fails (FILL_LOST: lease_word answers 0), when our add raced a
 * config change (FILL_BURN: the caller burns, as after refill()), when the config it is bound to
 * changed, at close() or interrupt(), or on a signal (FILL_LEFT).  `fills` counts its refills.  It
 * counts in `busy` as a wait does, so close() wakes it and waits for it to leave. */
#define FILL_UNTIL 1
#define FILL_IDLE 2
#define FILL_LOST 4
#define FILL_BURN 8
#define FILL_LEFT 16
#define FILL_PACE 32

/* Did the refills from the mark (ts0, head0) to (ts, head) lose more than `slack` ns of their time to
 * the clamp (filler.ClockFeed.lost: the stops' own ns, filler.slack_ns, are no loss)? */
static inline int
fill_lost(Waiter *w, uint64_t ts0, uint64_t head0, uint64_t ts, uint64_t head, uint64_t slack)
{
    uint64_t owed;
    int64_t gained = (int64_t)(head - head0);
    int64_t elapsed = (int64_t)(ts - ts0);
    if (elapsed <= (int64_t)slack)
        return gained < 0;
    if (__builtin_mul_overflow((uint64_t)elapsed - slack, w->tpn, &owed) || owed > (uint64_t)INT64_MAX)
        return 1;
    return gained < (int64_t)owed;
}

typedef struct {
    uint64_t period, until, lease_word, renewed, renew_every, lease_us, mark_ts, mark_head, fills, slack;
    int backed_off;
} FillSpan;

/* The filler lease renewed at `now` (filler.Lease.renew): a CAS from *word to the word of expiry
 * now + lease_us with the same slot bits; 0, and *word 0, when another process holds it. */
static int
lease_renew(uint64_t *lease, uint64_t *word, uint64_t now, uint64_t lease_us)
{
    uint64_t slot = *word & ((1u << WAIT_LEASE_SLOT_BITS) - 1);
    uint64_t renewed = ((now / 1000u + lease_us) << WAIT_LEASE_SLOT_BITS) | slot;
    if (!wcas(lease, *word, renewed)) {
        *word = 0;
        return 0;
    }
    *word = renewed;
    return 1;
}

/* Wake this process's sleepers on `closing` (a span woken so looks at its stop flag). */
static void
filler_wake(NativeCells *c)
{
#ifdef __linux__
    if (!__atomic_load_n(&c->closing, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &c->closing, FUTEX_WAKE | FUTEX_PRIVATE_FLAG, INT_MAX, NULL, NULL, 0);
#else
    (void)c;
#endif
}

/* A native filler span's sleep until `at`, on its process's `closing` word (close() and the
 * spans' interrupt() wake it): 0, or 1 on a signal. */
static int
filler_sleep(NativeCells *c, uint64_t at)
{
#ifdef __linux__
    struct timespec ts = ns_timespec(at);
    long r = syscall(SYS_futex, &c->closing, FUTEX_WAIT_BITSET | FUTEX_PRIVATE_FLAG, 0, &ts, NULL,
                     FUTEX_BITSET_MATCH_ANY);
    return r != 0 && errno == EINTR;
#else
    return !wait_plain_sleep(at);
#endif
}

static int
waiter_fill_loop(Waiter *w, FillSpan *f)
{
    for (;;) {
        if (__atomic_load_n(&w->stop, __ATOMIC_SEQ_CST))
            return FILL_LEFT;
        uint64_t at = monotonic_ns() + f->period;
        /* past `until`: a whole pace still, and leave before refilling, so the Python tick that
         * follows refills at the pace and judges a whole interval (a shorter one, at a pace of an
         * op or less, often holds no refill of the waiters', who keep the pace only once per op) */
        int last = at > f->until;
        if (filler_sleep(w->cells, at))
            return FILL_LEFT;
        if (span_leaving((WaitBase *)w))
            return FILL_LEFT;
        if (last)
            return FILL_UNTIL;
        uint64_t now = monotonic_ns();
        if (now - f->renewed >= f->renew_every) {
            if (!lease_renew(w->lease, &f->lease_word, now, f->lease_us))
                return FILL_LOST;
            f->renewed = now;
        }
        if (f->backed_off) { /* the others' refills since the mark, as the tick would see them */
            uint64_t head0 = wld(w->head), before = wld(w->repl_ts);
            if (before == f->mark_ts || fill_lost(w, f->mark_ts, f->mark_head, before, head0, f->slack))
                return FILL_PACE;
        }
        int burn = 0;
        waiter_replenish(w, 0, 0, &burn);
        f->fills++;
        if (burn)
            return FILL_BURN;
        uint64_t ts_after = wld(w->repl_ts), head = wld(w->head);
        if (f->backed_off && fill_lost(w, f->mark_ts, f->mark_head, ts_after, head, f->slack))
            return FILL_PACE;
        if ((int64_t)(wld(w->tail) - head) <= 0)
            return FILL_IDLE;
        f->mark_ts = ts_after;
        f->mark_head = head;
    }
}

static PyObject *
waiter_fill(Waiter *self, PyObject *const *args, Py_ssize_t n)
{
    FillSpan f = {0};
    if (n != 9 && n != 10) {
        PyErr_Format(PyExc_TypeError, "fill() takes 9 or 10 arguments (%zd given)", n);
        return NULL;
    }
    if (!check_open(self->cells) || (n == 10 && !u64(args[9], &f.slack)))
        return NULL;
    if (!u64(args[0], &f.period) || !u64(args[1], &f.until) || !u64(args[2], &f.lease_word) ||
        !u64(args[3], &f.renewed) || !u64(args[4], &f.renew_every) || !u64(args[5], &f.lease_us) ||
        !u64(args[6], &f.mark_ts) || !u64(args[7], &f.mark_head))
        return NULL;
    f.backed_off = PyObject_IsTrue(args[8]);
    if (f.backed_off < 0)
        return NULL;
    if (f.period < 1 || f.lease_word == 0 || f.lease_us >= ((uint64_t)1 << 40) || f.slack >= ((uint64_t)1 << 62)) {
        PyErr_SetString(PyExc_ValueError,
                        "fill: period_ns >= 1, a lease word held (not 0), lease_us < 2**40, slack_ns < 2**62");
        return NULL;
    }
    int rc;
    NativeCells *c = self->cells;
    cells_enter(c);
    Py_INCREF(self);
    Py_BEGIN_ALLOW_THREADS
    rc = waiter_fill_loop(self, &f);
    cells_leave(c);
    Py_END_ALLOW_THREADS
    Py_DECREF(self);
    return Py_BuildValue("(iKKKKK)", rc, (unsigned long long)f.fills, (unsigned long long)f.lease_word,
                         (unsigned long long)f.renewed, (unsigned long long)f.mark_ts, (unsigned long long)f.mark_head);
}

/* interrupt(): a filler span (Waiter.fill, FedWaiter.deliver) in progress in another thread ends
 * at once, and every later one of this waiter: the flag, then a wake of this process's sleepers on
 * `closing` (the spans; waiters sleep on `skips`). */
static PyObject *
wait_interrupt(WaitBase *self, PyObject *unused)
{
    (void)unused;
    __atomic_store_n(&self->stop, 1, __ATOMIC_SEQ_CST);
    filler_wake(self->cells);
    Py_RETURN_NONE;
}

/* Acquirer: the acquire fast path of one op, untimed, as one call -- a Grabber bound to records
 * and a Waiter of the same cells and config.  The grab claims a record before the CAS that takes a
 * ticket and stores its LEN after it (grab_recorded); a queued ticket is then waited for at once
 * (wait_run, counted in WAITING), and its record freed at its grant, as Python's wait_for_ticket
 * does with a Grabber's ticket and Waiter.wait.  So a waited grant costs one call, and no
 * Python runs between the grab and the grant.
 *
 * acq([until_ns]) answers None (granted: counted, its record free), False (nothing taken: the
 * config changed, the queue is full, or every record is in use -- the slow path naps in RECORD),
 * the ticket (still held, still recorded: the wait returned at `until_ns` -- now + max_nap_ns
 * by default --, on a config change, close() or a signal whose handlers raised nothing), or
 * (flags, ticket) when the wait's flags ask Python for more (WAIT_NUDGE, WAIT_BURN; granted if
 * WAIT_GRANTED is among them).  A signal handler that raises (KeyboardInterrupt) while the ticket
 * is held: `give(ticket, tokens, rec_offset, flags)` gives it back (and acts on the flags) before
 * the exception leaves, as wait_for_ticket's except clause does. */
typedef struct {
    BOUND_FIELDS
    Grabber *grab;
    WaitBase *waiter; /* a Waiter (waiter_loop) or a FedWaiter (fed_loop): `loop` is its type's */
    wait_loop_fn loop;
    PyObject *give;
    uint64_t max_nap_ns;
} Acquirer;

static void
acquirer_dealloc(Acquirer *self)
{
    Py_XDECREF(self->grab);
    Py_XDECREF(self->waiter);
    Py_XDECREF(self->give);
    bound_dealloc((Bound *)self);
}

/* The grab of acq() and take(): grab_recorded, or GRAB_NONE once the config changed or close()
 * began (taking nothing). */
static int
acquirer_grab(Acquirer *self, uint64_t *ticket, uint64_t **rec)
{
    Grabber *g = self->grab;
    *rec = NULL;
    if (wld(g->seq) != g->expected || records_left(self->cells))
        return GRAB_NONE;
    return grab_recorded(g->tail, g->head, g->grants, g->amount, g->ops, g->recs, g->nrec, ticket, rec);
}

static PyObject *
acquirer_call(Acquirer *self, PyObject *args, PyObject *kwds)
{
    uint64_t until = 0;
    Py_ssize_t na = PyTuple_GET_SIZE(args);
    if ((kwds && PyDict_GET_SIZE(kwds)) || na > 1) {
        PyErr_SetString(PyExc_TypeError, "acquirer takes at most one positional argument (until_ns)");
        return NULL;
    }
    if (na == 1 && !u64(PyTuple_GET_ITEM(args, 0), &until))
        return NULL;
    if (!check_open(self->cells))
        return NULL;
    Grabber *g = self->grab;
    uint64_t ticket = 0, *rec = NULL;
    int got = acquirer_grab(self, &ticket, &rec);
    if (got == GRAB_GRANTED)
        Py_RETURN_NONE;
    if (got != GRAB_QUEUED)
        Py_RETURN_FALSE;
    if (na == 0)
        until = monotonic_ns() + self->max_nap_ns;
    WaitBase *w = self->waiter;
    int rc = wait_run(w, ticket, g->ops, until, w->waiting, self->loop, rec, g->amount);
    if (rc == WAIT_GRANTED)
        Py_RETURN_NONE;
    if (!(rc & WAIT_GRANTED) && PyErr_CheckSignals() < 0) {
        /* a handler raised while we hold the ticket: give it back before the exception leaves */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *r = PyObject_CallFunction(self->give, "KKni", (unsigned long long)ticket, (unsigned long long)g->amount,
                                            (Py_ssize_t)((char *)rec - self->cells->base), rc);
        if (r)
            Py_DECREF(r);
        else
            PyErr_WriteUnraisable(self->give);
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
    if (rc & WAIT_GRANTED)
        return Py_BuildValue("(iK)", rc, (unsigned long long)ticket);
    handed.cells = self->cells; /* still held: see HANDED */
    handed.ticket = ticket;
    if (rc == 0)
        return PyLong_FromUnsignedLongLong(ticket);
    return Py_BuildValue("(iK)", rc, (unsigned long long)ticket);
}

/* The same grab and wait for a caller that must not block (an event loop): take() grabs; step()
 * is one step of the wait (waiter_step: what acq()'s wait decides between two of its sleeps),
 * and the caller sleeps where it waits, to the instant the step answers, then steps again.  So a
 * wake on a loop costs one call, as the wait's own wake costs one look.  Only a Waiter's wait has
 * steps (a FedWaiter's sleeps on the wake word: take() answers False, taking nothing).
 *
 * take() -> None (granted: counted), False (nothing taken, as acq()'s), or the ticket: queued,
 * recorded, and its caller counted in WAITING until step() grants it; a caller that leaves
 * otherwise gives the ticket back and uncounts itself (Request.end).
 * step(ticket) -> None (granted: counted, its record freed, no longer counted in WAITING), the
 * CLOCK_MONOTONIC ns to sleep to before the next step (at most max_nap_ns away, to look at the
 * config now and then), False (the step cannot decide: the config changed or close() began; the
 * ticket is still held, recorded and counted: the Python steps take over), or (flags, one of
 * those) when the flags ask Python for more (WAIT_NUDGE; WAIT_BURN, with False). */
static PyObject *
acquirer_take(Acquirer *self, PyObject *unused)
{
    (void)unused;
    if (!check_open(self->cells))
        return NULL;
    uint64_t ticket = 0, *rec;
    int got = self->loop == waiter_loop ? acquirer_grab(self, &ticket, &rec) : GRAB_NONE;
    if (got == GRAB_GRANTED)
        Py_RETURN_NONE;
    if (got != GRAB_QUEUED)
        Py_RETURN_FALSE;
    if (self->waiter->waiting) /* queued: counted among its process's queued callers until granted */
        __atomic_fetch_add(self->waiter->waiting, 1, __ATOMIC_SEQ_CST);
    return hand_ticket(self->cells, ticket);
}

static PyObject *
acquirer_step(Acquirer *self, PyObject *arg)
{
    uint64_t ticket, at = 0;
    if (!check_open(self->cells) || !u64(arg, &ticket))
        return NULL;
    if (self->loop != waiter_loop) {
        PyErr_SetString(PyExc_TypeError, "step: only a Waiter's wait has steps");
        return NULL;
    }
    Grabber *g = self->grab;
    Waiter *w = (Waiter *)self->waiter;
    int flags = 0;
    PyObject *next;
    if (waiter_step(w, ticket, g->ops, g->amount, monotonic_ns() + self->max_nap_ns, &flags, &at) == STEP_SLEEP) {
        next = PyLong_FromUnsignedLongLong(at);
        if (!next)
            return NULL;
    } else if (flags & WAIT_GRANTED) {
        free_record(g->recs, g->nrec, ticket, g->amount);
        if (w->waiting)
            __atomic_fetch_sub(w->waiting, 1, __ATOMIC_SEQ_CST);
        Py_INCREF(Py_None);
        next = Py_None;
    } else {
        Py_INCREF(Py_False);
        next = Py_False;
    }
    flags &= ~WAIT_GRANTED;
    if (!flags)
        return next;
    return Py_BuildValue("(iN)", flags, next);
}

static PyMethodDef acquirer_methods[] = {
    {"take", (PyCFunction)acquirer_take, METH_NOARGS,
     "take() -> None (granted), False (nothing taken) or the ticket, queued and counted waiting"},
    {"step", (PyCFunction)acquirer_step, METH_O,
     "step(ticket) -> None (granted), the ns to sleep to, False (Python takes over), or (flags, one of those)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject AcquirerType = {
    NATIVE_TYPE("Acquirer", Acquirer, "A Grabber's grab and a Waiter's wait as one call: acq([until_ns])."),
    .tp_call = (ternaryfunc)acquirer_call,
    .tp_dealloc = (destructor)acquirer_dealloc,
    .tp_methods = acquirer_methods,
};

/* acquirer(grabber, give, max_nap_ns) -> an Acquirer: this waiter's wait after `grabber`'s grab,
 * which must be bound to records and to this waiter's cells, config and words.  Both waiter types
 * have one (`loop` their wait's loop, `tail` their TAIL word or NULL: a FedWaiter binds none). */
static PyObject *
make_acquirer(WaitBase *self, uint64_t *tail, wait_loop_fn loop, PyObject *const *args, Py_ssize_t n)
{
    uint64_t max_nap;
    if (!nargs(n, 3, "acquirer") || !check_open(self->cells) || !u64(args[2], &max_nap))
        return NULL;
    if (!Py_IS_TYPE(args[0], &GrabberType)) {
        PyErr_SetString(PyExc_TypeError, "acquirer: grabber must be a Grabber");
        return NULL;
    }
    Grabber *g = (Grabber *)args[0];
    if (!g->recorded || g->cells != self->cells || g->seq != self->seq || g->expected != self->expected ||
        g->head != self->head || (tail && g->tail != tail) || g->grants != self->grants) {
        PyErr_SetString(PyExc_ValueError,
                        "acquirer: the grabber must be bound to records and to the waiter's cells, config and words");
        return NULL;
    }
    if (!PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "acquirer: give must be callable");
        return NULL;
    }
    if (max_nap < 1 || max_nap > 60000000000u) {
        PyErr_SetString(PyExc_ValueError, "acquirer: 1 <= max_nap_ns <= 60e9");
        return NULL;
    }
    Acquirer *a = PyObject_New(Acquirer, &AcquirerType);
    if (!a)
        return NULL;
    Py_INCREF(self->cells);
    a->cells = self->cells;
    Py_INCREF(g);
    a->grab = g;
    Py_INCREF(self);
    a->waiter = self;
    a->loop = loop;
    Py_INCREF(args[1]);
    a->give = args[1];
    a->max_nap_ns = max_nap;
    return (PyObject *)a;
}

static PyObject *
waiter_acquirer(Waiter *self, PyObject *const *args, Py_ssize_t n)
{
    return make_acquirer((WaitBase *)self, self->tail, waiter_loop, args, n);
}

static PyMethodDef waiter_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))waiter_wait, METH_FASTCALL,
     "wait(ticket, ops, until_ns, count_waiting[, tokens]) -> flags: 1 granted (ops counted), 2 nudge the filler, 4 burn"},
    {"replenish", (PyCFunction)(void (*)(void))waiter_replenish_at, METH_FASTCALL,
     "replenish(now_ns[, again_ns]) -> (tokens added, burn): Bucket.replenish at that clock reading "
     "(its second claim, if any, at again_ns)"},
    {"acquirer", (PyCFunction)(void (*)(void))waiter_acquirer, METH_FASTCALL,
     "acquirer(grabber, give, max_nap_ns) -> an Acquirer: grabber's grab, then this wait, in one call"},
    {"refill", (PyCFunction)waiter_refill, METH_NOARGS,
     "refill() -> (tokens added, burn): Bucket.replenish now (the clock read after the words)"},
    {"fill", (PyCFunction)(void (*)(void))waiter_fill, METH_FASTCALL,
     "fill(period_ns, until_ns, lease_word, renewed_ns, renew_every_ns, lease_us, mark_ts, mark_head, backed_off"
     "[, slack_ns]) -> "
     "(flags, fills, lease_word, renewed_ns, mark_ts, mark_head): the filler's ticks at its pace without the GIL "
     "(1 until, 2 idle, 4 lease lost, 8 burn, 16 left, 32 the pace ends)"},
    {"interrupt", (PyCFunction)wait_interrupt, METH_NOARGS,
     "interrupt(): a fill() in progress ends at once, and every later one"},
    {NULL, NULL, 0, NULL},
};

static PyObject *
waiter_get_naps(WaitBase *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&self->naps, __ATOMIC_RELAXED));
}

/* both waiter types' getters (WAIT_FIELDS) */
static PyGetSetDef waiter_getset[] = {
    {"naps", (getter)waiter_get_naps, NULL, "how many times this waiter's calls slept", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static void
waiter_dealloc(Waiter *self)
{
    PyMem_Free(self->recs);
    bound_dealloc((Bound *)self);
}

static PyTypeObject WaiterType = {
    NATIVE_TYPE("Waiter", Waiter, "A queued caller's wait for its ticket, in one call without the GIL."),
    .tp_dealloc = (destructor)waiter_dealloc,
    .tp_methods = waiter_methods,
    .tp_getset = waiter_getset,
};

/* The half of a waiter constructor both types share: `n` must be `want`; the args at the offsets
 * `at[0..k)` are bound as words into w[] (word(): checked against the mapping), the one at
 * `waiting_at` as *waiting (None: NULL), args[1] read as *expected.  0 with an exception set. */
static int
wait_bind(NativeCells *self, PyObject *const *args, Py_ssize_t n, Py_ssize_t want, const char *name,
          int waiting_at, const int *at, int k, uint64_t **w, uint64_t **waiting, uint64_t *expected)
{
    if (!nargs(n, want, name) || !check_open(self))
        return 0;
    *waiting = NULL;
    if (args[waiting_at] != Py_None && !(*waiting = word(self, args[waiting_at])))
        return 0;
    for (int i = 0; i < k; i++)
        if (!(w[i] = word(self, args[at[i]])))
            return 0;
    return u64(args[1], expected);
}

/* A new waiter of `type` bound to `self` (a reference held: the mapping outlives it) with the
 * WAIT_FIELDS set and no naps; the caller sets the rest of its type's fields. */
static WaitBase *
wait_new(NativeCells *self, PyTypeObject *type, uint64_t *seq, uint64_t *head, uint64_t *grants,
         uint64_t *waiting, uint64_t expected)
{
    WaitBase *g = PyObject_New(WaitBase, type); /* tp_basicsize: the whole Waiter or FedWaiter */
    if (!g)
        return NULL;
    Py_INCREF(self);
    g->cells = self;
    g->seq = seq;
    g->head = head;
    g->grants = grants;
    g->waiting = waiting;
    g->expected = expected;
    g->naps = 0;
    g->stop = 0;
    return g;
}

/* The bucket's words a waiter reads, in the order of the `words` tuple waiter() takes
 * (rovers.WAITER_WORDS): seq, tail, head, repl_ts, snap_head, snap_tail, lease, lost, snap_base,
 * snap_end, snap_next. */
#define WAITER_NWORDS 11

static PyObject *waiter_bind(NativeCells *self, PyObject *const *args, Py_ssize_t n);

/* waiter(words, expected, grants, waiting, tpn, cap, slack_ns, records, fences) -> a Waiter (see
 * above); `words` the bucket's word offsets (WAITER_NWORDS, a tuple); `waiting` is a word offset or
 * None; `records` every ticket record's LEN offset (a tuple); `fences` (FENCE_HINT, the first
 * record's START, how many records).  Laid out flat for waiter_bind, which checks each. */
static PyObject *
cells_waiter(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    if (!nargs(n, 9, "waiter"))
        return NULL;
    if (!PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != WAITER_NWORDS) {
        PyErr_SetString(PyExc_TypeError, "waiter: words must be a tuple of 11 word offsets");
        return NULL;
    }
    if (!PyTuple_CheckExact(args[8]) || PyTuple_GET_SIZE(args[8]) != 3) {
        PyErr_SetString(PyExc_TypeError, "waiter: fences must be a tuple (hint, first, count)");
        return NULL;
    }
    PyObject *const *w = &PyTuple_GET_ITEM(args[0], 0), *const *f = &PyTuple_GET_ITEM(args[8], 0);
    PyObject *flat[21] = {w[0], args[1], w[1], w[2], w[3], w[4], w[5], w[6], args[2], args[3], args[4],
                          args[5], args[6], w[7], w[8], w[9], w[10], args[7], f[0], f[1], f[2]};
    return waiter_bind(self, flat, 21);
}

/* The flat form: (seq, expected, tail, head, repl_ts, snap_head, snap_tail, lease, grants, waiting,
 * tpn, cap, slack_ns, lost, snap_base, snap_end, snap_next, records, fence_hint, fence_first,
 * fence_count). */
static PyObject *
waiter_bind(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t *w[14], *waiting, expected, tpn, cap, slack, fcount;
    const int at[14] = {0, 2, 3, 4, 5, 6, 7, 8, 13, 14, 15, 16, 18, 19};
    if (!wait_bind(self, args, n, 21, "waiter", 9, at, 14, w, &waiting, &expected))
        return NULL;
    if (!u64(args[10], &tpn) || !u64(args[11], &cap) || !u64(args[12], &slack) || !u64(args[20], &fcount))
        return NULL;
    if (fcount > 4096 || (fcount > 0 && (Py_ssize_t)((char *)w[13] - self->base) + (Py_ssize_t)((fcount - 1) * 32 + 24)
                                            > self->size - 8)) {
        PyErr_SetString(PyExc_IndexError, "waiter: the fence records run past the mapping");
        return NULL;
    }
    if (tpn < 1 || cap < 1 || cap > ((uint64_t)1 << 62) || slack < 1 || slack > 1000000000u) {
        PyErr_SetString(PyExc_ValueError, "waiter: tpn >= 1, 1 <= cap <= 2**62, 1 <= slack_ns <= 1e9");
        return NULL;
    }
    Py_ssize_t nrecs;
    uint64_t **recs = records_new(self, args[17], "waiter", &nrecs);
    if (!recs)
        return NULL;
    Waiter *g = (Waiter *)wait_new(self, &WaiterType, w[0], w[2], w[7], waiting, expected);
    if (!g) {
        PyMem_Free(recs);
        return NULL;
    }
    g->fence_hint = w[12];
    g->fence_first = w[13];
    g->fence_count = (Py_ssize_t)fcount;
    g->snap_base = w[9];
    g->snap_end = w[10];
    g->snap_next = w[11];
    g->recs = recs;
    g->nrecs = nrecs;
    g->tail = w[1];
    g->repl_ts = w[3];
    g->snap_head = w[4];
    g->snap_tail = w[5];
    g->lease = w[6];
    g->lost = w[8];
    g->tpn = tpn;
    g->cap = cap;
    g->slack_ns = (long)slack;
    return (PyObject *)g;
}
/* close(): wake the waiters of this process and wait until none is inside (they leave at once:
 * each looks at `closing` before every step and after every sleep). */
static void
waiters_leave(NativeCells *self)
{
    __atomic_store_n(&self->closing, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&self->skips, 1, __ATOMIC_SEQ_CST); /* a waiter about to sleep returns at once */
    if (self->busy_gen != waiter_fork_gen || __atomic_load_n(&self->busy, __ATOMIC_SEQ_CST) == 0)
        return;
#ifdef __linux__
    syscall(SYS_futex, &self->skips, FUTEX_WAKE | FUTEX_PRIVATE_FLAG, INT_MAX, NULL, NULL, 0);
    syscall(SYS_futex, &self->closing, FUTEX_WAKE | FUTEX_PRIVATE_FLAG, INT_MAX, NULL, NULL, 0);
    if (self->fed_word) /* FED WAIT: the shared word (other processes' waiters wake too, look, sleep again) */
        syscall(SYS_futex, self->fed_word, FUTEX_WAKE_BITSET, INT_MAX, NULL, NULL, FUTEX_BITSET_MATCH_ANY);
#endif
    Py_BEGIN_ALLOW_THREADS
    while (__atomic_load_n(&self->busy, __ATOMIC_SEQ_CST) > 0) {
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
    Py_END_ALLOW_THREADS
}
/* wake_waiters(): the waiters of this process step again (they sleep on `skips`, see waiter_sleep). */
static void
waiters_wake(NativeCells *self)
{
    __atomic_fetch_add(&self->skips, 1, __ATOMIC_SEQ_CST);
#ifdef __linux__
    if (self->busy_gen == waiter_fork_gen && __atomic_load_n(&self->busy, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, &self->skips, FUTEX_WAKE | FUTEX_PRIVATE_FLAG, INT_MAX, NULL, NULL, 0);
#endif
}
/* ======================================================================================
 * END WAITER
 * ====================================================================================== */

/* ======================================================================================
 * FED WAIT: hierarchical mode's waits, woken across processes when leased tokens land
 * ======================================================================================
 *
 * In hierarchical mode tokens come with leased batches, not with the clock, so no wait is
 * computable from REPL_TS.  Instead a waiter sleeps on a shared futex word (the low 32 bits of
 * the segment word UP_WAKE; a non-private futex, keyed by the mapping, so other processes'
 * wakes reach it), and whoever moves the head (Bucket.add, forgive, a fallback switch) bumps the
 * word and wakes the waiters whose tickets it covered: a waiter sleeps with the bit of its
 * ticket's op index (ticket / cost mod 32), the waker wakes the bits of every op index its move
 * covered (all 32 for 32 or more).  A waker that bumps the word between a waiter's load of it and
 * the waiter's sleep makes the sleep return at once (the kernel compares the word): no wake is
 * lost.  Every sleep still ends at a deadline: a missed or foreign move costs at most that.
 *
 * futex_wait(off, expected, bitset, deadline_ns) and futex_wake(off, bitset) are the two
 * primitives (the atomics backend has them through libc, futex.py); fed_waiter(...) is a
 * ticket's whole wait in one call without the GIL, like a Waiter, for this mode.
 */
static inline uint32_t *
fed_word32(uint64_t *w)
{
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (uint32_t *)w + 1; /* the low half */
#else
    return (uint32_t *)w;
#endif
}

/* Sleep on `w` while it holds `expected`, until CLOCK_MONOTONIC `at`: 0 woken (or the word
 * differed), ETIMEDOUT, EINTR; elsewhere than Linux a plain sleep to `at`. */
static int
fed_sleep(uint32_t *w, uint32_t expected, uint32_t bitset, uint64_t at)
{
#ifdef __linux__
    struct timespec ts = ns_timespec(at);
    long r = syscall(SYS_futex, w, FUTEX_WAIT_BITSET, expected, &ts, NULL, bitset ? bitset : FUTEX_BITSET_MATCH_ANY);
    if (r == 0 || errno == EAGAIN)
        return 0;
    return errno == ETIMEDOUT ? ETIMEDOUT : EINTR;
#else
    (void)w; (void)expected; (void)bitset;
    return wait_plain_sleep(at) ? ETIMEDOUT : EINTR;
#endif
}

/* futex_wait(off, expected, bitset, deadline_ns) -> False once the deadline passed, else True
 * (woken, the word no longer `expected`'s low 32 bits, or a signal): the caller looks again. */
static PyObject *
cells_futex_wait(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t *w, expected, bitset, at;
    if (!nargs(n, 4, "futex_wait") || !check_open(self) || !(w = word(self, args[0])))
        return NULL;
    if (!u64(args[1], &expected) || !u64(args[2], &bitset) || !u64(args[3], &at))
        return NULL;
    if (bitset == 0 || bitset > 0xffffffffu) {
        PyErr_SetString(PyExc_ValueError, "futex_wait: bitset must be in [1, 2**32)");
        return NULL;
    }
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = fed_sleep(fed_word32(w), (uint32_t)expected, (uint32_t)bitset, at);
    Py_END_ALLOW_THREADS
    if (r == ETIMEDOUT)
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* futex_wake(off, bitset) -> how many sleepers on the word (any process) were woken. */
static PyObject *
cells_futex_wake(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t *w, bitset;
    if (!nargs(n, 2, "futex_wake") || !check_open(self) || !(w = word(self, args[0])) || !u64(args[1], &bitset))
        return NULL;
    if (bitset == 0 || bitset > 0xffffffffu) {
        PyErr_SetString(PyExc_ValueError, "futex_wake: bitset must be in [1, 2**32)");
        return NULL;
    }
#ifdef __linux__
    long r = syscall(SYS_futex, fed_word32(w), FUTEX_WAKE_BITSET, INT_MAX, NULL, NULL, (uint32_t)bitset);
    return PyLong_FromLong(r < 0 ? 0 : r);
#else
    return PyLong_FromLong(0);
#endif
}

#define FED_NUDGE_NS 2000000u /* acquisition.POLL: the filler lease lapsed, come back this soon */

typedef struct {
    WAIT_FIELDS
    uint64_t *lease, *wake, *next_ns;
    uint64_t cost, tpn, grace_ns;
    /* 0: this process may take a lapsed lease (its nudge does), so a lapse is looked at again soon.
     * Else it cannot (it attached by name, without the upstream): its look changes nothing, and it
     * sleeps until the lease's expiry plus this long, by when a process that can (its waiters'
     * nudge, or a watching filler thread, within filler.WATCH_PERIOD) has taken the lease over;
     * the new filler's batch wakes it sooner.  Set by Python (attachment.update_fast). */
    uint64_t takeover_ns;
    /* DELIVER (bind_delivery): the words the elected filler's deliveries touch, NULL until bound */
    uint64_t *tail, *fence_hint, *repl_ts, *state, *wanting, *hungry, *leases, *records;
    uint64_t cap, nrecords_;
} FedWaiter;

/* Until when a fed waiter sleeps at most without a wake (Bucket.fed_deadline): the batch the
 * filler expects next (UP_NEXT_NS) or the ticket's turn at the local rate, whichever is later,
 * plus grace_ns.  A living filler's batch wakes it before; a dead one's does not, and the waiter
 * then looks at the lease (only waiters nudge a filler in this mode).  Never after `until`. */
static uint64_t
fed_deadline(FedWaiter *w, uint64_t now, uint64_t short_, uint64_t until)
{
    uint64_t nxt = wld(w->next_ns);
    double turn = (double)now + (double)short_ / (double)w->tpn;
    double at = ((double)nxt > turn ? (double)nxt : turn) + (double)w->grace_ns;
    return wait_deadline(at, until, 0);
}

/* The loop of a fed wait, without the GIL: granted once the head covers the ticket; asleep on the
 * word with the ticket's bit meanwhile; back to Python at `until`, on a changed config, a signal or
 * close(), and soon (WAIT_NUDGE) when the filler lease lapsed: only a filler leases. */
static int
fed_loop(WaitBase *base, uint64_t ticket, uint64_t ops, uint64_t tokens, uint64_t until)
{
    (void)tokens; /* (the futex sleep keeps the thread's timer slack as it is) */
    FedWaiter *w = (FedWaiter *)base;
    uint32_t *word = fed_word32(w->wake);
    uint32_t bit = 1u << ((ticket / w->cost) & 31);
    int flags = 0;
    for (;;) {
        if (wait_leaving(base))
            return flags;
        uint32_t v = __atomic_load_n(word, __ATOMIC_SEQ_CST); /* before the head: a move after it changes v */
        int64_t short_ = wait_short(base, ticket);
        if (short_ <= 0)
            return wait_grant(base, ops, flags);
        uint64_t now = monotonic_ns();
        if (now >= until)
            return flags;
        uint64_t at = fed_deadline(w, now, (uint64_t)short_, until);
        uint64_t l = wld(w->lease);
        if (l == 0 || (l >> WAIT_LEASE_SLOT_BITS) <= now / 1000u) {
            uint64_t soon = now + FED_NUDGE_NS;
            if (w->takeover_ns) { /* not ours to take: look once the take-over is due (past it: as usual) */
                uint64_t over = (l >> WAIT_LEASE_SLOT_BITS) * 1000u + w->takeover_ns;
                soon = over > now ? (over > soon ? over : soon) : at;
            } else {
                flags |= WAIT_NUDGE;
            }
            if (at > soon)
                at = soon;
        }
        __atomic_fetch_add(&w->naps, 1, __ATOMIC_RELAXED);
        wait_short_slice(); /* woken by a batch, it preempts as a local waiter does */
        int r = fed_sleep(word, v, bit, at);
        if (r == EINTR)
            return flags;
        if (r == ETIMEDOUT && at < until) { /* a deadline before `until` (a lapsed lease's short sleep, the
                                              * take-over's, the batch's grace): a last look, then Python's */
            if (wait_short(base, ticket) <= 0 && wld(w->seq) == w->expected)
                return wait_grant(base, ops, flags);
            return flags;
        }
    }
}

static PyObject *
fed_wait(FedWaiter *self, PyObject *const *args, Py_ssize_t n)
{
    return wait_call((WaitBase *)self, args, n, fed_loop);
}

/* acquirer(grabber, give, max_nap_ns) -> an Acquirer whose wait is this fed wait: an untimed
 * acquire of one op costs one call here too (the grab, the sleep on the wake word, the record
 * freed at the grant), not a grab, then Python's wait_for_ticket around wait(). */
static PyObject *
fed_acquirer(FedWaiter *self, PyObject *const *args, Py_ssize_t n)
{
    return make_acquirer((WaitBase *)self, NULL, fed_loop, args, n);
}

/* refill() -> (0, False): in this mode only leases add tokens (the interface of Waiter.refill). */
static PyObject *
fed_refill(FedWaiter *self, PyObject *unused)
{
    (void)unused;
    if (!check_open(self->cells))
        return NULL;
    return replenish_result(0, 0);
}

/* ======================================================================================
 * DELIVER: the elected filler's deliveries in hierarchical mode, between its whole ticks
 * ======================================================================================
 *
 * redis.feeder.Feeder.between, step for step, and the thread's nap around it: at 50/s most of the
 * filler's wakes only put one due batch into the bucket, and each cost ~180 us of CPU in Python on
 * cold caches (its nap ~85, the step ~95) against ~45 for a bare sleep.  deliver() sleeps to the
 * wake the last tick planned (renewing the filler lease as filler._nap_renewing does), then, while
 * each wake is a delivery alone -- before `until` less `early`, the first batch due, callers
 * queued (HEAD behind TAIL), the config the same, UP_STATE ok, UP_WANTING set, no refusal within
 * `hungry_ns` -- writes the batches' lease record (lease_records.write: one record, their earliest
 * stamp and all their ops), adds them (Bucket.add: never beyond TAIL + cap; with no reservation
 * fence in force, FENCE_HINT not after REPL_TS, else a whole tick: Python's add moves fences),
 * wakes the fed waiters they cover (fed_wait.wake), publishes UP_NEXT_NS and sleeps to the next.
 * Anything else is a whole tick's, in Python (DELIVER_TICK): at once when the wake is not a delivery
 * alone or a due batch is past its ttl (the tick expires it), after the delivery when a batch did
 * not fit, tokens are left held, or the batches passed in are all delivered; and with DELIVER_BURN
 * too when an add raced a config change (the config checked before it, changed after it: the
 * caller burns down to the config in force, as Bucket.add does).
 * With `now_ns` (an injected clock's instant: a test's, or a limiter's own clock=) it makes one
 * step at that instant, without sleeping. */
#define DELIVER_TICK 1
#define DELIVER_LOST 4
#define DELIVER_BURN 8 /* an add raced a config change: the caller burns (Bucket.burn_late_add) */
#define DELIVER_LEFT 16
#define DELIVER_MAX 64 /* batches passed in at most: the rest wait for a tick */
#define DELIVER_RECORD_BITS 24 /* lease_records.RECORD_OPS_BITS */
#define DELIVER_RECORD_MAX (((uint64_t)1 << DELIVER_RECORD_BITS) - 1)

typedef struct {
    uint64_t until, early, idle, min_tick, hungry_ns, ttl, lease_word, renewed, renew_every, lease_us;
    uint64_t due[DELIVER_MAX], stamp[DELIVER_MAX], ops[DELIVER_MAX], left[DELIVER_MAX];
    uint64_t recs[DELIVER_MAX];
    char recorded[DELIVER_MAX];
    Py_ssize_t nb, k, nrecs; /* batches passed in; the first not wholly delivered; records written */
    uint64_t wakes;
    int fake; /* an injected clock: `now` passed in, no sleep */
} Delivery;

/* bind_delivery(tail, fence_hint, repl_ts, state, wanting, hungry, leases, records, nrecords, cap):
 * the words deliver() reads and writes (offsets, checked), and the capacity (tokens) of the config
 * this waiter is bound to. */
static PyObject *
fed_bind_delivery(FedWaiter *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t *w[8], nrecords, cap;
    if (!nargs(n, 10, "bind_delivery") || !check_open(self->cells))
        return NULL;
    for (int i = 0; i < 8; i++)
        if (!(w[i] = word(self->cells, args[i])))
            return NULL;
    if (!u64(args[8], &nrecords) || !u64(args[9], &cap))
        return NULL;
    if (nrecords < 1 || nrecords > 64 || cap < 1 || cap > ((uint64_t)1 << 62)) {
        PyErr_SetString(PyExc_ValueError, "bind_delivery: 1 <= nrecords <= 64, 1 <= cap <= 2**62");
        return NULL;
    }
    PyObject *span = PyLong_FromUnsignedLongLong(8 * (nrecords - 1));
    PyObject *off = span ? PyNumber_Add(args[7], span) : NULL; /* the ring's last word: inside too */
    Py_XDECREF(span);
    int ok = off && word(self->cells, off) != NULL;
    Py_XDECREF(off);
    if (!ok)
        return NULL;
    self->tail = w[0];
    self->fence_hint = w[1];
    self->repl_ts = w[2];
    self->state = w[3];
    self->wanting = w[4];
    self->hungry = w[5];
    self->leases = w[6];
    self->records = w[7];
    self->cap = cap;
    self->nrecords_ = nrecords;
    Py_RETURN_NONE;
}

/* words.fed_mask: the futex bits of every ticket a head moved from `old` to `new` covered (a ticket t
 * with old < t <= new has its op index t / cost between old / cost and new / cost); all 32 for a
 * move of 31 ops or more, or one that wrapped. */
static uint32_t
fed_mask(uint64_t old, uint64_t new, uint64_t cost)
{
    uint64_t lo = old / cost, hi = new / cost;
    if (hi < lo || hi - lo >= 31)
        return 0xffffffffu;
    uint32_t mask = 0;
    for (uint64_t i = 0; i <= hi - lo; i++) /* (by count: hi may be the largest word) */
        mask |= (uint32_t)1 << ((lo + i) % 32);
    return mask;
}

/* fed_mask(old_head, new_head, cost) -> the bits deliver() wakes (words.fed_mask, for the tests). */
static PyObject *
native_fed_mask(PyObject *mod, PyObject *const *args, Py_ssize_t n)
{
    (void)mod;
    uint64_t old, new, cost;
    if (!nargs(n, 3, "fed_mask") || !u64(args[0], &old) || !u64(args[1], &new) || !u64(args[2], &cost))
        return NULL;
    if (cost < 1) {
        PyErr_SetString(PyExc_ValueError, "fed_mask: cost >= 1");
        return NULL;
    }
    return PyLong_FromUnsignedLong(fed_mask(old, new, cost));
}

/* Bucket.add of `tokens` with no fence in force: the head moves at most to TAIL + cap, and the
 * fed waiters the move covers are woken (fed_wait.wake).  The tokens added, or DELIVER_FENCED
 * (nothing added) when a reservation's fence is in force: FENCE_HINT after REPL_TS, read after
 * TAIL as Python's add reads the fences after it (a reservation stores its fence before the CAS
 * of the tail that we read, so a tail that counts it comes with a hint that shows it). */
#define DELIVER_FENCED UINT64_MAX
static uint64_t
deliver_add(FedWaiter *w, uint64_t tokens)
{
    for (;;) {
        uint64_t head = wld(w->head), tail = wld(w->tail);
        if (wld(w->fence_hint) > wld(w->repl_ts))
            return DELIVER_FENCED;
        int64_t room = (int64_t)(tail + w->cap - head);
        if (room <= 0 || tokens == 0)
            return 0;
        uint64_t add = tokens < (uint64_t)room ? tokens : (uint64_t)room;
        if (wcas(w->head, head, head + add)) {
            __atomic_fetch_add(w->wake, 1, __ATOMIC_SEQ_CST);
#ifdef __linux__
            syscall(SYS_futex, fed_word32(w->wake), FUTEX_WAKE_BITSET, INT_MAX, NULL, NULL,
                    fed_mask(head, head + add, w->cost));
#endif
            return add;
        }
    }
}

/* One wake of Feeder.between at `now`: 0 and the next wake in *next, or DELIVER_TICK. */
static int
deliver_step(FedWaiter *w, Delivery *d, uint64_t now, uint64_t *next)
{
    Py_ssize_t k = d->k;
    if (now >= d->until - d->early || k >= d->nb || d->due[k] > now ||
        (int64_t)(wld(w->head) - wld(w->tail)) >= 0 || wld(w->seq) != w->expected || wld(w->state) != 0 ||
        !wld(w->wanting) || (int64_t)(now - wld(w->hungry)) < (int64_t)d->hungry_ns ||
        wld(w->fence_hint) > wld(w->repl_ts))
        return DELIVER_TICK;
    Py_ssize_t first = k;
    while (d->k < d->nb && d->due[d->k] <= now) {
        k = d->k;
        if ((int64_t)(now - d->stamp[k]) >= (int64_t)d->ttl)
            return DELIVER_TICK; /* past its ttl: expired by the tick */
        if (!d->recorded[k]) {   /* the record of this batch and every one due behind it */
            uint64_t ops = 0, stamp = d->stamp[k];
            Py_ssize_t j = k;
            for (; j < d->nb && !d->recorded[j] && d->due[j] <= now && ops + d->ops[j] <= DELIVER_RECORD_MAX; j++) {
                ops += d->ops[j];
                if (d->stamp[j] < stamp)
                    stamp = d->stamp[j];
            }
            if (j == k)
                return DELIVER_TICK;
            uint64_t slot = __atomic_fetch_add(w->leases, 1, __ATOMIC_SEQ_CST) % w->nrecords_;
            uint64_t rec = ((stamp / 1000000u) << DELIVER_RECORD_BITS) | ops;
            __atomic_store_n(w->records + slot, rec, __ATOMIC_SEQ_CST);
            d->recs[d->nrecs++] = rec;
            for (Py_ssize_t i = k; i < j; i++)
                d->recorded[i] = 1;
        }
        uint64_t tokens;
        if (__builtin_mul_overflow(d->left[k], w->cost, &tokens))
            tokens = UINT64_MAX - 1; /* (more than any room) */
        uint64_t added = deliver_add(w, tokens);
        if (added == DELIVER_FENCED)
            return DELIVER_TICK; /* recorded, not added: the tick's add, which moves fences */
        /* a part of an op put in uses a whole op of the batch, as Feeder._deliver counts it: the
         * rest of the batch would otherwise put that op in whole at the next tick */
        d->left[k] -= added / w->cost + (added % w->cost != 0);
        if (added && wld(w->seq) != w->expected) { /* raced a config change (set_rate, stop): */
            if (!d->left[k])                        /* the caller burns, as after Bucket.add */
                d->k++;
            return DELIVER_TICK | DELIVER_BURN;
        }
        uint64_t after = d->fake ? now : monotonic_ns();
        if ((int64_t)(after - d->stamp[k]) >= (int64_t)d->ttl || d->left[k] > 0)
            return DELIVER_TICK; /* stopped past its ttl meanwhile (the tick expires), or no room */
        d->k++;
    }
    if (d->k == first || d->k >= d->nb || (int64_t)(wld(w->head) - wld(w->tail)) >= 0)
        return DELIVER_TICK; /* all delivered, or tokens held: the tick plans */
    uint64_t due = d->due[d->k];
    __atomic_store_n(w->next_ns, due, __ATOMIC_SEQ_CST);
    uint64_t at = due < d->until ? due : d->until;
    if (at > now + d->idle)
        at = now + d->idle;
    *next = now + (at - now > d->min_tick ? at - now : d->min_tick);
    d->wakes++;
    return 0;
}

/* Sleep until `at`, renewing the filler lease as filler.FillerThread._nap_renewing does: 0, or
 * DELIVER_LOST (a renewal failed), DELIVER_LEFT (interrupt(), close(), a changed config, a signal). */
static int
deliver_sleep(FedWaiter *w, Delivery *d, uint64_t at)
{
    for (;;) {
        if (span_leaving((WaitBase *)w))
            return DELIVER_LEFT;
        uint64_t now = monotonic_ns();
        if (now >= at)
            return 0;
        if (now - d->renewed >= d->renew_every || at - d->renewed > 2 * d->renew_every) {
            if (!lease_renew(w->lease, &d->lease_word, now, d->lease_us))
                return DELIVER_LOST;
            d->renewed = now;
        }
        uint64_t end = d->renewed + 2 * d->renew_every < at ? d->renewed + 2 * d->renew_every : at;
        if (filler_sleep(w->cells, end))
            return DELIVER_LEFT;
    }
}

static int
deliver_loop(FedWaiter *w, Delivery *d, uint64_t nap)
{
    uint64_t at = monotonic_ns() + nap, next = 0;
    for (;;) {
        int r = deliver_sleep(w, d, at);
        if (r)
            return r;
        r = deliver_step(w, d, monotonic_ns(), &next);
        if (r)
            return r;
        at = next;
    }
}

/* deliver(nap_ns, now_ns, until_ns, early_ns, idle_ns, min_ns, hungry_ns, ttl_ns, lease_word,
 * renewed_ns, renew_every_ns, lease_us, batches) -> (flags, done, left, recorded, records,
 * lease_word, renewed_ns, nap_ns, wakes).  `batches`: the feeder's pending batches, flat, five
 * numbers each (due, stamp, ops, left, recorded), at most DELIVER_MAX.  Answers: the batches wholly
 * delivered (`done`, from the first), the ops left of the next one, how many from the first are
 * recorded now, the record words written in order, the lease word and when it was last renewed,
 * the nap to the next wake (a step with `now_ns`; 0 on DELIVER_TICK) and the deliveries' wakes.
 * With `now_ns` 0 it sleeps `nap_ns` first and goes on to the first whole tick (DELIVER_TICK),
 * DELIVER_LOST or DELIVER_LEFT, without the GIL, counted in `busy` as a wait is. */
static PyObject *
fed_deliver(FedWaiter *self, PyObject *const *args, Py_ssize_t n)
{
    Delivery d;
    uint64_t nap, now;
    memset(&d, 0, sizeof d);
    if (!nargs(n, 13, "deliver") || !check_open(self->cells))
        return NULL;
    if (!self->records) {
        PyErr_SetString(PyExc_RuntimeError, "deliver: bind_delivery() first");
        return NULL;
    }
    if (!u64(args[0], &nap) || !u64(args[1], &now) || !u64(args[2], &d.until) || !u64(args[3], &d.early) ||
        !u64(args[4], &d.idle) || !u64(args[5], &d.min_tick) || !u64(args[6], &d.hungry_ns) ||
        !u64(args[7], &d.ttl) || !u64(args[8], &d.lease_word) || !u64(args[9], &d.renewed) ||
        !u64(args[10], &d.renew_every) || !u64(args[11], &d.lease_us))
        return NULL;
    if (d.ttl >= ((uint64_t)1 << 62) || d.hungry_ns >= ((uint64_t)1 << 62) || d.lease_us >= ((uint64_t)1 << 40) ||
        d.early > d.until || d.renew_every < 1 || (now == 0 && d.lease_word == 0)) {
        PyErr_SetString(PyExc_ValueError, "deliver: ttl_ns, hungry_ns < 2**62, lease_us < 2**40, early_ns <= "
                                          "until_ns, renew_every_ns >= 1, a lease word held (not 0) to sleep");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[12], "deliver: batches must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (len % 5 || len / 5 > DELIVER_MAX) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "deliver: batches: five numbers a batch, at most 64 batches");
        return NULL;
    }
    d.nb = len / 5;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < d.nb; i++) {
        uint64_t rec;
        if (!u64(items[5 * i], &d.due[i]) || !u64(items[5 * i + 1], &d.stamp[i]) || !u64(items[5 * i + 2], &d.ops[i]) ||
            !u64(items[5 * i + 3], &d.left[i]) || !u64(items[5 * i + 4], &rec)) {
            Py_DECREF(seq);
            return NULL;
        }
        if (d.left[i] > d.ops[i] || d.ops[i] > DELIVER_RECORD_MAX || rec > 1) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "deliver: a batch's left <= ops < 2**24, recorded 0 or 1");
            return NULL;
        }
        d.recorded[i] = (char)rec;
    }
    Py_DECREF(seq);
    int rc;
    uint64_t next = 0;
    if (now) {
        d.fake = 1;
        rc = deliver_step(self, &d, now, &next);
    } else {
        NativeCells *c = self->cells;
        cells_enter(c);
        Py_INCREF(self);
        Py_BEGIN_ALLOW_THREADS
        rc = deliver_loop(self, &d, nap);
        cells_leave(c);
        Py_END_ALLOW_THREADS
        Py_DECREF(self);
    }
    Py_ssize_t recorded = d.k;
    while (recorded < d.nb && d.recorded[recorded])
        recorded++;
    PyObject *recs = PyTuple_New(d.nrecs);
    if (!recs)
        return NULL;
    for (Py_ssize_t i = 0; i < d.nrecs; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(d.recs[i]);
        if (!v) {
            Py_DECREF(recs);
            return NULL;
        }
        PyTuple_SET_ITEM(recs, i, v);
    }
    return Py_BuildValue("(innnNKKKK)", rc, d.k, d.k < d.nb ? (Py_ssize_t)d.left[d.k] : (Py_ssize_t)0, recorded,
                         recs, (unsigned long long)d.lease_word, (unsigned long long)d.renewed,
                         (unsigned long long)(rc ? 0 : next - now), (unsigned long long)d.wakes);
}

/* ======================================================================================
 * END DELIVER
 * ====================================================================================== */

static PyMethodDef fed_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))fed_wait, METH_FASTCALL,
     "wait(ticket, ops, until_ns, count_waiting) -> flags: 1 granted (ops counted), 2 nudge the filler"},
    {"acquirer", (PyCFunction)(void (*)(void))fed_acquirer, METH_FASTCALL,
     "acquirer(grabber, give, max_nap_ns) -> an Acquirer: grabber's grab, then this fed wait, in one call"},
    {"refill", (PyCFunction)fed_refill, METH_NOARGS, "refill() -> (0, False): only leases add tokens"},
    {"bind_delivery", (PyCFunction)(void (*)(void))fed_bind_delivery, METH_FASTCALL,
     "bind_delivery(tail, fence_hint, repl_ts, state, wanting, hungry, leases, records, nrecords, cap)"},
    {"deliver", (PyCFunction)(void (*)(void))fed_deliver, METH_FASTCALL,
     "deliver(nap_ns, now_ns, until_ns, early_ns, idle_ns, min_ns, hungry_ns, ttl_ns, lease_word, renewed_ns, "
     "renew_every_ns, lease_us, batches) -> (flags, done, left, recorded, records, lease_word, renewed_ns, "
     "nap_ns, wakes)"},
    {"interrupt", (PyCFunction)wait_interrupt, METH_NOARGS, "interrupt(): a deliver() in progress ends at once"},
    {NULL, NULL, 0, NULL},
};

static PyObject *
fed_get_takeover(FedWaiter *self, void *unused)
{
    (void)unused;
    return PyLong_FromUnsignedLongLong(self->takeover_ns);
}

static int
fed_set_takeover(FedWaiter *self, PyObject *value, void *unused)
{
    (void)unused;
    uint64_t v;
    if (value == NULL || !u64(value, &v))
        return -1;
    if (v > 60000000000ull) {
        PyErr_SetString(PyExc_ValueError, "takeover_ns must be in [0, 60e9]");
        return -1;
    }
    self->takeover_ns = v;
    return 0;
}

static PyGetSetDef fed_getset[] = {
    {"naps", (getter)waiter_get_naps, NULL, "how many times this waiter's calls slept", NULL},
    {"takeover_ns", (getter)fed_get_takeover, (setter)fed_set_takeover,
     "0: this process takes a lapsed filler lease (looks again soon); else ns after the lease's expiry "
     "by when another process has taken it over (this one sleeps until then)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FedWaiterType = {
    NATIVE_TYPE("FedWaiter", FedWaiter,
                "A queued caller's wait for its ticket in hierarchical mode, woken when leased tokens land."),
    .tp_dealloc = (destructor)bound_dealloc,
    .tp_methods = fed_methods,
    .tp_getset = fed_getset,
};

/* fed_waiter(seq, expected, head, lease, grants, waiting, wake, next_ns, cost, tpn, grace_ns) -> a
 * FedWaiter; `waiting` is a word offset or None, `cost` the tokens of one op (the ticket's bit is
 * its op index), `tpn` tokens per ns at the local rate. */
static PyObject *
cells_fed_waiter(NativeCells *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t *w[6], *waiting, expected, cost, tpn, grace;
    const int at[6] = {0, 2, 3, 4, 6, 7};
    if (!wait_bind(self, args, n, 11, "fed_waiter", 5, at, 6, w, &waiting, &expected))
        return NULL;
    if (!u64(args[8], &cost) || !u64(args[9], &tpn) || !u64(args[10], &grace))
        return NULL;
    if (cost < 1 || tpn < 1 || grace > 1000000000u) {
        PyErr_SetString(PyExc_ValueError, "fed_waiter: cost >= 1, tpn >= 1, 0 <= grace_ns <= 1e9");
        return NULL;
    }
    FedWaiter *g = (FedWaiter *)wait_new(self, &FedWaiterType, w[0], w[1], w[3], waiting, expected);
    if (!g)
        return NULL;
    g->lease = w[2];
    g->wake = w[4];
    g->next_ns = w[5];
    g->cost = cost;
    g->tpn = tpn;
    g->grace_ns = grace;
    g->takeover_ns = 0;
    g->tail = g->fence_hint = g->repl_ts = g->state = g->wanting = g->hungry = g->leases = g->records = NULL;
    g->cap = g->nrecords_ = 0;
    self->fed_word = fed_word32(w[4]);
    return (PyObject *)g;
}
/* ======================================================================================
 * END FED WAIT
 * ====================================================================================== */

/* siphash128(data, k0, k1) -> (d0, d1): the keyed tables' digest of any bytes (a window table's
 * prefixed keys included), for the Python paths that hash without a KeyedTable. */
static PyObject *
native_siphash128(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    (void)mod;
    Py_buffer view;
    unsigned long long k0, k1;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "siphash128(data, k0, k1) takes 3 arguments");
        return NULL;
    }
    k0 = PyLong_AsUnsignedLongLong(args[1]);
    if (k0 == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    k1 = PyLong_AsUnsignedLongLong(args[2]);
    if (k1 == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t d[2];
    siphash128((const unsigned char *)view.buf, (size_t)view.len, k0, k1, d);
    PyBuffer_Release(&view);
    return Py_BuildValue("(KK)", (unsigned long long)d[0], (unsigned long long)d[1]);
}

/* fixed_windows(cells, slots, nslots, probe, k0, k1, keys_live, evicted, refused, pid, cut, flags):
 * the fixed-window step over the slot table at `slots` (nslots lines, probed `probe` at a time);
 * every region checked against the mapping once, here. */
static PyObject *
native_fixed_windows(PyObject *mod, PyObject *const *args, Py_ssize_t n)
{
    (void)mod;
    if (!nargs(n, 12, "fixed_windows"))
        return NULL;
    if (!PyObject_TypeCheck(args[0], &NativeCellsType)) {
        PyErr_Format(PyExc_TypeError, "fixed_windows: cells must be NativeCells, not %.100s",
                     Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    NativeCells *cells = (NativeCells *)args[0];
    uint64_t v[11];
    if (!check_open(cells))
        return NULL;
    for (int i = 0; i < 11; i++)
        if (!u64(args[i + 1], &v[i]))
            return NULL;
    uint64_t size = (uint64_t)cells->size;
    if (v[0] % 8 || v[1] == 0 || v[1] > size / 64 || v[0] > size - v[1] * 64 || v[2] == 0 ||
        v[2] > v[1] || v[5] > size - 8 || v[6] > size - 8 || v[7] > size - 8 || v[9] > size - 8 ||
        (v[5] | v[6] | v[7] | v[9]) % 8) {
        PyErr_SetString(PyExc_IndexError, "fixed_windows: a region lies outside the mapping");
        return NULL;
    }
    KeyedTable *t = PyObject_New(KeyedTable, &FixedWindowsType);
    if (!t)
        return NULL;
    Py_INCREF(cells);
    t->cells = cells;
    char *b = cells->base;
    t->cfg = t->ovr_live = t->ovr = t->grants = NULL;
    t->novr = 0;
    t->slots = (uint64_t *)(b + v[0]);
    t->nslots = v[1];
    t->probe = v[2];
    t->k0 = v[3];
    t->k1 = v[4];
    t->keys_live = (uint64_t *)(b + v[5]);
    t->evicted = (uint64_t *)(b + v[6]);
    t->refused = (uint64_t *)(b + v[7]);
    t->pid = v[8];
    t->cut = (uint64_t *)(b + v[9]);
    t->flags = v[10];
    t->windows = 1;
    return (PyObject *)t;
}

static PyMethodDef native_functions[] = {
    {"fixed_windows", (PyCFunction)(void (*)(void))native_fixed_windows, METH_FASTCALL,
     "fixed_windows(cells, slots, nslots, probe, k0, k1, keys_live, evicted, refused, pid, cut, flags)"
     " -> FixedWindows: keyed.windows' fixed-window step in one call"},
    {"fed_mask", (PyCFunction)(void (*)(void))native_fed_mask, METH_FASTCALL,
     "fed_mask(old_head, new_head, cost) -> the futex bits a head's move wakes (words.fed_mask)"},
    {"siphash128", (PyCFunction)(void (*)(void))native_siphash128, METH_FASTCALL,
     "siphash128(data, k0, k1) -> (d0, d1): SipHash-2-4 with a 128-bit output"},
    {"sleep_until", (PyCFunction)(void (*)(void))native_sleep_until, METH_FASTCALL,
     "sleep_until(deadline_ns, slack_ns[, seen]): sleep to a CLOCK_MONOTONIC deadline with a low timer "
     "slack (given seen, a wakes() count: or until a wake_sleepers() since)"},
    {"wakes", (PyCFunction)native_wakes, METH_NOARGS, "wakes() -> the count of wake_sleepers() so far"},
    {"wake_sleepers", (PyCFunction)native_wake_sleepers, METH_NOARGS,
     "wake_sleepers(): every sleep_until given a count before this one ends now"},
    {"multi_gate", (PyCFunction)(void (*)(void))native_multi_gate, METH_FASTCALL,
     "multi_gate(gates, caps, decide, names) -> a MultiGate: one try over several rates, all or nothing"},
#ifdef __linux__
    {"timerfd", (PyCFunction)native_timerfd, METH_NOARGS,
     "timerfd() -> fd: a CLOCK_MONOTONIC timerfd, non-blocking, close-on-exec"},
    {"timerfd_arm", (PyCFunction)(void (*)(void))native_timerfd_arm, METH_FASTCALL,
     "timerfd_arm(fd, deadline_ns): arm at an absolute CLOCK_MONOTONIC instant (0 disarms)"},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "shmlimit.shm._native", "Native atomic backend of shmlimit.", -1, native_functions,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    if (PyType_Ready(&NativeCellsType) < 0 || PyType_Ready(&GrabberType) < 0 || PyType_Ready(&KeyedTableType) < 0
        || PyType_Ready(&GateType) < 0 || PyType_Ready(&WaiterType) < 0 || PyType_Ready(&MultiGateType) < 0
        || PyType_Ready(&FedWaiterType) < 0 || PyType_Ready(&AcquirerType) < 0
        || PyType_Ready(&FixedWindowsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (!m)
        return NULL;
    pthread_atfork(NULL, NULL, waiter_atfork_child); /* WAITER: a child counts its own waiters */
    Py_INCREF(&NativeCellsType);
    if (PyModule_AddObject(m, "NativeCells", (PyObject *)&NativeCellsType) < 0) {
        Py_DECREF(&NativeCellsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
