# Included by _core.pyx: how generations that run on one llama.cpp context share
# its steps. Each generation's loop posts its tokens (evaluate_in_step, the llama.cpp
# engine's evaluation) and waits; once every present generation has posted, the
# step is led: all their tokens are evaluated in one batch, and each is handed
# its result. A context of several sequences leads its steps on a thread of its
# own (run_context_steps), so that a generation stopped during a step leaves it
# at once, without waiting for the others' work; a context of one sequence is led
# by its generation's thread.


cdef struct Batcher:
    # The generations running on one llama.cpp context post their tokens and
    # wait; a step's leader evaluates the tokens of every present generation in
    # one batch. The lock guards present, the posts, leading and each member's
    # turn (LoopState's in_step, left_step, delivering); the context and
    # everything after leading belong to the thread that set leading.
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
    # Threads waiting in claim_context: no new step starts before they have had their turn,
    # so that a restore or a copy waits for the step under way at most, not for every next one.
    int claims_waiting
    # The context's steps are led by a thread of its own (see run_context_steps),
    # which ends once closing is set.
    bint own_thread
    bint closing
    sl.pthread_t thread
    # Per sequence, where its cache is to be cut (-1: nowhere): a cut asked for
    # while a thread uses the context waits for that thread to end its turn.
    int cut_from[ll.SLL_MAX_SEQUENCES]
    int applied_threads
    int max_tokens         # the most tokens one evaluation takes
    # A prompt's last chunk takes a step without the decode tokens, which wait for the
    # next one (see evaluate_together).
    bint prompts_first
    # Evaluations run, the generations they carried in all (their ratio is how
    # many generations a step shared on average), and the evaluations that were
    # stopped for one generation and run again for the others.
    int64_t steps
    int64_t step_members
    int64_t reruns
    # Evaluations interrupted for a generation that preempted one of their members (see
    # evaluate_in_step): their members evaluate again, with its tokens.
    int64_t interruptions
    # Prompt tokens of aborted steps kept in the cache (see keep_finished_pieces).
    int64_t kept_after_aborts
    # Decode tokens handed to a later step because the batch had no room for them:
    # none, since a chunk never takes the room they are owed (see evaluate_together).
    int64_t decode_tokens_deferred
    # The stop conditions of the step being evaluated (the abort callback's data).
    sl.sl_group_watch group
    # Per sequence, what its cache holds for another sequence to share (copy_live_prefix):
    # positions [0, record_n) hold record_tokens[0..record_n), evaluated in whole steps with
    # prefill chunks of record_chunk. The tokens are the running generation's, else the
    # slot's record. record_n grows as a step hands a result and drops as soon as a cut
    # below it is asked for, so it never counts the half of an aborted or unfinished step.
    const int *record_tokens[ll.SLL_MAX_SEQUENCES]
    int record_n[ll.SLL_MAX_SEQUENCES]
    int record_chunk[ll.SLL_MAX_SEQUENCES]
    # Whether the model lets one sequence share another's cells (see sll_api.copy_prefix).
    bint shares_cells


cdef void claim_context(Batcher *b) noexcept nogil:
    """Wait until no thread uses the context, and take it, with every cut asked for made."""
    sl.pthread_mutex_lock(&b.lock)
    b.claims_waiting += 1
    while b.leading:
        sl.pthread_cond_wait(&b.changed, &b.lock)
    b.claims_waiting -= 1
    b.leading = True
    # No step is under way: an interrupt asked for during an earlier one has nothing to end.
    sl.sl_store_release(&b.group.interrupt, 0)
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
    b.record_n[seq] = min(b.record_n[seq], max(p0, 0))
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
            b.record_n[seq] = min(b.record_n[seq], max(b.cut_from[seq], 0))
            b.cut_from[seq] = -1


cdef void set_record(Batcher *b, int seq, const int *tokens, int n, int chunk) noexcept nogil:
    """Say what ``seq``'s cache holds for copies (called with the lock held): ``tokens[0..n)``,
    which stay as they are while they are its record, evaluated with prefill chunks of ``chunk``."""
    b.record_tokens[seq] = tokens
    b.record_n[seq] = n
    b.record_chunk[seq] = chunk


