# cython: language_level=3, boundscheck=False, wraparound=False
"""Stopline's native token loop, over two engines.

A :class:`Slot` is one KV cache with the record of which tokens it holds, so a
generation whose prompt starts with them evaluates only the rest. Its two
kinds are the engines: a :class:`CtransformersSlot` is one ctransformers model
instance (the weights memory-mapped and so shared between instances of the same
file), and a :class:`LlamaSequence` is one sequence of a llama.cpp
:class:`LlamaContext`, whose KV cache holds several. The loop below is written
once for both: what differs (evaluating, sampling, the end of generation,
turning a token into bytes) is each engine's row of operations, an
``EngineOps`` table its slot gives the generation (``Slot.prepare``).

The generations running on one llama.cpp context share its evaluations: each
step is one batch carrying every running generation's next tokens (a prompt
chunk, or the token it just sampled). The generations' own threads take turns
leading a step; the others wait for it, then sample in parallel. That is
_batcher.pxi, included below.

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

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc cimport errno
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t
from libc.stdlib cimport calloc, free, malloc
from libc.math cimport INFINITY, exp, log
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
import random
import time

from stopline.engine.errors import ContextOverflowError, EngineError, ModelLoadError
from stopline.protocol.requests import DEFAULT_WINDOW, MAX_TOP_LOGPROBS, SamplingParams

cdef enum:
    # How many recent tokens the repetition penalty looks at (ctransformers' default).
    LAST_N_TOKENS = 64
    # While paused for a slow reader, re-check the flag and deadlines this often.
    PAUSE_POLL_NS = 200000
    # The longest a loop's thread that has ended stays out of the GIL for its
    # reader (Generation.run's yield_to_reader), and how often it looks whether
    # it may go.
    READER_GRACE_NS = 5000000
    READER_POLL_NS = 20000
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

cdef struct LoopState


cdef struct EngineOps:
    # What the token loop asks of an engine, one table per engine (set by the slot a
    # generation runs on), so that the loop is written once for both.
    void (*begin)(LoopState *s) noexcept nogil               # before the first evaluation
    bint (*evaluate)(LoopState *s, int count) noexcept nogil  # the next count tokens into the KV cache
    float *(*logits)(LoopState *s) noexcept nogil             # the last evaluation's sampled logits
    int (*sample)(LoopState *s, int step) noexcept nogil      # a draw from them
    bint (*is_end)(LoopState *s, int token) noexcept nogil    # whether token ends the generation
    int (*write_piece)(LoopState *s, int token, char *out) noexcept nogil  # its bytes


cdef EngineOps CTRANSFORMERS_OPS
cdef EngineOps LLAMA_OPS


# The largest prefill chunk the library can evaluate at once.
MAX_PREFILL_CHUNK = ct.CT_MAX_BATCH
# The longest a finished loop's thread waits for its reader (Generation.run's yield_to_reader).
READER_GRACE_S = READER_GRACE_NS / 1e9
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


def load_ctransformers_library(str path):
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


cdef extern from "<malloc.h>" nogil:
    int mallopt(int param, int value)
    int M_MMAP_THRESHOLD

# Blocks of at least this many bytes are mapped on their own (see load_llama_library).
LARGE_BLOCK_BYTES = 1 << 20


def load_llama_library(str path):
    """Resolve the llama.cpp shim's C API from ``path`` (once per process). The
    library is opened RTLD_LOCAL: its ggml stays its own.

    The KV states this engine saves and restores (save_state, the prompt cache's
    files) are blocks of many MiB, allocated and freed in turn. glibc's malloc raises
    its mmap threshold to the largest block freed, after which such blocks come from
    the heap, which keeps the space they free: the process would grow past the states
    it holds. A fixed threshold maps every large block on its own, and a freed one
    goes back to the system at once."""
    global LLAMA_READY
    cdef char err[512]
    if LLAMA_READY:
        return
    if ll.sll_api_open(&LLAMA, os.fsencode(path), err, sizeof(err)) != 0:
        raise c_failure(EngineError, f"cannot load {path}", 0, err)
    mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES)
    LLAMA_READY = True


def llama_gpu_device():
    """The GPU device the loaded llama.cpp library offloads to, as "name (description)", or
    None: a library built for the CPU alone, or no device."""
    cdef char buf[256]
    if not LLAMA_READY:
        raise EngineError("load_llama_library() has not been called")
    if not LLAMA.gpu_device(buf, sizeof(buf)):
        return None
    return (<bytes>buf).decode("utf-8", "replace")


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
    :meth:`CtransformersSlot.probe_step_abort` proves that it works."""
    return STEP_ABORT


def step_abort_failure():
    """Why the hook could not be installed (an :class:`EngineError`), or None."""
    return STEP_ABORT_FAILURE


cdef class Slot:
    """What both engines' contexts share: one KV cache, and the record of the
    tokens it holds. Generations run on a slot one at a time."""
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
    # The ids that end a generation, found once (end_tokens).
    cdef tuple end_ids

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

    def end_tokens(self):
        """The vocabulary's ids that end a generation (its end-of-generation tokens)."""
        self._check_open()
        if self.end_ids is None:
            self.end_ids = tuple(i for i in range(self.vocab_size) if self.ends(i))
        return self.end_ids

    cdef bint ends(self, int token) noexcept:
        return False

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

    cdef int prepare(self, LoopState *s, bint step_abort, bint trim_output, bytes grammar) except -1:
        """Set the engine's part of a new generation's state: its operations and options."""
        raise NotImplementedError

    cdef void attach(self, LoopState *s) noexcept:
        """Point a generation about to run at this slot's native context."""

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


