# cython: language_level=3, boundscheck=False, wraparound=False
"""Stopline's native token loop over ctransformers.

A :class:`Context` is one ctransformers model instance: its own KV cache and
scratch buffers, with the weights memory-mapped and so shared between contexts
of the same file. A :class:`Generation` runs once on a context. Its loop runs
with the GIL released and checks the cancel flag (an atomic, acquire load)
before every prompt chunk and every token, and the two deadlines against the
monotonic clock at the same points.

Tokens are handed to Python through an append-only log: the loop writes each
token's id and bytes, publishes the count with a release store and wakes an
eventfd; Python reads everything below the published count. The loop never
runs more than ``window`` tokens ahead of what Python has consumed, so a slow
reader pauses the loop instead of growing a buffer.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint32_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset, strlen

from ctransformers cimport *

import os

# Outcome and reason names; they match server/vocabulary.py.
DONE, CANCELLED, TIMEOUT, ERROR = "done", "cancelled", "timeout", "error"

cdef enum LoopExit:
    EXIT_NONE = 0
    EXIT_EOS
    EXIT_MAX_TOKENS
    EXIT_STOP_SEQUENCE
    EXIT_CANCELLED
    EXIT_TOTAL_TIMEOUT
    EXIT_FIRST_TOKEN_TIMEOUT
    EXIT_EVAL_FAILED

_EXIT_NAMES = {
    EXIT_EOS: (DONE, "eos"),
    EXIT_MAX_TOKENS: (DONE, "max_tokens"),
    EXIT_STOP_SEQUENCE: (DONE, "stop_sequence"),
    EXIT_CANCELLED: (CANCELLED, None),
    EXIT_TOTAL_TIMEOUT: (TIMEOUT, "total_timeout"),
    EXIT_FIRST_TOKEN_TIMEOUT: (TIMEOUT, "first_token_timeout"),
    EXIT_EVAL_FAILED: (ERROR, "internal_error"),
}

cdef enum:
    # How many recent tokens the repetition penalty looks at (ctransformers' default).
    LAST_N_TOKENS = 64
    # While paused for a slow reader, re-check the flag and deadlines this often.
    PAUSE_POLL_NS = 200000

cdef ct_api API
cdef bint API_READY = False


class EngineError(RuntimeError):
    """A failure inside the native engine."""


class ModelLoadError(EngineError):
    """ctransformers could not create the model."""


class ContextOverflowError(EngineError, ValueError):
    """The prompt does not fit in the context."""


cdef raise_engine_error(type kind, str message):
    # The single place where C failures become Python exceptions.
    raise kind(message)


def load_library(str path):
    """Resolve the ctransformers C API from ``path`` (once per process)."""
    global API_READY
    cdef char err[512]
    if API_READY:
        return
    if ct_api_open(&API, os.fsencode(path), err, sizeof(err)) != 0:
        raise_engine_error(EngineError, err.decode("utf-8", "replace"))
    API_READY = True


cdef class Context:
    cdef ct_llm *llm
    cdef readonly int context_length
    cdef readonly int vocab_size
    cdef readonly int max_token_bytes
    cdef readonly str architecture
    cdef int busy

    def __cinit__(self, str model_path, str model_type="llama", int context_length=2048):
        cdef ct_config config
        if not API_READY:
            raise_engine_error(EngineError, "load_library() has not been called")
        config.context_length = context_length
        config.gpu_layers = 0
        config.mmap = True
        config.mlock = False
        path_bytes = os.fsencode(model_path)
        kind_bytes = model_type.encode()
        cdef const char *path = path_bytes
        cdef const char *kind = kind_bytes
        with nogil:
            self.llm = API.llm_create(path, kind, config)
        if self.llm is NULL:
            raise_engine_error(ModelLoadError, f"ctransformers could not create a {model_type!r} model from {model_path}")
        self.context_length = API.llm_context_length(self.llm)
        self.vocab_size = API.llm_vocab_size(self.llm)
        self.architecture = (<bytes>API.llm_architecture(self.llm)).decode("utf-8", "replace")
        cdef int token, longest = 0, size
        for token in range(self.vocab_size):
            size = <int>strlen(API.llm_detokenize(self.llm, token))
            if size > longest:
                longest = size
        self.max_token_bytes = longest

    def tokenize(self, str text):
        """The model's own tokenizer, for models whose GGUF has no byte-level BPE vocab."""
        self._check_open()
        data = text.encode("utf-8")
        cdef int *ids = <int *>malloc((len(data) + 1) * sizeof(int))
        if ids is NULL:
            raise MemoryError()
        try:
            n = API.llm_tokenize(self.llm, data, False, ids)
            return [ids[i] for i in range(n)]
        finally:
            free(ids)

    def token_bytes(self, int token):
        self._check_open()
        return <bytes>API.llm_detokenize(self.llm, token)

    @property
    def closed(self):
        return self.llm is NULL

    def close(self):
        if self.busy:
            raise_engine_error(EngineError, "cannot close a context while a generation runs on it")
        if self.llm is not NULL:
            API.llm_delete(self.llm)
            self.llm = NULL

    def __dealloc__(self):
        if self.llm is not NULL:
            API.llm_delete(self.llm)
            self.llm = NULL

    cdef _check_open(self):
        if self.llm is NULL:
            raise_engine_error(EngineError, "context is closed")


