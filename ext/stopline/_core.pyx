# cython: language_level=3, boundscheck=False, wraparound=False
"""Stopline's native token loop, over two engines.

A :class:`Slot` is one KV cache with the record of which tokens it holds, so a
generation whose prompt starts with them evaluates only the rest. Its two
kinds are the engines: a :class:`Context` is one ctransformers model instance
(the weights memory-mapped and so shared between contexts of the same file),
and a :class:`LlamaSequence` is one sequence of a llama.cpp
:class:`LlamaContext`, whose KV cache holds several. The loop below is the
same for both; only evaluating, sampling and turning a token into bytes
differ, in small functions that switch on the engine.

The generations running on one llama.cpp context share its evaluations: each
step is one batch carrying every running generation's next tokens (a prompt
chunk, or the token it just sampled). The generations' own threads take turns
leading a step; the others wait for it, then sample in parallel.

A :class:`Generation` runs once on a context. Its loop runs with the GIL
released and checks the stop conditions (the cancel flag, an atomic acquire
load, and two deadlines against the monotonic clock) before every prompt chunk
and every token; with the step hook installed (step_abort.h), ggml checks the
same conditions between the graph nodes of every evaluation as well, and
llama.cpp checks them through its official abort callback.

Tokens are handed to Python through an append-only log: the loop writes each
token's id and bytes, publishes the count with a release store and wakes an
eventfd; Python reads everything below the published count. The loop never
runs more than ``window`` tokens ahead of what Python has consumed, so a slow
reader pauses the loop instead of growing a buffer.

The loop knows only whether it must stop, never why a caller wanted it to:
:meth:`Generation.cancel` takes no reason, and a :class:`LoopResult` reports an
:class:`ExitKind`. ``stopline.protocol`` maps that to the service's vocabulary.

C declarations come from three .pxd files, cimported qualified: ``ct`` (the
ctransformers C API, ext/ctransformers_abi.h), ``ll`` (Stopline's shim over
llama.cpp, ext/llama_abi.h) and ``sl`` (Stopline's own C helpers).
:func:`c_failure` is the one place where a failure reported by C becomes a
Python exception.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc cimport errno
from libc.stdint cimport int32_t, int64_t, uint32_t
from libc.stdlib cimport calloc, free, malloc
from libc.math cimport exp, log
from libc.string cimport memcpy, memset, strlen
from posix cimport dlfcn, fcntl, unistd

from stopline cimport _ctransformers as ct
from stopline cimport _llama as ll
from stopline cimport _loop_support as sl

# The step hook watches every generation of one evaluation: a group must hold as
# many as one llama.cpp context runs at once.
cdef extern from *:
    """
    _Static_assert(SL_MAX_GROUP == SLL_MAX_SEQUENCES, "SL_MAX_GROUP must equal SLL_MAX_SEQUENCES");
    """

import os
import time

from stopline.protocol.errors import ContextOverflowError, EngineError, ModelLoadError

cdef enum:
    # The most alternatives a token's log probabilities list (OpenAI's top_logprobs limit).
    MAX_TOP_LOGPROBS = 20
    # How many recent tokens the repetition penalty looks at (ctransformers' default).
    LAST_N_TOKENS = 64
    # While paused for a slow reader, re-check the flag and deadlines this often.
    PAUSE_POLL_NS = 200000
    # Vocabulary ids a log-probability pass covers between two stop checks.
    SAMPLE_BLOCK = 16384
    # sample_next()'s answer when a stop came during the draw (llama_abi.h's SLL_SAMPLE_STOPPED).
    SAMPLE_STOPPED = -1

cdef ct.ct_api API
cdef bint API_READY = False
# Whether ggml's evaluations can be stopped between graph nodes (step_abort.h),
# and if not, why.
cdef bint STEP_ABORT = False
cdef object STEP_ABORT_FAILURE = None
cdef ll.sll_api LLAMA
cdef bint LLAMA_READY = False

cdef enum Engine:
    CTRANSFORMERS
    LLAMA_CPP


# The largest prefill chunk the library can evaluate at once.
MAX_PREFILL_CHUNK = ct.CT_MAX_BATCH
# The ctransformers release whose binary interface ctransformers_abi.h declares.
CTRANSFORMERS_VERSION = ct.CT_ABI_VERSION.decode()
# The llama.cpp commit whose shim ext/llama_abi.h declares, and the largest
# prompt chunk its contexts take.
LLAMA_COMMIT = ll.SLL_LLAMA_COMMIT.decode()
LLAMA_MAX_CHUNK = ll.SLL_MAX_CHUNK


cdef object c_failure(type kind, str what, int errnum=0, const char *detail=NULL):
    """The one place where a failure reported by C becomes a Python exception
    (returned, to be raised by the caller). ``errnum`` is the errno the failed
    call left (0: none), ``detail`` an explanation the library gave (dlerror())."""
    if detail is not NULL and detail[0]:
        what = f"{what}: {detail.decode('utf-8', 'replace')}"
    if issubclass(kind, OSError) and errnum:
        return kind(errnum, f"{what}: {os.strerror(errnum)}")
    if errnum:
        what = f"{what}: {os.strerror(errnum)}"
    error = kind(what)
    if errnum:
        error.errno = errnum
    return error


def load_library(str path):
    """Resolve the ctransformers C API from ``path`` and install the step hook (once per process)."""
    global API_READY, STEP_ABORT, STEP_ABORT_FAILURE
    cdef char err[512]
    cdef sl.sl_hook_status hook
    if API_READY:
        return
    if ct.ct_api_open(&API, os.fsencode(path), err, sizeof(err)) != 0:
        raise c_failure(EngineError, f"cannot load {path}", 0, err)
    API_READY = True
    hook = sl.sl_step_abort_install(API.handle)
    # Read right away: errno and dlerror() belong to the failed call.
    if hook == sl.SL_HOOK_NO_LINK_MAP:
        STEP_ABORT_FAILURE = c_failure(EngineError, "dlinfo() found no link map", 0, dlfcn.dlerror())
    elif hook == sl.SL_HOOK_READ_ONLY:
        STEP_ABORT_FAILURE = c_failure(EngineError, "cannot make the GOT entry writable", errno.errno)
    elif hook == sl.SL_HOOK_NO_PLT_ENTRY:
        STEP_ABORT_FAILURE = c_failure(EngineError, "the library does not call ggml_graph_compute through its PLT")
    STEP_ABORT = hook == sl.SL_HOOK_INSTALLED


def load_llama_library(str path):
    """Resolve the llama.cpp shim's C API from ``path`` (once per process). The
    library is opened RTLD_LOCAL: its ggml stays its own."""
    global LLAMA_READY
    cdef char err[512]
    if LLAMA_READY:
        return
    if ll.sll_api_open(&LLAMA, os.fsencode(path), err, sizeof(err)) != 0:
        raise c_failure(EngineError, f"cannot load {path}", 0, err)
    LLAMA_READY = True


def llama_checks_inside_nodes():
    """Whether the loaded llama.cpp library was built with Stopline's edits, which stop
    an evaluation between the pieces of a graph node, not only between nodes."""
    if not LLAMA_READY:
        raise EngineError("load_llama_library() has not been called")
    return bool(LLAMA.checks_inside_nodes())


cdef int *token_ids(tokens) except NULL:
    """A C copy of ``tokens``, for the caller to free(). (llama.cpp's token type,
    int32_t, is int on every platform the engines build for.)"""
    cdef int i, n = len(tokens)
    cdef int *ids = <int *>malloc((n + 1) * sizeof(int))
    if ids is NULL:
        raise c_failure(MemoryError, "cannot allocate the token ids")
    for i in range(n):
        ids[i] = tokens[i]
    return ids


def step_abort_installed():
    """Whether the hook that stops an evaluation between graph nodes is in place.
    :meth:`Context.probe_step_abort` proves that it works."""
    return STEP_ABORT


def step_abort_failure():
    """Why the hook could not be installed (an :class:`EngineError`), or None."""
    return STEP_ABORT_FAILURE


cdef class Slot:
    """What both engines' contexts share: one KV cache, and the record of the
    tokens it holds. Generations run on a slot one at a time."""
    cdef Engine engine
    cdef readonly int context_length
    cdef readonly int vocab_size
    cdef readonly int max_token_bytes
    # The most tokens one evaluation takes.
    cdef readonly int max_batch
    cdef int busy
    # The tokens whose keys and values the KV cache holds, from position 0,
    # and the prefill chunk they were evaluated with.
    cdef int *held
    cdef readonly int n_held
    cdef int held_chunk

    cdef int allocate_record(self) except -1:
        self.held = <int *>malloc(self.context_length * sizeof(int))
        if self.held is NULL:
            raise c_failure(MemoryError, "cannot allocate the KV cache's token record")
        return 0

    def reusable_prefix(self, tokens, int chunk):
        """How many leading ``tokens`` a generation with prefill chunks of
        ``chunk`` would take from this slot's KV cache instead of evaluating them."""
        cdef int *ids = token_ids(tokens)
        try:
            return self.usable_prefix(ids, len(tokens), chunk)
        finally:
            free(ids)

    cdef int usable_prefix(self, const int *tokens, int n, int chunk) noexcept:
        # Short of the last token, whose logits are needed. Only what was
        # evaluated with the same chunk size: another size sums differently
        # (see run_steps), and the guarantee is a fresh context's logits.
        cdef int i, held = min(n - 1, self.n_held)
        if chunk != self.held_chunk:
            return 0
        for i in range(held):
            if tokens[i] != self.held[i]:
                return i
        return max(held, 0)

    def forget(self):
        """Drop what the KV cache holds: the next generation evaluates its whole prompt."""
        self.n_held = 0

    def last_logits(self):
        """A copy of the logits the last token was sampled from (as float32 bytes, one per
        vocabulary id), with the penalties that sampling applied to them; None before any."""
        cdef const float *logits
        self._check_idle()
        logits = self.logits_pointer()
        if logits is NULL:
            return None
        return PyBytes_FromStringAndSize(<const char *>logits, self.vocab_size * sizeof(float))

    cdef const float *logits_pointer(self) noexcept:
        return NULL

    @property
    def closed(self):
        return True

    cdef _check_open(self):
        if self.closed:
            raise EngineError("context is closed")

    cdef _check_idle(self):
        # Open, and no generation running on it: what reading or probing its state needs.
        self._check_open()
        if self.busy:
            raise EngineError("the context is busy")

    cdef void free_native(self) noexcept:
        """Free the engine's context (each engine's own); safe to call twice."""

    def close(self):
        if self.busy:
            raise EngineError("cannot close a context while a generation runs on it")
        self.free_native()
        self.n_held = 0

    def __dealloc__(self):
        free(self.held)