cdef class CtransformersSlot(Slot):
    """One ctransformers model instance."""
    cdef ct.ct_llm *llm

    def __cinit__(self, str model_path, str model_type="llama", int context_length=2048):
        cdef ct.ct_config config
        cdef int fd
        if not API_READY:
            raise EngineError("load_ctransformers_library() has not been called")
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

    cdef bint ends(self, int token) noexcept:
        return API.llm_is_eos_token(self.llm, token)

    cdef int prepare(self, LoopState *s, bint step_abort, bint trim_output, bytes grammar) except -1:
        if grammar is not None:
            raise ValueError("a grammar needs the llama.cpp engine")
        s.ops = &CTRANSFORMERS_OPS
        s.step_abort = step_abort and STEP_ABORT
        # Trimming needs the hook, which only runs when step_abort is on.
        s.trim_output = trim_output and s.step_abort
        return 0

    cdef void attach(self, LoopState *s) noexcept:
        s.llm = self.llm

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
    # The layers offloaded to the GPU device (0 without one), of layer_count (the output layer is one).
    cdef readonly int gpu_layers
    cdef readonly int layer_count
    # Calls using the model without the GIL, which close() waits for.
    cdef int users

    def __cinit__(self, str model_path, int gpu_layers=0):
        """``gpu_layers``: the layers to offload to the GPU device, if there is one; negative: all."""
        cdef char err[512]
        cdef int fd, token, longest = 0, size
        cdef int32_t n_gpu_layers = gpu_layers
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
            self.model = LLAMA.model_load(path, n_gpu_layers, err, sizeof(err))
        if self.model is NULL:
            raise c_failure(ModelLoadError, f"llama.cpp could not load {model_path}", 0, err)
        self.vocab_size = LLAMA.model_n_vocab(self.model)
        self.context_limit = LLAMA.model_n_ctx_train(self.model)
        self.can_truncate = LLAMA.model_can_truncate(self.model)
        self.gpu_layers = LLAMA.model_gpu_layers(self.model)
        self.layer_count = LLAMA.model_n_layers(self.model)
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
    const EngineOps *ops           # the engine's side of the loop
    ct.ct_llm *llm                 # the ctransformers engine's model instance
    Batcher *batcher               # the llama.cpp engine's context, which other generations share,
    int seq                        # this generation's sequence in it,
    const ll.sll_model *lmodel     # its model,
    ll.sll_sampler *sampler        # and this generation's sampler chain
    float *logits                  # the logits sampled from (the slot's copy, written by each step)
    int max_token_bytes
    int *tokens            # prompt, then generated tokens
    int n_prompt
    # Leading prompt tokens the KV cache already holds: the record's count, until the
    # first evaluation finds the cache has lost some of them (evaluate_from_start).
    int n_reused
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
    # OpenAI's logit_bias: bias_values[i] is added to token bias_ids[i]'s logit at every draw.
    # ignore_eos appends the end-of-generation tokens at minus infinity.
    int n_bias
    int *bias_ids
    float *bias_values
    # llama.cpp's min_p (0: off): a token whose probability is under min_p times the
    # likeliest one's is dropped before temperature, top-k and top-p.
    float min_p
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
    int piece              # a chunk's tokens computed at once: a prompt resumes at multiples of it
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
    int reader_done        # the reader of a finished loop lets its thread return (Generation.let_return)
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
    # The work a stop threw away: the piece of a prompt chunk that an evaluation it cut short
    # was computing (the chunks before it, and the chunk's pieces the evaluation finished,
    # stay in the KV cache), and its share of the evaluation's time.
    int prompt_tokens_wasted
    int64_t wasted_eval_ns
    # Set by an evaluation that ended before its tokens were part of any step (evaluate_in_step).
    bint withdrawn
    # The llama.cpp engine's turn in its context's steps (guarded by the Batcher's lock).
    bint is_present        # counted in Batcher.present
    int post_count         # tokens posted for the next step
    PostResult post_result
    bint in_step           # a step has taken its tokens and not yet let go of it
    bint left_step         # it ended during that step, which drops its tokens (see leave)
    bint delivering        # that step is handing it its result: it can no longer leave
    # Preemption: while pause_requested is set (Generation.pause) the loop takes no step;
    # what it evaluated stays in its cache. How often it paused, and for how long.
    int pause_requested
    int preemptions
    int64_t preempted_ns
    # It preempted a generation of a lower priority: its first evaluation interrupts the
    # step under way on its context (evaluate_in_step).
    bint urgent


# How generations share one llama.cpp context's steps.
include "_batcher.pxi"


