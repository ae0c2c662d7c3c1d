"""Stopline's edits to llama.cpp's CPU backend, a stop inside a graph node, and to ggml's
scheduler, a stop between the pieces of a GPU's evaluation.

llama.cpp checks its abort callback between graph nodes only, so a stop waits
for the node under way, and a node grows with the model, the batch and the
prompt chunk (a 1B model's output projection, or a 512-token chunk's FFN, is a
long wait on a few cores; docs/engine.md, "Stopping inside a node"). Every long kernel of ggml's CPU backend
splits its node into pieces that the compute threads take in turn; these edits
make each thread ask the graph's abort callback between its pieces and take no
more once it says stop. The node then ends part-way, its output garbage that
nobody reads: the callback stays true (Stopline's stop conditions are sticky),
so the graph aborts at the node's end, ``llama_decode`` returns 2, and the loop
cuts each sequence's cache back to its record, as after any abort.

On a GPU, no abort callback is asked: ggml asks it on the CPU backend only. What ggml's
scheduler offers instead is its eval callback (``cb_eval``): where one is set, each split of
the graph is computed as a series of pieces, with a synchronize and a question to the callback
after each. The shim sets one where a model has layers on a GPU, and it answers false once the
stop is requested; unedited, that ends the split under way only, and the next split still
runs. The last edit makes it end the evaluation, which then returns 2 as after an abort.

Each edit replaces an anchor, text that must occur in the hash-verified source
exactly as often as the edit says, with the anchor and a line or two of our
own, marked "Stopline". The build fails with one line naming the file and the
anchor if one moved. Nothing else of llama.cpp changes, and the bench's
llama-server is built from the unedited tree. docs/engine.md ("Stopping inside
a node") explains each edit and has the measurements.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..protocol.errors import StoplineError

# The function the edited kernels call between pieces; the shim checks for it to
# report whether a library was built with the edits.
STOP_CHECK = "ggml_cpu_stop_requested"
# Where a kernel's piece is a few microseconds of work (a tile of llamafile's
# GEMMs, a row of the input's quantization), it asks once every this many.
SMALL_PIECES_PER_CHECK = 16
# The repacked matmul takes, with one plane, pieces of this many input columns
# (a multiple of its 4-column tiles; ggml takes them all at once), and plans its
# row pieces (ggml: 4 per thread) so that none is over this many multiply-adds:
# a fraction of a millisecond in decode, where a 1B model's output projection
# came in a few pieces of a millisecond or more. Finer than needed costs decode
# speed, so the bound is on the work, not a count per thread (docs/engine.md,
# "Stopping inside a node", has the measurements).
REPACK_COLUMNS = 128
REPACK_PIECE_MULTIPLY_ADDS = 4_000_000
# The tiled matmul's pieces, in rows and columns of the output (ggml plans 256).
TILED_PIECE = 64


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


def _after(path: str, anchor: str, lines: str) -> Edit:
    """Insert ``lines`` after ``anchor``."""
    return Edit(path, anchor, anchor + lines)


def _then_check(path: str, anchor: str, every: str = "", count: int = 1) -> Edit:
    """At the top of the loop over pieces whose head is ``anchor``'s first line, leave
    the loop when the stop check says so; ``every`` limits the check to some iterations."""
    head, rest = anchor.split("\n", 1)
    condition = f"{every} && {STOP_CHECK}()" if every else f"{STOP_CHECK}()"
    return Edit(path, anchor, f"{head}\n    if ({condition}) break;  // Stopline\n{rest}", count)


EDITS = (
    # The check, and the shared piece counter that the repacked matmul, flash
    # attention, llamafile's float GEMMs and the tiled matmul take pieces from.
    Edit(
        _CPU + "ggml-cpu.c",
        "int ggml_threadpool_chunk_add(struct ggml_threadpool * tp, int value) {\n",
        f"""\
// Stopline: the graph this compute thread is computing, and its node, for {STOP_CHECK}().
static _Thread_local struct ggml_threadpool * ggml_stop_threadpool;
static _Thread_local int ggml_stop_node;

