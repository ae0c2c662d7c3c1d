/* The binary interface between the native loop and llama.cpp: the C API of
 * Stopline's own shim library, libstopline-llama.so.
 *
 * The shim (ext/llama_shim.c) is compiled against llama.cpp commit 0c1e570
 * (2026-10-01), as vendored by the llama-cpp-python 0.3.36 source
 * distribution, and linked with that llama.cpp's static libraries into one
 * shared object whose only exported symbols are the sll_* functions below
 * (stopline/engine/llama_build.py builds it). The loop loads it RTLD_LOCAL, so its
 * ggml can never bind the ggml symbols of libctransformers.so, or the other
 * way round. No other file of the project declares a llama.cpp type: the shim
 * passes scalars and opaque handles only, and it includes this header, so
 * the compiler checks both sides against the same prototypes. */
#ifndef STOPLINE_LLAMA_ABI_H
#define STOPLINE_LLAMA_ABI_H

#include <dlfcn.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* The llama.cpp source this interface is built from. A shim reporting another
 * version (sll_abi_version) is refused. */
#define SLL_LLAMA_COMMIT "0c1e570"
#define SLL_ABI_VERSION 11

/* The largest prompt chunk, the most sequences one context holds, and the
 * largest batch one evaluation takes (the context's n_batch): a whole chunk
 * beside the next token of every other sequence. */
#define SLL_MAX_CHUNK 512
#define SLL_MAX_SEQUENCES 64
#define SLL_MAX_BATCH (SLL_MAX_CHUNK + SLL_MAX_SEQUENCES - 1)

typedef struct sll_model sll_model;        /* a loaded model and its vocabulary */
typedef struct sll_context sll_context;    /* one context: one KV cache, several sequences */
typedef struct sll_sampler sll_sampler;    /* one generation's sampler chain */

/* Called by the CPU backend after every graph node, on the thread that called
 * sll_batch_decode(), and with Stopline's edits between the pieces of a node,
 * on every compute thread, and where a model has layers on a GPU, between the
 * pieces of the evaluation, on the calling thread; a true return ends the
 * evaluation (sll_batch_decode returns SLL_ABORTED), and must stay true until it has. */
typedef bool (*sll_abort_fn)(void *data);

/* sll_batch_decode()'s results: llama_decode()'s codes, plus the shim's own
 * refusal of a batch that would reach one of llama.cpp's asserts. */
enum {
    SLL_OK = 0,
    SLL_NO_KV_SLOT = 1,
    SLL_ABORTED = 2,
    SLL_INVALID_BATCH = -1,
    SLL_REFUSED = -100,
};

/* sll_sample()'s answer when its stop check said stop. */
#define SLL_SAMPLE_STOPPED (-1)

/* Sampler settings. temperature <= 0 is greedy (the other fields are ignored). */
typedef struct {
    float temperature;
    int32_t top_k;          /* <= 0: off */
    float top_p;            /* >= 1: off */
    /* 1: off. OpenAI's frequency and presence penalties are the loop's own (_core.pyx). */
    float repeat_penalty;
    int32_t penalty_last_n;
    uint32_t seed;
    /* A GBNF grammar (root rule "root") every generated token must follow; NULL: none. */
    const char *grammar;
} sll_sampling;