cdef struct LoopState:
    # Written by Python before the loop starts, read-only inside it.
    int *tokens            # prompt, then generated tokens
    int n_prompt
    int max_tokens
    int top_k
    float top_p
    float temperature
    float repetition_penalty
    int seed
    int prefill_chunk
    int threads
    int window
    int64_t deadline_ns            # 0: none
    int64_t first_token_deadline_ns
    char *stops                    # stop sequences, back to back
    int *stop_sizes
    int n_stops
    int wake_fd
    # Shared with Python through atomics.
    int cancel_requested   # claimed once, by the first Generation.cancel()
    int cancel_flag        # what the loop polls
    int published          # tokens whose id and bytes are readable
    int consumed           # tokens Python has read
    int published_at_cancel
    # Outputs, written by the loop.
    char *text
    uint32_t *text_end     # text_end[i]: bytes of text after token i
    int n_generated
    int n_prompt_evaluated
    int stop_at            # byte offset where the matched stop sequence starts
    LoopExit exit
    int tokens_after_cancel
    int64_t start_ns
    int64_t first_token_ns
    int64_t cancel_observed_ns
    int64_t end_ns


cdef inline bint should_stop(LoopState *s) noexcept nogil:
    """The poll done before every chunk and token: cancel flag, then deadlines."""
    cdef int64_t now
    if sl_load_acquire(&s.cancel_flag):
        s.cancel_observed_ns = sl_monotonic_ns()
        s.exit = EXIT_CANCELLED
        s.tokens_after_cancel = s.n_generated - s.published_at_cancel
        return True
    if s.deadline_ns == 0 and s.first_token_deadline_ns == 0:
        return False
    now = sl_monotonic_ns()
    if s.deadline_ns and now >= s.deadline_ns:
        s.exit = EXIT_TOTAL_TIMEOUT
        return True
    if s.first_token_deadline_ns and s.n_generated == 0 and now >= s.first_token_deadline_ns:
        s.exit = EXIT_FIRST_TOKEN_TIMEOUT
        return True
    return False


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


cdef void run_loop(LoopState *s, ct_llm *llm, ct_api *api) noexcept nogil:
    cdef int n_past = 0, chunk, token, first_last, step, size, old_size
    cdef int top_k = s.top_k
    cdef float temperature = s.temperature
    cdef const char *piece
    if temperature <= 0:
        # Greedy: keep only the best candidate (the library divides by temperature).
        top_k = 1
        temperature = 1.0

    s.start_ns = sl_monotonic_ns()
    # Prefill in chunks so that a cancel or a deadline is seen between them.
    while n_past < s.n_prompt:
        if should_stop(s):
            return
        chunk = s.n_prompt - n_past
        if chunk > s.prefill_chunk:
            chunk = s.prefill_chunk
        if not api.llm_batch_eval(llm, s.tokens + n_past, chunk, n_past, chunk, s.threads):
            s.exit = EXIT_EVAL_FAILED
            return
        n_past += chunk
        s.n_prompt_evaluated = n_past

    for step in range(s.max_tokens):
        if should_stop(s):
            return
        # Pause while the reader is a full window behind.
        while s.n_generated - sl_load_acquire(&s.consumed) >= s.window:
            sl_sleep_ns(PAUSE_POLL_NS)
            if should_stop(s):
                return

        first_last = n_past - LAST_N_TOKENS
        if first_last < 0:
            first_last = 0
        token = api.llm_sample(llm, s.tokens + first_last, n_past - first_last, top_k, s.top_p,
                               temperature, s.repetition_penalty,
                               <int>((<unsigned int>s.seed + <unsigned int>step) & 0x7fffffffu))
        if api.llm_is_eos_token(llm, token):
            s.exit = EXIT_EOS
            return

        # Publish: bytes and id first, then the count with release semantics.
        piece = api.llm_detokenize(llm, token)
        size = <int>strlen(piece)
        old_size = s.text_end[s.n_generated - 1] if s.n_generated else 0
        memcpy(s.text + old_size, piece, size)
        s.text_end[s.n_generated] = old_size + size
        s.tokens[n_past] = token
        s.n_generated += 1
        if s.n_generated == 1:
            s.first_token_ns = sl_monotonic_ns()
        sl_store_release(&s.published, s.n_generated)
        sl_wake(s.wake_fd)

        if s.n_stops and stop_sequence_matched(s, old_size, old_size + size):
            s.exit = EXIT_STOP_SEQUENCE
            return
        if s.n_generated == s.max_tokens:
            break
        # Don't start a decode step for a request that is already cancelled.
        if should_stop(s):
            return
        if not api.llm_batch_eval(llm, s.tokens + n_past, 1, n_past, 1, s.threads):
            s.exit = EXIT_EVAL_FAILED
            return
        n_past += 1
    s.exit = EXIT_MAX_TOKENS