cdef class LlamaEmbedder:
    """Sentence embeddings from an embedding model (a BERT) by llama.cpp: one evaluation
    takes up to ``max_inputs`` inputs of ``max_tokens`` tokens in all. Not thread-safe: one
    thread at a time calls :meth:`embed`."""
    cdef LlamaModel model
    cdef ll.sll_context *ctx
    cdef readonly int dimensions
    cdef readonly int max_tokens
    cdef readonly int max_inputs
    # The most tokens one input may have: the model's positions.
    cdef readonly int input_limit

    def __cinit__(self, LlamaModel model, int max_tokens=2048, int max_inputs=64, int threads=1):
        cdef char err[512]
        model._check_open()
        if max_tokens < 1 or threads < 1 or not 1 <= max_inputs <= ll.SLL_MAX_SEQUENCES:
            raise ValueError(f"max_tokens and threads are positive, max_inputs 1 to {ll.SLL_MAX_SEQUENCES}")
        err[0] = 0
        with nogil:
            self.ctx = LLAMA.embedding_context_new(model.model, max_tokens, threads, max_inputs, err, sizeof(err))
        if self.ctx is NULL:
            raise c_failure(ModelLoadError, "llama.cpp could not create an embedding context", 0, err)
        self.model = model
        self.dimensions = LLAMA.model_n_embd(model.model)
        self.max_tokens = max_tokens
        self.max_inputs = max_inputs
        self.input_limit = model.context_limit

    def embed(self, list inputs):
        """The pooled embedding of each input (a list of token ids), in one evaluation: the
        float32 bytes of ``len(inputs)`` rows of :attr:`dimensions` values, in input order."""
        cdef int32_t n = len(inputs), total = 0, i, j = 0, status
        cdef int32_t *tokens
        cdef int32_t *offsets
        cdef float *out
        if self.ctx is NULL:
            raise EngineError("the embedder is closed")
        # What would reach one of llama.cpp's asserts is refused here (and again by the shim).
        if not 1 <= n <= self.max_inputs:
            raise ValueError(f"1 to {self.max_inputs} inputs at a time")
        for ids in inputs:
            if not 1 <= len(ids) <= self.input_limit:
                raise ValueError(f"an input has 1 to {self.input_limit} tokens")
            total += len(ids)
        if total > self.max_tokens:
            raise ValueError(f"{total} tokens: one evaluation takes {self.max_tokens} at most")
        rows = bytearray(n * self.dimensions * sizeof(float))
        out = <float *><char *>rows
        tokens = <int32_t *>malloc(total * sizeof(int32_t))
        offsets = <int32_t *>malloc((n + 1) * sizeof(int32_t))
        try:
            if tokens is NULL or offsets is NULL:
                raise c_failure(MemoryError, "cannot allocate the inputs")
            offsets[0] = 0
            for i in range(n):
                for token in inputs[i]:
                    if not 0 <= token < self.model.vocab_size:
                        raise ValueError(f"token {token} is not in the vocabulary")
                    tokens[j] = token
                    j += 1
                offsets[i + 1] = j
            self.model.users += 1
            with nogil:
                status = LLAMA.embed(self.ctx, tokens, offsets, n, out)
            self.model.users -= 1
        finally:
            free(tokens)
            free(offsets)
        if status != ll.SLL_OK:
            raise EngineError(f"llama.cpp could not embed {n} inputs (status {status})")
        return bytes(rows)

    def close(self):
        if self.ctx is not NULL:
            LLAMA.context_free(self.ctx)
            self.ctx = NULL

    def __dealloc__(self):
        self.close()


