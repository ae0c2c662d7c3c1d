# libctransformers.so's C API, as ext/ctransformers_abi.h declares it for
# ctransformers 0.2.27. The ggml structures in that header are used by
# step_abort.h only; no Cython code touches them. Cimport qualified:
# `from stopline cimport _ctransformers as ct`, then `ct.ct_api`.

cdef extern from "ctransformers_abi.h" nogil:
    const char *CT_ABI_VERSION
    enum: CT_MAX_BATCH

    ctypedef struct ct_config:
        int context_length
        int gpu_layers
        bint mmap
        bint mlock

    ctypedef void ct_llm

    ctypedef struct ct_api:
        void *handle
        ct_llm *(*llm_create)(const char *model_path, const char *model_type, ct_config config) noexcept nogil
        void (*llm_delete)(ct_llm *llm) noexcept nogil
        int (*llm_tokenize)(ct_llm *llm, const char *text, bint add_bos_token, int *output) noexcept nogil
        const char *(*llm_detokenize)(ct_llm *llm, int token) noexcept nogil
        bint (*llm_is_eos_token)(ct_llm *llm, int token) noexcept nogil
        int (*llm_vocab_size)(ct_llm *llm) noexcept nogil
        int (*llm_context_length)(ct_llm *llm) noexcept nogil
        bint (*llm_batch_eval)(ct_llm *llm, const int *tokens, int n_tokens, int n_past,
                               int batch_size, int threads) noexcept nogil
        int (*llm_sample)(ct_llm *llm, const int *last_tokens, int n_last, int top_k,
                          float top_p, float temperature, float repetition_penalty, int seed) noexcept nogil
        float *(*llm_logits_data)(ct_llm *llm) noexcept nogil
        int (*llm_logits_size)(ct_llm *llm) noexcept nogil

    # 0, or -1 with dlerror()'s text in err.
    int ct_api_open(ct_api *api, const char *path, char *err, size_t err_size)
