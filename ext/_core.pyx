# cython: language_level=3, boundscheck=False, wraparound=False
"""Stopline's native token loop over ctransformers.

A :class:`Context` is one ctransformers model instance: its own KV cache and
scratch buffers, with the weights memory-mapped and so shared between contexts
of the same file. A context remembers which tokens its KV cache holds, so a
generation whose prompt starts with them evaluates only the rest.

A :class:`Generation` runs once on a context. Its loop runs with the GIL
released and checks the stop conditions (the cancel flag, an atomic acquire
load, and two deadlines against the monotonic clock) before every prompt chunk
and every token; with the step hook installed (step_abort.h), ggml checks the
same conditions between the graph nodes of every evaluation as well.

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

from ctransformers_abi cimport CT_MAX_BATCH, ct_api, ct_api_open, ct_config, ct_llm
from loop_support cimport (
    SL_RUN, SL_STOP_CANCELLED, SL_STOP_TOTAL_TIMEOUT, sl_check, sl_claim, sl_drain, sl_eventfd,
    sl_load_acquire, sl_monotonic_ns, sl_sleep_ns, sl_step_abort_install, sl_stop, sl_store_release,
    sl_wake, sl_watch, sl_watch_enter, sl_watch_leave,
)

import os

# Outcome and reason names; they match stopline/vocabulary.py.
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

cdef enum GenerationState:
    GENERATION_NEW
    GENERATION_RUNNING
    GENERATION_FINISHED

cdef ct_api API
cdef bint API_READY = False
# Whether ggml's evaluations can be stopped between graph nodes (step_abort.h).
cdef bint STEP_ABORT = False


# The largest prefill chunk the library can evaluate at once.
MAX_PREFILL_CHUNK = CT_MAX_BATCH


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
    """Resolve the ctransformers C API from ``path`` and install the step hook (once per process)."""
    global API_READY, STEP_ABORT
    cdef char err[512]
    if API_READY:
        return
    if ct_api_open(&API, os.fsencode(path), err, sizeof(err)) != 0:
        raise_engine_error(EngineError, err.decode("utf-8", "replace"))
    API_READY = True
    STEP_ABORT = sl_step_abort_install(API.handle) == 1


def step_abort_installed():
    """Whether the hook that stops an evaluation between graph nodes is in place.
    :meth:`Context.probe_step_abort` proves that it works."""
    return STEP_ABORT


cdef class Context:
    cdef ct_llm *llm
    cdef readonly int context_length
    cdef readonly int vocab_size
    cdef readonly int max_token_bytes
    cdef readonly str architecture
    cdef int busy
    # The tokens whose keys and values the KV cache holds, from position 0,
    # and the prefill chunk they were evaluated with.
    cdef int *held
    cdef readonly int n_held
    cdef int held_chunk

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
        self.held = <int *>malloc(self.context_length * sizeof(int))
        if self.held is NULL:
            raise MemoryError()

    def reusable_prefix(self, tokens, int chunk):
        """How many leading ``tokens`` a generation with prefill chunks of
        ``chunk`` would take from this context's KV cache instead of evaluating them."""
        cdef int i, n = len(tokens)
        cdef int *ids = <int *>malloc((n + 1) * sizeof(int))
        if ids is NULL:
            raise MemoryError()
        try:
            for i in range(n):
                ids[i] = tokens[i]
            return self.usable_prefix(ids, n, chunk)
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

    def probe_step_abort(self, tokens):
        """Prove the step hook on a real evaluation of ``tokens`` (two or more).

        Returns ``(aborts, trim_exact)``: whether an evaluation with the stop
        flag set returned part-way, and whether the last token's logits
        computed alone are bit-identical to those of a full evaluation."""
        cdef sl_watch watch
        cdef int n = len(tokens), i, size
        cdef bint ok, aborts
        cdef int *ids
        self._check_open()
        if self.busy:
            raise_engine_error(EngineError, "the context is busy")
        if not 2 <= n <= CT_MAX_BATCH:
            raise ValueError(f"the probe evaluates 2 to {CT_MAX_BATCH} tokens at once")
        if not STEP_ABORT:
            return False, False
        ids = <int *>malloc(n * sizeof(int))
        if ids is NULL:
            raise MemoryError()
        for i in range(n):
            ids[i] = tokens[i]
        self.n_held = 0
        memset(&watch, 0, sizeof(watch))
        try:
            with nogil:
                sl_watch_enter(&watch)
                watch.cancel_flag = 1
                API.llm_batch_eval(self.llm, ids, n, 0, n, 1)
                aborts = watch.aborted == 1
                watch.cancel_flag = 0
                ok = API.llm_batch_eval(self.llm, ids, n, 0, n, 1)
                sl_watch_leave()
            if not ok or watch.aborted:
                return aborts, False
            size = API.llm_logits_size(self.llm)
            full = PyBytes_FromStringAndSize(<char *>API.llm_logits_data(self.llm), size * sizeof(float))
            with nogil:
                sl_watch_enter(&watch)
                watch.trim_output = 1
                ok = API.llm_batch_eval(self.llm, ids, n, 0, n, 1)
                sl_watch_leave()
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
        self.n_held = 0

    def __dealloc__(self):
        if self.llm is not NULL:
            API.llm_delete(self.llm)
            self.llm = NULL
        free(self.held)

    cdef _check_open(self):
        if self.llm is NULL:
            raise_engine_error(EngineError, "context is closed")


