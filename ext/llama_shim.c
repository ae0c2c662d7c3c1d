/* libstopline-llama.so: the narrow C API of ext/llama_abi.h over llama.cpp.
 *
 * Compiled against llama.cpp's own include/llama.h (commit SLL_LLAMA_COMMIT)
 * and linked with its static libraries; only the sll_* functions are
 * exported. Everything that could reach one of llama.cpp's asserts (which end
 * the process) is checked here first: batch sizes, token ids, positions. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "llama.h"
#include "llama_abi.h"

#define SLL_EXPORT __attribute__((visibility("default")))

struct sll_model {
    struct llama_model *model;
    const struct llama_vocab *vocab;
    int32_t n_vocab;
    /* The layers offloaded, as llama.cpp counts them when it places the model. */
    int32_t gpu_layers;
};

struct sll_context {
    struct llama_context *ctx;
    const sll_model *model;
    /* The batch being built for the next sll_batch_decode(). */
    struct llama_batch batch;
    int32_t n_batch;
    int32_t n_seq;
    /* The most positions one sequence may hold. */
    int32_t n_ctx_seq;
    /* Per sequence: whether the batch being built has its tokens already. */
    unsigned char *in_batch;
    /* The context's compute threads, kept between evaluations (NULL: llama.cpp
     * starts threads for each evaluation). */
    struct ggml_threadpool *threads;
    /* The stop, asked between the pieces of a GPU's evaluation too (eval_piece). */
    sll_abort_fn abort_fn;
    void *abort_data;
    uint32_t piece_nodes;
};

struct sll_sampler {
    struct llama_sampler *chain;
    llama_token eos;
    /* Kept out of the chain: it sees only generated tokens, and is applied to all
     * candidates only when the token drawn without it breaks it. NULL: no grammar. */
    struct llama_sampler *grammar;
    llama_token_data *candidates;
    int32_t n_vocab;
    /* The repetition penalty's window: the last n_window tokens seen, oldest
     * overwritten first (a ring). The shim applies it rather than llama.cpp's
     * penalties sampler, which looks every candidate up in a map of the window,
     * a cost that grows with the vocabulary and has no stop check
     * (docs/engine.md, "Sampling"). */
    float repeat_penalty;
    llama_token *window;
    int32_t n_window, n_seen;
};

/* llama.cpp logs through one process-wide callback. Errors are kept (the last
 * one explains a failed load); everything else, such as the warning it logs
 * on every aborted evaluation, is dropped. */
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static char last_error[512];

static void sll_log(enum ggml_log_level level, const char *text, void *data) {
    (void)data;
    if (level != GGML_LOG_LEVEL_ERROR || text == NULL)
        return;
    pthread_mutex_lock(&log_lock);
    snprintf(last_error, sizeof last_error, "%s", text);
    size_t n = strlen(last_error);
    while (n && (last_error[n - 1] == '\n' || last_error[n - 1] == ' '))
        last_error[--n] = 0;
    pthread_mutex_unlock(&log_lock);
}

static void take_error(char *err, size_t err_size, const char *fallback) {
    pthread_mutex_lock(&log_lock);
    snprintf(err, err_size, "%s", last_error[0] ? last_error : fallback);
    last_error[0] = 0;
    pthread_mutex_unlock(&log_lock);
}

static pthread_once_t backend_once = PTHREAD_ONCE_INIT;

static void backend_init(void) {
    llama_log_set(sll_log, NULL);
    llama_backend_init();
}

SLL_EXPORT int sll_abi_version(void) { return SLL_ABI_VERSION; }

/* Defined by Stopline's edits to ggml's CPU backend: linked in when present. */
extern bool ggml_cpu_stop_requested(void) __attribute__((weak));

SLL_EXPORT int sll_checks_inside_nodes(void) { return ggml_cpu_stop_requested != NULL; }

/* The device llama.cpp offloads to by default: its first GPU, else its first integrated GPU. */
static ggml_backend_dev_t gpu_dev(void) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
    return dev != NULL ? dev : ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_IGPU);
}

SLL_EXPORT int sll_gpu_device(char *buf, size_t buf_size) {
    pthread_once(&backend_once, backend_init);
    ggml_backend_dev_t dev = gpu_dev();
    if (buf_size)
        buf[0] = 0;
    if (dev == NULL)
        return 0;
    snprintf(buf, buf_size, "%s (%s)", ggml_backend_dev_name(dev), ggml_backend_dev_description(dev));
    return 1;
}