cdef class Context(Slot):
    """One ctransformers model instance."""
    cdef ct.ct_llm *llm

    def __cinit__(self, str model_path, str model_type="llama", int context_length=2048):
        cdef ct.ct_config config
        cdef int fd
        if not API_READY:
            raise EngineError("load_library() has not been called")
        config.context_length = context_length
        config.gpu_layers = 0
        config.mmap = True
        config.mlock = False
        path_bytes = os.fsencode(model_path)
        kind_bytes = model_type.encode()
        cdef const char *path = path_bytes
        cdef const char *kind = kind_bytes
        # The library reports any failure as NULL; an unreadable file gets its errno here.
        fd = fcntl.open(path, fcntl.O_RDONLY | fcntl.O_CLOEXEC)
        if fd < 0:
            raise c_failure(ModelLoadError, f"cannot open {model_path}", errno.errno)
        unistd.close(fd)
        with nogil:
            self.llm = API.llm_create(path, kind, config)
        if self.llm is NULL:
            raise c_failure(ModelLoadError, f"ctransformers could not create a {model_type!r} model from {model_path}")
        self.engine = Engine.CTRANSFORMERS
        self.max_batch = ct.CT_MAX_BATCH
        self.context_length = API.llm_context_length(self.llm)
        self.vocab_size = API.llm_vocab_size(self.llm)
        cdef int token, longest = 0, size
        for token in range(self.vocab_size):
            size = <int>strlen(API.llm_detokenize(self.llm, token))
            if size > longest:
                longest = size
        self.max_token_bytes = longest
        self.allocate_record()

    def probe_step_abort(self, tokens):
        """Prove the step hook on a real evaluation of ``tokens`` (two or more).

        Returns ``(aborts, trim_exact)``: whether an evaluation with the stop
        flag set returned part-way, and whether the last token's logits
        computed alone are bit-identical to those of a full evaluation."""
        cdef sl.sl_watch watch
        cdef int n = len(tokens), size
        cdef bint ok, aborts
        cdef int *ids
        self._check_idle()
        if not 2 <= n <= ct.CT_MAX_BATCH:
            raise ValueError(f"the probe evaluates 2 to {ct.CT_MAX_BATCH} tokens at once")
        if not STEP_ABORT:
            return False, False
        ids = token_ids(tokens)
        self.n_held = 0
        memset(&watch, 0, sizeof(watch))
        try:
            with nogil:
                sl.sl_watch_enter(&watch)
                watch.cancel_flag = 1
                API.llm_batch_eval(self.llm, ids, n, 0, n, 1)
                aborts = watch.aborted == 1
                watch.cancel_flag = 0
                ok = API.llm_batch_eval(self.llm, ids, n, 0, n, 1)
                sl.sl_watch_leave()
            if not ok or watch.aborted:
                return aborts, False
            size = API.llm_logits_size(self.llm)
            full = PyBytes_FromStringAndSize(<char *>API.llm_logits_data(self.llm), size * sizeof(float))
            with nogil:
                sl.sl_watch_enter(&watch)
                watch.trim_output = 1
                ok = API.llm_batch_eval(self.llm, ids, n, 0, n, 1)
                sl.sl_watch_leave()
            trimmed = PyBytes_FromStringAndSize(<char *>API.llm_logits_data(self.llm), size * sizeof(float))
            return aborts, ok and not watch.aborted and trimmed == full
        finally:
            free(ids)

    def tokenize(self, str text):
        """The model's own tokenizer, for models whose GGUF has no byte-level BPE vocab."""
        self._check_open()
        data = text.encode("utf-8")
        cdef int *ids = <int *>malloc((len(data) + 1) * sizeof(int))
        if ids is NULL:
            raise c_failure(MemoryError, "cannot allocate the token ids")
        try:
            n = API.llm_tokenize(self.llm, data, False, ids)
            return [ids[i] for i in range(n)]
        finally:
            free(ids)

    def token_bytes(self, int token):
        self._check_open()
        return <bytes>API.llm_detokenize(self.llm, token)

    cdef const float *logits_pointer(self) noexcept:
        if API.llm_logits_size(self.llm) < self.vocab_size:
            return NULL
        return API.llm_logits_data(self.llm) + API.llm_logits_size(self.llm) - self.vocab_size

    @property
    def closed(self):
        return self.llm is NULL

    cdef void free_native(self) noexcept:
        if self.llm is not NULL:
            API.llm_delete(self.llm)
            self.llm = NULL

    def __dealloc__(self):
        self.free_native()