cdef int longest_record(Batcher *b, int dst, const int *tokens, int n, int chunk, int *length) noexcept nogil:
    """The sequence other than ``dst`` whose record holds the longest prefix of ``tokens[0..n)``
    evaluated with prefill chunks of ``chunk``, longer than ``*length`` (then set to its length);
    -1 when none (called with the lock held)."""
    cdef int seq, i, limit, best = -1
    for seq in range(ll.SLL_MAX_SEQUENCES):
        if seq == dst or b.record_tokens[seq] is NULL or b.record_chunk[seq] != chunk:
            continue
        limit = min(b.record_n[seq], n)
        if limit <= length[0]:
            continue
        i = 0
        while i < limit and b.record_tokens[seq][i] == tokens[i]:
            i += 1
        if i > length[0]:
            length[0] = i
            best = seq
    return best


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


cdef bint evaluate_in_step(LoopState *s, int count) noexcept nogil:
    """The llama.cpp engine's evaluation: post the tokens for the context's next
    step and wait for it. On a context of one sequence, the generation leads its
    own steps; a context of several has a thread that leads them."""
    cdef Batcher *b = s.batcher
    sl.pthread_mutex_lock(&b.lock)
    stay_paused(b, s)
    s.post_count = count
    s.post_result = PostResult.POST_WAITING
    b.posted[b.n_posted] = s
    b.n_posted += 1
    if s.urgent:
        # It preempted a generation of a lower priority: rather than wait for the step under
        # way, which the others' tokens fill, it ends that step now, and its members take
        # the next one with its tokens. (Only its first evaluation: its prompt's first chunk.)
        s.urgent = False
        if b.leading and b.own_thread:
            sl.sl_store_release(&b.group.interrupt, 1)
    sl.pthread_cond_broadcast(&b.changed)
    while s.post_result == PostResult.POST_WAITING:
        if not b.own_thread and not b.leading and not b.claims_waiting and b.n_posted >= b.present:
            lead_step(b, s)
        elif sl.sl_check(&s.watch) != sl.SL_RUN and leave(b, s):
            pass
        elif sl.sl_load_acquire(&s.pause_requested) and withdraw(b, s):
            # Preempted before a step took its tokens: they wait with it.
            stay_paused(b, s)
            b.posted[b.n_posted] = s
            b.n_posted += 1
            sl.pthread_cond_broadcast(&b.changed)
        else:
            # Woken by every post, result and step's end, and by a cancel
            # (Generation.cancel); a deadline is a time to wake at.
            sl.sl_cond_wait_until(&b.changed, &b.lock, sl.sl_next_deadline(&s.watch))
    sl.pthread_mutex_unlock(&b.lock)
    return s.post_result == PostResult.POST_DONE


cdef void stay_paused(Batcher *b, LoopState *s) noexcept nogil:
    """While ``s`` is preempted (Generation.pause), wait out of the context's steps
    (called with the lock held, its tokens not posted). A stop ends the wait: the
    post that follows is then withdrawn at once (see leave)."""
    cdef int64_t start
    if not sl.sl_load_acquire(&s.pause_requested):
        return
    start = sl.sl_monotonic_ns()
    s.preemptions += 1
    if s.is_present:
        b.present -= 1
        sl.pthread_cond_broadcast(&b.changed)
    while sl.sl_load_acquire(&s.pause_requested) and sl.sl_check(&s.watch) == sl.SL_RUN:
        sl.sl_cond_wait_until(&b.changed, &b.lock, sl.sl_next_deadline(&s.watch))
    if s.is_present:
        b.present += 1
    s.preempted_ns += sl.sl_monotonic_ns() - start


cdef bint leave(Batcher *b, LoopState *s) noexcept nogil:
    """End ``s``'s wait for a step it must no longer take part in (called with
    the lock held): its tokens are taken back if no step has taken them yet
    (``withdrawn``), or, on a context with a thread of its own, left in the step
    under way, which drops them when it ends (``left_step``). Its loop ends at
    once either way. Not while the step is handing ``s`` its result."""
    if withdraw(b, s):
        s.withdrawn = True
    elif b.own_thread and s.in_step and not s.delivering:
        s.left_step = True
    else:
        return False
    should_stop(s)
    s.post_result = PostResult.POST_STOPPED
    return True


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


cdef void wait_out_step(LoopState *s) noexcept nogil:
    """Wait until the step ``s`` left (if any) has let go of it: until then the
    step may read its record, which must outlive it."""
    cdef Batcher *b = s.batcher
    sl.pthread_mutex_lock(&b.lock)
    while s.in_step:
        sl.pthread_cond_wait(&b.changed, &b.lock)
    sl.pthread_mutex_unlock(&b.lock)


