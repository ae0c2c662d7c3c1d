/* Every part of libctransformers.so's binary interface that Stopline relies on.
 *
 * Matches ctransformers 0.2.27 exactly (pinned in pyproject.toml): its C API
 * (models/llm.cc) and the ggml structures of the ggml it bundles (models/ggml/
 * ggml.h, August 2023). Nothing else in the project declares a C type of
 * theirs.
 *
 * The library ships inside the ctransformers wheel in one build per CPU
 * feature level; Python picks the same one ctransformers itself would pick
 * and hands its path to ct_api_open(). */
#ifndef STOPLINE_CTRANSFORMERS_ABI_H
#define STOPLINE_CTRANSFORMERS_ABI_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

/* The release this file describes. The extension exports it, and the engine
 * refuses to load any other installed ctransformers. */
#define CT_ABI_VERSION "0.2.27"

/* Mirrors `struct Config` in ctransformers' models/llm.h. */
typedef struct {
    int context_length;
    int gpu_layers;
    bool mmap;
    bool mlock;
} ct_config;

typedef void ct_llm;

typedef struct {
    void *handle;
    ct_llm *(*llm_create)(const char *model_path, const char *model_type, ct_config config);
    void (*llm_delete)(ct_llm *llm);
    int (*llm_tokenize)(ct_llm *llm, const char *text, bool add_bos_token, int *output);
    const char *(*llm_detokenize)(ct_llm *llm, int token);
    bool (*llm_is_eos_token)(ct_llm *llm, int token);
    int (*llm_vocab_size)(ct_llm *llm);
    int (*llm_context_length)(ct_llm *llm);
    bool (*llm_batch_eval)(ct_llm *llm, const int *tokens, int n_tokens, int n_past,
                           int batch_size, int threads);
    int (*llm_sample)(ct_llm *llm, const int *last_tokens, int n_last, int top_k,
                      float top_p, float temperature, float repetition_penalty, int seed);
    float *(*llm_logits_data)(ct_llm *llm);
    int (*llm_logits_size)(ct_llm *llm);
} ct_api;

/* Fill `api` from the library at `path`. Returns 0, or -1 with the loader's
 * own explanation (dlerror()) in `err`. */
static int ct_api_open(ct_api *api, const char *path, char *err, size_t err_size) {
    const char *why;
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        snprintf(err, err_size, "%s", dlerror());
        return -1;
    }
#define CT_RESOLVE(field, symbol)                                              \
    dlerror();                                                                 \
    *(void **)(&api->field) = dlsym(handle, symbol);                           \
    if (api->field == NULL) {                                                  \
        why = dlerror();                                                       \
        snprintf(err, err_size, "%s", why ? why : "no symbol " symbol);       \
        dlclose(handle);                                                       \
        return -1;                                                             \
    }
    CT_RESOLVE(llm_create, "ctransformers_llm_create")
    CT_RESOLVE(llm_delete, "ctransformers_llm_delete")
    CT_RESOLVE(llm_tokenize, "ctransformers_llm_tokenize")
    CT_RESOLVE(llm_detokenize, "ctransformers_llm_detokenize")
    CT_RESOLVE(llm_is_eos_token, "ctransformers_llm_is_eos_token")
    CT_RESOLVE(llm_vocab_size, "ctransformers_llm_vocab_size")
    CT_RESOLVE(llm_context_length, "ctransformers_llm_context_length")
    CT_RESOLVE(llm_batch_eval, "ctransformers_llm_batch_eval")
    CT_RESOLVE(llm_sample, "ctransformers_llm_sample")
    CT_RESOLVE(llm_logits_data, "ctransformers_llm_logits_data")
    CT_RESOLVE(llm_logits_size, "ctransformers_llm_logits_size")
#undef CT_RESOLVE
    api->handle = handle;
    return 0;
}

/* The most tokens one evaluation may hold: llama.cpp (as bundled) sizes its
 * compute buffer for llama_context_default_params().n_batch tokens and
 * aborts the process on a larger batch; ctransformers does not check. */
#define CT_MAX_BATCH 512

/* --- ggml, as bundled ----------------------------------------------------
 * Only the leading fields the step hook reads or writes are named; the rest
 * of each struct is opaque. The asserts pin the offsets measured against the
 * bundled ggml.h on x86_64 and aarch64 Linux (LP64). */

#define GGML_MAX_DIMS 4
#define GGML_MAX_SRC 6
#define GGML_MAX_NAME 64
#define GGML_MAX_OP_PARAMS 32
#define GGML_MAX_NODES 4096
#define GGML_OP_MUL_MAT 24          /* enum ggml_op */
#define GGML_EXIT_ABORTED 1

struct ggml_tensor {
    int type;                       /* enum ggml_type */
    int backend;                    /* enum ggml_backend */
    int n_dims;
    int64_t ne[GGML_MAX_DIMS];      /* elements per dimension */
    size_t nb[GGML_MAX_DIMS];       /* stride in bytes per dimension */
    int op;                         /* enum ggml_op */
    int32_t op_params[GGML_MAX_OP_PARAMS / sizeof(int32_t)];
    bool is_param;
    struct ggml_tensor *grad;
    struct ggml_tensor *src[GGML_MAX_SRC];
    int perf_runs;
    int64_t perf_cycles;
    int64_t perf_time_us;
    void *data;
    char name[GGML_MAX_NAME];
    void *extra;
    char padding[4];
};

struct ggml_cgraph {
    int n_nodes;
    int n_leafs;
    struct ggml_tensor *nodes[GGML_MAX_NODES];
    /* grads, leafs, the visited hash table and perf counters follow */
};

struct ggml_cplan {
    size_t work_size;
    uint8_t *work_data;
    int n_threads;
    int n_tasks[GGML_MAX_NODES];
    /* ggml polls this between graph nodes and stops when it returns true;
       ctransformers itself never sets it. */
    bool (*abort_callback)(void *data);
    void *abort_callback_data;
};

typedef int (*ggml_graph_compute_fn)(struct ggml_cgraph *graph, struct ggml_cplan *plan);

#if UINTPTR_MAX != 0xffffffffffffffffu
#error "the ggml layout below is declared for 64-bit platforms only"
#else
_Static_assert(offsetof(struct ggml_tensor, ne) == 16, "ggml_tensor.ne");
_Static_assert(offsetof(struct ggml_tensor, nb) == 48, "ggml_tensor.nb");
_Static_assert(offsetof(struct ggml_tensor, op) == 80, "ggml_tensor.op");
_Static_assert(offsetof(struct ggml_tensor, src) == 128, "ggml_tensor.src");
_Static_assert(offsetof(struct ggml_tensor, data) == 200, "ggml_tensor.data");
_Static_assert(offsetof(struct ggml_tensor, name) == 208, "ggml_tensor.name");
_Static_assert(sizeof(struct ggml_tensor) == 288, "sizeof ggml_tensor");
_Static_assert(offsetof(struct ggml_cgraph, nodes) == 8, "ggml_cgraph.nodes");
_Static_assert(offsetof(struct ggml_cplan, abort_callback) == 16408, "ggml_cplan.abort_callback");
_Static_assert(sizeof(struct ggml_cplan) == 16424, "sizeof ggml_cplan");
#endif

#endif
