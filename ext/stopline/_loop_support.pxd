# Stopline's own C helpers: atomics, the clock and the eventfd (ext/loop_support.h),
# the stop conditions with the in-step abort hook (ext/step_abort.h), and the
# POSIX mutex and condition variable the llama.cpp engine's shared steps take turns by.
# Cimport qualified: `from stopline cimport _loop_support as sl`, then `sl.sl_check`.

from libc.stdint cimport int64_t

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef unsigned long pthread_t
    int pthread_join(pthread_t thread, void **retval)
    int pthread_mutex_init(pthread_mutex_t *mutex, const void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *mutex)
    int pthread_mutex_lock(pthread_mutex_t *mutex)
    int pthread_mutex_unlock(pthread_mutex_t *mutex)
    int pthread_cond_init(pthread_cond_t *cond, const void *attr)
    int pthread_cond_destroy(pthread_cond_t *cond)
    int pthread_cond_wait(pthread_cond_t *cond, pthread_mutex_t *mutex)
    int pthread_cond_broadcast(pthread_cond_t *cond)

cdef extern from "loop_support.h" nogil:
    int sl_load_acquire(const int *p)
    void sl_store_release(int *p, int v)
    int sl_claim(int *p, int v)
    int64_t sl_monotonic_ns()
    void sl_sleep_ns(long ns)
    int sl_eventfd()
    void sl_wake(int fd)
    void sl_drain(int fd)
    int sl_cond_init_monotonic(pthread_cond_t *cond)
    void sl_cond_wait_until(pthread_cond_t *cond, pthread_mutex_t *mutex, int64_t deadline_ns)
    int sl_thread_start(pthread_t *thread, void *(*fn)(void *) noexcept nogil, void *arg)

cdef extern from "step_abort.h" nogil:
    ctypedef enum sl_stop:
        SL_RUN
        SL_STOP_CANCELLED
        SL_STOP_TOTAL_TIMEOUT
        SL_STOP_FIRST_TOKEN_TIMEOUT

    ctypedef enum sl_hook_status:
        SL_HOOK_INSTALLED
        SL_HOOK_NO_LINK_MAP
        SL_HOOK_NO_PLT_ENTRY
        SL_HOOK_READ_ONLY

    ctypedef struct sl_watch:
        int cancel_flag
        int64_t deadline_ns
        int64_t first_token_deadline_ns
        int trim_output
        int aborted
        int64_t last_poll_ns
        int64_t longest_gap_ns

    enum: SL_MAX_GROUP

    ctypedef struct sl_group_watch:
        sl_watch *members[SL_MAX_GROUP]
        int n
        int aborted
        int interrupt
        int64_t start_ns
        int64_t longest_gap_ns

    sl_stop sl_check(const sl_watch *w)
    int64_t sl_next_deadline(const sl_watch *w)
    # sl_check() as a stop callback, its data a watch.
    bint sl_watch_says_stop(void *data) noexcept nogil
    # llama.cpp's abort callback: polls every watch of the group passed as its data.
    bint sl_group_abort_callback(void *data) noexcept nogil
    sl_hook_status sl_step_abort_install(void *handle)
    void sl_watch_enter(sl_watch *w)
    void sl_watch_leave()