cdef class LlamaModel:
    """A GGUF model loaded by llama.cpp: its weights and vocabulary, shared by
    every :class:`LlamaContext` made from it."""
    cdef ll.sll_model *model
    cdef readonly int vocab_size
    # The context length the model was trained with.
    cdef readonly int context_limit
    cdef readonly int max_token_bytes
    # Whether a context's cache can be cut back to a prefix (not for recurrent models).
    cdef readonly bint can_truncate
    # Calls using the model without the GIL, which close() waits for.
    cdef int users

    def __cinit__(self, str model_path):
        cdef char err[512]
        cdef int fd, token, longest = 0, size
        cdef char piece[256]
        if not LLAMA_READY:
            raise EngineError("load_llama_library() has not been called")
        path_bytes = os.fsencode(model_path)
        cdef const char *path = path_bytes
        fd = fcntl.open(path, fcntl.O_RDONLY | fcntl.O_CLOEXEC)
        if fd < 0:
            raise c_failure(ModelLoadError, f"cannot open {model_path}", errno.errno)
        unistd.close(fd)
        err[0] = 0
        with nogil:
            self.model = LLAMA.model_load(path, err, sizeof(err))
        if self.model is NULL:
            raise c_failure(ModelLoadError, f"llama.cpp could not load {model_path}", 0, err)
        self.vocab_size = LLAMA.model_n_vocab(self.model)
        self.context_limit = LLAMA.model_n_ctx_train(self.model)
        self.can_truncate = LLAMA.model_can_truncate(self.model)
        with nogil:
            for token in range(self.vocab_size):
                size = LLAMA.token_piece(self.model, token, piece, sizeof(piece), False)
                if size < 0:
                    size = -size
                if size > longest:
                    longest = size
        self.max_token_bytes = longest

    def metadata(self, str key):
        """The GGUF metadata value under ``key`` as text, or None."""
        cdef int32_t size
        cdef char small[256]
        self._check_open()
        key_bytes = key.encode()
        size = LLAMA.model_meta(self.model, key_bytes, small, sizeof(small))
        if size < 0:
            return None
        if size < <int32_t>sizeof(small):
            return (<bytes>small[:size]).decode("utf-8", "replace")
        buffer = bytearray(size + 1)
        size = LLAMA.model_meta(self.model, key_bytes, <char *>buffer, size + 1)
        return bytes(buffer[:size]).decode("utf-8", "replace")

    def tokenize(self, str text, bint add_special=False):
        """The model's own tokenizer; special tokens written in ``text`` stay whole."""
        cdef int32_t n
        cdef int32_t *ids
        self._check_open()
        data = text.encode("utf-8")
        cdef const char *chars = data
        cdef int32_t size = len(data)
        cdef int32_t capacity = size + 2
        ids = <int32_t *>malloc(capacity * sizeof(int32_t))
        if ids is NULL:
            raise c_failure(MemoryError, "cannot allocate the token ids")
        try:
            # Without the GIL: a long prompt takes milliseconds, which the event loop
            # (the tokenizer lanes call this from their threads) must not wait for.
            self.users += 1
            with nogil:
                n = LLAMA.tokenize(self.model, chars, size, ids, capacity, add_special, True)
            self.users -= 1
            if n < 0:
                raise c_failure(EngineError, f"llama.cpp could not tokenize {len(data)} bytes")
            return [ids[i] for i in range(n)]
        finally:
            free(ids)

    def token_bytes(self, int token, bint special=False):
        """``token``'s bytes; a control token's own text only when ``special``."""
        cdef char piece[256]
        cdef int32_t size
        self._check_open()
        size = LLAMA.token_piece(self.model, token, piece, sizeof(piece), special)
        return piece[:max(size, 0)]

    def is_end(self, int token):
        """Whether ``token`` ends a generation (llama.cpp's end-of-generation set)."""
        self._check_open()
        return bool(LLAMA.is_end(self.model, token))

    @property
    def special_tokens(self):
        """``(bos, eos, add_bos)``: the beginning- and end-of-sequence tokens (-1: none),
        and whether the model wants a prompt to start with bos."""
        self._check_open()
        return LLAMA.bos(self.model), LLAMA.eos(self.model), bool(LLAMA.add_bos(self.model))

    cdef _check_open(self):
        if self.model is NULL:
            raise EngineError("model is closed")

    def close(self):
        """Free the weights, once a tokenizing thread is done with them. Every context
        made from the model must be closed first."""
        while self.users:
            time.sleep(0.001)
        if self.model is not NULL:
            LLAMA.model_free(self.model)
            self.model = NULL

    def __dealloc__(self):
        self.close()


cdef struct Batcher


cdef enum PostResult:
    POST_WAITING
    POST_DONE
    POST_STOPPED           # a stop condition holds (s.exit says which)
    POST_FAILED


cdef struct LoopState:
    # Written by Python before the loop starts, read-only inside it.
    Engine engine
    ct.ct_llm *llm                 # the ctransformers engine's model instance
    Batcher *batcher               # the llama.cpp engine's context, which other generations share,
    int seq                        # this generation's sequence in it,
    const ll.sll_model *lmodel     # its model,
    ll.sll_sampler *sampler        # and this generation's sampler chain
    float *logits                  # the logits sampled from (the slot's copy, written by each step)
    int max_token_bytes
    int *tokens            # prompt, then generated tokens
    int n_prompt
    int n_reused           # leading prompt tokens the KV cache already holds
    int max_tokens
    bint max_tokens_capped  # max_tokens is the room the context has left
    int top_k
    float top_p
    float temperature
    float repetition_penalty
    # OpenAI's penalties: logit[t] -= count[t] * frequency_penalty + (count[t] > 0) * presence_penalty,
    # count[t] being how often t was generated so far. counts is NULL when both are 0.
    float frequency_penalty
    float presence_penalty
    int *counts            # occurrences of each token id among the generated tokens
    int *seen              # the distinct ids generated, in order of first appearance
    int n_seen
    int vocab_size
    # Log probabilities (n_top < 0: off): the log-softmax of the model's logits at each
    # draw, before penalties, temperature, truncation and grammar. For generated token
    # i: chosen_logprob[i], and its n_top best alternatives in top_ids/top_logprobs[i * n_top ...].
    int n_top
    float *scratch         # the raw logits of the current draw
    float log_sum          # their log-sum-exp
    float *chosen_logprob
    int *top_ids
    float *top_logprobs
    int seed
    int prefill_chunk
    int threads            # wanted for the next evaluation; Python may change it at any time
    int window
    bint step_abort        # let the hook stop evaluations between graph nodes
    bint trim_output       # compute only the last token's logits of a chunk
    char *stops                    # stop sequences, back to back
    int *stop_sizes
    int n_stops
    int wake_fd
    # The stop conditions: the cancel flag and the deadlines.
    sl.sl_watch watch
    # Shared with Python through atomics.
    int cancel_requested   # claimed once, by the first Generation.cancel()
    int published          # tokens whose id and bytes are readable
    int consumed           # tokens Python has read
    int published_at_cancel
    # Outputs, written by the loop.
    char *text
    uint32_t *text_end     # text_end[i]: bytes of text after token i
    int n_past             # tokens fully evaluated into the KV cache
    int n_generated
    int n_prompt_evaluated
    int stop_at            # byte offset where the matched stop sequence starts
    ExitKind exit
    int tokens_after_cancel
    int64_t start_ns
    int64_t first_token_ns
    int64_t cancel_observed_ns
    int64_t end_ns
    int64_t longest_prefill_node_ns
    int64_t longest_decode_node_ns
    # The llama.cpp engine's turn in its context's steps (guarded by the Batcher's lock).
    bint is_present        # counted in Batcher.present
    int post_count         # tokens posted for the next step
    PostResult post_result


cdef struct Batcher:
    # Generations running on one llama.cpp context take turns leading: the
    # leader evaluates the tokens every present generation has posted, in one
    # batch, while the others wait. The lock guards present, the posts and
    # leading; the context and everything after leading belong to the thread
    # that set leading.
    sl.pthread_mutex_t lock
    sl.pthread_cond_t changed
    ll.sll_context *ctx
    # Running generations that are not paused for their reader: a step waits
    # until each of them has posted its tokens, so that they share it.
    int present
    int n_posted
    LoopState *posted[ll.SLL_MAX_SEQUENCES]
    # A thread is using the context (evaluating, or changing its cache).
    bint leading
    # Per sequence, where its cache is to be cut (-1: nowhere): a cut asked for
    # while a thread uses the context waits for that thread to end its turn.
    int cut_from[ll.SLL_MAX_SEQUENCES]
    int applied_threads
    int max_tokens         # the most tokens one evaluation takes
    # Evaluations run, the generations they carried in all (their ratio is how
    # many generations a step shared on average), and the evaluations that were
    # stopped for one generation and run again for the others.
    int64_t steps
    int64_t step_members
    int64_t reruns
    # The stop conditions of the step being evaluated (the abort callback's data).
    sl.sl_group_watch group


cdef class LlamaContext:
    """One llama.cpp context over a :class:`LlamaModel`: one KV cache holding
    ``sequences`` sequences, each a :class:`LlamaSequence` slot. The generations
    running on its sequences are evaluated together, one batch per step.
    ``batch`` is the most tokens one evaluation takes (the prefill chunk)."""
    cdef Batcher b
    cdef readonly LlamaModel model
    cdef readonly tuple sequences
    cdef readonly int context_length
    cdef readonly int max_batch
    cdef int open_sequences

    def __cinit__(self, LlamaModel model, int context_length=2048, int batch=64, int threads=1,
                  int sequences=1):
        cdef char err[512]
        model._check_open()
        if not 1 <= batch <= ll.SLL_MAX_CHUNK:
            raise ValueError(f"batch is 1 to {ll.SLL_MAX_CHUNK}")
        if not 1 <= sequences <= ll.SLL_MAX_SEQUENCES:
            raise ValueError(f"sequences is 1 to {ll.SLL_MAX_SEQUENCES}")
        if context_length < 2 or threads < 1:
            raise ValueError("context_length must be at least 2 and threads positive")
        # Room for a whole prompt chunk and the next token of every other sequence.
        self.b.max_tokens = batch + sequences - 1
        err[0] = 0
        with nogil:
            self.b.ctx = LLAMA.context_new(model.model, context_length, self.b.max_tokens, threads, sequences,
                                           err, sizeof(err))
        if self.b.ctx is NULL:
            raise c_failure(ModelLoadError, "llama.cpp could not create a context", 0, err)
        sl.pthread_mutex_init(&self.b.lock, NULL)
        sl.pthread_cond_init(&self.b.changed, NULL)
        for seq in range(ll.SLL_MAX_SEQUENCES):
            self.b.cut_from[seq] = -1
        self.b.applied_threads = threads
        LLAMA.set_abort(self.b.ctx, sl.sl_group_abort_callback, &self.b.group)
        self.model = model
        self.max_batch = batch
        self.context_length = LLAMA.context_n_ctx(self.b.ctx)
        self.sequences = tuple(LlamaSequence(self, seq) for seq in range(sequences))
        self.open_sequences = sequences

    @property
    def closed(self):
        return self.b.ctx is NULL

    @property
    def step_counts(self):
        """``(steps, generations, reruns)``: the evaluations run, the generations they
        carried in all, and the evaluations stopped for one generation and run again
        for the others."""
        claim_context(&self.b)
        counts = (self.b.steps, self.b.step_members, self.b.reruns)
        release_context(&self.b)
        return counts

    cdef void sequence_closed(self) noexcept:
        self.open_sequences -= 1
        if self.open_sequences == 0 and self.b.ctx is not NULL:
            LLAMA.context_free(self.b.ctx)
            self.b.ctx = NULL

    def __dealloc__(self):
        if self.b.ctx is not NULL:
            LLAMA.context_free(self.b.ctx)
            self.b.ctx = NULL
        sl.pthread_cond_destroy(&self.b.changed)
        sl.pthread_mutex_destroy(&self.b.lock)