typedef struct {
    void *handle;
    int (*abi_version)(void);
    /* Whether llama.cpp was built with Stopline's edits (stopline/engine/llama_edits.py),
     * which call the abort callback between the pieces of a graph node too. */
    int (*checks_inside_nodes)(void);
    /* The GPU device a model's layers go to (llama.cpp's first GPU, or integrated GPU where
     * there is none): 1 with its name and description in buf, or 0 where the library was built
     * for the CPU alone or finds no device. */
    int (*gpu_device)(char *buf, size_t buf_size);
    /* Models. Failures return NULL with llama.cpp's own explanation in err. n_gpu_layers is
     * llama.cpp's: the layers (the output layer counts as one) to offload; negative: all. */
    sll_model *(*model_load)(const char *path, int32_t n_gpu_layers, char *err, size_t err_size);
    /* The layers offloaded to the GPU device (0 without one), and the most that could be. */
    int32_t (*model_gpu_layers)(const sll_model *model);
    int32_t (*model_n_layers)(const sll_model *model);
    void (*model_free)(sll_model *model);
    int32_t (*model_n_vocab)(const sll_model *model);
    int32_t (*model_n_ctx_train)(const sll_model *model);
    int32_t (*model_meta)(const sll_model *model, const char *key, char *buf, size_t buf_size);
    int (*model_can_truncate)(const sll_model *model);
    /* Tokens. tokenize() returns the count, or minus the room it needs. */
    int32_t (*tokenize)(const sll_model *model, const char *text, int32_t text_len, int32_t *out,
                        int32_t out_max, int add_special, int parse_special);
    /* special: render control tokens as their text, not as nothing. */
    int32_t (*token_piece)(const sll_model *model, int32_t token, char *buf, int32_t size, int special);
    int (*is_end)(const sll_model *model, int32_t token);
    int32_t (*bos)(const sll_model *model);
    int32_t (*eos)(const sll_model *model);
    int (*add_bos)(const sll_model *model);
    /* Contexts: n_seq sequences (0..n_seq-1) of up to n_ctx_seq positions each,
     * in one pool of KV cells, evaluated by n_threads compute threads that the
     * context keeps (set_threads may lower the count that takes part, not raise it).
     * A call's batch is computed in pieces of n_ubatch tokens (at most n_batch), in the
     * batch's order; an aborted call keeps the pieces it finished in the cache.
     * Not thread-safe: one thread at a time calls a context. */
    sll_context *(*context_new)(sll_model *model, int32_t n_ctx_seq, int32_t n_batch, int32_t n_ubatch,
                                int32_t n_threads, int32_t n_seq, char *err, size_t err_size);
    void (*context_free)(sll_context *ctx);
    int32_t (*context_n_ctx)(const sll_context *ctx);  /* n_ctx_seq */
    void (*set_abort)(sll_context *ctx, sll_abort_fn fn, void *data);
    void (*set_threads)(sll_context *ctx, int32_t n_threads);
    /* A sequence's highest position in the cache (-1: none), and dropping its positions from p0 on. */
    int32_t (*pos_max)(sll_context *ctx, int32_t seq);
    int (*truncate)(sll_context *ctx, int32_t seq, int32_t p0);
    /* Whether the cache holds exactly positions [0, n) of a sequence, in every layer. The cache
     * of a sliding-window layer gives the cells of positions outside a sequence's window to other
     * tokens, other sequences' included, so a prefix it held may be gone. */
    int (*holds)(sll_context *ctx, int32_t seq, int32_t n);
    /* Make sequence dst hold positions [0, n) of sequence src, by sharing src's cells
     * (llama_memory_seq_cp in a unified cache: no token is evaluated and no byte copied).
     * Whatever dst held is dropped first. A later cut or evaluation of either sequence leaves
     * the other's cells as they are. 1 when dst holds exactly [0, n); 0 when refused (an
     * unknown sequence, src == dst, n outside [1, n_ctx_seq], src not holding [0, n)), dst
     * then unchanged, or when the copy did not hold them all, dst then holding nothing; -1,
     * whatever the arguments, for a model with sliding-window layers, whose cache gives
     * cells away: nothing is shared there. */
    int (*copy_prefix)(sll_context *ctx, int32_t src, int32_t dst, int32_t n);
    /* A sequence's KV state as bytes (llama_state_seq_get_data): state_size() is the room
     * state_save() needs, and state_save() returns the bytes written (0: failure). state_load()
     * replaces the sequence's positions with a saved state of the same model and context
     * shape, and returns the bytes read (0: failure, the sequence then holds nothing). */
    size_t (*state_size)(sll_context *ctx, int32_t seq);
    size_t (*state_save)(sll_context *ctx, int32_t seq, uint8_t *dst, size_t size);
    size_t (*state_load)(sll_context *ctx, int32_t seq, const uint8_t *src, size_t size);
    /* One evaluation of several sequences: clear, add each sequence's next
     * tokens[0..n) at positions pos0.. (logits for the last one only when
     * want_logits; returns its index in the batch, or SLL_REFUSED), then
     * decode (an SLL_* code). */
    void (*batch_clear)(sll_context *ctx);
    int32_t (*batch_add)(sll_context *ctx, int32_t seq, const int32_t *tokens, int32_t n, int32_t pos0,
                         int want_logits);
    int32_t (*batch_decode)(sll_context *ctx);
    /* The logits of the last evaluation's token at batch index `index` (NULL: none asked for). */
    const float *(*logits)(sll_context *ctx, int32_t index);
    /* Samplers. sample() draws from `logits` (one per vocabulary id) and records the token,
     * or returns SLL_SAMPLE_STOPPED, having recorded nothing, as soon as stop(data) says so
     * (it is asked between the parts of a draw). sampler_new() returns NULL when it cannot
     * allocate, or when llama.cpp cannot parse the grammar. */
    sll_sampler *(*sampler_new)(const sll_model *model, const sll_sampling *settings);
    void (*sampler_free)(sll_sampler *sampler);
    void (*sampler_accept)(sll_sampler *sampler, int32_t token);
    int32_t (*sample)(sll_sampler *sampler, const float *logits, sll_abort_fn stop, void *data);
    /* Sentence embeddings, from an embedding model (a BERT: attention over the whole input,
     * pooled as its file says). embedding_context_new() makes a context that embeds up to n_seq
     * inputs of n_tokens tokens in all in one evaluation (sll_context_free frees it). embed()
     * evaluates the n inputs tokens[offsets[i]..offsets[i + 1]) and writes input i's pooled
     * embedding, model_n_embd() floats, at out + i * model_n_embd(): an SLL_* code. */
    sll_context *(*embedding_context_new)(sll_model *model, int32_t n_tokens, int32_t n_threads, int32_t n_seq,
                                          char *err, size_t err_size);
    int32_t (*model_n_embd)(const sll_model *model);
    int32_t (*embed)(sll_context *ctx, const int32_t *tokens, const int32_t *offsets, int32_t n, float *out);
} sll_api;

