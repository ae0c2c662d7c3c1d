# The extension's own enums, visible from Python as IntEnum classes of
# stopline._core (and declared in stopline/_core.pyi).

cpdef enum GenerationState:
    # Published with release semantics, read with acquire (Generation.state).
    NEW = 0
    RUNNING
    FINISHED

cpdef enum ExitKind:
    # Why the token loop ended. Only C-level facts: a cancel's reason lives with
    # its request in stopline.protocol, which maps each kind to the vocabulary.
    NONE = 0                # the loop has not ended
    EOS
    MAX_TOKENS
    CONTEXT_FULL            # max_tokens was capped by the room left after the prompt
    STOP_SEQUENCE
    CANCELLED
    TOTAL_DEADLINE
    FIRST_TOKEN_DEADLINE
    EVAL_FAILED             # the library reported a failed evaluation
