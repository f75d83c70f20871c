/* cudafut._waker: native notice threads, the compiled half of the waiter.
 *
 * A notice tells an event loop that the work before a CUDA event is done, by
 * closing the write end of a pipe whose read end the loop watches (the loop
 * then polls, in Python, as it does after any wake-up). Here a small pool of
 * native threads does it: each takes a (context, event, fd) job, blocks in
 * cuEventSynchronize on the event (a blocking-sync event: the thread sleeps
 * in the driver, taking no CPU), then close()s the fd. No Python runs on
 * these threads and they never take the GIL (docs/design.md, hazard 1); the
 * caller holds the GIL only to queue a job (a mutex and a condition signal).
 *
 * Unlike a host function launched on a stream, a thread blocked on an
 * event returns after a context error too (cuEventSynchronize reports it),
 * so the loop learns of the error at once (hazard 2).
 *
 * The pool grows on demand up to a cap and never shrinks; when every
 * thread is busy, notice() returns False and the caller polls instead. The
 * threads are detached: at exit they end with the process. After fork() the
 * child starts with no threads and an empty queue (pthread_atfork).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <unistd.h>

typedef int (*cu_event_sync_t)(void *);
typedef int (*cu_ctx_set_t)(void *);

typedef struct job {
    void *ctx;
    void *event;
    int fd;
    struct job *next;
} job_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ready = PTHREAD_COND_INITIALIZER;
static job_t *head = NULL, *tail = NULL;
static int threads = 0;    /* threads started */
static int idle = 0;       /* threads waiting for a job */
static int queued = 0;     /* jobs no thread has taken yet */
static int cap = 0;        /* 0: not started (start() not called) */
static unsigned long long done_count = 0;
static cu_event_sync_t cu_event_sync = NULL;
static cu_ctx_set_t cu_ctx_set = NULL;

static void *worker(void *arg) {
    (void)arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (head == NULL) {
            idle++;
            pthread_cond_wait(&ready, &lock);
            idle--;
        }
        job_t *j = head;
        head = j->next;
        if (head == NULL) tail = NULL;
        queued--;
        pthread_mutex_unlock(&lock);
        /* A failure (a context error, a destroyed context) ends the wait
         * too: the loop's poll then reads the event's status itself. */
        if (cu_ctx_set(j->ctx) == 0) (void)cu_event_sync(j->event);
        /* Counted before the close, which may wake a reader of the count. */
        pthread_mutex_lock(&lock);
        done_count++;
        pthread_mutex_unlock(&lock);
        while (close(j->fd) == -1 && errno == EINTR) {
        }
        free(j);
        pthread_mutex_lock(&lock);
    }
    return NULL;
}

static void child_after_fork(void) {
    /* The parent's threads do not exist here; its queued fds are copies the
     * child's loop never watches: close them, and start afresh. */
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&ready, NULL);
    job_t *j = head;
    while (j != NULL) {
        job_t *next = j->next;
        close(j->fd);
        free(j);
        j = next;
    }
    head = tail = NULL;
    threads = idle = queued = 0;
}

PyDoc_STRVAR(start_doc,
             "start(max_threads) -> bool\n\n"
             "Load libcuda's cuEventSynchronize and cuCtxSetCurrent and allow up to\n"
             "max_threads notice threads (made on demand). False if libcuda.so.1 cannot\n"
             "be loaded. Calling it again only changes the cap.");

static PyObject *start(PyObject *self, PyObject *args) {
    int max_threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "i:start", &max_threads)) return NULL;
    if (max_threads < 1 || max_threads > 1024) {
        PyErr_SetString(PyExc_ValueError, "max_threads must be between 1 and 1024");
        return NULL;
    }
    if (cu_event_sync == NULL) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (lib == NULL) lib = dlopen("libcuda.so.1", RTLD_NOW);
        if (lib == NULL) Py_RETURN_FALSE;
        cu_ctx_set_t set = (cu_ctx_set_t)dlsym(lib, "cuCtxSetCurrent");
        cu_event_sync_t sync = (cu_event_sync_t)dlsym(lib, "cuEventSynchronize");
        if (set == NULL || sync == NULL) Py_RETURN_FALSE;
        static int forked_handler = 0;
        if (!forked_handler) {
            if (pthread_atfork(NULL, NULL, child_after_fork) != 0) Py_RETURN_FALSE;
            forked_handler = 1;
        }
        cu_ctx_set = set;
        cu_event_sync = sync;
    }
    pthread_mutex_lock(&lock);
    cap = max_threads;
    pthread_mutex_unlock(&lock);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(notice_doc,
             "notice(context, event, fd) -> bool\n\n"
             "Close fd once the work before the CUDA event (a blocking-sync event of\n"
             "context, both driver handles as ints) is done, from a notice thread.\n"
             "Takes fd when it returns True; False (fd untouched) when every thread\n"
             "is busy at the cap, or start() was not called. Never blocks: a mutex\n"
             "held for a list append, and a new thread (tens of us) when none is idle.");

static PyObject *notice(PyObject *self, PyObject *args) {
    PyObject *ctx_obj, *event_obj;
    int fd;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!i:notice", &PyLong_Type, &ctx_obj, &PyLong_Type, &event_obj, &fd))
        return NULL;
    /* Checked conversions: a negative or too large handle is an OverflowError. */
    unsigned long long ctx = PyLong_AsUnsignedLongLong(ctx_obj);
    if (ctx == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    unsigned long long event = PyLong_AsUnsignedLongLong(event_obj);
    if (event == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "fd must be a file descriptor (>= 0)");
        return NULL;
    }
    if (event == 0) {
        PyErr_SetString(PyExc_ValueError, "event must be a CUDA event handle, not 0");
        return NULL;
    }
    job_t *j = malloc(sizeof(job_t));
    if (j == NULL) return PyErr_NoMemory();
    j->ctx = (void *)(uintptr_t)ctx;
    j->event = (void *)(uintptr_t)event;
    j->fd = fd;
    j->next = NULL;
    pthread_mutex_lock(&lock);
    if (cap == 0 || (idle <= queued && threads >= cap)) {
        pthread_mutex_unlock(&lock);
        free(j);
        Py_RETURN_FALSE;
    }
    if (idle <= queued) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        int rc = pthread_create(&t, &attr, worker, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            pthread_mutex_unlock(&lock);
            free(j);
            Py_RETURN_FALSE;
        }
        threads++;
    }
    if (tail == NULL) head = j; else tail->next = j;
    tail = j;
    queued++;
    pthread_cond_signal(&ready);
    pthread_mutex_unlock(&lock);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(statistics_doc,
             "statistics() -> (threads, idle, queued, cap, done)\n\n"
             "A snapshot of the pool: threads made, idle ones, jobs queued, the cap,\n"
             "and notices delivered since the process started (or forked).");

static PyObject *statistics(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    pthread_mutex_lock(&lock);
    int t = threads, i = idle, q = queued, c = cap;
    unsigned long long d = done_count;
    pthread_mutex_unlock(&lock);
    return Py_BuildValue("(iiiiK)", t, i, q, c, d);
}

static PyMethodDef methods[] = {
    {"start", start, METH_VARARGS, start_doc},
    {"notice", notice, METH_VARARGS, notice_doc},
    {"statistics", statistics, METH_NOARGS, statistics_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cudafut._waker",
    "Native notice threads: close a pipe's fd once a CUDA event completes, no Python on the way.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__waker(void) { return PyModule_Create(&module); }