cdef class LlamaContext:
    """One llama.cpp context over a :class:`LlamaModel`: one KV cache holding
    ``sequences`` sequences, each a :class:`LlamaSequence` slot. The generations
    running on its sequences are evaluated together, one batch per step.
    ``batch`` is the most tokens one evaluation takes (the prefill chunk), computed in
    pieces of ``ubatch`` tokens (0: the whole batch) that a stop keeps once finished: a
    prompt chunk it cuts short loses the piece under way only (see keep_finished_pieces)."""
    cdef Batcher b
    cdef readonly LlamaModel model
    cdef readonly tuple sequences
    cdef readonly int context_length
    cdef readonly int max_batch
    cdef readonly int ubatch
    cdef int open_sequences

    def __cinit__(self, LlamaModel model, int context_length=2048, int batch=64, int threads=1,
                  int sequences=1, int ubatch=0):
        cdef char err[512]
        cdef int errnum
        model._check_open()
        if not 1 <= batch <= ll.SLL_MAX_CHUNK:
            raise ValueError(f"batch is 1 to {ll.SLL_MAX_CHUNK}")
        if not 1 <= sequences <= ll.SLL_MAX_SEQUENCES:
            raise ValueError(f"sequences is 1 to {ll.SLL_MAX_SEQUENCES}")
        if context_length < 2 or threads < 1 or ubatch < 0:
            raise ValueError("context_length must be at least 2, threads positive and ubatch not negative")
        # Pieces end where a chunk does (prompt chunks go first in a batch; see
        # evaluate_together), or a resumed prompt would be cut elsewhere than a fresh one.
        if ubatch == 0 or ubatch > batch or batch % ubatch:
            ubatch = batch
        # Room for a whole prompt chunk and the next token of every other sequence.
        self.b.max_tokens = batch + sequences - 1
        err[0] = 0
        with nogil:
            self.b.ctx = LLAMA.context_new(model.model, context_length, self.b.max_tokens,
                                           self.b.max_tokens if ubatch == batch else ubatch, threads,
                                           sequences, err, sizeof(err))
        if self.b.ctx is NULL:
            raise c_failure(ModelLoadError, "llama.cpp could not create a context", 0, err)
        sl.pthread_mutex_init(&self.b.lock, NULL)
        sl.sl_cond_init_monotonic(&self.b.changed)
        for seq in range(ll.SLL_MAX_SEQUENCES):
            self.b.cut_from[seq] = -1
        self.b.applied_threads = threads
        LLAMA.set_abort(self.b.ctx, sl.sl_group_abort_callback, &self.b.group)
        # -1 whatever the arguments: a model whose cache gives cells away shares none.
        self.b.shares_cells = sequences > 1 and LLAMA.copy_prefix(self.b.ctx, 0, 0, 0) != -1
        self.model = model
        self.max_batch = batch
        self.ubatch = ubatch
        self.context_length = LLAMA.context_n_ctx(self.b.ctx)
        self.sequences = tuple(LlamaSequence(self, seq) for seq in range(sequences))
        self.open_sequences = sequences
        if sequences > 1:
            errnum = start_step_thread(&self.b)
            if errnum:
                raise c_failure(EngineError, "could not start the context's step thread", errnum)

    @property
    def closed(self):
        return self.b.ctx is NULL

    @property
    def prompts_first(self):
        """Whether a prompt's last chunk takes a step of its own, the decode tokens
        waiting for the next (see ends_a_prompt)."""
        return self.b.prompts_first

    @prompts_first.setter
    def prompts_first(self, bint value):
        self.b.prompts_first = value

    @property
    def step_under_way(self):
        """Whether a thread is using the context now: a step, or a change to its cache."""
        sl.pthread_mutex_lock(&self.b.lock)
        under_way = self.b.leading
        sl.pthread_mutex_unlock(&self.b.lock)
        return under_way

    @property
    def step_counts(self):
        """``(steps, generations, reruns, interruptions)``: the evaluations run, the
        generations they carried in all, the evaluations stopped for one generation and
        run again for the others, and those interrupted for a generation that preempted."""
        claim_context(&self.b)
        counts = (self.b.steps, self.b.step_members, self.b.reruns, self.b.interruptions)
        release_context(&self.b)
        return counts

    @property
    def kept_after_aborts(self):
        """The prompt tokens that aborted steps kept: the finished pieces of the chunks they cut short."""
        claim_context(&self.b)
        kept = self.b.kept_after_aborts
        release_context(&self.b)
        return kept

    @property
    def decode_tokens_deferred(self):
        """Decode tokens handed to a later step for want of room in the batch: none, since a
        prompt chunk never takes a decode token's room (``--prompt-steps alone`` hands them
        on by design, and they are not counted here)."""
        claim_context(&self.b)
        deferred = self.b.decode_tokens_deferred
        release_context(&self.b)
        return deferred

    cdef void sequence_closed(self) noexcept:
        self.open_sequences -= 1
        if self.open_sequences == 0 and self.b.ctx is not NULL:
            with nogil:
                stop_step_thread(&self.b)
            LLAMA.context_free(self.b.ctx)
            self.b.ctx = NULL

    def __dealloc__(self):
        with nogil:
            stop_step_thread(&self.b)
        if self.b.ctx is not NULL:
            LLAMA.context_free(self.b.ctx)
            self.b.ctx = NULL
        sl.pthread_cond_destroy(&self.b.changed)
        sl.pthread_mutex_destroy(&self.b.lock)


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

    cdef bint ends(self, int token) noexcept:
        return LLAMA.is_end(self.owner.model.model, token)

    cdef int prepare(self, LoopState *s, bint step_abort, bint trim_output, bytes grammar) except -1:
        cdef ll.sll_sampling sampling
        s.ops = &LLAMA_OPS
        # llama.cpp's abort callback is official, and it computes only the
        # logits asked for: nothing to trim.
        s.step_abort = step_abort
        s.trim_output = False
        if s.prefill_chunk % self.owner.ubatch == 0:
            s.piece = self.owner.ubatch
        sampling.temperature = s.temperature
        sampling.top_k = s.top_k
        sampling.top_p = s.top_p
        sampling.repeat_penalty = s.repetition_penalty
        sampling.penalty_last_n = LAST_N_TOKENS
        sampling.seed = <uint32_t>s.seed
        sampling.grammar = NULL
        if grammar is not None:
            sampling.grammar = grammar
        s.sampler = LLAMA.sampler_new(self.owner.model.model, &sampling)
        if s.sampler is NULL and grammar is not None:
            raise ValueError("llama.cpp cannot parse the grammar")
        if s.sampler is NULL:
            raise c_failure(MemoryError, "cannot allocate the sampler")
        return 0

    cdef void attach(self, LoopState *s) noexcept:
        s.batcher = &self.owner.b
        s.seq = self.seq
        s.lmodel = self.owner.model.model
        s.logits = self.logits

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

    def held_record(self):
        """``(tokens, chunk)``: the tokens this sequence's KV cache holds from position 0,
        and the prefill chunk they were evaluated with."""
        cdef int i
        self._check_open()
        return [self.held[i] for i in range(self.n_held)], self.held_chunk

    def save_state(self):
        """A copy of this sequence's KV state, which holds :meth:`held_record`'s tokens,
        for :meth:`restore_state`; None when it holds none, or when its cache no longer
        holds every one of their positions (a sliding-window layer gave some away)."""
        cdef Batcher *b = &self.owner.b
        cdef int n = self.n_held
        cdef size_t size = 0, again = 0, written = 0
        cdef bint whole = False
        cdef bytes data
        cdef uint8_t *dst
        self._check_idle()
        if n == 0:
            return None
        # The GIL is never taken while the context is claimed (a thread holding it may
        # wait for the claim): measure, allocate, then copy if the size still holds.
        with nogil:
            claim_context(b)
            whole = LLAMA.holds(b.ctx, self.seq, n)
            if whole:
                size = LLAMA.state_size(b.ctx, self.seq)
            release_context(b)
        if not whole or size == 0:
            return None
        data = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>size)
        dst = <uint8_t *>PyBytes_AS_STRING(data)
        with nogil:
            claim_context(b)
            again = LLAMA.state_size(b.ctx, self.seq)
            if again == size and LLAMA.holds(b.ctx, self.seq, n):
                written = LLAMA.state_save(b.ctx, self.seq, dst, size)
            release_context(b)
        if written != size:
            return None
        return data

    def restore_state(self, bytes data not None, tokens, int chunk):
        """Load a state saved by :meth:`save_state` (of a sequence of this model, in a
        context of the same shape) and keep its first ``len(tokens)`` positions, which
        hold ``tokens``, evaluated with prefill chunks of ``chunk``. Returns whether the
        cache holds them now; if not, it holds nothing."""
        cdef Batcher *b = &self.owner.b
        cdef int n = len(tokens)
        cdef const uint8_t *src = <const uint8_t *>PyBytes_AS_STRING(data)
        cdef size_t size = len(data), read = 0
        cdef bint whole = False
        cdef int *ids
        self._check_idle()
        if not 1 <= n <= self.context_length:
            raise ValueError(f"a restored state holds 1 to {self.context_length} tokens")
        ids = token_ids(tokens)
        self.n_held = 0
        try:
            with nogil:
                claim_context(b)
                read = LLAMA.state_load(b.ctx, self.seq, src, size)
                if read != 0:
                    LLAMA.truncate(b.ctx, self.seq, n)
                    whole = LLAMA.holds(b.ctx, self.seq, n)
                if not whole:
                    LLAMA.truncate(b.ctx, self.seq, 0)
                else:
                    memcpy(self.held, ids, n * sizeof(int))
                    self.n_held = n
                    self.held_chunk = chunk
                sl.pthread_mutex_lock(&b.lock)
                set_record(b, self.seq, self.held, self.n_held, self.held_chunk)
                sl.pthread_mutex_unlock(&b.lock)
                release_context(b)
            return whole
        finally:
            free(ids)

    def copy_live_prefix(self, tokens, int chunk, int longer_than):
        """Take the longest prefix of ``tokens`` that another sequence of this context holds,
        evaluated with prefill chunks of ``chunk``, if it is longer than ``longer_than``: this
        sequence's cells are dropped and it shares the other's cells of that prefix
        (sll_api.copy_prefix: nothing is evaluated or copied). The other sequence may be
        running: only what its finished steps evaluated counts, and a later cut or stop of it
        leaves the copy as it is. Returns the tokens taken (0: none, the slot as it was)."""
        cdef Batcher *b = &self.owner.b
        cdef int n = min(len(tokens), self.context_length), source = -1, copied = 0
        cdef int found = max(longer_than, 0)
        cdef int *ids
        self._check_idle()
        longer_than = found
        if n <= longer_than or not b.shares_cells:
            return 0
        ids = token_ids(tokens)
        try:
            with nogil:
                # A look first, without waiting for the step under way: most prompts find none.
                sl.pthread_mutex_lock(&b.lock)
                source = longest_record(b, self.seq, ids, n, chunk, &found)
                sl.pthread_mutex_unlock(&b.lock)
                if source >= 0:
                    claim_context(b)
                    # Looked at again once the context is this thread's: the records may have changed,
                    # and no cut asked for from now on is made before release_context.
                    found = longer_than
                    sl.pthread_mutex_lock(&b.lock)
                    source = longest_record(b, self.seq, ids, n, chunk, &found)
                    sl.pthread_mutex_unlock(&b.lock)
                    if source >= 0:
                        copied = LLAMA.copy_prefix(b.ctx, source, self.seq, found)
                        if copied == 1:
                            memcpy(self.held, ids, found * sizeof(int))
                            self.n_held = found
                            self.held_chunk = chunk
                        elif not LLAMA.holds(b.ctx, self.seq, self.n_held):
                            # A copy that did not hold leaves the sequence empty.
                            LLAMA.truncate(b.ctx, self.seq, 0)
                            self.n_held = 0
                        sl.pthread_mutex_lock(&b.lock)
                        if copied == 1:
                            set_record(b, self.seq, self.held, found, chunk)
                        elif self.n_held == 0:
                            b.record_n[self.seq] = 0
                        sl.pthread_mutex_unlock(&b.lock)
                    release_context(b)
            return found if copied == 1 else 0
        finally:
            free(ids)

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
                sl.pthread_mutex_lock(&b.lock)
                set_record(b, self.seq, self.held, 0, 0)
                sl.pthread_mutex_unlock(&b.lock)
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


