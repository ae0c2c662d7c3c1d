"""Stopline's edits to llama.cpp's CPU backend: a stop inside a graph node.

llama.cpp checks its abort callback between graph nodes only, so a stop waits
for the node under way, and a node grows with the model, the batch and the
prompt chunk (a 1B model's output projection, or a 512-token chunk's FFN, takes
tens of milliseconds on two cores). Every long kernel of ggml's CPU backend
splits its node into pieces that the compute threads take in turn; these edits
make each thread ask the graph's abort callback between its pieces and take no
more once it says stop. The node then ends part-way, its output garbage that
nobody reads: the callback stays true (Stopline's stop conditions are sticky),
so the graph aborts at the node's end, ``llama_decode`` returns 2, and the loop
cuts each sequence's cache back to its record, as after any abort.

Each edit replaces an anchor, text that must occur in the hash-verified source
exactly as often as the edit says, with the anchor and a few lines of our own.
The build fails with one line naming the file and the anchor if one moved.
Nothing else of llama.cpp changes, and the bench's llama-server is built from
the unedited tree. docs/engine.md ("Stopping inside a node") has the
measurements.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .errors import StoplineError

# The function the edited kernels call between pieces; the shim checks for it to
# report whether a library was built with the edits.
STOP_CHECK = "ggml_cpu_stop_requested"
# A tinyBLAS thread's share of a node is a static range of tiles of a few
# microseconds each: it asks once every this many tiles.
TILES_PER_CHECK = 16
# Pieces per compute thread in the kernels that plan their pieces per thread
# (ggml plans 4): small enough that a piece of a 512-token prompt chunk of a
# 1B model takes a fraction of a millisecond, and speed does not change.
PIECES_PER_THREAD = 64


class LlamaEditError(StoplineError):
    """An anchor of an edit is not where the edit expects it: the source is not the pinned one."""


@dataclass(frozen=True)
class Edit:
    """Replace ``count`` occurrences of ``anchor`` in ``path`` (relative to the
    llama.cpp tree) with ``replacement``."""

    path: str
    anchor: str
    replacement: str
    count: int = 1


_CPU = "ggml/src/ggml-cpu/"

EDITS = (
    # The check, and the shared piece counter that the repacked matmul, flash
    # attention, llamafile's float GEMMs and the tiled matmul take pieces from.
    Edit(
        _CPU + "ggml-cpu.c",
        "int ggml_threadpool_chunk_add(struct ggml_threadpool * tp, int value) {\n",
        f"""\
// Stopline: the graph this compute thread is computing, for {STOP_CHECK}().
static _Thread_local struct ggml_threadpool * ggml_stop_threadpool;

// Stopline: whether the graph's abort callback wants the evaluation to end now.
// Kernels ask between the pieces of a node; the callback is thread-safe.
bool {STOP_CHECK}(void) {{
    struct ggml_threadpool * tp = ggml_stop_threadpool;
    return tp != NULL && tp->cplan->abort_callback != NULL &&
           tp->cplan->abort_callback(tp->cplan->abort_callback_data);
}}

int ggml_threadpool_chunk_add(struct ggml_threadpool * tp, int value) {{
    // Stopline: past every piece, so the caller's loop takes no more.
    if ({STOP_CHECK}()) {{
        return INT_MAX / 2;
    }}
""",
    ),
    Edit(
        _CPU + "ggml-cpu.c",
        "    struct ggml_threadpool    * tp    = state->threadpool;\n",
        "    struct ggml_threadpool    * tp    = state->threadpool;\n"
        "    ggml_stop_threadpool = tp;  // Stopline\n",
    ),
    # The plain matmul counts its pieces with its own atomic.
    Edit(
        _CPU + "ggml-cpu.c",
        "current_chunk = atomic_fetch_add_explicit(&params->threadpool->current_chunk, 1, memory_order_relaxed);",
        "current_chunk = ggml_threadpool_chunk_add(params->threadpool, 1);  // Stopline",
    ),
    # The mixture-of-experts matmul, one counter per expert.
    Edit(
        _CPU + "ggml-cpu.c",
        "current_chunk = atomic_fetch_add_explicit(current_chunk_ctr, 1, memory_order_relaxed);",
        f"current_chunk = {STOP_CHECK}() ? INT_MAX / 2  // Stopline\n"
        "                : atomic_fetch_add_explicit(current_chunk_ctr, 1, memory_order_relaxed);",
    ),
    Edit(
        _CPU + "ggml-cpu-impl.h",
        "int  ggml_threadpool_chunk_add(struct ggml_threadpool * tp, int value);\n",
        "int  ggml_threadpool_chunk_add(struct ggml_threadpool * tp, int value);\n"
        f"bool {STOP_CHECK}(void);  // Stopline\n",
    ),
    # Finer plans where ggml plans 4 pieces per thread: a piece was 1/8 of a node on 2 threads.
    Edit(
        _CPU + "repack.cpp",
        "int     nth_scaled  = nth * 4;",
        f"int     nth_scaled  = nth * {PIECES_PER_THREAD};  // Stopline",
    ),
    Edit(
        _CPU + "ops.cpp",
        "int nth_scaled = nth * 4;",
        f"int nth_scaled = nth * {PIECES_PER_THREAD};  // Stopline",
        count=2,
    ),
    # llamafile's quantized GEMMs give each thread a static range of tiles, taken from no counter.
    Edit(
        _CPU + "llamafile/sgemm.cpp",
        "for (int64_t job = start; job < end; ++job) {\n",
        "for (int64_t job = start; job < end; ++job) {\n"
        f"            if ((job - start) % {TILES_PER_CHECK} == 0 && {STOP_CHECK}()) break;  // Stopline\n",
        count=14,
    ),
)


def edits_key() -> str:
    """A digest of the edits: a change to them builds a new library."""
    digest = hashlib.sha256()
    for edit in EDITS:
        digest.update(repr(edit).encode())
    return digest.hexdigest()[:12]


def apply_edits(source: Path) -> None:
    """Apply every edit to the llama.cpp tree at ``source``, in place, checking
    every anchor first: a tree whose anchors are not all where they belong is
    left untouched."""
    texts: dict[str, str] = {}
    for edit in EDITS:
        if edit.path not in texts:
            texts[edit.path] = (source / edit.path).read_text()
        found = texts[edit.path].count(edit.anchor)
        if found != edit.count:
            first_line = edit.anchor.strip().splitlines()[0]
            raise LlamaEditError(
                f"{edit.path}: expected {edit.count} of the anchor {first_line!r}, found {found}; "
                "the llama.cpp source is not the one the edits were written for"
            )
        texts[edit.path] = texts[edit.path].replace(edit.anchor, edit.replacement)
    for path, text in texts.items():
        (source / path).write_text(text)
