/* Stopping inside a ggml evaluation, between graph nodes.
 *
 * ggml checks `ggml_cplan.abort_callback` between graph nodes, but
 * ctransformers never sets it. libctransformers.so reaches
 * ggml_graph_compute through its own PLT, so Stopline rewrites that one GOT
 * entry (in that library only) to point at sl_graph_compute(), which installs
 * the callback and forwards to the library's own function. The callback
 * watches the stop conditions of the generation running on the calling
 * thread; on any other thread (or before a generation enters its watch) the
 * call passes through untouched.
 *
 * The same hook computes the output projection for the last token only:
 * llama.cpp (in this version) projects every token of a prompt chunk onto the
 * vocabulary and then keeps the last row of logits. */
#ifndef STOPLINE_STEP_ABORT_H
#define STOPLINE_STEP_ABORT_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE  /* dlinfo() */
#endif
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ctransformers_abi.h"
#include "loop_support.h"

/* Why a generation must stop now. */
typedef enum {
    SL_RUN = 0,
    SL_STOP_CANCELLED,
    SL_STOP_TOTAL_TIMEOUT,
    SL_STOP_FIRST_TOKEN_TIMEOUT,
} sl_stop;

/* The stop conditions of one generation, polled before every chunk and token
 * by the loop and between graph nodes by the hook. */
typedef struct {
    int cancel_flag;                  /* set once, with release semantics */
    int64_t deadline_ns;              /* 0: none */
    int64_t first_token_deadline_ns;  /* 0: none, or a token has been published */
    /* Per evaluation, for the hook: */
    int trim_output;                  /* compute only the last token's logits */
    int aborted;                      /* the evaluation was stopped part-way */
    struct ggml_cgraph *graph;        /* the graph being computed */
    int n_nodes;                      /* its real node count, restored afterwards */
    int64_t last_poll_ns;
    int64_t longest_gap_ns;           /* longest time between two polls: the longest node */
} sl_watch;

/* Why `w`'s generation must stop at `now` (0: read the clock if a deadline needs it). */
static inline sl_stop sl_check_at(const sl_watch *w, int64_t now) {
    if (sl_load_acquire(&w->cancel_flag))
        return SL_STOP_CANCELLED;
    if (w->deadline_ns == 0 && w->first_token_deadline_ns == 0)
        return SL_RUN;
    if (now == 0)
        now = sl_monotonic_ns();
    if (w->deadline_ns && now >= w->deadline_ns)
        return SL_STOP_TOTAL_TIMEOUT;
    if (w->first_token_deadline_ns && now >= w->first_token_deadline_ns)
        return SL_STOP_FIRST_TOKEN_TIMEOUT;
    return SL_RUN;
}

static inline sl_stop sl_check(const sl_watch *w) { return sl_check_at(w, 0); }

/* When `w`'s next deadline passes (0: it has none). */
static inline int64_t sl_next_deadline(const sl_watch *w) {
    int64_t total = w->deadline_ns, first = w->first_token_deadline_ns;
    if (total == 0 || (first != 0 && first < total))
        return first;
    return total;
}

/* The same check as a stop callback (sll_abort_fn), for one generation's watch. */
static bool sl_watch_says_stop(void *data) { return sl_check((const sl_watch *)data) != SL_RUN; }

static ggml_graph_compute_fn sl_real_graph_compute;
static __thread sl_watch *sl_thread_watch;

/* The poll between two graph nodes, for both engines: it records the longest
 * node and whether the evaluation must end. */
static inline bool sl_poll_between_nodes(sl_watch *w) {
    int64_t now = sl_monotonic_ns();
    int64_t gap = now - __atomic_load_n(&w->last_poll_ns, __ATOMIC_RELAXED);
    if (gap > w->longest_gap_ns)
        w->longest_gap_ns = gap;
    __atomic_store_n(&w->last_poll_ns, now, __ATOMIC_RELAXED);
    if (sl_check(w) == SL_RUN)
        return false;
    __atomic_store_n(&w->aborted, 1, __ATOMIC_RELAXED);
    return true;
}