// Stopline: whether the graph's abort callback wants the evaluation to end now.
// Kernels ask between the pieces of a node; the callback is thread-safe. Once it
// has said so, the graph ends after this node, as when the thread that checks
// between nodes finds it so (it may have checked before this stop came): every
// thread leaves the node loop at the same node, so the barriers stay matched.
bool {STOP_CHECK}(void) {{
    struct ggml_threadpool * tp = ggml_stop_threadpool;
    if (tp == NULL || tp->cplan->abort_callback == NULL ||
        !tp->cplan->abort_callback(tp->cplan->abort_callback_data)) {{
        return false;
    }}
    atomic_store_explicit(&tp->abort, ggml_stop_node + 1, memory_order_relaxed);
    __atomic_store_n(&tp->ec, GGML_STATUS_ABORTED, __ATOMIC_RELAXED);
    return true;
}}

int ggml_threadpool_chunk_add(struct ggml_threadpool * tp, int value) {{
    // Stopline: past every piece, so the caller's loop takes no more.
    if ({STOP_CHECK}()) {{
        return INT_MAX / 2;
    }}
""",
    ),
    _after(
        _CPU + "ggml-cpu.c",
        "memory_order_relaxed) != node_n; node_n++) {\n        struct ggml_tensor * node = cgraph->nodes[node_n];\n",
        "        ggml_stop_threadpool = tp;  // Stopline\n        ggml_stop_node = node_n;\n",
    ),
    _after(
        _CPU + "ggml-cpu-impl.h",
        "int  ggml_threadpool_chunk_add(struct ggml_threadpool * tp, int value);\n",
        f"bool {STOP_CHECK}(void);  // Stopline\n",
    ),
    # The plain matmul counts its pieces with its own atomic, and the mixture-of-experts
    # matmul with one per expert.
    Edit(
        _CPU + "ggml-cpu.c",
        "current_chunk = atomic_fetch_add_explicit(&params->threadpool->current_chunk, 1, memory_order_relaxed);",
        "current_chunk = ggml_threadpool_chunk_add(params->threadpool, 1);  // Stopline",
    ),
    Edit(
        _CPU + "ggml-cpu.c",
        "current_chunk = atomic_fetch_add_explicit(current_chunk_ctr, 1, memory_order_relaxed);",
        f"current_chunk = {STOP_CHECK}() ? INT_MAX / 2  // Stopline\n"
        "                : atomic_fetch_add_explicit(current_chunk_ctr, 1, memory_order_relaxed);",
    ),
    # Before their pieces, the matmuls quantize the input, each thread its share of
    # every row (a millisecond for a 512-token chunk of a 1B model's FFN input).
    _then_check(
        _CPU + "ggml-cpu.c",
        "for (int64_t i11 = 0; i11 < ne11; ++i11) {\n                    int64_t ne10_block_start",
        f"i11 % {SMALL_PIECES_PER_CHECK} == 0",
    ),
    *(
        _then_check(
            path,
            "for (int64_t i11 = 0; i11 < ne11; ++i11) {\n                    size_t bs = ggml_blck_size(vec_dot_type);",
            f"i11 % {SMALL_PIECES_PER_CHECK} == 0",
        )
        # The mixture-of-experts matmul, and the tiled one.
        for path in (_CPU + "ggml-cpu.c", _CPU + "tiled/tiled.cpp")
    ),
    _then_check(
        _CPU + "repack.cpp",
        "for (int64_t i11 = ith * 4; i11 < ne11 - ne11 % 4; i11 += nth * 4) {\n",
    ),
    # The repacked matmul: row pieces of a bounded size, and column pieces (it took every column at once)
    Edit(
        _CPU + "repack.cpp",
        "int     nth_scaled  = nth * 4;",
        "int     nth_scaled  = MAX(nth * 4,  // Stopline\n"
        "                                 "
        f"(int) (nr0 * ne00 * MIN(ne11, {REPACK_COLUMNS}) / {REPACK_PIECE_MULTIPLY_ADDS}));",
    ),
    # (and keeps them with one thread, which it gave the whole node),
    Edit(
        _CPU + "repack.cpp",
        "if (nth == 1 || ((nchunk0 < nth || disable_chunking)",
        "if (/* Stopline */ ((nchunk0 < nth || disable_chunking)",
    ),
    Edit(
        _CPU + "repack.cpp",
        "int64_t nchunk1 = ne12;",
        f"int64_t nchunk1 = ne12 == 1 ? (ne11 + {REPACK_COLUMNS} - 1) / {REPACK_COLUMNS} : ne12;  // Stopline",
    ),
    Edit(
        _CPU + "repack.cpp",
        "            int64_t src1_start = ith1 * ne11;\n            int64_t src1_end = (ith1 + 1) * ne11;\n",
        f"            int64_t src1_start = ne12 == 1 ? ith1 * {REPACK_COLUMNS} : ith1 * ne11;  // Stopline\n"
        f"            int64_t src1_end = ne12 == 1 ? MIN(src1_start + {REPACK_COLUMNS}, ne11) : (ith1 + 1) * ne11;\n",
    ),
    # The tiled matmul (the K-quants of a prompt) plans 256 x 256 output pieces, each a long
    # wait in a prompt's FFN; smaller tiles give a stop more places to land.
    Edit(
        _CPU + "tiled/tiled.cpp",
        "int chunk_size = 256; //TILED_TILE_ROWS;",
        f"int chunk_size = {TILED_PIECE};  // Stopline",
    ),
    # Flash attention: a piece is a tile of 64 queries against the whole cache (milliseconds
    # at a long context), so it asks between the cache's tiles; in decode each thread takes
    # one range of the cache for every head, and asks between heads.
    _then_check(_CPU + "ops.cpp", "for (int64_t ic = 0; ic < nek1; ic += KV_TILE_SZ) {\n"),
    _then_check(
        _CPU + "ops.cpp",
        "for (int64_t q_head = 0; q_head < neq2; q_head++) {\n"
        "                ggml_compute_forward_flash_attn_ext_f16_one_chunk(",
    ),
    # The FFN's gated activation (a 512-token chunk of a 1B model's is 4M values) splits its rows
    # statically among the threads.
    *(
        _then_check(
            _CPU + "ops.cpp",
            f"for (int i1 = ir0; i1 < ir1; i1++) {{\n        {kind} * src0_p = ({kind} *) (src0_d + i1*src0_o);",
            f"(i1 - ir0) % {SMALL_PIECES_PER_CHECK} == 0",
            count,
        )
        for kind, count in (("float", 6), ("ggml_fp16_t", 5))
    ),
    # A prompt chunk's embeddings, and its RMS norms, also split their rows statically.
    _then_check(
        _CPU + "ops.cpp",
        "for (int64_t i = ir0; i < ir1; ++i) {\n        const int64_t i12 = i/(ne11*ne10);",
        f"(i - ir0) % {SMALL_PIECES_PER_CHECK} == 0",
        count=4,
    ),
    _then_check(
        _CPU + "ops.cpp",
        "for (int64_t i01 = ith; i01 < ne01; i01 += nth) {\n"
        "                const float * x = (float *) ((char *) src0->data + i01*nb01 + i02*nb02 + i03*nb03);",
        f"i01 % ({SMALL_PIECES_PER_CHECK} * nth) == ith",
    ),
    # llamafile's quantized GEMMs give each thread a static range of tiles, taken from no counter.
    _then_check(
        _CPU + "llamafile/sgemm.cpp",
        "for (int64_t job = start; job < end; ++job) {\n",
        f"(job - start) % {SMALL_PIECES_PER_CHECK} == 0",
        count=14,
    ),
    # The scheduler's eval callback answering false (the stop, asked between the pieces of a GPU's
    # split) ends the evaluation, not only the split under way: llama_decode returns 2 for it.
    Edit(
        "ggml/src/ggml-backend.cpp",
        "                if (need && !sched->callback_eval(t, false, sched->callback_eval_user_data)) {\n"
        "                    break;\n",
        "                if (need && !sched->callback_eval(t, false, sched->callback_eval_user_data)) {\n"
        "                    return GGML_STATUS_ABORTED;  // Stopline: the evaluation, not only this split\n",
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