cdef inline void record_longest_node(LoopState *s, int64_t gap) noexcept nogil:
    if s.n_generated == 0:
        if gap > s.longest_prefill_node_ns:
            s.longest_prefill_node_ns = gap
    elif gap > s.longest_decode_node_ns:
        s.longest_decode_node_ns = gap


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


cdef inline void apply_penalties(LoopState *s) noexcept nogil:
    """OpenAI's frequency and presence penalties, on the logits in place: only the
    ids generated so far change, so a step costs as many subtractions as there are."""
    cdef int i, token
    cdef float *logits = s.ops.logits(s)
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


cdef inline void apply_bias(LoopState *s) noexcept nogil:
    cdef int i
    cdef float *logits = s.ops.logits(s)
    if logits is NULL:
        return
    for i in range(s.n_bias):
        logits[s.bias_ids[i]] += s.bias_values[i]


cdef bint apply_min_p(LoopState *s) noexcept nogil:
    """Drop, in place, every logit under the best one's plus log(min_p): on the raw logits,
    that is a probability under min_p times the likeliest token's. The stop is checked
    every SAMPLE_BLOCK ids (False: it said stop)."""
    cdef int i, n = s.vocab_size
    cdef float *logits = s.ops.logits(s)
    cdef float floor = -INFINITY
    if logits is NULL:
        return True
    for i in range(n):
        if logits[i] > floor:
            floor = logits[i]
    floor += log(s.min_p)
    for i in range(n):
        if logits[i] < floor:
            logits[i] = -INFINITY
        if i % SAMPLE_BLOCK == 0 and sl.sl_check(&s.watch) != sl.SL_RUN:
            return False
    return True