cdef void *run_context_steps(void *arg) noexcept nogil:
    """The thread of a context of several sequences: it leads every step once
    each present generation has posted, until the context closes. A generation's
    own thread only posts and waits, so a stopped one is never inside a step's
    evaluation: it leaves the step at once (see leave)."""
    cdef Batcher *b = <Batcher *>arg
    sl.pthread_mutex_lock(&b.lock)
    while not b.closing:
        if not b.leading and not b.claims_waiting and b.n_posted > 0 and b.n_posted >= b.present:
            lead_step(b, NULL)
        else:
            sl.pthread_cond_wait(&b.changed, &b.lock)
    sl.pthread_mutex_unlock(&b.lock)
    return NULL


cdef int start_step_thread(Batcher *b) noexcept nogil:
    """Start the context's own thread; 0, or the errno that kept it from starting."""
    cdef int errnum = sl.sl_thread_start(&b.thread, run_context_steps, b)
    b.own_thread = errnum == 0
    return errnum


cdef void stop_step_thread(Batcher *b) noexcept nogil:
    if not b.own_thread:
        return
    sl.pthread_mutex_lock(&b.lock)
    b.closing = True
    sl.pthread_cond_broadcast(&b.changed)
    sl.pthread_mutex_unlock(&b.lock)
    sl.pthread_join(b.thread, NULL)
    b.own_thread = False


cdef void lead_step(Batcher *b, LoopState *leader) noexcept nogil:
    """Evaluate what is posted (called and returning with the lock held), on the
    thread of ``leader``, a generation whose tokens are posted, or on the
    context's own thread (``leader`` NULL)."""
    cdef LoopState *members[ll.SLL_MAX_SEQUENCES]
    cdef int i, n = 0
    # The leader first: its tokens always fit the batch.
    if leader is not NULL:
        members[0] = leader
        n = 1
    for i in range(b.n_posted):
        if b.posted[i] != leader:
            members[n] = b.posted[i]
            n += 1
    for i in range(n):
        members[i].in_step = True
    b.n_posted = 0
    b.leading = True
    # Every post so far is in this step: an interrupt asked for before it is answered.
    sl.sl_store_release(&b.group.interrupt, 0)
    make_cuts(b)
    sl.pthread_mutex_unlock(&b.lock)
    evaluate_together(b, members, n, leader is not NULL)
    sl.pthread_mutex_lock(&b.lock)
    for i in range(n):
        if members[i] is not NULL:
            post_again(b, members, i)
    make_cuts(b)
    b.leading = False
    sl.pthread_cond_broadcast(&b.changed)


cdef int post_again(Batcher *b, LoopState **members, int i) noexcept nogil:
    """Hand member ``i`` back to the posted tokens (called with the lock held): a
    later step takes it, and until then it can leave at once if it is stopped. A
    member that has left the step is only let go. Returns 1 (one member fewer
    waiting)."""
    cdef LoopState *s = members[i]
    members[i] = NULL
    s.in_step = False
    s.delivering = False
    if not s.left_step:
        b.posted[b.n_posted] = s
        b.n_posted += 1
    sl.pthread_cond_broadcast(&b.changed)
    return 1


cdef int let_go(Batcher *b, LoopState **members, int i) noexcept nogil:
    """Let go of member ``i``, which has left the step (called with the lock
    held): its positions the step evaluated are dropped, and its loop may return.
    Returns 1 (one member fewer waiting)."""
    cdef LoopState *s = members[i]
    members[i] = NULL
    LLAMA.truncate(b.ctx, s.seq, s.n_past)
    s.in_step = False
    sl.pthread_cond_broadcast(&b.changed)
    return 1