/* The most generations one llama.cpp evaluation carries (SLL_MAX_SEQUENCES;
 * _core.pyx asserts that they agree). */
#define SL_MAX_GROUP 64

/* The generations one batched llama.cpp evaluation carries: it must end as
 * soon as any of them must stop. */
typedef struct {
    sl_watch *members[SL_MAX_GROUP];
    int n;
    int aborted;
    /* Set by a generation of a higher priority that preempted one of the members: the
     * evaluation ends at the next check, whoever its members are (see _batcher.pxi). */
    int interrupt;
    int64_t start_ns;         /* when the evaluation started; also tells one evaluation from the next */
    int64_t longest_gap_ns;   /* the longest a compute thread went between two clock readings of its checks */
} sl_group_watch;

/* A compute thread's checks during one evaluation. Between two small pieces of
 * a node a check reads the cancel flags only; the clock (far dearer than a
 * flag) is read every `per_clock` checks, doubled or halved so that readings
 * come about every SL_CLOCK_EVERY_NS, and at most every SL_MAX_CHECKS_PER_CLOCK
 * checks: when the pieces grow from a few microseconds to a millisecond, the
 * next reading is that many pieces away. The deadlines are checked, and the
 * gaps measured, at each reading. */
typedef struct {
    const sl_group_watch *group;
    int64_t start_ns;    /* the evaluation these checks belong to */
    int64_t clock_ns;    /* the last reading */
    int since_clock;     /* checks since then */
    int per_clock;
    int64_t offered_ns;  /* when this thread last offered its core (sched_yield) */
} sl_thread_checks;

#define SL_CLOCK_EVERY_NS 20000
#define SL_MAX_CHECKS_PER_CLOCK 8

/* How often a compute thread offers its core to a thread waiting for one
 * (sched_yield() at a clock reading). An evaluation's compute threads usually
 * fill every core, and the scheduler lets a running thread finish its slice
 * before a thread that wakes meanwhile gets the core: the event loop with a
 * cancel to read, a generation's thread whose stop has come. With nobody
 * waiting the call returns at once. docs/engine.md ("The stop a client sees")
 * has the measurements: what a woken thread waits with and without the offer,
 * and what it costs where the compute threads outnumber the cores. */
#define SL_OFFER_CORE_EVERY_NS 250000

static __thread sl_thread_checks sl_checks;