cdef bint record_distribution(LoopState *s) noexcept nogil:
    """Keep the draw's raw logits, their log-sum-exp and the n_top best ids, for the token
    about to be generated (index n_generated). O(vocabulary x n_top) at worst, O(vocabulary)
    as a rule; the stop is checked every SAMPLE_BLOCK ids (False: it said stop)."""
    cdef int i, j, n = s.vocab_size, k = s.n_top
    cdef float *logits = s.ops.logits(s)
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
    if s.n_top >= 0 and not record_distribution(s):
        return SAMPLE_STOPPED
    if s.counts is not NULL:
        apply_penalties(s)
    if s.n_bias:
        apply_bias(s)
    # Greedy keeps the likeliest token, which min_p never drops.
    if s.min_p > 0 and s.temperature > 0 and not apply_min_p(s):
        return SAMPLE_STOPPED
    return s.ops.sample(s, step)


cdef void run_loop(LoopState *s) noexcept nogil:
    s.start_ns = sl.sl_monotonic_ns()
    s.n_past = s.n_reused
    s.ops.begin(s)
    run_steps(s)
    sl.sl_watch_leave()


cdef void run_steps(LoopState *s) noexcept nogil:
    cdef int chunk, token, step, size, old_size
    cdef bint done

    # Prefill in chunks so that a cancel or a deadline is seen between them
    # even when the hook cannot stop an evaluation part-way. Chunks, and the
    # pieces an evaluation computes them in, end at multiples of prefill_chunk
    # and piece, wherever the prompt resumes: a token's attention sums in an
    # order that depends on where its batch ends, so aligned ends make a
    # resumed prompt compute exactly what a fresh one does.
    while s.n_past < s.n_prompt:
        if should_stop(s):
            return
        chunk = s.prefill_chunk - s.n_past % s.prefill_chunk
        if s.n_past % s.piece:
            chunk = min(chunk, s.piece - s.n_past % s.piece)
        if chunk > s.n_prompt - s.n_past:
            chunk = s.n_prompt - s.n_past
        done = evaluate_counted(s, chunk, True)
        # A stop keeps the pieces it let finish (see keep_finished_pieces).
        s.n_prompt_evaluated = s.n_past - s.n_reused
        if not done:
            return

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
        if s.ops.is_end(s, token):
            s.exit = ExitKind.EOS
            return

        # Publish: bytes and id first, then the count with release semantics.
        old_size = s.text_end[s.n_generated - 1] if s.n_generated else 0
        size = s.ops.write_piece(s, token, s.text + old_size)
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
        if not evaluate_counted(s, 1, False):
            return
    s.exit = ExitKind.CONTEXT_FULL if s.max_tokens_capped else ExitKind.MAX_TOKENS


cdef bint evaluate_counted(LoopState *s, int count, bint prompt) noexcept nogil:
    """The engine's evaluation of the next ``count`` tokens. One that fails after it began
    computing threw its work away: the result reports it as wasted."""
    cdef int64_t start = sl.sl_monotonic_ns()
    cdef int n_past = s.n_past, kept, lost
    s.withdrawn = False
    if s.ops.evaluate(s, count):
        return True
    if not s.withdrawn:
        # The piece under way is lost; the pieces before it are kept (see keep_finished_pieces),
        # and those after it were never computed. The time is shared out over the computed ones.
        kept = s.n_past - n_past
        lost = min(s.piece, count - kept)
        s.wasted_eval_ns += (sl.sl_monotonic_ns() - start) * lost // max(kept + lost, 1)
        if prompt:
            s.prompt_tokens_wasted = lost
    return False


# Each engine's side of the loop ------------------------------------------------

cdef bint ct_evaluate(LoopState *s, int count) noexcept nogil:
    """The ctransformers engine's evaluation of the next ``count`` tokens into the KV
    cache. False when the loop must end instead (s.exit says why)."""
    cdef bint ok
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


cdef void ct_begin(LoopState *s) noexcept nogil:
    if s.step_abort:
        sl.sl_watch_enter(&s.watch)


cdef float *ct_logits(LoopState *s) noexcept nogil:
    return API.llm_logits_data(s.llm) + API.llm_logits_size(s.llm) - s.vocab_size


cdef int ct_sample(LoopState *s, int step) noexcept nogil:
    cdef int first_last, top_k = s.top_k
    cdef float temperature = s.temperature
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


cdef bint ct_is_end(LoopState *s, int token) noexcept nogil:
    return API.llm_is_eos_token(s.llm, token)


cdef int ct_write_piece(LoopState *s, int token, char *out) noexcept nogil:
    cdef const char *piece = API.llm_detokenize(s.llm, token)
    cdef int size = <int>strlen(piece)
    memcpy(out, piece, size)
    return size


cdef void llama_begin(LoopState *s) noexcept nogil:
    # The repetition penalty looks at recent tokens, the prompt's included.
    cdef int i = s.n_prompt - LAST_N_TOKENS
    for i in range(i if i > 0 else 0, s.n_prompt):
        LLAMA.sampler_accept(s.sampler, s.tokens[i])


cdef float *llama_logits(LoopState *s) noexcept nogil:
    return s.logits


cdef int llama_sample(LoopState *s, int step) noexcept nogil:
    return LLAMA.sample(s.sampler, s.logits, sl.sl_watch_says_stop, &s.watch)


cdef bint llama_is_end(LoopState *s, int token) noexcept nogil:
    return LLAMA.is_end(s.lmodel, token)


cdef int llama_write_piece(LoopState *s, int token, char *out) noexcept nogil:
    # Control tokens write nothing: they belong to the template, not the text.
    cdef int size = LLAMA.token_piece(s.lmodel, token, out, s.max_token_bytes, False)
    return size if size > 0 else 0