cdef void claim_context(Batcher *b) noexcept nogil:
    """Wait until no thread uses the context, and take it, with every cut asked for made."""
    sl.pthread_mutex_lock(&b.lock)
    while b.leading:
        sl.pthread_cond_wait(&b.changed, &b.lock)
    b.leading = True
    make_cuts(b)
    sl.pthread_mutex_unlock(&b.lock)


cdef void release_context(Batcher *b) noexcept nogil:
    sl.pthread_mutex_lock(&b.lock)
    make_cuts(b)
    b.leading = False
    sl.pthread_cond_broadcast(&b.changed)
    sl.pthread_mutex_unlock(&b.lock)


cdef void truncate_sequence(Batcher *b, int seq, int p0) noexcept nogil:
    """Drop ``seq``'s positions from ``p0`` on: at once if no thread uses the
    context, else as that thread takes or gives up the context, before any
    evaluation of ``seq`` and any read of its cache. A generation that starts
    during a step (or is stopped before its first evaluation) does not wait
    for the step."""
    sl.pthread_mutex_lock(&b.lock)
    if b.cut_from[seq] < 0 or p0 < b.cut_from[seq]:
        b.cut_from[seq] = p0
    if not b.leading:
        make_cuts(b)
    sl.pthread_mutex_unlock(&b.lock)


cdef void make_cuts(Batcher *b) noexcept nogil:
    """Cut the caches as asked (called with the lock held, by the thread that
    uses the context, or while none does)."""
    cdef int seq
    for seq in range(ll.SLL_MAX_SEQUENCES):
        if b.cut_from[seq] >= 0:
            LLAMA.truncate(b.ctx, seq, b.cut_from[seq])
            b.cut_from[seq] = -1


cdef class LlamaSequence(Slot):
    """One sequence of a :class:`LlamaContext`: its share of the KV cache, and
    the logits its last token was sampled from."""
    cdef readonly LlamaContext owner
    cdef readonly int seq
    cdef float *logits
    cdef bint is_closed

    def __cinit__(self, LlamaContext owner, int seq):
        self.owner = owner
        self.seq = seq
        self.engine = Engine.LLAMA_CPP
        self.max_batch = owner.max_batch
        self.context_length = owner.context_length
        self.vocab_size = owner.model.vocab_size
        self.max_token_bytes = owner.model.max_token_bytes
        self.allocate_record()
        self.logits = <float *>malloc(self.vocab_size * sizeof(float))
        if self.logits is NULL:
            raise c_failure(MemoryError, "cannot allocate the logits")

    @property
    def model(self):
        return self.owner.model

    @property
    def kv_positions(self):
        """How many positions the KV cache holds for this sequence, as llama.cpp reports them."""
        cdef int32_t pos_max
        self._check_open()
        claim_context(&self.owner.b)
        pos_max = LLAMA.pos_max(self.owner.b.ctx, self.seq)
        release_context(&self.owner.b)
        return pos_max + 1

    def forget(self):
        self.n_held = 0
        if not self.closed:
            truncate_sequence(&self.owner.b, self.seq, 0)

    def probe_step_abort(self, tokens):
        """Prove the abort callback on a real evaluation of ``tokens`` (two or
        more): with the stop flag set, the evaluation must end part-way and
        leave nothing in the cache; with it clear, it must complete.

        Returns ``(aborts, True)``: a llama.cpp evaluation computes the output
        projection only for the tokens it is asked for, so there is nothing to trim."""
        cdef sl.sl_watch watch
        cdef Batcher *b = &self.owner.b
        cdef int n = len(tokens)
        cdef int32_t first, second, left
        cdef int32_t *ids
        self._check_idle()
        if not 2 <= n <= self.max_batch:
            raise ValueError(f"the probe evaluates 2 to {self.max_batch} tokens at once")
        ids = <int32_t *>token_ids(tokens)
        self.n_held = 0
        memset(&watch, 0, sizeof(watch))
        try:
            with nogil:
                claim_context(b)
                LLAMA.truncate(b.ctx, self.seq, 0)
                b.group.n = 1
                b.group.members[0] = &watch
                watch.cancel_flag = 1
                first = probe_decode(b, self.seq, ids, n)
                left = LLAMA.pos_max(b.ctx, self.seq)
                LLAMA.truncate(b.ctx, self.seq, 0)
                watch.cancel_flag = 0
                second = probe_decode(b, self.seq, ids, n)
                LLAMA.truncate(b.ctx, self.seq, 0)
                b.group.n = 0
                release_context(b)
            return first == ll.SLL_ABORTED and left == -1 and second == ll.SLL_OK, True
        finally:
            free(ids)

    def tokenize(self, str text):
        return self.owner.model.tokenize(text)

    def token_bytes(self, int token):
        return self.owner.model.token_bytes(token)

    cdef const float *logits_pointer(self) noexcept:
        return self.logits if self.n_held else NULL

    @property
    def closed(self):
        return self.is_closed or self.owner.closed

    cdef void free_native(self) noexcept:
        if self.is_closed:
            return
        self.is_closed = True
        if not self.owner.closed:
            truncate_sequence(&self.owner.b, self.seq, 0)
            self.owner.sequence_closed()

    def __dealloc__(self):
        free(self.logits)


cdef int32_t probe_decode(Batcher *b, int seq, const int32_t *ids, int n) noexcept nogil:
    LLAMA.batch_clear(b.ctx)
    if LLAMA.batch_add(b.ctx, seq, ids, n, 0, 1) < 0:
        return ll.SLL_REFUSED
    return decode_batch(b)


cdef int32_t decode_batch(Batcher *b) noexcept nogil:
    """Evaluate the batch built in the context, with the group's stop conditions
    watched throughout. Any check that saw a stop makes it an aborted evaluation:
    a thread may have left a node part-way after the last check of llama.cpp's own."""
    cdef int32_t status
    b.group.aborted = 0
    b.group.longest_gap_ns = 0
    b.group.start_ns = sl.sl_monotonic_ns()
    status = LLAMA.batch_decode(b.ctx)
    return ll.SLL_ABORTED if b.group.aborted else status


cdef inline bint should_stop(LoopState *s) noexcept nogil:
    """The poll done before every chunk and token; records why the loop ends."""
    cdef sl.sl_stop why = sl.sl_check(&s.watch)
    if why == sl.SL_RUN:
        return False
    if why == sl.SL_STOP_CANCELLED:
        s.cancel_observed_ns = sl.sl_monotonic_ns()
        s.exit = ExitKind.CANCELLED
        s.tokens_after_cancel = s.n_generated - s.published_at_cancel
    elif why == sl.SL_STOP_TOTAL_TIMEOUT:
        s.exit = ExitKind.TOTAL_DEADLINE
    else:
        s.exit = ExitKind.FIRST_TOKEN_DEADLINE
    return True


