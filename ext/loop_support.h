/* Atomics, the monotonic clock and the eventfd wake-up used by the token loop. */
#ifndef STOPLINE_LOOP_SUPPORT_H
#define STOPLINE_LOOP_SUPPORT_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>

static inline int sl_load_acquire(const int *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void sl_store_release(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* Set *p from 0 to v; returns 1 if this call made the change. */
static inline int sl_claim(int *p, int v) {
    int expected = 0;
    return __atomic_compare_exchange_n(p, &expected, v, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

static inline int64_t sl_monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void sl_sleep_ns(long ns) {
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
}

static inline int sl_eventfd(void) { return eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC); }

/* Wake whoever watches the eventfd; the counter coalesces repeated wakes. */
static inline void sl_wake(int fd) {
    uint64_t one = 1;
    ssize_t unused = write(fd, &one, sizeof one);
    (void)unused;
}

/* Reset the eventfd's counter; nothing to read is fine (it is non-blocking). */
static inline void sl_drain(int fd) {
    uint64_t counter;
    ssize_t unused = read(fd, &counter, sizeof counter);
    (void)unused;
}

/* A condition variable whose timed waits read CLOCK_MONOTONIC, the deadlines' clock. */
static inline int sl_cond_init_monotonic(pthread_cond_t *cond) {
    pthread_condattr_t attr;
    int status = pthread_condattr_init(&attr);
    if (status == 0)
        status = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    if (status == 0)
        status = pthread_cond_init(cond, &attr);
    pthread_condattr_destroy(&attr);
    return status;
}

/* Wait on `cond` until woken, or until `deadline_ns` on the monotonic clock (0: none). */
static inline void sl_cond_wait_until(pthread_cond_t *cond, pthread_mutex_t *mutex, int64_t deadline_ns) {
    if (deadline_ns <= 0) {
        pthread_cond_wait(cond, mutex);
        return;
    }
    struct timespec until = {(time_t)(deadline_ns / 1000000000LL), (long)(deadline_ns % 1000000000LL)};
    pthread_cond_timedwait(cond, mutex, &until);
}

/* Start a thread that runs fn(arg); 0 on success, else an errno value. */
static inline int sl_thread_start(pthread_t *thread, void *(*fn)(void *), void *arg) {
    return pthread_create(thread, NULL, fn, arg);
}

#endif