def measure_flag_poll(int iterations=1000000):
    """Mean cost in ns of one poll of the cancel flag and both deadlines, as the loop does it."""
    cdef LoopState s
    # hits keeps the compiler from optimising the polls away.
    cdef int i, hits = 0
    cdef int64_t start, elapsed
    memset(&s, 0, sizeof(s))
    s.deadline_ns = sl_monotonic_ns() + 3600 * 1000000000
    s.first_token_deadline_ns = s.deadline_ns
    with nogil:
        start = sl_monotonic_ns()
        for i in range(iterations):
            hits += should_stop(&s)
        elapsed = sl_monotonic_ns() - start
    return elapsed / iterations


class GenerationResult:
    """What a finished generation reports. Timestamps are CLOCK_MONOTONIC ns (0: never)."""

    __slots__ = ("outcome", "reason", "prompt_tokens", "prompt_tokens_evaluated", "tokens_generated",
                 "tokens_after_cancel", "start_ns", "first_token_ns", "cancel_observed_ns", "end_ns",
                 "text_kept_bytes")

    def __init__(self, **fields):
        for name in self.__slots__:
            setattr(self, name, fields[name])

    def __repr__(self):
        return "GenerationResult(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__) + ")"


cdef class Generation:
    """One run of the token loop on a context. Create it, call :meth:`run` once
    (from any thread; it blocks without the GIL), read tokens with :meth:`take`."""

    cdef LoopState s
    cdef Context context
    cdef int state   # 0 new, 1 running, 2 finished
    # Set only once eventfd() succeeded: __dealloc__ runs even when __cinit__ fails.
    cdef bint owns_wake_fd
    cdef object cancel_reason
    cdef object _result
    cdef readonly object stop_sequences

    def __cinit__(self, Context context, prompt_tokens, *, int max_tokens=256, double temperature=0.8,
                  int top_k=40, double top_p=0.95, double repetition_penalty=1.1, int seed=0,
                  stop=(), int prefill_chunk=8, int threads=1, int window=64,
                  int64_t deadline_ns=0, int64_t first_token_deadline_ns=0):
        cdef int i, n_prompt = len(prompt_tokens), offset = 0
        context._check_open()
        if n_prompt == 0:
            raise ValueError("the prompt has no tokens")
        if n_prompt >= context.context_length:
            raise_engine_error(ContextOverflowError,
                f"the prompt has {n_prompt} tokens; the context holds {context.context_length} "
                "and needs room for at least one generated token")
        if max_tokens < 1 or prefill_chunk < 1 or threads < 1 or window < 1:
            raise ValueError("max_tokens, prefill_chunk, threads and window must be positive")
        # The context must hold the prompt and every generated token.
        max_tokens = min(max_tokens, context.context_length - n_prompt)
        self.context = context
        self.stop_sequences = tuple(bytes(x) for x in stop if x)
        self.s.n_prompt = n_prompt
        self.s.max_tokens = max_tokens
        self.s.temperature = temperature
        self.s.top_k = top_k
        self.s.top_p = top_p
        self.s.repetition_penalty = repetition_penalty
        self.s.seed = seed
        self.s.prefill_chunk = prefill_chunk
        self.s.threads = threads
        self.s.window = window
        self.s.deadline_ns = deadline_ns
        self.s.first_token_deadline_ns = first_token_deadline_ns
        self.s.tokens = <int *>malloc((n_prompt + max_tokens) * sizeof(int))
        self.s.text = <char *>malloc(<size_t>max_tokens * context.max_token_bytes + 1)
        self.s.text_end = <uint32_t *>calloc(max_tokens, sizeof(uint32_t))
        self.s.n_stops = len(self.stop_sequences)
        self.s.stop_sizes = <int *>malloc((self.s.n_stops + 1) * sizeof(int))
        self.s.stops = <char *>malloc(sum(len(x) for x in self.stop_sequences) + 1)
        if not (self.s.tokens and self.s.text and self.s.text_end and self.s.stop_sizes and self.s.stops):
            raise MemoryError()
        for i in range(n_prompt):
            token = prompt_tokens[i]
            if not 0 <= token < context.vocab_size:
                raise ValueError(f"prompt token {token} is outside the vocabulary")
            self.s.tokens[i] = token
        for i, seq in enumerate(self.stop_sequences):
            memcpy(self.s.stops + offset, <const char *>seq, len(seq))
            self.s.stop_sizes[i] = len(seq)
            offset += len(seq)
        self.s.wake_fd = sl_eventfd()
        if self.s.wake_fd < 0:
            raise OSError("eventfd failed")
        self.owns_wake_fd = True

    def __dealloc__(self):
        free(self.s.tokens)
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
        if self.state == 1:
            raise_engine_error(EngineError, "cannot close a running generation")
        if self.owns_wake_fd:
            os.close(self.s.wake_fd)
            self.owns_wake_fd = False
            # The number may be reused by another file from now on.
            self.s.wake_fd = -1

    @property
    def finished(self):
        return self.state == 2

    @property
    def prompt_tokens(self):
        return self.s.n_prompt

    @property
    def max_tokens(self):
        return self.s.max_tokens

    def cancel(self, reason="user_cancelled"):
        """Ask the loop to stop. Thread-safe and idempotent: only the first call counts,
        and a call after the loop ended changes nothing. Returns True if this call
        was the one that requested the stop of a running or not-yet-started loop."""
        if self.state == 2:
            return False
        if not sl_claim(&self.s.cancel_requested, 1):
            return False
        self.cancel_reason = reason
        self.s.published_at_cancel = sl_load_acquire(&self.s.published)
        sl_store_release(&self.s.cancel_flag, 1)
        return True

    def run(self):
        """Run the loop to its end and return the :class:`GenerationResult`."""
        cdef Context context = self.context
        if self.state != 0:
            raise_engine_error(EngineError, "a generation runs only once")
        if context.busy:
            raise_engine_error(EngineError, "another generation is running on this context")
        context._check_open()
        self.state = 1
        context.busy = 1
        with nogil:
            run_loop(&self.s, context.llm, &API)
            self.s.end_ns = sl_monotonic_ns()
        context.busy = 0
        self.state = 2
        sl_wake(self.s.wake_fd)
        outcome, reason = _EXIT_NAMES[self.s.exit]
        if self.s.exit == EXIT_CANCELLED:
            reason = self.cancel_reason
        kept = self.s.text_end[self.s.n_generated - 1] if self.s.n_generated else 0
        if self.s.exit == EXIT_STOP_SEQUENCE:
            kept = self.s.stop_at
        self._result = GenerationResult(
            outcome=outcome, reason=reason, prompt_tokens=self.s.n_prompt,
            prompt_tokens_evaluated=self.s.n_prompt_evaluated, tokens_generated=self.s.n_generated,
            tokens_after_cancel=self.s.tokens_after_cancel if self.s.exit == EXIT_CANCELLED else 0,
            start_ns=self.s.start_ns, first_token_ns=self.s.first_token_ns,
            cancel_observed_ns=self.s.cancel_observed_ns, end_ns=self.s.end_ns, text_kept_bytes=kept)
        return self._result

    @property
    def result(self):
        """The result once the loop has ended, else None."""
        return self._result

    def take(self):
        """Return the bytes of each token published since the last call, as a list,
        and let the loop run ahead again."""
        cdef int start = sl_load_acquire(&self.s.consumed)
        cdef int end = sl_load_acquire(&self.s.published)
        cdef int i
        cdef uint32_t begin
        cdef list pieces = []
        if self.owns_wake_fd:
            sl_drain(self.s.wake_fd)
        for i in range(start, end):
            begin = self.s.text_end[i - 1] if i else 0
            pieces.append(PyBytes_FromStringAndSize(self.s.text + begin, self.s.text_end[i] - begin))
        sl_store_release(&self.s.consumed, end)
        return pieces
