# libstopline-llama.so's C API, as ext/llama_abi.h declares it for the llama.cpp
# that llama-cpp-python 0.3.36 vendors. Cimport qualified:
# `from stopline cimport _llama as ll`, then `ll.sll_api`.

from libc.stdint cimport int32_t, uint8_t, uint32_t

cdef extern from "llama_abi.h" nogil:
    const char *SLL_LLAMA_COMMIT
    enum: SLL_MAX_CHUNK
    enum: SLL_MAX_BATCH
    enum: SLL_MAX_SEQUENCES

    enum:
        SLL_OK
        SLL_NO_KV_SLOT
        SLL_ABORTED
        SLL_INVALID_BATCH
        SLL_REFUSED
        SLL_SAMPLE_STOPPED

    ctypedef struct sll_model
    ctypedef struct sll_context
    ctypedef struct sll_sampler
    ctypedef bint (*sll_abort_fn)(void *data) noexcept nogil

    ctypedef struct sll_sampling:
        float temperature
        int32_t top_k
        float top_p
        float repeat_penalty
        int32_t penalty_last_n
        uint32_t seed
        const char *grammar

    ctypedef struct sll_api:
        void *handle
        int (*abi_version)() noexcept nogil
        int (*checks_inside_nodes)() noexcept nogil
        int (*gpu_device)(char *buf, size_t buf_size) noexcept nogil
        sll_model *(*model_load)(const char *path, int32_t n_gpu_layers, char *err, size_t err_size) noexcept nogil
        int32_t (*model_gpu_layers)(const sll_model *model) noexcept nogil
        int32_t (*model_n_layers)(const sll_model *model) noexcept nogil
        void (*model_free)(sll_model *model) noexcept nogil
        int32_t (*model_n_vocab)(const sll_model *model) noexcept nogil
        int32_t (*model_n_ctx_train)(const sll_model *model) noexcept nogil
        int32_t (*model_meta)(const sll_model *model, const char *key, char *buf, size_t buf_size) noexcept nogil
        int (*model_can_truncate)(const sll_model *model) noexcept nogil
        int32_t (*tokenize)(const sll_model *model, const char *text, int32_t text_len, int32_t *out,
                            int32_t out_max, int add_special, int parse_special) noexcept nogil
        int32_t (*token_piece)(const sll_model *model, int32_t token, char *buf, int32_t size,
                               int special) noexcept nogil
        int (*is_end)(const sll_model *model, int32_t token) noexcept nogil
        int32_t (*bos)(const sll_model *model) noexcept nogil
        int32_t (*eos)(const sll_model *model) noexcept nogil
        int (*add_bos)(const sll_model *model) noexcept nogil
        sll_context *(*context_new)(sll_model *model, int32_t n_ctx_seq, int32_t n_batch, int32_t n_ubatch,
                                    int32_t n_threads, int32_t n_seq, char *err, size_t err_size) noexcept nogil
        void (*context_free)(sll_context *ctx) noexcept nogil
        int32_t (*context_n_ctx)(const sll_context *ctx) noexcept nogil
        void (*set_abort)(sll_context *ctx, sll_abort_fn fn, void *data) noexcept nogil
        void (*set_threads)(sll_context *ctx, int32_t n_threads) noexcept nogil
        int32_t (*pos_max)(sll_context *ctx, int32_t seq) noexcept nogil
        int (*truncate)(sll_context *ctx, int32_t seq, int32_t p0) noexcept nogil
        int (*holds)(sll_context *ctx, int32_t seq, int32_t n) noexcept nogil
        int (*copy_prefix)(sll_context *ctx, int32_t src, int32_t dst, int32_t n) noexcept nogil
        size_t (*state_size)(sll_context *ctx, int32_t seq) noexcept nogil
        size_t (*state_save)(sll_context *ctx, int32_t seq, uint8_t *dst, size_t size) noexcept nogil
        size_t (*state_load)(sll_context *ctx, int32_t seq, const uint8_t *src, size_t size) noexcept nogil
        void (*batch_clear)(sll_context *ctx) noexcept nogil
        int32_t (*batch_add)(sll_context *ctx, int32_t seq, const int32_t *tokens, int32_t n, int32_t pos0,
                             int want_logits) noexcept nogil
        int32_t (*batch_decode)(sll_context *ctx) noexcept nogil
        const float *(*logits)(sll_context *ctx, int32_t index) noexcept nogil
        sll_sampler *(*sampler_new)(const sll_model *model, const sll_sampling *settings) noexcept nogil
        void (*sampler_free)(sll_sampler *sampler) noexcept nogil
        void (*sampler_accept)(sll_sampler *sampler, int32_t token) noexcept nogil
        int32_t (*sample)(sll_sampler *sampler, const float *logits, sll_abort_fn stop, void *data) noexcept nogil
        sll_context *(*embedding_context_new)(sll_model *model, int32_t n_tokens, int32_t n_threads, int32_t n_seq,
                                              char *err, size_t err_size) noexcept nogil
        int32_t (*model_n_embd)(const sll_model *model) noexcept nogil
        int32_t (*embed)(sll_context *ctx, const int32_t *tokens, const int32_t *offsets, int32_t n,
                         float *out) noexcept nogil

    # 0, or -1 with dlerror()'s text (or the version mismatch) in err.
    int sll_api_open(sll_api *api, const char *path, char *err, size_t err_size)