cdef void evaluate_together(Batcher *b, LoopState **members, int n, bint led_by_member) noexcept nogil:
    """Evaluate the ``n`` members' posted tokens in one batch, and again without
    a member whose stop aborted it. A member leaves ``members`` (set to NULL) as
    soon as it has its result: it may post again at once, for the next step. A
    member is handed back to the posted tokens (see post_again) when its tokens
    do not fit the batch. Led by a member (``members[0]``), every member still
    waiting once the leader has its result is handed back too, so that no
    generation waits for an evaluation it is not part of: a stopped one would
    wait for it to end, a whole step.

    Only a member whose tokens are most of the step's work can abort it: a
    prompt chunk beside decode tokens, or a lone member. Any other member that
    is stopped leaves the step under way (see leave), which goes on for the
    rest; its positions are dropped when the step ends."""
    cdef LoopState *s
    # The members in the batch being evaluated, and where each one's sampled token is in it (-1: none).
    cdef int included[ll.SLL_MAX_SEQUENCES]
    cdef int order[ll.SLL_MAX_SEQUENCES]
    cdef int32_t output[ll.SLL_MAX_SEQUENCES]
    cdef int i, j, k, room, owed, stopped, total, waiting = n, threads = 1
    cdef int32_t index, status
    cdef bint want_logits, prompts_only
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
        # Under the lock, a member can neither leave nor be stopped unseen while it joins the batch.
        sl.pthread_mutex_lock(&b.lock)
        prompts_only = b.prompts_first and ends_a_prompt(members, n)
        # Prompt chunks first: llama.cpp computes a batch in pieces taken in its order, so a
        # chunk is cut into the same pieces whatever decode tokens share its step. The room
        # that the decode tokens after them are owed is kept for them.
        owed = put_chunks_first(members, n, order)
        for j in range(n):
            i = order[j]
            s = members[i]
            if s is NULL:
                continue
            s.delivering = False
            if s.left_step:
                waiting -= let_go(b, members, i)
                continue
            if should_stop(s):
                waiting -= give_result_locked(b, members, i, PostResult.POST_STOPPED)
                continue
            if s.n_past == s.n_reused > 0 and not LLAMA.holds(b.ctx, s.seq, s.n_past):
                evaluate_from_start(b, s)
            # The batch holds one prompt chunk beside every other member's token
            # (see LlamaContext); a second chunk waits for the next step, even a short
            # one that would fit in the room of the decode tokens.
            if s.n_past >= s.n_prompt:
                owed -= 1
                if prompts_only:
                    waiting -= post_again(b, members, i)
                    continue
                if s.post_count > room:
                    b.decode_tokens_deferred += 1
                    waiting -= post_again(b, members, i)
                    continue
            elif s.post_count > room - owed:
                waiting -= post_again(b, members, i)
                continue
            # Logits only where a token will be sampled: after the prompt's last chunk, and in decode.
            want_logits = s.n_past + s.post_count >= s.n_prompt
            index = LLAMA.batch_add(b.ctx, s.seq, <const int32_t *>(s.tokens + s.n_past), s.post_count,
                                    s.n_past, want_logits)
            if index < 0:
                s.exit = ExitKind.EVAL_FAILED
                waiting -= give_result_locked(b, members, i, PostResult.POST_FAILED)
                continue
            room -= s.post_count
            output[k] = index if want_logits else -1
            included[k] = i
            k += 1
        sl.pthread_mutex_unlock(&b.lock)
        if led_by_member and members[0] is NULL:
            return
        if k == 0:
            if waiting:
                # Nothing left fits an empty batch (Generation bounds a chunk by it, so
                # this cannot happen): end those generations rather than leave them waiting.
                fail_the_rest(b, members, n)
            return
        total = b.max_tokens - room
        b.group.n = 0
        for j in range(k):
            s = members[included[j]]
            if s.step_abort and (k == 1 or 2 * s.post_count > total):
                b.group.members[b.group.n] = &s.watch
                b.group.n += 1
        status = decode_batch(b)
        b.steps += 1
        b.step_members += k
        # From here until its result, a member that has not left stays: see leave.
        sl.pthread_mutex_lock(&b.lock)
        for j in range(k):
            s = members[included[j]]
            if s.left_step:
                waiting -= let_go(b, members, included[j])
                included[j] = -1
            else:
                s.delivering = True
        sl.pthread_mutex_unlock(&b.lock)
        for j in range(k):
            if included[j] >= 0:
                record_longest_node(members[included[j]], b.group.longest_gap_ns)
        if status == ll.SLL_OK:
            for j in range(k):
                if included[j] < 0:
                    continue
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
        # An aborted or failed step leaves its finished pieces behind: drop them, so that
        # each sequence's cache holds exactly the tokens of its record, except those of a
        # prompt chunk cut short by a stop or an interrupt, which keeps them.
        # (A member that left is counted as stopped: it has been let go already.)
        stopped = 0
        for j in range(k):
            if included[j] < 0:
                stopped += 1
                continue
            s = members[included[j]]
            if b.group.aborted and posts_a_chunk(s):
                keep_finished_pieces(b, s)
            LLAMA.truncate(b.ctx, s.seq, s.n_past)
        # Stopped part-way: the stop condition that did it still holds (the
        # flag is sticky, deadlines only pass). Its generation leaves at once;
        # the others evaluate the step again without it.
        if b.group.aborted:
            for j in range(k):
                if included[j] >= 0 and should_stop(members[included[j]]):
                    waiting -= give_result(b, members, included[j], PostResult.POST_STOPPED)
                    stopped += 1
            if sl.sl_load_acquire(&b.group.interrupt):
                # Interrupted for a generation that preempted: the rest are handed back
                # (lead_step), to take the next step with its tokens.
                b.interruptions += 1
                return
        if stopped and waiting:
            b.reruns += 1
        if stopped == 0:
            # Failed, or aborted while no stop condition held: nothing to retry.
            fail_the_rest(b, members, n)
            return