CTRANSFORMERS_OPS.begin = ct_begin
CTRANSFORMERS_OPS.evaluate = ct_evaluate
CTRANSFORMERS_OPS.logits = ct_logits
CTRANSFORMERS_OPS.sample = ct_sample
CTRANSFORMERS_OPS.is_end = ct_is_end
CTRANSFORMERS_OPS.write_piece = ct_write_piece
LLAMA_OPS.begin = llama_begin
LLAMA_OPS.evaluate = evaluate_in_step
LLAMA_OPS.logits = llama_logits
LLAMA_OPS.sample = llama_sample
LLAMA_OPS.is_end = llama_is_end
LLAMA_OPS.write_piece = llama_write_piece


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
    cdef readonly int prompt_tokens_wasted
    cdef readonly int64_t wasted_eval_ns
    cdef readonly int preemptions
    cdef readonly int64_t preempted_ns

    def __repr__(self):
        # The fields are the readonly attributes above, in their order: no second list to keep.
        names = [n for n, v in vars(LoopResult).items() if type(v).__name__ == "getset_descriptor"]
        return "LoopResult(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"


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
    r.prompt_tokens_wasted = s.prompt_tokens_wasted
    r.wasted_eval_ns = s.wasted_eval_ns
    r.preemptions = s.preemptions
    r.preempted_ns = s.preempted_ns
    return r


cdef void wait_for_reader(LoopState *s) noexcept nogil:
    """Wait until the reader lets the loop's thread return (Generation.run's yield_to_reader)."""
    cdef int64_t until = sl.sl_monotonic_ns() + READER_GRACE_NS
    while not sl.sl_load_acquire(&s.reader_done) and sl.sl_monotonic_ns() < until:
        sl.sl_sleep_ns(READER_POLL_NS)