/* Resolve every function from the shim at `path`, opened RTLD_LOCAL.
 * 0, or -1 with dlerror()'s text (or the version mismatch) in err. */
static int sll_api_open(sll_api *api, const char *path, char *err, size_t err_size) {
    const char *why;
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        snprintf(err, err_size, "%s", dlerror());
        return -1;
    }
#define SLL_RESOLVE(field)                                                     \
    dlerror();                                                                 \
    *(void **)(&api->field) = dlsym(handle, "sll_" #field);                    \
    if (api->field == NULL) {                                                  \
        why = dlerror();                                                       \
        snprintf(err, err_size, "%s", why ? why : "no symbol sll_" #field);   \
        dlclose(handle);                                                       \
        return -1;                                                             \
    }
    SLL_RESOLVE(abi_version)
    if (api->abi_version() != SLL_ABI_VERSION) {
        snprintf(err, err_size, "%s has interface version %d; this build needs %d", path, api->abi_version(),
                 SLL_ABI_VERSION);
        dlclose(handle);
        return -1;
    }
    SLL_RESOLVE(checks_inside_nodes)
    SLL_RESOLVE(gpu_device)
    SLL_RESOLVE(model_load)
    SLL_RESOLVE(model_gpu_layers)
    SLL_RESOLVE(model_n_layers)
    SLL_RESOLVE(model_free)
    SLL_RESOLVE(model_n_vocab)
    SLL_RESOLVE(model_n_ctx_train)
    SLL_RESOLVE(model_meta)
    SLL_RESOLVE(model_can_truncate)
    SLL_RESOLVE(tokenize)
    SLL_RESOLVE(token_piece)
    SLL_RESOLVE(is_end)
    SLL_RESOLVE(bos)
    SLL_RESOLVE(eos)
    SLL_RESOLVE(add_bos)
    SLL_RESOLVE(context_new)
    SLL_RESOLVE(context_free)
    SLL_RESOLVE(context_n_ctx)
    SLL_RESOLVE(set_abort)
    SLL_RESOLVE(set_threads)
    SLL_RESOLVE(pos_max)
    SLL_RESOLVE(truncate)
    SLL_RESOLVE(holds)
    SLL_RESOLVE(copy_prefix)
    SLL_RESOLVE(state_size)
    SLL_RESOLVE(state_save)
    SLL_RESOLVE(state_load)
    SLL_RESOLVE(batch_clear)
    SLL_RESOLVE(batch_add)
    SLL_RESOLVE(batch_decode)
    SLL_RESOLVE(logits)
    SLL_RESOLVE(sampler_new)
    SLL_RESOLVE(sampler_free)
    SLL_RESOLVE(sampler_accept)
    SLL_RESOLVE(sample)
    SLL_RESOLVE(embedding_context_new)
    SLL_RESOLVE(model_n_embd)
    SLL_RESOLVE(embed)
#undef SLL_RESOLVE
    api->handle = handle;
    return 0;
}

#endif