cdef bint evaluate(LoopState *s, int count) noexcept nogil:
    """Evaluate the next ``count`` tokens into the KV cache. False when the loop
    must end instead (s.exit says why)."""
    cdef bint ok
    if s.engine == Engine.LLAMA_CPP:
        return evaluate_in_step(s, count)
    s.watch.aborted = 0
    s.watch.longest_gap_ns = 0
    s.watch.trim_output = s.trim_output
    # Threads are read once per evaluation: the scheduler reshares the cores as generations come and go.
    ok = API.llm_batch_eval(s.llm, s.tokens + s.n_past, count, s.n_past, count, sl.sl_load_acquire(&s.threads))
    record_longest_node(s, s.watch.longest_gap_ns)
    if s.watch.aborted:
        # Stopped between graph nodes: the stop condition that did it still
        # holds (the flag is sticky, deadlines only pass), and these positions
        # of the KV cache hold nothing usable.
        if not should_stop(s):
            s.exit = ExitKind.EVAL_FAILED
        return False
    if not ok:
        s.exit = ExitKind.EVAL_FAILED
        return False
    s.n_past += count
    return True


cdef inline void record_longest_node(LoopState *s, int64_t gap) noexcept nogil:
    if s.n_generated == 0:
        if gap > s.longest_prefill_node_ns:
            s.longest_prefill_node_ns = gap
    elif gap > s.longest_decode_node_ns:
        s.longest_decode_node_ns = gap


cdef bint evaluate_in_step(LoopState *s, int count) noexcept nogil:
    """The llama.cpp engine's evaluate(): post the tokens for the context's next
    step and wait for it. Whichever waiting generation finds every present one
    posted leads the step for all of them."""
    cdef Batcher *b = s.batcher
    sl.pthread_mutex_lock(&b.lock)
    s.post_count = count
    s.post_result = PostResult.POST_WAITING
    b.posted[b.n_posted] = s
    b.n_posted += 1
    while s.post_result == PostResult.POST_WAITING:
        if not b.leading and b.n_posted >= b.present:
            lead_step(b, s)
        elif sl.sl_check(&s.watch) != sl.SL_RUN and withdraw(b, s):
            # Stopped while a step it is not part of runs: it leaves without waiting for it.
            should_stop(s)
            s.post_result = PostResult.POST_STOPPED
        else:
            # Woken by every result, every step's end, and a cancel (Generation.cancel).
            sl.pthread_cond_wait(&b.changed, &b.lock)
    sl.pthread_mutex_unlock(&b.lock)
    return s.post_result == PostResult.POST_DONE


cdef bint withdraw(Batcher *b, LoopState *s) noexcept nogil:
    """Take ``s``'s tokens back if no step has taken them yet (called with the lock held)."""
    cdef int i, j
    for i in range(b.n_posted):
        if b.posted[i] == s:
            for j in range(i, b.n_posted - 1):
                b.posted[j] = b.posted[j + 1]
            b.n_posted -= 1
            return True
    return False


cdef void lead_step(Batcher *b, LoopState *leader) noexcept nogil:
    """Evaluate what is posted, on ``leader``'s thread (called and returning with
    the lock held)."""
    cdef LoopState *members[ll.SLL_MAX_SEQUENCES]
    cdef int i, n = 1
    # The leader first: its tokens always fit the batch.
    members[0] = leader
    for i in range(b.n_posted):
        if b.posted[i] != leader:
            members[n] = b.posted[i]
            n += 1
    b.n_posted = 0
    b.leading = True
    make_cuts(b)
    sl.pthread_mutex_unlock(&b.lock)
    evaluate_together(b, members, n)
    sl.pthread_mutex_lock(&b.lock)
    for i in range(n):
        if members[i] is not NULL:
            post_again(b, members, i)
    make_cuts(b)
    b.leading = False
    sl.pthread_cond_broadcast(&b.changed)


cdef int post_again(Batcher *b, LoopState **members, int i) noexcept nogil:
    """Hand member ``i`` back to the posted tokens (called with the lock held): a
    step led by one of the waiting generations takes it, and until then it can
    leave at once if it is stopped. Returns 1 (one member fewer waiting)."""
    b.posted[b.n_posted] = members[i]
    b.n_posted += 1
    members[i] = NULL
    sl.pthread_cond_broadcast(&b.changed)
    return 1


cdef void evaluate_together(Batcher *b, LoopState **members, int n) noexcept nogil:
    """Evaluate the ``n`` members' posted tokens in one batch, led by
    ``members[0]``, and again without a member whose stop aborted it. A member
    leaves ``members`` (set to NULL) as soon as it has its result: it may post
    again at once, for the next step. A member is handed back to the posted
    tokens (see post_again) when its tokens do not fit the batch, and every
    member still waiting once the leader has its result, so that no generation
    waits for an evaluation it is not part of: a stopped one would wait for it
    to end, a whole step."""
    cdef LoopState *s
    # The members in the batch being evaluated, and where each one's sampled token is in it (-1: none).
    cdef int included[ll.SLL_MAX_SEQUENCES]
    cdef int32_t output[ll.SLL_MAX_SEQUENCES]
    cdef int i, j, k, room, stopped, waiting = n, threads = 1
    cdef int32_t index, status
    cdef bint want_logits
    cdef const float *row
    # Every member asks for the same cores (the scheduler shares them among steps, not members).
    for i in range(n):
        threads = max(threads, sl.sl_load_acquire(&members[i].threads))
    if threads != b.applied_threads:
        LLAMA.set_threads(b.ctx, threads)
        b.applied_threads = threads
    while waiting:
        LLAMA.batch_clear(b.ctx)
        k = 0
        room = b.max_tokens
        b.group.n = 0
        for i in range(n):
            s = members[i]
            if s is NULL:
                continue
            if should_stop(s):
                waiting -= give_result(b, members, i, PostResult.POST_STOPPED)
                continue
            # The batch holds one prompt chunk beside every other member's token
            # (see LlamaContext); a second chunk waits for the next step.
            if s.post_count > room:
                sl.pthread_mutex_lock(&b.lock)
                waiting -= post_again(b, members, i)
                sl.pthread_mutex_unlock(&b.lock)
                continue
            # Logits only where a token will be sampled: after the prompt's last chunk, and in decode.
            want_logits = s.n_past + s.post_count >= s.n_prompt
            index = LLAMA.batch_add(b.ctx, s.seq, <const int32_t *>(s.tokens + s.n_past), s.post_count,
                                    s.n_past, want_logits)
            if index < 0:
                s.exit = ExitKind.EVAL_FAILED
                waiting -= give_result(b, members, i, PostResult.POST_FAILED)
                continue
            room -= s.post_count
            output[k] = index if want_logits else -1
            included[k] = i
            k += 1
            if s.step_abort:
                b.group.members[b.group.n] = &s.watch
                b.group.n += 1
        if members[0] is NULL:
            return
        if k == 0:
            # Nothing left fits an empty batch (Generation bounds a chunk by it, so
            # this cannot happen): end those generations rather than leave them waiting.
            fail_the_rest(b, members, n)
            return
        status = decode_batch(b)
        b.steps += 1
        b.step_members += k
        for j in range(k):
            record_longest_node(members[included[j]], b.group.longest_gap_ns)
        if status == ll.SLL_OK:
            for j in range(k):
                s = members[included[j]]
                row = LLAMA.logits(b.ctx, output[j]) if output[j] >= 0 else NULL
                if output[j] >= 0 and row is NULL:
                    LLAMA.truncate(b.ctx, s.seq, s.n_past)
                    s.exit = ExitKind.EVAL_FAILED
                    waiting -= give_result(b, members, included[j], PostResult.POST_FAILED)
                    continue
                if row is not NULL:
                    memcpy(s.logits, row, s.vocab_size * sizeof(float))
                s.n_past += s.post_count
                waiting -= give_result(b, members, included[j], PostResult.POST_DONE)
            continue
        # One call is one physical batch, so an aborted or failed step leaves
        # at most its own positions behind: drop them, so that each sequence's
        # cache holds exactly the tokens of its record.
        for j in range(k):
            s = members[included[j]]
            LLAMA.truncate(b.ctx, s.seq, s.n_past)
        # Stopped part-way: the stop condition that did it still holds (the
        # flag is sticky, deadlines only pass). Its generation leaves at once;
        # the others evaluate the step again without it.
        stopped = 0
        if b.group.aborted:
            for j in range(k):
                if should_stop(members[included[j]]):
                    stopped += give_result(b, members, included[j], PostResult.POST_STOPPED)
        waiting -= stopped
        if stopped and waiting:
            b.reruns += 1
        if stopped == 0:
            # Failed, or aborted while no stop condition held: nothing to retry.
            fail_the_rest(b, members, n)
            return


cdef void fail_the_rest(Batcher *b, LoopState **members, int n) noexcept nogil:
    """End every member still waiting with EVAL_FAILED."""
    cdef int i
    for i in range(n):
        if members[i] is not NULL:
            members[i].exit = ExitKind.EVAL_FAILED
            give_result(b, members, i, PostResult.POST_FAILED)