cdef class Generation:
    """One run of the token loop on a context. Create it, call :meth:`run` once
    (from any thread; it blocks without the GIL), read tokens with :meth:`take`.

    ``params`` is a ``stopline.protocol.SamplingParams``, the one source of the sampling
    settings and their defaults (the stop sequences included); the other arguments are
    the loop's own options. ``urgent``: it preempted a generation of a lower priority, and
    its first evaluation interrupts the step under way on its context rather than wait
    for it (shared steps only)."""

    cdef LoopState s
    cdef Slot context
    # A GenerationState, stored with release and read with acquire semantics.
    cdef int _state
    # Set only once eventfd() succeeded: __dealloc__ runs even when __cinit__ fails.
    cdef bint owns_wake_fd
    cdef LoopResult _result
    cdef readonly object stop_sequences

    def __cinit__(self, Slot context, prompt_tokens, params, *, int prefill_chunk=1, int threads=1,
                  int window=DEFAULT_WINDOW, int64_t deadline_ns=0, int64_t first_token_deadline_ns=0,
                  bint step_abort=True, bint trim_output=True, bint urgent=False):
        cdef int max_tokens, top_k, seed, logprobs
        cdef double temperature, top_p, repetition_penalty, frequency_penalty, presence_penalty, min_p
        cdef bint ignore_eos
        cdef bytes grammar_text
        cdef int i, n_prompt = len(prompt_tokens), offset = 0
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        # Each sampling field is read once, here: the loop never looks at params again.
        max_tokens = params.max_tokens
        temperature = params.temperature
        top_k = params.top_k
        top_p = params.top_p
        repetition_penalty = params.repetition_penalty
        frequency_penalty = params.frequency_penalty
        presence_penalty = params.presence_penalty
        min_p = params.min_p
        logit_bias = params.logit_bias
        ignore_eos = params.ignore_eos
        # A request that names no seed gets a fresh one, 0 to requests.MAX_SEED - 1 (2**31).
        seed = random.getrandbits(31) if params.seed is None else params.seed
        grammar_text = None if params.grammar is None else str(params.grammar).encode("utf-8")
        logprobs = -1 if params.logprobs is None else params.logprobs
        context._check_open()
        if n_prompt == 0:
            raise ValueError("the prompt has no tokens")
        if n_prompt >= context.context_length:
            raise ContextOverflowError(
                f"the prompt has {n_prompt} tokens; the context holds {context.context_length} "
                "and needs room for at least one generated token")
        if not 0 <= min_p <= 1:
            raise ValueError("min_p is 0 (off) to 1")
        if max_tokens < 1 or prefill_chunk < 1 or threads < 1 or window < 1:
            raise ValueError("max_tokens, prefill_chunk, threads and window must be positive")
        if prefill_chunk > context.max_batch:
            raise ValueError(f"prefill_chunk is at most {context.max_batch}, the context's batch limit")
        # The context must hold the prompt and every generated token.
        self.s.max_tokens_capped = max_tokens > context.context_length - n_prompt
        max_tokens = min(max_tokens, context.context_length - n_prompt)
        self.context = context
        self.stop_sequences = tuple(str(x).encode("utf-8") for x in params.stop if x)
        self.s.n_prompt = n_prompt
        self.s.max_tokens = max_tokens
        self.s.temperature = temperature
        self.s.top_k = top_k
        self.s.top_p = top_p
        self.s.repetition_penalty = repetition_penalty
        self.s.frequency_penalty = frequency_penalty
        self.s.presence_penalty = presence_penalty
        self.s.min_p = min_p
        self.s.vocab_size = context.vocab_size
        self.s.seed = seed
        self.s.prefill_chunk = prefill_chunk
        self.s.piece = prefill_chunk
        self.s.threads = threads
        self.s.window = window
        self.s.watch.deadline_ns = deadline_ns
        self.s.watch.first_token_deadline_ns = first_token_deadline_ns
        self.s.urgent = urgent
        self.s.max_token_bytes = context.max_token_bytes
        context.prepare(&self.s, step_abort, trim_output, grammar_text)
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
        bias = list(logit_bias)
        if ignore_eos:
            bias += [(token, -INFINITY) for token in context.end_tokens()]
        self.s.bias_ids = <int *>malloc((len(bias) + 1) * sizeof(int))
        self.s.bias_values = <float *>malloc((len(bias) + 1) * sizeof(float))
        if not (self.s.bias_ids and self.s.bias_values):
            raise c_failure(MemoryError, "cannot allocate the logit bias")
        for token, value in bias:
            if not 0 <= token < context.vocab_size:
                raise ValueError(f"logit_bias names token {token}, outside the vocabulary")
            self.s.bias_ids[self.s.n_bias] = token
            self.s.bias_values[self.s.n_bias] = value
            self.s.n_bias += 1
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
        free(self.s.bias_ids)
        free(self.s.bias_values)
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
            # Waiting for a step, or paused, it would otherwise see the flag only once woken.
            self._wake_step_waiters()
        return True

    def pause(self):
        """Preempt the generation: from its next step on, until :meth:`resume`, its loop
        takes no step (a step under way ends first, so nothing it computes is lost). What
        it has evaluated stays in its context's cache, and it resumes from there. A stop
        still ends it at once. Thread-safe; the llama.cpp engine only."""
        self._check_pausable()
        sl.sl_store_release(&self.s.pause_requested, 1)
        self._wake_step_waiters()

    def resume(self):
        """End a :meth:`pause`: the loop takes its next step."""
        self._check_pausable()
        sl.sl_store_release(&self.s.pause_requested, 0)
        self._wake_step_waiters()

    cdef _check_pausable(self):
        if self.s.batcher is NULL:
            raise EngineError("only a generation of the llama.cpp engine can pause")

    cdef void _wake_step_waiters(self) noexcept:
        # A generation waiting for a step, or paused, waits on its context's condition.
        sl.pthread_mutex_lock(&self.s.batcher.lock)
        sl.pthread_cond_broadcast(&self.s.batcher.changed)
        sl.pthread_mutex_unlock(&self.s.batcher.lock)

    def run(self, bint yield_to_reader=False):
        """Run the loop to its end and return the :class:`LoopResult`.

        ``yield_to_reader``: another thread reads this generation (woken by
        :meth:`fileno`) and has work to do at its end, such as telling a
        client. This thread's way back into Python would take the GIL from
        it, at its first system call; so once it has published the end, this
        thread waits outside the GIL until the reader calls :meth:`let_return`,
        or READER_GRACE_S has passed."""
        cdef Slot context = self.context
        if sl.sl_load_acquire(&self._state) != GenerationState.NEW:
            raise EngineError("a generation runs only once")
        if context.busy:
            raise EngineError("another generation is running on this context")
        context._check_open()
        self.s.n_reused = context.usable_prefix(self.s.tokens, self.s.n_prompt, self.s.prefill_chunk)
        context.attach(&self.s)
        sl.sl_store_release(&self._state, GenerationState.RUNNING)
        context.busy = 1
        # Positions from n_reused on are about to be overwritten.
        context.n_held = self.s.n_reused
        with nogil:
            if self.s.batcher is not NULL:
                # Positions from n_reused on go: the cache must continue exactly where the record does.
                truncate_sequence(self.s.batcher, self.s.seq, self.s.n_reused)
                # Its cache is its tokens' now (the slot's record and they agree up to n_reused).
                sl.pthread_mutex_lock(&self.s.batcher.lock)
                set_record(self.s.batcher, self.s.seq, self.s.tokens,
                           min(self.s.batcher.record_n[self.s.seq], self.s.n_reused), self.s.prefill_chunk)
                sl.pthread_mutex_unlock(&self.s.batcher.lock)
                set_present(&self.s, True)
            run_loop(&self.s)
            set_present(&self.s, False)
            self.s.end_ns = sl.sl_monotonic_ns()
            memcpy(context.held, self.s.tokens, self.s.n_past * sizeof(int))
            context.n_held = self.s.n_past
            context.held_chunk = self.s.prefill_chunk
            if self.s.batcher is not NULL:
                # The slot's record holds the same tokens, and outlives the generation.
                sl.pthread_mutex_lock(&self.s.batcher.lock)
                set_record(self.s.batcher, self.s.seq, context.held, self.s.batcher.record_n[self.s.seq],
                           self.s.prefill_chunk)
                sl.pthread_mutex_unlock(&self.s.batcher.lock)
            context.busy = 0
            # Publish in this order: the loop's record, then the finished state (a
            # release store), then the wake-up. A reader that sees "finished", or
            # that was woken by the last wake-up, finds the record (see result).
            sl.sl_store_release(&self._state, GenerationState.FINISHED)
            sl.sl_wake(self.s.wake_fd)
            if self.s.batcher is not NULL:
                wait_out_step(&self.s)
            if yield_to_reader:
                wait_for_reader(&self.s)
        return self.result

    @property
    def result(self):
        """The :class:`LoopResult` once the loop has ended, else None."""
        cdef LoopResult result
        if self._result is None and sl.sl_load_acquire(&self._state) == GenerationState.FINISHED:
            result = loop_result(&self.s)
            # Two threads may build it at once (a collection in between can switch
            # threads): the first one kept is everyone's.
            if self._result is None:
                self._result = result
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

    def let_return(self):
        """Let the thread of a loop run with ``yield_to_reader`` return to Python:
        the reader has done what the end asked of it."""
        sl.sl_store_release(&self.s.reader_done, 1)
