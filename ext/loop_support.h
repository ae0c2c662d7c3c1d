/* Atomics, the monotonic clock and the eventfd wake-up used by the token loop. */
#ifndef STOPLINE_LOOP_SUPPORT_H
#define STOPLINE_LOOP_SUPPORT_H

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

#endif
