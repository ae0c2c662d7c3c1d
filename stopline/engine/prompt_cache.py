"""A prompt cache across requests, in host memory: the KV states of sequences whose
contents were about to be lost, found again by token prefix.

A slot holds the prefix of its last generation only until another prompt takes it.
Before a prompt that does not continue what a llama.cpp sequence holds is evaluated
there, the sequence's state is copied out (``LlamaSequence.save_state``) and kept here
under its tokens; a prompt whose start one of these states holds, further than its
slot does, has that state loaded into its sequence (``restore_state``) and evaluates
only the rest. Both run on the generation's worker thread, before its loop starts,
never on the event loop's.

Entries are found through chained hashes of fixed-size token blocks (as vLLM does):
the hash of a block covers every block before it, and the first covers the model's
key, so one server's cache never hands a state to another model, template or context
shape. What a hash finds is checked token for token. The least recently used entries
go first once the states held pass the budget.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("stopline")

__all__ = ["BLOCK_TOKENS", "CacheStats", "PromptCache", "model_key"]

# Tokens per hashed block: the granularity at which prefixes are found, and the least a
# state must add over what a slot holds to be saved or restored.
BLOCK_TOKENS = 32


def model_key(model_path: Path, *parts: object) -> str:
    """What a saved state belongs to: the model file (its resolved path, size and
    modification time) and every other part given (the chat template, the context's
    shape, the prefill chunk); a state is only ever restored under the same key."""
    path = Path(model_path).resolve()
    stat = path.stat()
    h = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    for part in parts:
        h.update(b"\0" + repr(part).encode())
    return h.hexdigest()


def _block_hashes(key: str, tokens: Sequence[int], block: int) -> list[int]:
    """The chained hash of each whole block of ``tokens``."""
    hashes = []
    parent = hash(key)
    for start in range(0, len(tokens) - block + 1, block):
        parent = hash((parent, tuple(tokens[start : start + block])))
        hashes.append(parent)
    return hashes


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True, eq=False)
class _Entry:
    key: str
    tokens: tuple[int, ...]
    state: bytes
    hashes: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.state)


@dataclass(frozen=True)
class CacheStats:
    """Counts since the cache was made, and what it holds now."""

    hits: int
    misses: int
    tokens_restored: int
    saves: int
    evictions: int
    entries: int
    bytes_held: int
    budget_bytes: int


class PromptCache:
    """One server's saved KV states, within ``budget_bytes``. Thread-safe: each
    generation's worker thread consults it."""

    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS):
        if budget_bytes < 0 or block_tokens < 1:
            raise ValueError("the budget is at least 0 bytes and a block at least 1 token")
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self._lock = threading.Lock()
        # Least recently used first.
        self._entries: OrderedDict[_Entry, None] = OrderedDict()
        # Chained block hash -> the entries whose tokens start with those blocks.
        self._index: dict[int, dict[_Entry, None]] = {}
        self._bytes = 0
        self._hits = self._misses = self._tokens_restored = self._saves = self._evictions = 0

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                tokens_restored=self._tokens_restored,
                saves=self._saves,
                evictions=self._evictions,
                entries=len(self._entries),
                bytes_held=self._bytes,
                budget_bytes=self.budget_bytes,
            )

    def _longest(self, key: str, tokens: Sequence[int]) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with ``tokens``, and that length (called locked)."""
        best: _Entry | None = None
        for depth, h in reversed(list(enumerate(_block_hashes(key, tokens, self.block_tokens)))):
            candidates = self._index.get(h)
            if not candidates:
                continue
            aligned = (depth + 1) * self.block_tokens
            best_n = 0
            for entry in candidates:
                # A hash is a claim, checked token for token.
                if entry.key != key or _common_prefix(entry.tokens, tokens) < aligned:
                    continue
                n = _common_prefix(entry.tokens, tokens, aligned)
                if n > best_n:
                    best, best_n = entry, n
            if best is not None:
                return best, best_n
        return None, 0

    def covered(self, key: str, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` some entry already holds."""
        with self._lock:
            return self._longest(key, tokens)[1]

    def lookup(self, key: str, tokens: Sequence[int], held: int) -> tuple[bytes, int] | None:
        """The state of the entry holding the longest prefix of ``tokens``, and that
        prefix's length, if it is at least a block longer than the ``held`` tokens the
        slot already has; None otherwise. Counted as a hit or a miss."""
        with self._lock:
            entry, n = self._longest(key, tokens)
            if entry is None or n < held + self.block_tokens:
                self._misses += 1
                return None
            self._entries.move_to_end(entry)
            return entry.state, n

    def restored(self, tokens: int) -> None:
        """Count a hit: ``tokens`` prompt tokens were restored from a state found by :meth:`lookup`."""
        with self._lock:
            self._hits += 1
            self._tokens_restored += tokens

    def failed(self) -> None:
        """Count a state found by :meth:`lookup` that its sequence could not load, as a miss."""
        with self._lock:
            self._misses += 1

    def store(self, key: str, tokens: Sequence[int], state: bytes) -> bool:
        """Keep ``state``, which holds ``tokens``, evicting the least recently used
        entries as the budget needs. False when it alone exceeds the budget."""
        if len(state) > self.budget_bytes or len(tokens) < self.block_tokens:
            return False
        entry = _Entry(key, tuple(tokens), state, tuple(_block_hashes(key, tokens, self.block_tokens)))
        with self._lock:
            # An entry whose tokens this one's start with holds nothing more.
            shorter = {other for h in entry.hashes for other in self._index.get(h, ())}
            for other in shorter:
                if (
                    other.key == key
                    and len(other.tokens) <= len(tokens)
                    and entry.tokens[: len(other.tokens)] == other.tokens
                ):
                    self._remove(other)
            while self._entries and self._bytes + entry.size > self.budget_bytes:
                self._remove(next(iter(self._entries)))
                self._evictions += 1
            self._entries[entry] = None
            self._bytes += entry.size
            for h in entry.hashes:
                self._index.setdefault(h, {})[entry] = None
            self._saves += 1
        return True

    def _remove(self, entry: _Entry) -> None:
        del self._entries[entry]
        self._bytes -= entry.size
        for h in entry.hashes:
            holders = self._index.get(h)
            if holders is not None:
                holders.pop(entry, None)
                if not holders:
                    del self._index[h]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._index.clear()
            self._bytes = 0

    def prepare(self, key: str, slot, prompt_tokens: Sequence[int], chunk: int) -> int:
        """Ready ``slot`` (a ``LlamaSequence``, idle) for a generation of ``prompt_tokens``
        with prefill chunks of ``chunk``: save what it holds if the prompt would lose at
        least a block of it that no entry holds, then load the state holding the longest
        prefix of the prompt, if that is at least a block more than the slot keeps. Returns
        how many prompt tokens were restored (0: none)."""
        held, held_chunk = slot.held_record()
        reuse = slot.reusable_prefix(prompt_tokens, chunk)
        if (
            held_chunk == chunk
            and len(held) - reuse >= self.block_tokens
            and self.covered(key, held) + self.block_tokens <= len(held)
        ):
            state = slot.save_state()
            if state is not None:
                self.store(key, held, state)
        # Short of the last prompt token, whose logits are needed.
        wanted = list(prompt_tokens[: len(prompt_tokens) - 1])
        if len(wanted) < reuse + self.block_tokens:
            return 0
        found = self.lookup(key, wanted, reuse)
        if found is None:
            return 0
        state, n = found
        if not slot.restore_state(state, wanted[:n], chunk):
            self.failed()
            log.warning("prompt_cache_restore_failed", tokens=n)
            return 0
        self.restored(n)
        return n
