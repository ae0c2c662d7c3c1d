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

A second tier on disk (:class:`DiskTier`) keeps what memory lets go: an entry evicted
from memory, and every entry when the server stops, is handed to a writer thread
through a bounded queue, so no write runs inside a step or on the event loop. A prompt
whose longest cached prefix is only on disk has it read back on its worker thread
(memory is preferred at equal length). Each file is a small header (a magic, the
format's version, the model's key, the prefill chunk, the token ids, the state's length
and the sha256 of the tokens and the state) and then the state; it is written to a
temporary name and renamed, so a crash mid-write leaves no half file. At startup the
directory is indexed from the headers alone, so the next turn of a conversation after a
restart is served from disk. A file that is corrupt, truncated or not what its name
says is skipped with one ``prompt_cache_file_skipped`` line and removed. The least
recently used files go first once the disk's budget is passed.

A live tier comes before both: in a context of several sequences (shared steps), where
another sequence, running or idle, holds a longer prefix of a prompt than its slot keeps
and than a restore would give, evaluated with the same prefill chunk, the slot drops its
cells and shares that sequence's cells of the prefix (``copy_live_prefix``,
llama_memory_seq_cp in the unified KV cache): nothing is evaluated, read or copied. Only
what that sequence's finished steps evaluated is shared, and a later cut or stop of it
leaves the copy as it is. Models with sliding-window layers share nothing.
"""

from __future__ import annotations

import hashlib
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from ..protocol.errors import StoplineError

log = structlog.get_logger("stopline")

__all__ = ["BLOCK_TOKENS", "CacheStats", "DiskTier", "PromptCache", "model_key"]

# Tokens per hashed block: the granularity at which prefixes are found, and the least a
# state must add over what a slot holds to be saved or restored.
BLOCK_TOKENS = 32


def model_key(model_path: Path, *parts: object) -> str:
    """What a saved state belongs to: the model file (its resolved path, size and
    modification time) and every other part given (the chat template, the context's
    shape, the prefill chunk and its pieces); a state is only ever restored under the same key."""
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


def _longest(index: dict, block: int, key: str, tokens: Sequence[int]) -> tuple:
    """In ``index`` (chained block hash -> entries), the entry sharing the longest prefix
    with ``tokens``, and that length; (None, 0) when none shares a block."""
    for depth, h in reversed(list(enumerate(_block_hashes(key, tokens, block)))):
        candidates = index.get(h)
        if not candidates:
            continue
        aligned = (depth + 1) * block
        best, best_n = None, 0
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


def _index_add(index: dict, entry) -> None:
    for h in entry.hashes:
        index.setdefault(h, {})[entry] = None


def _index_remove(index: dict, entry) -> None:
    for h in entry.hashes:
        holders = index.get(h)
        if holders is not None:
            holders.pop(entry, None)
            if not holders:
                del index[h]


@dataclass(frozen=True, eq=False)
class _Entry:
    key: str
    tokens: tuple[int, ...]
    state: bytes
    hashes: tuple[int, ...]
    chunk: int = 0

    @property
    def size(self) -> int:
        return len(self.state)


@dataclass(frozen=True)
class CacheStats:
    """Counts since the cache was made, and what it holds now (the disk's fields: 0 without a disk tier)."""

    hits: int
    misses: int
    tokens_restored: int
    saves: int
    evictions: int
    entries: int
    bytes_held: int
    budget_bytes: int
    disk_hits: int = 0
    disk_writes: int = 0
    disk_skipped: int = 0
    disk_evictions: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_budget_bytes: int = 0
    # The live tier: prompts that shared another running or idle sequence's cells of their
    # prefix (part of hits), and the tokens they took that way (part of tokens_restored).
    live_hits: int = 0
    live_tokens: int = 0


# The disk tier ----------------------------------------------------------------

_MAGIC = b"STOPLKV\0"
# Raised whenever the layout below changes: a file of another version is skipped.
FORMAT_VERSION = 1
# magic, version, model key (64 hex digits), prefill chunk, token count, state length, sha256.
_HEADER = struct.Struct("<8sI64sIIQ32s")
_SUFFIX = ".kv"
# Entries waiting for the writer; beyond it an evicted entry is dropped, never waited for.
WRITE_QUEUE = 64
# The most a server's stop waits for the writer to put the memory tier on disk.
SHUTDOWN_WRITE_S = 10.0


class _Skipped(StoplineError):
    """A file that is not a usable state: its reason is the log line's (it never reaches a client)."""


@dataclass(frozen=True, eq=False)
class _DiskEntry:
    key: str
    tokens: tuple[int, ...]
    hashes: tuple[int, ...]
    chunk: int
    path: Path
    size: int


def _file_name(key: str, tokens: Sequence[int]) -> str:
    digest = hashlib.sha256(key.encode() + struct.pack(f"<{len(tokens)}I", *tokens)).hexdigest()
    return f"{key[:16]}-{digest[:32]}{_SUFFIX}"


def _read_header(path: Path, handle) -> tuple[str, tuple[int, ...], int, int, bytes, int]:
    """The key, tokens, chunk, state length, digest and payload offset of an open state file."""
    raw = handle.read(_HEADER.size)
    if len(raw) < _HEADER.size:
        raise _Skipped("truncated")
    magic, version, key_raw, chunk, count, state_len, digest = _HEADER.unpack(raw)
    if magic != _MAGIC:
        raise _Skipped("corrupt")
    if version != FORMAT_VERSION:
        raise _Skipped("version")
    raw_tokens = handle.read(4 * count)
    if len(raw_tokens) < 4 * count:
        raise _Skipped("truncated")
    try:
        key = key_raw.decode("ascii")
    except UnicodeDecodeError:
        raise _Skipped("corrupt") from None
    tokens = struct.unpack(f"<{count}I", raw_tokens)
    offset = _HEADER.size + 4 * count
    size = os.fstat(handle.fileno()).st_size
    if size < offset + state_len:
        raise _Skipped("truncated")
    if size > offset + state_len:
        raise _Skipped("corrupt")
    # A file names the key and tokens it holds: one renamed or copied over another is not used.
    if path.name != _file_name(key, tokens):
        raise _Skipped("model_key" if not path.name.startswith(key[:16]) else "corrupt")
    return key, tokens, chunk, state_len, digest, offset


class DiskTier:
    """Saved KV states in ``directory``, within ``budget_bytes``, written by one
    background thread. Thread-safe. Made by a :class:`PromptCache` that is given one."""

    def __init__(self, directory: Path, budget_bytes: int, block_tokens: int = BLOCK_TOKENS):
        if budget_bytes < 0:
            raise ValueError("the disk's budget is at least 0 bytes")
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self._lock = threading.Lock()
        # Least recently used first.
        self._entries: OrderedDict[_DiskEntry, None] = OrderedDict()
        self._by_name: dict[str, _DiskEntry] = {}
        self._index: dict[int, dict[_DiskEntry, None]] = {}
        self._bytes = 0
        self.hits = self.writes = self.skipped = self.evictions = 0
        self._queue: queue.Queue[_Entry | None] = queue.Queue(WRITE_QUEUE)
        # Past it, the writer drops what is left (set by close()).
        self._deadline: float | None = None
        self.directory.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="stopline-prompt-cache-writer", daemon=True)
        self._writer.start()

    # What is on disk ----------------------------------------------------------

    def _scan(self) -> None:
        """Index the directory from the files' headers, oldest first (by modification time)."""
        found = []
        for path in self.directory.iterdir():
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                # A write that a crash cut short.
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(_SUFFIX):
                continue
            try:
                with path.open("rb") as handle:
                    key, tokens, chunk, state_len, _, offset = _read_header(path, handle)
                found.append((path.stat().st_mtime_ns, _DiskEntry(key, tokens, (), chunk, path, offset + state_len)))
            except _Skipped as exc:
                self._skip(path, str(exc))
            except OSError as exc:
                self._skip(path, "unreadable", error=str(exc))
        for _, entry in sorted(found, key=lambda item: item[0]):
            entry = _DiskEntry(
                entry.key,
                entry.tokens,
                tuple(_block_hashes(entry.key, entry.tokens, self.block_tokens)),
                entry.chunk,
                entry.path,
                entry.size,
            )
            self._add(entry)
        with self._lock:
            self._evict()
        log.info(
            "prompt_cache_disk_indexed",
            directory=str(self.directory),
            entries=len(self._entries),
            bytes=self._bytes,
            budget_bytes=self.budget_bytes,
        )

    def _skip(self, path: Path, reason: str, **fields) -> None:
        log.warning("prompt_cache_file_skipped", file=path.name, reason=reason, **fields)
        with self._lock:
            self.skipped += 1
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("prompt_cache_file_not_removed", file=path.name, error=str(exc))

    def _add(self, entry: _DiskEntry) -> None:
        with self._lock:
            old = self._by_name.pop(entry.path.name, None)
            if old is not None:
                self._drop(old)
            self._entries[entry] = None
            self._by_name[entry.path.name] = entry
            _index_add(self._index, entry)
            self._bytes += entry.size

    def _drop(self, entry: _DiskEntry) -> None:
        """Forget ``entry`` (called locked); its file is the caller's to remove."""
        if entry in self._entries:
            del self._entries[entry]
            self._bytes -= entry.size
            _index_remove(self._index, entry)
            if self._by_name.get(entry.path.name) is entry:
                del self._by_name[entry.path.name]

    def _evict(self, incoming: int = 0) -> None:
        """Remove the least recently used files until the rest, and ``incoming`` bytes about to
        be written, fit the budget (called locked)."""
        while self._entries and self._bytes + incoming > self.budget_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.evictions += 1
            oldest.path.unlink(missing_ok=True)

    @property
    def entries(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return self._bytes

    def longest(self, key: str, tokens: Sequence[int], chunk: int) -> tuple[_DiskEntry | None, int]:
        """The file holding the longest prefix of ``tokens`` for ``key`` and ``chunk``, and that length."""
        with self._lock:
            entry, n = _longest(self._index, self.block_tokens, key, tokens)
            if entry is None or entry.chunk != chunk:
                return None, 0
            return entry, n

    def holds(self, key: str, tokens: Sequence[int]) -> bool:
        with self._lock:
            return _file_name(key, tokens) in self._by_name

    def load(self, entry: _DiskEntry) -> bytes | None:
        """The state ``entry``'s file holds, checked against its header's digest; None
        (the file skipped and removed) when it is not there, or not what it says."""
        try:
            with entry.path.open("rb") as handle:
                key, tokens, chunk, state_len, digest, _ = _read_header(entry.path, handle)
                if (key, tokens, chunk) != (entry.key, entry.tokens, entry.chunk):
                    raise _Skipped("corrupt")
                state = handle.read(state_len)
            if len(state) < state_len:
                raise _Skipped("truncated")
            check = hashlib.sha256(struct.pack(f"<{len(tokens)}I", *tokens))
            check.update(state)
            if check.digest() != digest:
                raise _Skipped("corrupt")
        except FileNotFoundError:
            # Removed for room since it was found: nothing is wrong with it.
            with self._lock:
                self._drop(entry)
            return None
        except (_Skipped, OSError) as exc:
            with self._lock:
                self._drop(entry)
            self._skip(entry.path, str(exc) if isinstance(exc, _Skipped) else "unreadable")
            return None
        with self._lock:
            if entry in self._entries:
                self._entries.move_to_end(entry)
        # The order of use outlives a restart through the files' modification times.
        try:
            os.utime(entry.path)
        except OSError:
            pass
        return state

    # Writing --------------------------------------------------------------------

    def put(self, entry: _Entry) -> bool:
        """Hand ``entry`` to the writer; False (it is dropped) when the queue is full."""
        try:
            self._queue.put_nowait(entry)
            return True
        except queue.Full:
            log.debug("prompt_cache_write_dropped", tokens=len(entry.tokens))
            return False

    def _write_loop(self) -> None:
        while True:
            entry = self._queue.get()
            try:
                if entry is None:
                    return
                if self._deadline is None or time.monotonic() < self._deadline:
                    self._write(entry)
            except OSError as exc:
                log.warning("prompt_cache_write_failed", error=str(exc))
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every entry handed to the writer so far is written (or dropped)."""
        self._queue.join()

    def _write(self, entry: _Entry) -> None:
        raw_tokens = struct.pack(f"<{len(entry.tokens)}I", *entry.tokens)
        size = _HEADER.size + len(raw_tokens) + len(entry.state)
        if size > self.budget_bytes or self.holds(entry.key, entry.tokens):
            return
        digest = hashlib.sha256(raw_tokens)
        digest.update(entry.state)
        header = _HEADER.pack(
            _MAGIC,
            FORMAT_VERSION,
            entry.key.encode("ascii"),
            entry.chunk,
            len(entry.tokens),
            len(entry.state),
            digest.digest(),
        )
        name = _file_name(entry.key, entry.tokens)
        path = self.directory / name
        temporary = self.directory / f".{name}.{threading.get_ident()}.tmp"
        # Room first: the folder never holds more than its budget, the file being written included.
        with self._lock:
            self._evict(size)
        try:
            with temporary.open("wb") as handle:
                handle.write(header)
                handle.write(raw_tokens)
                handle.write(entry.state)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        written = _DiskEntry(entry.key, entry.tokens, entry.hashes, entry.chunk, path, size)
        self._add(written)
        log.debug("prompt_cache_written", file=name, tokens=len(entry.tokens), bytes=written.size)
        with self._lock:
            self.writes += 1
            # A file whose tokens this one's start with holds nothing more.
            shorter = {other for h in entry.hashes for other in self._index.get(h, ())}
            for other in shorter:
                if (
                    other is not written
                    and other.key == entry.key
                    and len(other.tokens) <= len(entry.tokens)
                    and entry.tokens[: len(other.tokens)] == other.tokens
                ):
                    self._drop(other)
                    other.path.unlink(missing_ok=True)
            self._evict()

    def close(self, pending: Sequence[_Entry] = (), timeout_s: float = SHUTDOWN_WRITE_S) -> None:
        """Write ``pending`` (the memory tier's entries) after what is queued, for at most
        ``timeout_s`` in all, then stop the writer. What is left then is dropped."""
        self._deadline = time.monotonic() + timeout_s
        for entry in pending:
            try:
                self._queue.put(entry, timeout=max(0.0, self._deadline - time.monotonic()))
            except queue.Full:
                break
        try:
            self._queue.put(None, timeout=max(0.0, self._deadline - time.monotonic()) + 1.0)
        except queue.Full:
            log.warning("prompt_cache_writer_stuck")
            return
        self._writer.join(max(0.0, self._deadline - time.monotonic()) + 1.0)


class PromptCache:
    """One server's saved KV states, within ``budget_bytes``. Thread-safe: each
    generation's worker thread consults it."""

    def __init__(
        self,
        budget_bytes: int,
        block_tokens: int = BLOCK_TOKENS,
        disk_dir: Path | None = None,
        disk_budget_bytes: int = 0,
    ):
        if budget_bytes < 0 or block_tokens < 1:
            raise ValueError("the budget is at least 0 bytes and a block at least 1 token")
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        # The disk tier, which keeps what memory lets go; None: memory alone.
        self.disk = DiskTier(disk_dir, disk_budget_bytes, block_tokens) if disk_dir and disk_budget_bytes else None
        self._lock = threading.Lock()
        # Least recently used first.
        self._entries: OrderedDict[_Entry, None] = OrderedDict()
        # Chained block hash -> the entries whose tokens start with those blocks.
        self._index: dict[int, dict[_Entry, None]] = {}
        self._bytes = 0
        self._hits = self._misses = self._tokens_restored = self._saves = self._evictions = 0
        self._live_hits = self._live_tokens = 0

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
                live_hits=self._live_hits,
                live_tokens=self._live_tokens,
                **self._disk_stats(),
            )

    def _disk_stats(self) -> dict[str, int]:
        disk = self.disk
        if disk is None:
            return {}
        with disk._lock:
            return {
                "disk_hits": disk.hits,
                "disk_writes": disk.writes,
                "disk_skipped": disk.skipped,
                "disk_evictions": disk.evictions,
                "disk_entries": len(disk._entries),
                "disk_bytes": disk._bytes,
                "disk_budget_bytes": disk.budget_bytes,
            }

    def _longest(self, key: str, tokens: Sequence[int]) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with ``tokens``, and that length (called locked)."""
        return _longest(self._index, self.block_tokens, key, tokens)

    def covered(self, key: str, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` some entry already holds."""
        with self._lock:
            return self._longest(key, tokens)[1]

    def lookup(self, key: str, tokens: Sequence[int], held: int, chunk: int = 0) -> tuple[bytes, int] | None:
        """The state of the entry holding the longest prefix of ``tokens``, and that
        prefix's length, if it is at least a block longer than the ``held`` tokens the
        slot already has; None otherwise. Counted as a miss when None. An entry only on
        disk, longer than memory's, is read back (on the caller's thread) and kept in
        memory again."""
        found = self._find(key, tokens, held, chunk)
        return None if found is None else found[:2]

    def _find(self, key: str, tokens: Sequence[int], held: int, chunk: int) -> tuple[bytes, int, bool] | None:
        """As :meth:`lookup`, with whether the state came from disk."""
        while True:
            with self._lock:
                entry, n = self._longest(key, tokens)
            on_disk, disk_n = self.disk.longest(key, tokens, chunk) if self.disk is not None else (None, 0)
            if on_disk is not None and disk_n > n and disk_n >= held + self.block_tokens:
                state = self.disk.load(on_disk) if self.disk is not None else None
                if state is None:
                    # Skipped and removed: look again without it.
                    continue
                self.store(key, on_disk.tokens, state, chunk)
                return state, disk_n, True
            with self._lock:
                if entry is None or n < held + self.block_tokens or entry not in self._entries:
                    self._misses += 1
                    return None
                self._entries.move_to_end(entry)
                return entry.state, n, False

    def _stored(self, key: str, tokens: Sequence[int], chunk: int) -> int:
        """How many leading ``tokens`` the memory or disk tier holds for ``chunk``, read from
        neither (what a restore would give at most)."""
        with self._lock:
            n = self._longest(key, tokens)[1]
        disk_n = self.disk.longest(key, tokens, chunk)[1] if self.disk is not None else 0
        return max(n, disk_n)

    def copied(self, tokens: int) -> None:
        """Count a hit of the live tier: ``tokens`` prompt tokens shared from another sequence."""
        with self._lock:
            self._hits += 1
            self._tokens_restored += tokens
            self._live_hits += 1
            self._live_tokens += tokens

    def restored(self, tokens: int) -> None:
        """Count a hit: ``tokens`` prompt tokens were restored from a state found by :meth:`lookup`."""
        with self._lock:
            self._hits += 1
            self._tokens_restored += tokens

    def failed(self) -> None:
        """Count a state found by :meth:`lookup` that its sequence could not load, as a miss."""
        with self._lock:
            self._misses += 1

    def store(self, key: str, tokens: Sequence[int], state: bytes, chunk: int = 0) -> bool:
        """Keep ``state``, which holds ``tokens`` evaluated in prefill chunks of ``chunk``,
        evicting the least recently used entries as the budget needs (to the disk tier,
        if there is one). False when it alone exceeds the budget."""
        if len(state) > self.budget_bytes or len(tokens) < self.block_tokens:
            return False
        entry = _Entry(key, tuple(tokens), state, tuple(_block_hashes(key, tokens, self.block_tokens)), chunk)
        evicted = []
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
                oldest = next(iter(self._entries))
                self._remove(oldest)
                self._evictions += 1
                evicted.append(oldest)
            self._entries[entry] = None
            self._bytes += entry.size
            _index_add(self._index, entry)
            self._saves += 1
        if self.disk is not None:
            for oldest in evicted:
                self.disk.put(oldest)
        return True

    def _remove(self, entry: _Entry) -> None:
        del self._entries[entry]
        self._bytes -= entry.size
        _index_remove(self._index, entry)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._index.clear()
            self._bytes = 0

    def close(self, timeout_s: float = SHUTDOWN_WRITE_S) -> None:
        """Put every entry held in memory on disk (the most recently used first), within
        ``timeout_s``, and stop the disk's writer. Blocks: never call it on the event loop."""
        if self.disk is None:
            return
        with self._lock:
            pending = list(reversed(self._entries))
        self.disk.close(pending, timeout_s)

    def keep(self, key: str, slot, chunk: int) -> bool:
        """Save what ``slot`` (a ``LlamaSequence``, idle) holds, evaluated in prefill chunks
        of ``chunk``, if at least a block of it is in no entry. True if it was kept."""
        held, held_chunk = slot.held_record()
        if held_chunk != chunk or self.covered(key, held) + self.block_tokens > len(held):
            return False
        state = slot.save_state()
        return state is not None and self.store(key, held, state, chunk)

    def prepare(self, key: str, slot, prompt_tokens: Sequence[int], chunk: int) -> int:
        """Ready ``slot`` (a ``LlamaSequence``, idle) for a generation of ``prompt_tokens``
        with prefill chunks of ``chunk``: save what it holds if the prompt would lose at
        least a block of it that no entry holds, then load the state holding the longest
        prefix of the prompt, if that is at least a block more than the slot keeps. Where
        another sequence of the slot's context holds a longer prefix still (the live tier),
        the slot shares its cells instead (``copy_live_prefix``). Returns how many prompt
        tokens were restored or shared (0: none)."""
        held, held_chunk = slot.held_record()
        reuse = slot.reusable_prefix(prompt_tokens, chunk)
        if (
            held_chunk == chunk
            and len(held) - reuse >= self.block_tokens
            and self.covered(key, held) + self.block_tokens <= len(held)
        ):
            state = slot.save_state()
            if state is not None:
                self.store(key, held, state, chunk)
        # Short of the last prompt token, whose logits are needed.
        wanted = list(prompt_tokens[: len(prompt_tokens) - 1])
        if len(wanted) < reuse + self.block_tokens:
            return 0
        # The live tier first: another sequence of the slot's context (one model, template and
        # shape: one key) that holds more of the prompt than a restore would give shares it.
        copied = slot.copy_live_prefix(
            wanted, chunk, max(reuse + self.block_tokens - 1, self._stored(key, wanted, chunk))
        )
        if copied:
            self.copied(copied)
            return copied
        found = self._find(key, wanted, reuse, chunk)
        if found is None:
            return 0
        state, n, from_disk = found
        if not slot.restore_state(state, wanted[:n], chunk):
            self.failed()
            log.warning("prompt_cache_restore_failed", tokens=n)
            return 0
        self.restored(n)
        if from_disk and self.disk is not None:
            with self.disk._lock:
                self.disk.hits += 1
        return n