cdef struct LoopState:
    # Written by Python before the loop starts, read-only inside it.
    int *tokens            # prompt, then generated tokens
    int n_prompt
    int n_reused           # leading prompt tokens the KV cache already holds
    int max_tokens
    int top_k
    float top_p
    float temperature
    float repetition_penalty
    int seed
    int prefill_chunk
    int threads
    int window
    bint step_abort        # let the hook stop evaluations between graph nodes
    bint trim_output       # compute only the last token's logits of a chunk
    char *stops                    # stop sequences, back to back
    int *stop_sizes
    int n_stops
    int wake_fd
    # The stop conditions: the cancel flag and the deadlines.
    sl_watch watch
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
    LoopExit exit
    int tokens_after_cancel
    int64_t start_ns
    int64_t first_token_ns
    int64_t cancel_observed_ns
    int64_t end_ns
    int64_t longest_prefill_node_ns
    int64_t longest_decode_node_ns


cdef inline bint should_stop(LoopState *s) noexcept nogil:
    """The poll done before every chunk and token; records why the loop ends."""
    cdef sl_stop why = sl_check(&s.watch)
    if why == SL_RUN:
        return False
    if why == SL_STOP_CANCELLED:
        s.cancel_observed_ns = sl_monotonic_ns()
        s.exit = EXIT_CANCELLED
        s.tokens_after_cancel = s.n_generated - s.published_at_cancel
    elif why == SL_STOP_TOTAL_TIMEOUT:
        s.exit = EXIT_TOTAL_TIMEOUT
    else:
        s.exit = EXIT_FIRST_TOKEN_TIMEOUT
    return True


cdef bint evaluate(LoopState *s, ct_llm *llm, ct_api *api, int count) noexcept nogil:
    """Evaluate the next ``count`` tokens into the KV cache. False when the loop
    must end instead (s.exit says why)."""
    cdef bint ok
    s.watch.aborted = 0
    s.watch.longest_gap_ns = 0
    s.watch.trim_output = s.trim_output
    ok = api.llm_batch_eval(llm, s.tokens + s.n_past, count, s.n_past, count, s.threads)
    if s.n_generated == 0 and s.watch.longest_gap_ns > s.longest_prefill_node_ns:
        s.longest_prefill_node_ns = s.watch.longest_gap_ns
    elif s.n_generated and s.watch.longest_gap_ns > s.longest_decode_node_ns:
        s.longest_decode_node_ns = s.watch.longest_gap_ns
    if s.watch.aborted:
        # Stopped between graph nodes: the stop condition that did it still
        # holds (the flag is sticky, deadlines only pass), and these positions
        # of the KV cache hold nothing usable.
        if not should_stop(s):
            s.exit = EXIT_EVAL_FAILED
        return False
    if not ok:
        s.exit = EXIT_EVAL_FAILED
        return False
    s.n_past += count
    return True


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
    s.start_ns = sl_monotonic_ns()
    s.n_past = s.n_reused
    if s.step_abort:
        sl_watch_enter(&s.watch)
    run_steps(s, llm, api)
    sl_watch_leave()