cdef int give_result(Batcher *b, LoopState **members, int i, PostResult result) noexcept nogil:
    """Hand member ``i`` its step's result and wake it; returns 1 (one member fewer
    waiting). Its fields the step wrote (n_past, logits, exit) are published by the
    same lock, and from then on it is its own again."""
    cdef LoopState *s = members[i]
    members[i] = NULL
    sl.pthread_mutex_lock(&b.lock)
    s.post_result = result
    sl.pthread_cond_broadcast(&b.changed)
    sl.pthread_mutex_unlock(&b.lock)
    return 1


cdef void set_present(LoopState *s, bint present) noexcept nogil:
    """Count the generation in (or out of) its context's steps: a step waits for
    the tokens of every present generation."""
    cdef Batcher *b = s.batcher
    if b is NULL or s.is_present == present:
        return
    sl.pthread_mutex_lock(&b.lock)
    b.present += 1 if present else -1
    s.is_present = present
    sl.pthread_cond_broadcast(&b.changed)
    sl.pthread_mutex_unlock(&b.lock)


cdef inline bint stop_sequence_matched(LoopState *s, int old_size, int new_size) noexcept nogil:
    """Whether a stop sequence now ends inside the newest token's bytes; if so,
    s.stop_at is where the earliest such match starts."""
    cdef int i, start, pos, offset = 0, size, earliest = -1
    for i in range(s.n_stops):
        size = s.stop_sizes[i]
        start = old_size - size + 1
        if start < 0:
            start = 0
        for pos in range(start, new_size - size + 1):
            if earliest != -1 and pos >= earliest:
                break
            if memcmp_n(s.text + pos, s.stops + offset, size):
                earliest = pos
                break
        offset += size
    if earliest == -1:
        return False
    s.stop_at = earliest
    return True


cdef inline bint memcmp_n(const char *a, const char *b, int n) noexcept nogil:
    cdef int i
    for i in range(n):
        if a[i] != b[i]:
            return False
    return True


cdef inline float *last_logits(LoopState *s) noexcept nogil:
    """The logits of the last evaluation's sampled position (NULL: none), which sampling reads."""
    if s.engine == Engine.LLAMA_CPP:
        return s.logits
    return API.llm_logits_data(s.llm) + API.llm_logits_size(s.llm) - s.vocab_size


cdef inline void apply_penalties(LoopState *s) noexcept nogil:
    """OpenAI's frequency and presence penalties, on the logits in place: only the
    ids generated so far change, so a step costs as many subtractions as there are."""
    cdef int i, token
    cdef float *logits = last_logits(s)
    if logits is NULL:
        return
    for i in range(s.n_seen):
        token = s.seen[i]
        logits[token] -= s.counts[token] * s.frequency_penalty + s.presence_penalty


cdef inline void count_token(LoopState *s, int token) noexcept nogil:
    if s.counts is NULL:
        return
    if s.counts[token] == 0:
        s.seen[s.n_seen] = token
        s.n_seen += 1
    s.counts[token] += 1


cdef bint record_distribution(LoopState *s) noexcept nogil:
    """Keep the draw's raw logits, their log-sum-exp and the n_top best ids, for the token
    about to be generated (index n_generated). O(vocabulary x n_top) at worst, O(vocabulary)
    as a rule; the stop is checked every SAMPLE_BLOCK ids (False: it said stop)."""
    cdef int i, j, n = s.vocab_size, k = s.n_top
    cdef float *logits = last_logits(s)
    cdef double best = -1e300, total = 0
    cdef int *ids = s.top_ids + s.n_generated * k
    cdef float *values = s.top_logprobs + s.n_generated * k
    cdef int filled = 0
    if logits is NULL:
        return True
    memcpy(s.scratch, logits, n * sizeof(float))
    for i in range(n):
        if s.scratch[i] > best:
            best = s.scratch[i]
    for i in range(n):
        total += exp(s.scratch[i] - best)
        if i % SAMPLE_BLOCK == 0 and sl.sl_check(&s.watch) != sl.SL_RUN:
            return False
    s.log_sum = <float>(best + log(total))
    # Insertion into a sorted list of k: most candidates fail the first comparison.
    for i in range(n):
        if filled == k and (k == 0 or s.scratch[i] <= values[k - 1]):
            continue
        j = filled if filled < k else k - 1
        while j > 0 and values[j - 1] < s.scratch[i]:
            values[j] = values[j - 1]
            ids[j] = ids[j - 1]
            j -= 1
        values[j] = s.scratch[i]
        ids[j] = i
        if filled < k:
            filled += 1
    for j in range(k):
        values[j] -= s.log_sum
    return True


cdef inline int sample_next(LoopState *s, int step) noexcept nogil:
    """The next token, drawn from the logits of the last evaluation; SAMPLE_STOPPED
    when a stop condition came to hold meanwhile (a draw over a large vocabulary
    takes milliseconds, and a stop does not wait for it)."""
    cdef int first_last, top_k = s.top_k
    cdef float temperature = s.temperature
    if s.n_top >= 0 and not record_distribution(s):
        return SAMPLE_STOPPED
    if s.counts is not NULL:
        apply_penalties(s)
    if s.engine == Engine.LLAMA_CPP:
        return LLAMA.sample(s.sampler, s.logits, sl.sl_watch_says_stop, &s.watch)
    if temperature <= 0:
        # Greedy: keep only the best candidate (the library divides by temperature).
        top_k = 1
        temperature = 1.0
    first_last = s.n_past - LAST_N_TOKENS
    if first_last < 0:
        first_last = 0
    return API.llm_sample(s.llm, s.tokens + first_last, s.n_past - first_last, top_k, s.top_p,
                          temperature, s.repetition_penalty,
                          <int>((<unsigned int>s.seed + <unsigned int>step) & 0x7fffffffu))


cdef inline bint ends_generation(LoopState *s, int token) noexcept nogil:
    if s.engine == Engine.LLAMA_CPP:
        return LLAMA.is_end(s.lmodel, token)
    return API.llm_is_eos_token(s.llm, token)


cdef inline int write_piece(LoopState *s, int token, char *out) noexcept nogil:
    """Write ``token``'s bytes to ``out`` (room for max_token_bytes); returns their count."""
    cdef const char *piece
    cdef int size
    if s.engine == Engine.LLAMA_CPP:
        # Control tokens write nothing: they belong to the template, not the text.
        size = LLAMA.token_piece(s.lmodel, token, out, s.max_token_bytes, False)
        return size if size > 0 else 0
    piece = API.llm_detokenize(s.llm, token)
    size = <int>strlen(piece)
    memcpy(out, piece, size)
    return size


cdef void run_loop(LoopState *s) noexcept nogil:
    cdef int i
    s.start_ns = sl.sl_monotonic_ns()
    s.n_past = s.n_reused
    if s.engine == Engine.LLAMA_CPP:
        # The repetition penalty looks at recent tokens, the prompt's included.
        i = s.n_prompt - LAST_N_TOKENS
        for i in range(i if i > 0 else 0, s.n_prompt):
            LLAMA.sampler_accept(s.sampler, s.tokens[i])
    elif s.step_abort:
        sl.sl_watch_enter(&s.watch)
    run_steps(s)
    sl.sl_watch_leave()