cdef int put_chunks_first(LoopState **members, int n, int *order) noexcept nogil:
    """Fill ``order`` with the members' indices, those posting prompt chunks first.
    Returns how many members after them post a decode token."""
    cdef int i, k = 0, decoders = 0
    for i in range(n):
        if posts_a_chunk(members[i]):
            order[k] = i
            k += 1
    for i in range(n):
        if not posts_a_chunk(members[i]):
            order[k] = i
            k += 1
            decoders += members[i] is not NULL
    return decoders


cdef inline bint posts_a_chunk(LoopState *s) noexcept nogil:
    return s is not NULL and s.n_past < s.n_prompt


cdef void keep_finished_pieces(Batcher *b, LoopState *s) noexcept nogil:
    """Keep the pieces of ``s``'s prompt chunk that an aborted step finished: llama.cpp
    drops the positions of the piece under way only. They become evaluated tokens of its
    record, and what it posts shrinks to the rest of the chunk: a stopped generation's
    resend starts after them, and one whose step was interrupted evaluates only the rest.
    A whole chunk is kept only by a stopped generation: another needs the logits of its
    last token, which the abort lost."""
    cdef int end = LLAMA.pos_max(b.ctx, s.seq) + 1
    if end <= s.n_past or end > s.n_past + s.post_count:
        return
    if end == s.n_past + s.post_count and not should_stop(s):
        return
    sl.pthread_mutex_lock(&b.lock)
    # Only where the record reaches the chunk: no cut below it was asked for meanwhile.
    if b.record_n[s.seq] == s.n_past:
        b.record_n[s.seq] = end
        b.kept_after_aborts += end - s.n_past
        s.post_count -= end - s.n_past
        s.n_past = end
    sl.pthread_mutex_unlock(&b.lock)


cdef bint ends_a_prompt(LoopState **members, int n) noexcept nogil:
    """Whether a member posts its prompt's last chunk: with prompts_first, that step
    leaves the decode tokens out, so that the new generation's first token waits for
    no other generation's work. The others lose no token, only the time of one step's
    fixed costs: their tokens would have been evaluated beside the chunk otherwise."""
    cdef LoopState *s
    cdef int i
    for i in range(n):
        s = members[i]
        if s is not NULL and s.n_past < s.n_prompt <= s.n_past + s.post_count:
            return True
    return False


cdef void evaluate_from_start(Batcher *b, LoopState *s) noexcept nogil:
    """Make ``s``'s first evaluation its prompt's first chunk: the cache no longer
    holds the prefix its record does (another sequence took cells of it from a
    sliding-window layer; see sll_api.holds), so none of it is reused."""
    LLAMA.truncate(b.ctx, s.seq, 0)
    b.record_n[s.seq] = 0
    s.n_reused = 0
    s.n_past = 0
    s.post_count = min(s.prefill_chunk, s.n_prompt)


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
    sl.pthread_mutex_lock(&b.lock)
    give_result_locked(b, members, i, result)
    sl.pthread_mutex_unlock(&b.lock)
    return 1


cdef int give_result_locked(Batcher *b, LoopState **members, int i, PostResult result) noexcept nogil:
    """give_result, called with the lock held."""
    cdef LoopState *s = members[i]
    members[i] = NULL
    if result == PostResult.POST_DONE:
        # Its cache holds every token evaluated so far: another sequence may share them.
        b.record_n[s.seq] = s.n_past
    s.post_result = result
    s.in_step = False
    s.delivering = False
    sl.pthread_cond_broadcast(&b.changed)
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