SLL_EXPORT sll_model *sll_model_load(const char *path, int32_t n_gpu_layers, char *err, size_t err_size) {
    pthread_once(&backend_once, backend_init);
    struct llama_model_params params = llama_model_default_params();
    params.n_gpu_layers = n_gpu_layers;
    sll_model *m = calloc(1, sizeof *m);
    if (m == NULL) {
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    m->model = llama_model_load_from_file(path, params);
    if (m->model == NULL) {
        take_error(err, err_size, "llama.cpp could not load the model");
        free(m);
        return NULL;
    }
    m->vocab = llama_model_get_vocab(m->model);
    m->n_vocab = llama_vocab_n_tokens(m->vocab);
    /* llama.cpp's own count (llama_model::load_tensors): none without a device, else at
     * most every repeating layer and the output layer. */
    int32_t n_layers = llama_model_n_layer(m->model) + 1;
    m->gpu_layers = gpu_dev() == NULL ? 0 : n_gpu_layers < 0 || n_gpu_layers > n_layers ? n_layers : n_gpu_layers;
    return m;
}

SLL_EXPORT void sll_model_free(sll_model *m) {
    if (m == NULL)
        return;
    llama_model_free(m->model);
    free(m);
}

SLL_EXPORT int32_t sll_model_gpu_layers(const sll_model *m) { return m->gpu_layers; }

SLL_EXPORT int32_t sll_model_n_layers(const sll_model *m) { return llama_model_n_layer(m->model) + 1; }

SLL_EXPORT int32_t sll_model_n_vocab(const sll_model *m) { return m->n_vocab; }

SLL_EXPORT int32_t sll_model_n_ctx_train(const sll_model *m) { return llama_model_n_ctx_train(m->model); }

SLL_EXPORT int32_t sll_model_meta(const sll_model *m, const char *key, char *buf, size_t buf_size) {
    return llama_model_meta_val_str(m->model, key, buf, buf_size);
}

/* Recurrent and hybrid models keep one state per sequence, not one entry per
 * position: a cache cannot be cut back to a prefix. */
SLL_EXPORT int sll_model_can_truncate(const sll_model *m) {
    return !llama_model_is_recurrent(m->model) && !llama_model_is_hybrid(m->model);
}

SLL_EXPORT int32_t sll_tokenize(const sll_model *m, const char *text, int32_t text_len, int32_t *out,
                                int32_t out_max, int add_special, int parse_special) {
    return llama_tokenize(m->vocab, text, text_len, out, out_max, add_special != 0, parse_special != 0);
}

SLL_EXPORT int32_t sll_token_piece(const sll_model *m, int32_t token, char *buf, int32_t size, int special) {
    if (token < 0 || token >= m->n_vocab)
        return 0;
    return llama_token_to_piece(m->vocab, token, buf, size, 0, special != 0);
}

SLL_EXPORT int sll_is_end(const sll_model *m, int32_t token) { return llama_vocab_is_eog(m->vocab, token); }

SLL_EXPORT int32_t sll_bos(const sll_model *m) { return llama_vocab_bos(m->vocab); }

SLL_EXPORT int32_t sll_eos(const sll_model *m) { return llama_vocab_eos(m->vocab); }

SLL_EXPORT int sll_add_bos(const sll_model *m) { return llama_vocab_get_add_bos(m->vocab); }

/* The graph nodes in one piece of a GPU's evaluation. Each piece ends with a synchronize,
 * which costs throughput; a stop waits for the piece under way. */
#define SLL_GPU_PIECE_NODES 64

/* ggml's scheduler eval callback, set where a model has layers on a GPU, whose backend asks
 * no abort callback. Asked (ask) whether a node's result is wanted, it ends a piece every
 * SLL_GPU_PIECE_NODES nodes; after each piece, synchronized, it answers false once the stop
 * is requested, which ends the evaluation (Stopline's edit to ggml-backend.cpp). */
static bool eval_piece(struct ggml_tensor *t, bool ask, void *data) {
    sll_context *c = data;
    (void)t;
    if (ask)
        return ++c->piece_nodes % SLL_GPU_PIECE_NODES == 0;
    return c->abort_fn == NULL || !c->abort_fn(c->abort_data);
}

/* A context of `params` (n_batch, n_seq_max and the thread counts set), each sequence up to
 * n_ctx_seq positions; `pieces`: a GPU's evaluation in pieces, with the stop between them
 * (eval_piece). NULL with `failure` and llama.cpp's explanation in err. */
static sll_context *open_context(sll_model *m, struct llama_context_params params, int32_t n_ctx_seq, bool pieces,
                                 const char *failure, char *err, size_t err_size) {
    sll_context *c = calloc(1, sizeof *c);
    if (c == NULL || (c->in_batch = calloc((size_t)params.n_seq_max, 1)) == NULL) {
        free(c);
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    if (pieces) {
        params.cb_eval = eval_piece;
        params.cb_eval_user_data = c;
    }
    c->ctx = llama_init_from_model(m->model, params);
    if (c->ctx == NULL) {
        take_error(err, err_size, failure);
        free(c->in_batch);
        free(c);
        return NULL;
    }
    /* Without a pool of its own, ggml starts and joins n_threads - 1 threads for every
     * evaluation. A new thread waits for a core, up to a scheduler tick when
     * every core computes, and a stop waits for it too: the evaluation ends only
     * once each of its threads has run. llama.cpp's own tools keep a pool, as
     * here; its threads sleep between evaluations (poll 0) rather than spin, so
     * that the cores are free for the event loop and for the other contexts. */
    struct ggml_threadpool_params pool = ggml_threadpool_params_default(params.n_threads);
    pool.poll = 0;
    c->threads = ggml_threadpool_new(&pool);
    if (c->threads != NULL)
        llama_attach_threadpool(c->ctx, c->threads, c->threads);
    c->model = m;
    c->n_batch = (int32_t)params.n_batch;
    c->n_seq = (int32_t)params.n_seq_max;
    c->n_ctx_seq = n_ctx_seq;
    c->batch = llama_batch_init(c->n_batch, 0, 1);
    return c;
}

SLL_EXPORT sll_context *sll_context_new(sll_model *m, int32_t n_ctx_seq, int32_t n_batch, int32_t n_ubatch,
                                        int32_t n_threads, int32_t n_seq, char *err, size_t err_size) {
    if (n_batch < 1 || n_batch > SLL_MAX_BATCH || n_ubatch < 1 || n_ubatch > n_batch || n_ctx_seq < 2 ||
        n_threads < 1 || n_seq < 1 || n_seq > SLL_MAX_SEQUENCES) {
        snprintf(err, err_size, "invalid context sizes");
        return NULL;
    }
    struct llama_context_params params = llama_context_default_params();
    params.n_ctx = (uint32_t)(n_ctx_seq * n_seq);
    /* llama.cpp computes a call in physical batches of n_ubatch tokens, and an
     * abort drops the positions of the one under way only: the finished ones
     * stay in the cache, and pos_max() says how far they reach. */
    params.n_batch = (uint32_t)n_batch;
    params.n_ubatch = (uint32_t)n_ubatch;
    params.n_seq_max = (uint32_t)n_seq;
    /* One pool of cells for every sequence: a batch is then never split by
     * sequence (llama.cpp splits per-sequence caches into equal shares of
     * consecutive sequence ids), and one sequence may use what another does not. */
    params.kv_unified = true;
    params.n_threads = n_threads;
    params.n_threads_batch = n_threads;
    params.no_perf = true;
    /* Sliding-window models (Gemma 3) keep every position, so that a
     * conversation can resume from any prefix. */
    params.swa_full = true;
    return open_context(m, params, n_ctx_seq, m->gpu_layers > 0, "llama.cpp could not create a context", err,
                        err_size);
}

SLL_EXPORT void sll_context_free(sll_context *c) {
    if (c == NULL)
        return;
    llama_batch_free(c->batch);
    llama_free(c->ctx);
    if (c->threads != NULL)
        ggml_threadpool_free(c->threads);
    free(c->in_batch);
    free(c);
}

SLL_EXPORT int32_t sll_context_n_ctx(const sll_context *c) { return c->n_ctx_seq; }

SLL_EXPORT void sll_set_abort(sll_context *c, sll_abort_fn fn, void *data) {
    c->abort_fn = fn;
    c->abort_data = data;
    llama_set_abort_callback(c->ctx, fn, data);
}

SLL_EXPORT void sll_set_threads(sll_context *c, int32_t n_threads) {
    if (n_threads > 0)
        llama_set_n_threads(c->ctx, n_threads, n_threads);
}

SLL_EXPORT int32_t sll_pos_max(sll_context *c, int32_t seq) {
    if (seq < 0 || seq >= c->n_seq)
        return -1;
    return llama_memory_seq_pos_max(llama_get_memory(c->ctx), seq);
}

SLL_EXPORT int sll_truncate(sll_context *c, int32_t seq, int32_t p0) {
    if (seq < 0 || seq >= c->n_seq)
        return 0;
    if (p0 < 0)
        p0 = 0;
    return llama_memory_seq_rm(llama_get_memory(c->ctx), seq, p0, -1);
}

SLL_EXPORT int sll_holds(sll_context *c, int32_t seq, int32_t n) {
    llama_memory_t mem = llama_get_memory(c->ctx);
    if (seq < 0 || seq >= c->n_seq || n < 0)
        return 0;
    /* For a model with sliding-window layers llama.cpp reports their cache's
     * positions: the full layers' never lose any. */
    return llama_memory_seq_pos_max(mem, seq) == n - 1 && (n == 0 || llama_memory_seq_pos_min(mem, seq) == 0);
}

SLL_EXPORT int sll_copy_prefix(sll_context *c, int32_t src, int32_t dst, int32_t n) {
    llama_memory_t mem = llama_get_memory(c->ctx);
    /* Sliding-window layers give the cells of positions out of a window to other tokens:
     * a prefix shared there is not known to stay whole. */
    if (llama_model_n_swa(c->model->model) > 0)
        return -1;
    /* What llama.cpp asserts on, or would get wrong, refused instead: an unknown sequence,
     * a copy onto itself, a range outside a sequence's positions and a source that lacks
     * part of it. */
    if (src < 0 || src >= c->n_seq || dst < 0 || dst >= c->n_seq || src == dst)
        return 0;
    if (n < 1 || n > c->n_ctx_seq)
        return 0;
    if (llama_memory_seq_pos_min(mem, src) != 0 || llama_memory_seq_pos_max(mem, src) < n - 1)
        return 0;
    /* dst's own cells go first: a cell it already shared with src would be added twice. */
    llama_memory_seq_rm(mem, dst, -1, -1);
    llama_memory_seq_cp(mem, src, dst, 0, n);
    if (sll_holds(c, dst, n))
        return 1;
    llama_memory_seq_rm(mem, dst, -1, -1);
    return 0;
}

SLL_EXPORT size_t sll_state_size(sll_context *c, int32_t seq) {
    if (seq < 0 || seq >= c->n_seq)
        return 0;
    return llama_state_seq_get_size(c->ctx, seq);
}

SLL_EXPORT size_t sll_state_save(sll_context *c, int32_t seq, uint8_t *dst, size_t size) {
    if (seq < 0 || seq >= c->n_seq || dst == NULL)
        return 0;
    return llama_state_seq_get_data(c->ctx, dst, size, seq);
}

SLL_EXPORT size_t sll_state_load(sll_context *c, int32_t seq, const uint8_t *src, size_t size) {
    size_t read;
    if (seq < 0 || seq >= c->n_seq || src == NULL)
        return 0;
    read = llama_state_seq_set_data(c->ctx, src, size, seq);
    if (read == 0)
        llama_memory_seq_rm(llama_get_memory(c->ctx), seq, -1, -1);
    return read;
}

SLL_EXPORT void sll_batch_clear(sll_context *c) {
    c->batch.n_tokens = 0;
    memset(c->in_batch, 0, (size_t)c->n_seq);
}

SLL_EXPORT int32_t sll_batch_add(sll_context *c, int32_t seq, const int32_t *tokens, int32_t n, int32_t pos0,
                                 int want_logits) {
    int32_t i, at = c->batch.n_tokens;
    /* What llama.cpp asserts on, refused instead: an unknown sequence or one
     * given twice, an empty batch or one past n_batch, a token outside the
     * vocabulary, a gap in the positions, and a position beyond the context. */
    if (seq < 0 || seq >= c->n_seq || c->in_batch[seq])
        return SLL_REFUSED;
    if (n < 1 || n > c->n_batch - at || pos0 < 0 || pos0 + n > c->n_ctx_seq)
        return SLL_REFUSED;
    if (pos0 != sll_pos_max(c, seq) + 1)
        return SLL_REFUSED;
    for (i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->model->n_vocab)
            return SLL_REFUSED;
    for (i = 0; i < n; i++) {
        c->batch.token[at + i] = tokens[i];
        c->batch.pos[at + i] = pos0 + i;
        c->batch.n_seq_id[at + i] = 1;
        c->batch.seq_id[at + i][0] = seq;
        c->batch.logits[at + i] = 0;
    }
    /* Only flagged tokens go through the output projection. */
    c->batch.logits[at + n - 1] = want_logits ? 1 : 0;
    c->batch.n_tokens = at + n;
    c->in_batch[seq] = 1;
    return at + n - 1;
}

SLL_EXPORT int32_t sll_batch_decode(sll_context *c) {
    if (c->batch.n_tokens == 0)
        return SLL_REFUSED;
    return llama_decode(c->ctx, c->batch);
}

SLL_EXPORT const float *sll_logits(sll_context *c, int32_t index) {
    if (index < 0 || index >= c->batch.n_tokens || !c->batch.logits[index])
        return NULL;
    return llama_get_logits_ith(c->ctx, index);
}

SLL_EXPORT void sll_sampler_free(sll_sampler *smp) {
    if (smp == NULL)
        return;
    if (smp->chain != NULL)
        llama_sampler_free(smp->chain);
    if (smp->grammar != NULL)
        llama_sampler_free(smp->grammar);
    free(smp->window);
    free(smp->candidates);
    free(smp);
}

SLL_EXPORT sll_sampler *sll_sampler_new(const sll_model *m, const sll_sampling *s) {
    sll_sampler *smp = calloc(1, sizeof *smp);
    if (smp == NULL)
        return NULL;
    struct llama_sampler_chain_params params = llama_sampler_chain_default_params();
    params.no_perf = true;
    smp->n_vocab = m->n_vocab;
    smp->eos = llama_vocab_eos(m->vocab);
    smp->candidates = malloc((size_t)m->n_vocab * sizeof *smp->candidates);
    if (s->repeat_penalty != 1.0f && s->penalty_last_n > 0) {
        smp->repeat_penalty = s->repeat_penalty;
        smp->n_window = s->penalty_last_n;
        smp->window = malloc((size_t)smp->n_window * sizeof *smp->window);
    }
    if (s->grammar != NULL)
        smp->grammar = llama_sampler_init_grammar(m->vocab, s->grammar, "root");
    if (smp->candidates == NULL || (smp->n_window > 0 && smp->window == NULL) ||
        (s->grammar != NULL && smp->grammar == NULL)) {
        sll_sampler_free(smp);
        return NULL;
    }
    smp->chain = llama_sampler_chain_init(params);
    if (s->temperature <= 0.0f) {
        llama_sampler_chain_add(smp->chain, llama_sampler_init_greedy());
        return smp;
    }
    if (s->top_k > 0)
        llama_sampler_chain_add(smp->chain, llama_sampler_init_top_k(s->top_k));
    if (s->top_p < 1.0f)
        llama_sampler_chain_add(smp->chain, llama_sampler_init_top_p(s->top_p, 1));
    llama_sampler_chain_add(smp->chain, llama_sampler_init_temp(s->temperature));
    llama_sampler_chain_add(smp->chain, llama_sampler_init_dist(s->seed));
    return smp;
}

SLL_EXPORT void sll_sampler_accept(sll_sampler *smp, int32_t token) {
    if (smp->n_window > 0)
        smp->window[smp->n_seen++ % smp->n_window] = token;
    llama_sampler_accept(smp->chain, token);
}

/* llama.cpp's repetition penalty, by id: each token of the window, counted once,
 * has its logit divided by the penalty when positive, else multiplied by it. The
 * candidates are still in id order (candidates[id].id == id). */
static void penalize_window(sll_sampler *smp) {
    int32_t n = smp->n_seen < smp->n_window ? smp->n_seen : smp->n_window;
    for (int32_t i = 0; i < n; i++) {
        llama_token token = smp->window[i];
        int32_t first = 0;
        while (smp->window[first] != token)
            first++;
        if (first < i)
            continue;
        float *logit = &smp->candidates[token].logit;
        *logit = *logit <= 0.0f ? *logit * smp->repeat_penalty : *logit / smp->repeat_penalty;
    }
}

/* Candidates filled between two stop checks: a few microseconds' work. */
#define FILL_BLOCK 16384

/* Draw through the chain from all candidates, after the grammar when it is
 * given; the stop is checked between blocks of the fill and between the
 * chain's samplers, for a draw over a large vocabulary takes milliseconds.
 * SLL_SAMPLE_STOPPED when it said stop. */
static llama_token draw(sll_sampler *smp, const float *logits, int with_grammar, sll_abort_fn stop, void *data) {
    llama_token_data_array all = {smp->candidates, (size_t)smp->n_vocab, -1, false};
    for (int32_t start = 0; start < smp->n_vocab; start += FILL_BLOCK) {
        int32_t end = start + FILL_BLOCK < smp->n_vocab ? start + FILL_BLOCK : smp->n_vocab;
        for (int32_t i = start; i < end; i++)
            smp->candidates[i] = (llama_token_data){i, logits[i], 0.0f};
        if (stop(data))
            return SLL_SAMPLE_STOPPED;
    }
    if (smp->n_window > 0)
        penalize_window(smp);
    if (with_grammar) {
        llama_sampler_apply(smp->grammar, &all);
        if (stop(data))
            return SLL_SAMPLE_STOPPED;
    }
    for (int32_t i = 0, n = llama_sampler_chain_n(smp->chain); i < n; i++) {
        llama_sampler_apply(llama_sampler_chain_get(smp->chain, i), &all);
        if (stop(data))
            return SLL_SAMPLE_STOPPED;
    }
    return all.data[all.selected].id;
}

static int grammar_allows(sll_sampler *smp, llama_token token) {
    llama_token_data single = {token, 1.0f, 0.0f};
    llama_token_data_array one = {&single, 1, -1, false};
    llama_sampler_apply(smp->grammar, &one);
    return single.logit != -INFINITY;
}

SLL_EXPORT int32_t sll_sample(sll_sampler *smp, const float *logits, sll_abort_fn stop, void *data) {
    llama_token token = draw(smp, logits, 0, stop, data);
    if (token == SLL_SAMPLE_STOPPED)
        return token;
    if (smp->grammar != NULL) {
        /* As llama.cpp's common sampler does: draw without the grammar, and
         * check only that token against it; most tokens pass, and checking one
         * token is far cheaper than masking the vocabulary. Only a token that
         * breaks the grammar costs a second draw from the masked candidates. */
        if (!grammar_allows(smp, token)) {
            token = draw(smp, logits, 1, stop, data);
            if (token == SLL_SAMPLE_STOPPED)
                return token;
            /* Accepting a token the grammar refuses ends the process inside
             * llama.cpp: a grammar with no way on ends the generation instead. */
            if (!grammar_allows(smp, token))
                return smp->eos;
        }
        llama_sampler_accept(smp->grammar, token);
    }
    sll_sampler_accept(smp, token);
    return token;
}

SLL_EXPORT sll_context *sll_embedding_context_new(sll_model *m, int32_t n_tokens, int32_t n_threads, int32_t n_seq,
                                                  char *err, size_t err_size) {
    if (n_tokens < 1 || n_threads < 1 || n_seq < 1 || n_seq > SLL_MAX_SEQUENCES) {
        snprintf(err, err_size, "invalid embedding context sizes");
        return NULL;
    }
    struct llama_context_params params = llama_context_default_params();
    /* An encoder sees every token of an input at once: one evaluation is one physical batch. */
    params.n_ctx = (uint32_t)n_tokens;
    params.n_batch = (uint32_t)n_tokens;
    params.n_ubatch = (uint32_t)n_tokens;
    params.n_seq_max = (uint32_t)n_seq;
    params.n_threads = n_threads;
    params.n_threads_batch = n_threads;
    params.embeddings = true;
    params.no_perf = true;
    sll_context *c = open_context(m, params, n_tokens, false, "llama.cpp could not create an embedding context", err,
                                  err_size);
    if (c != NULL && llama_pooling_type(c->ctx) == LLAMA_POOLING_TYPE_NONE) {
        sll_context_free(c);
        snprintf(err, err_size, "the model's file names no pooling: it has no sentence embedding");
        return NULL;
    }
    return c;
}

SLL_EXPORT int32_t sll_model_n_embd(const sll_model *m) { return llama_model_n_embd(m->model); }

SLL_EXPORT int32_t sll_embed(sll_context *c, const int32_t *tokens, const int32_t *offsets, int32_t n, float *out) {
    int32_t i, j, at = 0, n_embd = llama_model_n_embd(c->model->model);
    /* What llama.cpp asserts on, refused instead: more inputs than sequences, an empty input,
     * more tokens than one evaluation takes, an input longer than the model's positions, and
     * a token outside the vocabulary. */
    if (n < 1 || n > c->n_seq || offsets[0] != 0 || offsets[n] > c->n_batch)
        return SLL_REFUSED;
    for (i = 0; i < n; i++)
        if (offsets[i + 1] <= offsets[i] || offsets[i + 1] - offsets[i] > llama_model_n_ctx_train(c->model->model))
            return SLL_REFUSED;
    for (j = 0; j < offsets[n]; j++)
        if (tokens[j] < 0 || tokens[j] >= c->model->n_vocab)
            return SLL_REFUSED;
    for (i = 0; i < n; i++) {
        for (j = offsets[i]; j < offsets[i + 1]; j++, at++) {
            c->batch.token[at] = tokens[j];
            c->batch.pos[at] = j - offsets[i];
            c->batch.n_seq_id[at] = 1;
            c->batch.seq_id[at][0] = i;
            c->batch.logits[at] = 1;
        }
    }
    c->batch.n_tokens = at;
    /* A model that keeps a cache (a causal one pooled by its last token) starts each call afresh. */
    llama_memory_t memory = llama_get_memory(c->ctx);
    if (memory != NULL)
        llama_memory_clear(memory, true);
    int32_t status = llama_decode(c->ctx, c->batch);
    c->batch.n_tokens = 0;
    if (status != 0)
        return status;
    for (i = 0; i < n; i++) {
        const float *pooled = llama_get_embeddings_seq(c->ctx, i);
        if (pooled == NULL)
            return SLL_INVALID_BATCH;
        memcpy(out + (size_t)i * (size_t)n_embd, pooled, (size_t)n_embd * sizeof(float));
    }
    return SLL_OK;
}

/* The compiler checks every function above against ext/llama_abi.h's table. */
static const sll_api sll_signatures __attribute__((unused)) = {
    .abi_version = sll_abi_version,
    .checks_inside_nodes = sll_checks_inside_nodes,
    .gpu_device = sll_gpu_device,
    .model_load = sll_model_load,
    .model_gpu_layers = sll_model_gpu_layers,
    .model_n_layers = sll_model_n_layers,
    .model_free = sll_model_free,
    .model_n_vocab = sll_model_n_vocab,
    .model_n_ctx_train = sll_model_n_ctx_train,
    .model_meta = sll_model_meta,
    .model_can_truncate = sll_model_can_truncate,
    .tokenize = sll_tokenize,
    .token_piece = sll_token_piece,
    .is_end = sll_is_end,
    .bos = sll_bos,
    .eos = sll_eos,
    .add_bos = sll_add_bos,
    .context_new = sll_context_new,
    .context_free = sll_context_free,
    .context_n_ctx = sll_context_n_ctx,
    .set_abort = sll_set_abort,
    .set_threads = sll_set_threads,
    .pos_max = sll_pos_max,
    .truncate = sll_truncate,
    .holds = sll_holds,
    .copy_prefix = sll_copy_prefix,
    .state_size = sll_state_size,
    .state_save = sll_state_save,
    .state_load = sll_state_load,
    .batch_clear = sll_batch_clear,
    .batch_add = sll_batch_add,
    .batch_decode = sll_batch_decode,
    .logits = sll_logits,
    .sampler_new = sll_sampler_new,
    .sampler_free = sll_sampler_free,
    .sampler_accept = sll_sampler_accept,
    .sample = sll_sample,
    .embedding_context_new = sll_embedding_context_new,
    .model_n_embd = sll_model_n_embd,
    .embed = sll_embed,
};
