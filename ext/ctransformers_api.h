/* The ctransformers C API, resolved at run time from libctransformers.so.
 *
 * The library ships inside the ctransformers wheel in one build per CPU
 * feature level; Python picks the same one ctransformers itself would pick
 * and hands its path to ct_api_open(). */
#ifndef STOPLINE_CTRANSFORMERS_API_H
#define STOPLINE_CTRANSFORMERS_API_H

#include <dlfcn.h>
#include <stdbool.h>
#include <stdio.h>

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
    const char *(*llm_architecture)(ct_llm *llm);
    bool (*llm_batch_eval)(ct_llm *llm, const int *tokens, int n_tokens, int n_past,
                           int batch_size, int threads);
    int (*llm_sample)(ct_llm *llm, const int *last_tokens, int n_last, int top_k,
                      float top_p, float temperature, float repetition_penalty, int seed);
    void (*llm_reset)(ct_llm *llm);
} ct_api;

/* Fill `api` from the library at `path`. Returns 0, or -1 with a message in `err`. */
static int ct_api_open(ct_api *api, const char *path, char *err, size_t err_size) {
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        snprintf(err, err_size, "cannot load %s: %s", path, dlerror());
        return -1;
    }
#define CT_RESOLVE(field, symbol)                                              \
    *(void **)(&api->field) = dlsym(handle, symbol);                           \
    if (api->field == NULL) {                                                  \
        snprintf(err, err_size, "%s has no symbol %s", path, symbol);          \
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
    CT_RESOLVE(llm_architecture, "ctransformers_llm_architecture")
    CT_RESOLVE(llm_batch_eval, "ctransformers_llm_batch_eval")
    CT_RESOLVE(llm_sample, "ctransformers_llm_sample")
    CT_RESOLVE(llm_reset, "ctransformers_llm_reset")
#undef CT_RESOLVE
    api->handle = handle;
    return 0;
}

#endif