cdef void run_steps(LoopState *s) noexcept nogil:
    cdef int chunk, token, step, size, old_size

    # Prefill in chunks so that a cancel or a deadline is seen between them
    # even when the hook cannot stop an evaluation part-way. Chunks end at
    # multiples of prefill_chunk, wherever the prompt resumes: a token's
    # attention sums in an order that depends on where its batch ends, so
    # aligned ends make a resumed prompt compute exactly what a fresh one does.
    while s.n_past < s.n_prompt:
        if should_stop(s):
            return
        chunk = s.prefill_chunk - s.n_past % s.prefill_chunk
        if chunk > s.n_prompt - s.n_past:
            chunk = s.n_prompt - s.n_past
        if not evaluate(s, chunk):
            return
        s.n_prompt_evaluated = s.n_past - s.n_reused

    for step in range(s.max_tokens):
        if should_stop(s):
            return
        # Pause while the reader is a full window behind, out of the context's steps.
        if s.n_generated - sl.sl_load_acquire(&s.consumed) >= s.window:
            set_present(s, False)
            while s.n_generated - sl.sl_load_acquire(&s.consumed) >= s.window:
                sl.sl_sleep_ns(PAUSE_POLL_NS)
                if should_stop(s):
                    return
            set_present(s, True)

        token = sample_next(s, step)
        # A stop that came during the draw wins, and no token is published. (A draw
        # that gave up, SAMPLE_STOPPED, saw a stop condition, and it still holds.)
        if should_stop(s):
            return
        if ends_generation(s, token):
            s.exit = ExitKind.EOS
            return

        # Publish: bytes and id first, then the count with release semantics.
        old_size = s.text_end[s.n_generated - 1] if s.n_generated else 0
        size = write_piece(s, token, s.text + old_size)
        s.text_end[s.n_generated] = old_size + size
        s.tokens[s.n_past] = token
        if s.n_top >= 0:
            s.chosen_logprob[s.n_generated] = s.scratch[token] - s.log_sum
        s.n_generated += 1
        count_token(s, token)
        if s.n_generated == 1:
            s.first_token_ns = sl.sl_monotonic_ns()
            # The first-token deadline has been met.
            s.watch.first_token_deadline_ns = 0
        sl.sl_store_release(&s.published, s.n_generated)
        sl.sl_wake(s.wake_fd)

        if s.n_stops and stop_sequence_matched(s, old_size, old_size + size):
            s.exit = ExitKind.STOP_SEQUENCE
            return
        if s.n_generated == s.max_tokens:
            break
        # Don't start a decode step for a request that is already cancelled.
        if should_stop(s):
            return
        if not evaluate(s, 1):
            return
    s.exit = ExitKind.CONTEXT_FULL if s.max_tokens_capped else ExitKind.MAX_TOKENS


def measure_flag_poll(int iterations=1000000):
    """Mean cost in ns of one poll of the cancel flag and both deadlines, as the loop does it."""
    cdef LoopState s
    # hits keeps the compiler from optimising the polls away.
    cdef int _i, hits = 0
    cdef int64_t start, elapsed
    memset(&s, 0, sizeof(s))
    s.watch.deadline_ns = sl.sl_monotonic_ns() + 3600 * 1000000000
    s.watch.first_token_deadline_ns = s.watch.deadline_ns
    with nogil:
        start = sl.sl_monotonic_ns()
        for _i in range(iterations):
            hits += should_stop(&s)
        elapsed = sl.sl_monotonic_ns() - start
    return elapsed / iterations


cdef class LoopResult:
    """What a finished loop reports: why it ended (an :class:`ExitKind`), the
    counts, and CLOCK_MONOTONIC timestamps in ns (0: never)."""

    cdef readonly ExitKind exit
    cdef readonly int prompt_tokens
    cdef readonly int prompt_tokens_reused
    cdef readonly int prompt_tokens_evaluated
    cdef readonly int tokens_generated
    cdef readonly int tokens_after_cancel
    cdef readonly int64_t start_ns
    cdef readonly int64_t first_token_ns
    cdef readonly int64_t cancel_observed_ns
    cdef readonly int64_t end_ns
    cdef readonly int text_kept_bytes
    cdef readonly int64_t longest_prefill_node_ns
    cdef readonly int64_t longest_decode_node_ns

    FIELDS = ("exit", "prompt_tokens", "prompt_tokens_reused", "prompt_tokens_evaluated", "tokens_generated",
              "tokens_after_cancel", "start_ns", "first_token_ns", "cancel_observed_ns", "end_ns",
              "text_kept_bytes", "longest_prefill_node_ns", "longest_decode_node_ns")

    def __repr__(self):
        return "LoopResult(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.FIELDS) + ")"


cdef LoopResult loop_result(const LoopState *s):
    cdef LoopResult r = LoopResult.__new__(LoopResult)
    r.exit = s.exit
    r.prompt_tokens = s.n_prompt
    r.prompt_tokens_reused = s.n_reused
    r.prompt_tokens_evaluated = s.n_prompt_evaluated
    r.tokens_generated = s.n_generated
    r.tokens_after_cancel = s.tokens_after_cancel if s.exit == ExitKind.CANCELLED else 0
    r.start_ns = s.start_ns
    r.first_token_ns = s.first_token_ns
    r.cancel_observed_ns = s.cancel_observed_ns
    r.end_ns = s.end_ns
    if s.exit == ExitKind.STOP_SEQUENCE:
        r.text_kept_bytes = s.stop_at
    else:
        r.text_kept_bytes = s.text_end[s.n_generated - 1] if s.n_generated else 0
    r.longest_prefill_node_ns = s.longest_prefill_node_ns
    r.longest_decode_node_ns = s.longest_decode_node_ns
    return r