cdef void run_steps(LoopState *s, ct_llm *llm, ct_api *api) noexcept nogil:
    cdef int chunk, token, first_last, step, size, old_size
    cdef int top_k = s.top_k
    cdef float temperature = s.temperature
    cdef const char *piece
    if temperature <= 0:
        # Greedy: keep only the best candidate (the library divides by temperature).
        top_k = 1
        temperature = 1.0

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
        if not evaluate(s, llm, api, chunk):
            return
        s.n_prompt_evaluated = s.n_past - s.n_reused

    for step in range(s.max_tokens):
        if should_stop(s):
            return
        # Pause while the reader is a full window behind.
        while s.n_generated - sl_load_acquire(&s.consumed) >= s.window:
            sl_sleep_ns(PAUSE_POLL_NS)
            if should_stop(s):
                return

        first_last = s.n_past - LAST_N_TOKENS
        if first_last < 0:
            first_last = 0
        token = api.llm_sample(llm, s.tokens + first_last, s.n_past - first_last, top_k, s.top_p,
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
        s.tokens[s.n_past] = token
        s.n_generated += 1
        if s.n_generated == 1:
            s.first_token_ns = sl_monotonic_ns()
            # The first-token deadline has been met.
            s.watch.first_token_deadline_ns = 0
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
        if not evaluate(s, llm, api, 1):
            return
    s.exit = EXIT_MAX_TOKENS


def measure_flag_poll(int iterations=1000000):
    """Mean cost in ns of one poll of the cancel flag and both deadlines, as the loop does it."""
    cdef LoopState s
    # hits keeps the compiler from optimising the polls away.
    cdef int i, hits = 0
    cdef int64_t start, elapsed
    memset(&s, 0, sizeof(s))
    s.watch.deadline_ns = sl_monotonic_ns() + 3600 * 1000000000
    s.watch.first_token_deadline_ns = s.watch.deadline_ns
    with nogil:
        start = sl_monotonic_ns()
        for i in range(iterations):
            hits += should_stop(&s)
        elapsed = sl_monotonic_ns() - start
    return elapsed / iterations


class GenerationResult:
    """What a finished generation reports. Timestamps are CLOCK_MONOTONIC ns (0: never)."""

    __slots__ = ("outcome", "reason", "prompt_tokens", "prompt_tokens_reused", "prompt_tokens_evaluated",
                 "tokens_generated", "tokens_after_cancel", "start_ns", "first_token_ns", "cancel_observed_ns",
                 "end_ns", "text_kept_bytes", "longest_prefill_node_ns", "longest_decode_node_ns")

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
    cdef GenerationState state
    # Set only once eventfd() succeeded: __dealloc__ runs even when __cinit__ fails.
    cdef bint owns_wake_fd
    cdef object cancel_reason
    cdef object _result
    cdef readonly object stop_sequences

    def __cinit__(self, Context context, prompt_tokens, *, int max_tokens=256, double temperature=0.7,
                  int top_k=40, double top_p=0.95, double repetition_penalty=1.1, int seed=0,
                  stop=(), int prefill_chunk=1, int threads=1, int window=64,
                  int64_t deadline_ns=0, int64_t first_token_deadline_ns=0,
                  bint step_abort=True, bint trim_output=True):
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
        if prefill_chunk > CT_MAX_BATCH:
            raise ValueError(f"prefill_chunk is at most {CT_MAX_BATCH}, the library's batch limit")
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
        self.s.watch.deadline_ns = deadline_ns
        self.s.watch.first_token_deadline_ns = first_token_deadline_ns
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
        if self.state == GENERATION_RUNNING:
            raise_engine_error(EngineError, "cannot close a running generation")
        if self.owns_wake_fd:
            os.close(self.s.wake_fd)
            self.owns_wake_fd = False
            # The number may be reused by another file from now on.
            self.s.wake_fd = -1

    @property
    def finished(self):
        return self.state == GENERATION_FINISHED

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
        if self.state == GENERATION_FINISHED:
            return False
        if not sl_claim(&self.s.cancel_requested, 1):
            return False
        self.cancel_reason = reason
        self.s.published_at_cancel = sl_load_acquire(&self.s.published)
        sl_store_release(&self.s.watch.cancel_flag, 1)
        return True

    def run(self):
        """Run the loop to its end and return the :class:`GenerationResult`."""
        cdef Context context = self.context
        cdef int i
        if self.state != GENERATION_NEW:
            raise_engine_error(EngineError, "a generation runs only once")
        if context.busy:
            raise_engine_error(EngineError, "another generation is running on this context")
        context._check_open()
        self.s.n_reused = context.usable_prefix(self.s.tokens, self.s.n_prompt, self.s.prefill_chunk)
        self.state = GENERATION_RUNNING
        context.busy = 1
        # Positions from n_reused on are about to be overwritten.
        context.n_held = self.s.n_reused
        with nogil:
            run_loop(&self.s, context.llm, &API)
            self.s.end_ns = sl_monotonic_ns()
            memcpy(context.held, self.s.tokens, self.s.n_past * sizeof(int))
        context.n_held = self.s.n_past
        context.held_chunk = self.s.prefill_chunk
        context.busy = 0
        outcome, reason = _EXIT_NAMES[self.s.exit]
        if self.s.exit == EXIT_CANCELLED:
            reason = self.cancel_reason
        kept = self.s.text_end[self.s.n_generated - 1] if self.s.n_generated else 0
        if self.s.exit == EXIT_STOP_SEQUENCE:
            kept = self.s.stop_at
        self._result = GenerationResult(
            outcome=outcome, reason=reason, prompt_tokens=self.s.n_prompt, prompt_tokens_reused=self.s.n_reused,
            prompt_tokens_evaluated=self.s.n_prompt_evaluated, tokens_generated=self.s.n_generated,
            tokens_after_cancel=self.s.tokens_after_cancel if self.s.exit == EXIT_CANCELLED else 0,
            start_ns=self.s.start_ns, first_token_ns=self.s.first_token_ns,
            cancel_observed_ns=self.s.cancel_observed_ns, end_ns=self.s.end_ns, text_kept_bytes=kept,
            longest_prefill_node_ns=self.s.longest_prefill_node_ns,
            longest_decode_node_ns=self.s.longest_decode_node_ns)
        # The result is in place before anyone can see the generation finished.
        self.state = GENERATION_FINISHED
        sl_wake(self.s.wake_fd)
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
