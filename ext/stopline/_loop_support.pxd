# Stopline's own C helpers: atomics, the clock and the eventfd (ext/loop_support.h),
# and the stop conditions with the in-step abort hook (ext/step_abort.h).
# Cimport qualified: `from stopline cimport _loop_support as sl`, then `sl.sl_check`.

from libc.stdint cimport int64_t

cdef extern from "loop_support.h" nogil:
    int sl_load_acquire(const int *p)
    void sl_store_release(int *p, int v)
    int sl_claim(int *p, int v)
    int64_t sl_monotonic_ns()
    void sl_sleep_ns(long ns)
    int sl_eventfd()
    void sl_wake(int fd)
    void sl_drain(int fd)

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

    sl_stop sl_check(const sl_watch *w)
    # llama.cpp's abort callback: polls the watch passed as its data.
    bint sl_node_abort_callback(void *data) noexcept nogil
    sl_hook_status sl_step_abort_install(void *handle)
    void sl_watch_enter(sl_watch *w)
    void sl_watch_leave()