static inline void sl_store_max(int64_t *p, int64_t value) {
    int64_t seen = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (value > seen && !__atomic_compare_exchange_n(p, &seen, value, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

/* llama.cpp's abort callback, polling every member of the group passed as its
 * data. The CPU backend calls it after every graph node on the thread that
 * called llama_decode(), and llama.cpp built with Stopline's edits
 * (stopline/engine/llama_edits.py) calls it from every compute thread between the
 * pieces of a node too: it writes only its thread's own state, and atomically
 * the longest gap and `aborted`. Once any thread has seen a stop, the outputs
 * of the evaluation are garbage even if llama_decode() completes (the stop came
 * during the last node, after the thread that calls it had checked): the loop
 * reads `aborted`, not only llama_decode()'s code. At its clock readings it
 * also offers the thread's core (SL_OFFER_CORE_EVERY_NS). */
static bool sl_group_abort_callback(void *data) {
    sl_group_watch *g = (sl_group_watch *)data;
    sl_thread_checks *c = &sl_checks;
    int64_t now = 0, gap;
    /* A stop holds for the rest of the evaluation, whichever thread saw it. */
    if (__atomic_load_n(&g->aborted, __ATOMIC_RELAXED))
        return true;
    if (__atomic_load_n(&g->interrupt, __ATOMIC_RELAXED)) {
        __atomic_store_n(&g->aborted, 1, __ATOMIC_RELAXED);
        return true;
    }
    if (c->group != g || c->start_ns != g->start_ns) {
        c->group = g;
        c->start_ns = c->clock_ns = c->offered_ns = g->start_ns;
        c->since_clock = 0;
        c->per_clock = 1;
    }
    if (++c->since_clock >= c->per_clock) {
        now = sl_monotonic_ns();
        gap = now - c->clock_ns;
        sl_store_max(&g->longest_gap_ns, gap);
        if (gap < SL_CLOCK_EVERY_NS / 2 && c->per_clock < SL_MAX_CHECKS_PER_CLOCK)
            c->per_clock *= 2;
        else if (gap > SL_CLOCK_EVERY_NS * 2 && c->per_clock > 1)
            c->per_clock /= 2;
        c->clock_ns = now;
        c->since_clock = 0;
        if (now - c->offered_ns >= SL_OFFER_CORE_EVERY_NS) {
            sched_yield();
            c->offered_ns = now;
        }
    }
    for (int i = 0; i < g->n; i++) {
        sl_watch *w = g->members[i];
        if (now ? sl_check_at(w, now) != SL_RUN : sl_load_acquire(&w->cancel_flag)) {
            __atomic_store_n(&g->aborted, 1, __ATOMIC_RELAXED);
            return true;
        }
    }
    return false;
}

/* The hook's callback, called by every ggml worker thread between nodes. */
static bool sl_abort_callback(void *data) {
    sl_watch *w = (sl_watch *)data;
    if (!sl_poll_between_nodes(w))
        return false;
    /* End the graph as well: after an abort this ggml would otherwise compute
     * the node it just finished a second time before returning. */
    __atomic_store_n(&w->graph->n_nodes, 0, __ATOMIC_RELAXED);
    return true;
}

/* A one-column view of `t`: its column `col`, same type and strides. */
static void sl_column_view(struct ggml_tensor *view, const struct ggml_tensor *t, int64_t col) {
    *view = *t;
    view->ne[1] = 1;
    view->nb[2] = view->nb[1];
    view->nb[3] = view->nb[2] * view->ne[2];
    view->data = (char *)t->data + col * t->nb[1];
}

static int sl_graph_compute(struct ggml_cgraph *graph, struct ggml_cplan *plan) {
    sl_watch *w = sl_thread_watch;
    struct ggml_tensor *out, *in, out_last, in_last;
    int status, last;
    if (w == NULL || plan->abort_callback != NULL || graph->n_nodes == 0)
        return sl_real_graph_compute(graph, plan);

    last = graph->n_nodes - 1;
    out = graph->nodes[last];
    in = out->src[1];
    /* Only llama.cpp's logits node: MUL_MAT(output weights, normed hidden
     * states) with one column per token. Its rows land where llama.cpp reads
     * the last token's logits, at the same address as before. */
    int trimmed = w->trim_output && out->op == GGML_OP_MUL_MAT && in != NULL
        && strcmp(out->name, "result_output") == 0
        && out->ne[1] > 1 && out->ne[2] == 1 && out->ne[3] == 1 && in->ne[1] == out->ne[1]
        && in->ne[2] == 1 && in->ne[3] == 1;
    if (trimmed) {
        sl_column_view(&in_last, in, in->ne[1] - 1);
        sl_column_view(&out_last, out, out->ne[1] - 1);
        out_last.src[1] = &in_last;
        graph->nodes[last] = &out_last;
    }

    w->aborted = 0;
    w->graph = graph;
    w->n_nodes = graph->n_nodes;
    w->last_poll_ns = sl_monotonic_ns();
    plan->abort_callback = sl_abort_callback;
    plan->abort_callback_data = w;
    status = sl_real_graph_compute(graph, plan);
    plan->abort_callback = NULL;
    plan->abort_callback_data = NULL;
    graph->n_nodes = w->n_nodes;
    w->graph = NULL;
    if (trimmed)
        graph->nodes[last] = out;
    if (status == GGML_EXIT_ABORTED)
        w->aborted = 1;
    return status;
}

/* Whether the hook is in place, and if not, why. */
typedef enum {
    SL_HOOK_INSTALLED = 0,
    SL_HOOK_NO_LINK_MAP,   /* dlinfo() failed; dlerror() says why */
    SL_HOOK_NO_PLT_ENTRY,  /* the library does not call ggml_graph_compute through its PLT */
    SL_HOOK_READ_ONLY,     /* mprotect() failed; errno says why */
} sl_hook_status;

/* Route `symbol`'s PLT calls made by the library behind `handle` to
 * `replacement`, and store the function the entry pointed to in `original`. */
static sl_hook_status sl_patch_plt(void *handle, const char *symbol, void *replacement, void **original) {
    struct link_map *map = NULL;
    const ElfW(Dyn) *dyn;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const ElfW(Rela) *relocs = NULL;
    size_t relocs_size = 0, i;
    long reloc_kind = 0;
    if (dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || map == NULL)
        return SL_HOOK_NO_LINK_MAP;
    for (dyn = map->l_ld; dyn->d_tag != DT_NULL; dyn++) {
        /* glibc has already relocated these addresses; others may not have. */
        uintptr_t addr = dyn->d_un.d_ptr;
        if (addr < map->l_addr)
            addr += map->l_addr;
        switch (dyn->d_tag) {
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)addr; break;
        case DT_STRTAB: strtab = (const char *)addr; break;
        case DT_JMPREL: relocs = (const ElfW(Rela) *)addr; break;
        case DT_PLTRELSZ: relocs_size = dyn->d_un.d_val; break;
        case DT_PLTREL: reloc_kind = (long)dyn->d_un.d_val; break;
        }
    }
    if (symtab == NULL || strtab == NULL || relocs == NULL || reloc_kind != DT_RELA)
        return SL_HOOK_NO_PLT_ENTRY;
    for (i = 0; i < relocs_size / sizeof(ElfW(Rela)); i++) {
        const ElfW(Sym) *sym = &symtab[ELF64_R_SYM(relocs[i].r_info)];
        if (strcmp(strtab + sym->st_name, symbol) != 0)
            continue;
        void **entry = (void **)(map->l_addr + relocs[i].r_offset);
        /* Under full RELRO the entry's page is read-only; it stays writable
         * afterwards, as it is in a library built without full RELRO. */
        long page = sysconf(_SC_PAGESIZE);
        void *start = (void *)((uintptr_t)entry & ~(uintptr_t)(page - 1));
        *original = __atomic_load_n(entry, __ATOMIC_ACQUIRE);
        if (mprotect(start, (size_t)page, PROT_READ | PROT_WRITE) != 0)
            return SL_HOOK_READ_ONLY;
        __atomic_store_n(entry, replacement, __ATOMIC_RELEASE);
        return SL_HOOK_INSTALLED;
    }
    return SL_HOOK_NO_PLT_ENTRY;
}

/* Install the hook into the library behind `handle` (opened RTLD_NOW, so the
 * entry already holds the real function). Idempotent. */
static sl_hook_status sl_step_abort_install(void *handle) {
    void *original = NULL;
    sl_hook_status status;
    if (sl_real_graph_compute != NULL)
        return SL_HOOK_INSTALLED;
    status = sl_patch_plt(handle, "ggml_graph_compute", (void *)sl_graph_compute, &original);
    if (status != SL_HOOK_INSTALLED)
        return status;
    /* The entry already held this very hook: there is no real function to forward to. */
    if (original == NULL || original == (void *)sl_graph_compute)
        return SL_HOOK_NO_PLT_ENTRY;
    sl_real_graph_compute = (ggml_graph_compute_fn)original;
    return SL_HOOK_INSTALLED;
}

static inline void sl_watch_enter(sl_watch *w) { sl_thread_watch = w; }
static inline void sl_watch_leave(void) { sl_thread_watch = NULL; }

#endif