cdef class Generation:
    """One run of the token loop on a context. Create it, call :meth:`run` once
    (from any thread; it blocks without the GIL), read tokens with :meth:`take`.

    The sampling arguments have no defaults here: ``stopline.protocol.SamplingParams``
    is their one source (``stopline.engine.sampling_args`` turns it into them)."""

    cdef LoopState s
    cdef Slot context
    # A GenerationState, stored with release and read with acquire semantics.
    cdef int _state
    # Set only once eventfd() succeeded: __dealloc__ runs even when __cinit__ fails.
    cdef bint owns_wake_fd
    cdef LoopResult _result
    cdef readonly object stop_sequences

    def __cinit__(self, Slot context, prompt_tokens, *, int max_tokens, double temperature,
                  int top_k, double top_p, double repetition_penalty, double frequency_penalty,
                  double presence_penalty, int seed, grammar, int logprobs,
                  stop=(), int prefill_chunk=1, int threads=1, int window=64,
                  int64_t deadline_ns=0, int64_t first_token_deadline_ns=0,
                  bint step_abort=True, bint trim_output=True):
        cdef int i, n_prompt = len(prompt_tokens), offset = 0
        cdef ll.sll_sampling sampling
        cdef bytes grammar_text = None if grammar is None else str(grammar).encode("utf-8")
        context._check_open()
        if n_prompt == 0:
            raise ValueError("the prompt has no tokens")
        if n_prompt >= context.context_length:
            raise ContextOverflowError(
                f"the prompt has {n_prompt} tokens; the context holds {context.context_length} "
                "and needs room for at least one generated token")
        if grammar_text is not None and context.engine != Engine.LLAMA_CPP:
            raise ValueError("a grammar needs the llama.cpp engine")
        if max_tokens < 1 or prefill_chunk < 1 or threads < 1 or window < 1:
            raise ValueError("max_tokens, prefill_chunk, threads and window must be positive")
        if prefill_chunk > context.max_batch:
            raise ValueError(f"prefill_chunk is at most {context.max_batch}, the context's batch limit")
        # The context must hold the prompt and every generated token.
        self.s.max_tokens_capped = max_tokens > context.context_length - n_prompt
        max_tokens = min(max_tokens, context.context_length - n_prompt)
        self.context = context
        self.stop_sequences = tuple(bytes(x) for x in stop if x)
        self.s.n_prompt = n_prompt
        self.s.max_tokens = max_tokens
        self.s.temperature = temperature
        self.s.top_k = top_k
        self.s.top_p = top_p
        self.s.repetition_penalty = repetition_penalty
        self.s.frequency_penalty = frequency_penalty
        self.s.presence_penalty = presence_penalty
        self.s.vocab_size = context.vocab_size
        self.s.seed = seed
        self.s.prefill_chunk = prefill_chunk
        self.s.threads = threads
        self.s.window = window
        self.s.watch.deadline_ns = deadline_ns
        self.s.watch.first_token_deadline_ns = first_token_deadline_ns
        self.s.engine = context.engine
        self.s.max_token_bytes = context.max_token_bytes
        if context.engine == Engine.LLAMA_CPP:
            # llama.cpp's abort callback is official, and it computes only the
            # logits asked for: nothing to trim.
            self.s.step_abort = step_abort
            self.s.trim_output = False
            sampling.temperature = temperature
            sampling.top_k = top_k
            sampling.top_p = top_p
            sampling.repeat_penalty = repetition_penalty
            sampling.penalty_last_n = LAST_N_TOKENS
            sampling.seed = <uint32_t>seed
            sampling.grammar = NULL if grammar_text is None else <const char *>grammar_text
            self.s.sampler = LLAMA.sampler_new((<LlamaSequence>context).owner.model.model, &sampling)
            if self.s.sampler is NULL and grammar_text is not None:
                raise ValueError("llama.cpp cannot parse the grammar")
            if self.s.sampler is NULL:
                raise c_failure(MemoryError, "cannot allocate the sampler")
        else:
            self.s.step_abort = step_abort and STEP_ABORT
            # Trimming needs the hook, which only runs when step_abort is on.
            self.s.trim_output = trim_output and self.s.step_abort
        self.s.tokens = <int *>malloc((n_prompt + max_tokens) * sizeof(int))
        self.s.text = <char *>malloc(<size_t>max_tokens * context.max_token_bytes + 1)
        self.s.text_end = <uint32_t *>calloc(max_tokens, sizeof(uint32_t))
        self.s.n_stops = len(self.stop_sequences)
        self.s.stop_sizes = <int *>malloc((self.s.n_stops + 1) * sizeof(int))
        self.s.stops = <char *>malloc(sum(len(x) for x in self.stop_sequences) + 1)
        if not (self.s.tokens and self.s.text and self.s.text_end and self.s.stop_sizes and self.s.stops):
            raise c_failure(MemoryError, "cannot allocate the token log")
        if not -1 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs is -1 (off) to {MAX_TOP_LOGPROBS}")
        self.s.n_top = logprobs
        if logprobs >= 0:
            self.s.scratch = <float *>malloc(context.vocab_size * sizeof(float))
            self.s.chosen_logprob = <float *>malloc(max_tokens * sizeof(float))
            self.s.top_ids = <int *>malloc((max_tokens * logprobs + 1) * sizeof(int))
            self.s.top_logprobs = <float *>malloc((max_tokens * logprobs + 1) * sizeof(float))
            if not (self.s.scratch and self.s.chosen_logprob and self.s.top_ids and self.s.top_logprobs):
                raise c_failure(MemoryError, "cannot allocate the log probabilities")
        if frequency_penalty != 0 or presence_penalty != 0:
            self.s.counts = <int *>calloc(context.vocab_size, sizeof(int))
            self.s.seen = <int *>malloc(max_tokens * sizeof(int))
            if not (self.s.counts and self.s.seen):
                raise c_failure(MemoryError, "cannot allocate the penalty counts")
        for i in range(n_prompt):
            token = prompt_tokens[i]
            if not 0 <= token < context.vocab_size:
                raise ValueError(f"prompt token {token} is outside the vocabulary")
            self.s.tokens[i] = token
        for i, seq in enumerate(self.stop_sequences):
            memcpy(self.s.stops + offset, <const char *>seq, len(seq))
            self.s.stop_sizes[i] = len(seq)
            offset += len(seq)
        self.s.wake_fd = sl.sl_eventfd()
        if self.s.wake_fd < 0:
            raise c_failure(OSError, "eventfd() failed", errno.errno)
        self.owns_wake_fd = True

    def __dealloc__(self):
        if self.s.sampler is not NULL:
            LLAMA.sampler_free(self.s.sampler)
        free(self.s.tokens)
        free(self.s.counts)
        free(self.s.seen)
        free(self.s.scratch)
        free(self.s.chosen_logprob)
        free(self.s.top_ids)
        free(self.s.top_logprobs)
        free(self.s.text)
        free(self.s.text_end)
        free(self.s.stops)
        free(self.s.stop_sizes)
        if self.owns_wake_fd:
            os.close(self.s.wake_fd)

    def fileno(self):
        """The eventfd that becomes readable when tokens are published or the loop ends."""
        return self.s.wake_fd

    def close(self):
        """Release the eventfd early (the memory goes with the object)."""
        if sl.sl_load_acquire(&self._state) == GenerationState.RUNNING:
            raise EngineError("cannot close a running generation")
        if self.owns_wake_fd:
            os.close(self.s.wake_fd)
            self.owns_wake_fd = False
            # The number may be reused by another file from now on.
            self.s.wake_fd = -1

    @property
    def state(self):
        """Where the generation stands: a :class:`GenerationState`."""
        return GenerationState(sl.sl_load_acquire(&self._state))

    @property
    def finished(self):
        """Whether the loop has ended; :attr:`result` is set once this is true."""
        return sl.sl_load_acquire(&self._state) == GenerationState.FINISHED

    @property
    def prompt_tokens(self):
        return self.s.n_prompt

    @property
    def max_tokens(self):
        return self.s.max_tokens

    @property
    def threads(self):
        """Compute threads for the loop's next evaluation."""
        return sl.sl_load_acquire(&self.s.threads)

    @threads.setter
    def threads(self, int value):
        # Thread-safe: the loop reads it once per evaluation, so a running
        # generation takes the new count at its next step.
        if value < 1:
            raise ValueError("threads must be positive")
        sl.sl_store_release(&self.s.threads, value)

    def cancel(self):
        """Ask the loop to stop. Thread-safe and idempotent: only the first call counts,
        and a call after the loop ended changes nothing. Returns True if this call
        was the one that requested the stop of a running or not-yet-started loop.
        Why it was stopped is the caller's to remember: the loop knows only that."""
        if sl.sl_load_acquire(&self._state) == GenerationState.FINISHED:
            return False
        if not sl.sl_claim(&self.s.cancel_requested, 1):
            return False
        self.s.published_at_cancel = sl.sl_load_acquire(&self.s.published)
        sl.sl_store_release(&self.s.watch.cancel_flag, 1)
        if self.s.batcher is not NULL:
            # Waiting for a step it is not part of, it would otherwise see the flag only once that step ends.
            sl.pthread_mutex_lock(&self.s.batcher.lock)
            sl.pthread_cond_broadcast(&self.s.batcher.changed)
            sl.pthread_mutex_unlock(&self.s.batcher.lock)
        return True

    def run(self):
        """Run the loop to its end and return the :class:`LoopResult`."""
        cdef Slot context = self.context
        cdef LlamaSequence sequence
        if sl.sl_load_acquire(&self._state) != GenerationState.NEW:
            raise EngineError("a generation runs only once")
        if context.busy:
            raise EngineError("another generation is running on this context")
        context._check_open()
        self.s.n_reused = context.usable_prefix(self.s.tokens, self.s.n_prompt, self.s.prefill_chunk)
        if context.engine == Engine.LLAMA_CPP:
            sequence = <LlamaSequence>context
            self.s.batcher = &sequence.owner.b
            self.s.seq = sequence.seq
            self.s.lmodel = sequence.owner.model.model
            self.s.logits = sequence.logits
        else:
            self.s.llm = (<Context>context).llm
        sl.sl_store_release(&self._state, GenerationState.RUNNING)
        context.busy = 1
        # Positions from n_reused on are about to be overwritten.
        context.n_held = self.s.n_reused
        with nogil:
            if self.s.batcher is not NULL:
                # Positions from n_reused on go: the cache must continue exactly where the record does.
                truncate_sequence(self.s.batcher, self.s.seq, self.s.n_reused)
                set_present(&self.s, True)
            run_loop(&self.s)
            set_present(&self.s, False)
            self.s.end_ns = sl.sl_monotonic_ns()
            memcpy(context.held, self.s.tokens, self.s.n_past * sizeof(int))
        context.n_held = self.s.n_past
        context.held_chunk = self.s.prefill_chunk
        context.busy = 0
        # Publish in this order: the result, then the finished state (a release
        # store), then the wake-up. A reader that sees "finished", or that was
        # woken by the last wake-up, always finds the result.
        self._result = loop_result(&self.s)
        sl.sl_store_release(&self._state, GenerationState.FINISHED)
        sl.sl_wake(self.s.wake_fd)
        return self._result

    @property
    def result(self):
        """The :class:`LoopResult` once the loop has ended, else None."""
        return self._result

    def logprobs(self, int start, int end):
        """The log probabilities of published tokens start..end-1: for each, its own and its
        best alternatives', as ``(logprob, [(token_id, logprob), ...])``; None when not asked for."""
        cdef int i, j, k = self.s.n_top
        if k < 0:
            return None
        if not 0 <= start <= end <= sl.sl_load_acquire(&self.s.published):
            raise ValueError("only published tokens have log probabilities")
        return [
            (self.s.chosen_logprob[i], [(self.s.top_ids[i * k + j], self.s.top_logprobs[i * k + j]) for j in range(k)])
            for i in range(start, end)
        ]

    def token_ids(self):
        """The ids of every token published so far (the end of generation is not one)."""
        cdef int i, end = sl.sl_load_acquire(&self.s.published)
        return [self.s.tokens[self.s.n_prompt + i] for i in range(end)]

    def take(self):
        """Return the bytes of each token published since the last call, as a list,
        and let the loop run ahead again."""
        cdef int start = sl.sl_load_acquire(&self.s.consumed)
        cdef int end = sl.sl_load_acquire(&self.s.published)
        cdef int i
        cdef uint32_t begin
        cdef list pieces = []
        if self.owns_wake_fd:
            sl.sl_drain(self.s.wake_fd)
        for i in range(start, end):
            begin = self.s.text_end[i - 1] if i else 0
            pieces.append(PyBytes_FromStringAndSize(self.s.text + begin, self.s.text_end[i] - begin))
        sl.sl_store_release(&self.s.consumed, end)
        return pieces
