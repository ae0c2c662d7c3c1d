"""Build llama.cpp once, into the user cache: the llama.cpp engine's shim library.

    python -m stopline.engine.llama_build    # the engine's library (what --engine llama.cpp needs)
    STOPLINE_GPU=vulkan python -m stopline.engine.llama_build    # its Vulkan build

The backend (:func:`choose_backend`) is the CPU unless ``STOPLINE_GPU`` (``cpu``, ``vulkan``,
``cuda``, ``auto``) asks for another, or, left at ``auto``, the machine has both a GPU backend's
compiler and a device for it; each backend builds in trees of its own.

llama.cpp's source is taken from the ``llama-cpp-python`` source distribution on
PyPI, which vendors llama.cpp (``vendor/llama.cpp``) at the commit pinned by that
release; the archive is verified against a pinned sha256. It is built twice, for
the CPU, with every optional network feature off and the same options: once with
Stopline's edits (``stopline/engine/llama_edits.py``: a stop inside a graph node), whose
static libraries are linked with Stopline's shim (``ext/llama_shim.c``) into
``libstopline-llama.so``, exporting nothing but the shim's functions; and, for
the benchmark only, unedited (:func:`build_unedited`, :func:`ensure_llama_library`
with ``edited=False``): the benchmark's ``llama-server``, the peer as its users run
it (``bench/drivers/llama_server.py``), and a shim library to measure the edits against.
Nothing of llama.cpp is part of this repository.

``STOPLINE_LLAMA_SOURCE`` names an extracted copy of that tree (``python -m bench gpu-check --pack``
writes a trimmed one) to build from instead, on a machine that cannot reach the package index.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import cmake as cmake_module
import ninja
from tqdm import tqdm

from ..protocol.errors import StoplineError, UsageError
from ..settings import cache_dir
from .llama_edits import LlamaEditError, apply_edits, edits_key
from .model import ModelFetchError, PinnedFile, download_pinned

SDIST_VERSION = "0.3.36"
SDIST_FILENAME = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST = PinnedFile("llama-cpp-python", SDIST_FILENAME, SDIST_SHA256)
VENDORED_SOURCE = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp"
# What the peer is called in reports: the llama.cpp that release vendors.
SOURCE_LABEL = f"llama.cpp as vendored by llama-cpp-python {SDIST_VERSION}"

CMAKE_OPTIONS = [
    # Ninja from PyPI (a dependency, as cmake is): no make needed.
    "-GNinja",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    # The static libraries go into a shared object.
    "-DCMAKE_POSITION_INDEPENDENT_CODE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    # No network at build or run time: no HTTPS client, no web UI (built or downloaded).
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_LLGUIDANCE=OFF",
    # ggml's own threads rather than OpenMP's. The engine evaluates on whichever
    # thread runs the generation, and every thread that starts an OpenMP region
    # keeps a team of its own; once the teams outnumber the cores, libgomp stops
    # spinning at barriers and sleeps at every graph node, which slows a lone
    # decode on a second thread (docs/engine.md, "Threads", has the measurement).
    "-DGGML_OPENMP=OFF",
]
if platform.machine().lower() in ("x86_64", "amd64"):
    # AVX2, as the ctransformers build ours runs on. Not -march=native: that also turns on AMX, whose
    # tile instructions fault where the kernel does not grant them (virtual machines, for one).
    CMAKE_OPTIONS += [
        "-DGGML_NATIVE=OFF",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_BMI2=ON",
    ]
# An extracted llama.cpp tree to build from instead of the sdist's (a machine without network).
SOURCE_ENV = "STOPLINE_LLAMA_SOURCE"
# The static libraries the shim links, in link order, relative to the build tree.
STATIC_LIBRARIES = ["src/libllama.a", "ggml/src/libggml.a", "ggml/src/libggml-cpu.a", "ggml/src/libggml-base.a"]
SHIM_SOURCES = ("llama_shim.c", "llama_abi.h")
# What each GPU backend adds to the CPU build: its CMake options, its static library (linked
# before libggml-base.a, which it calls), and the system libraries it needs at run time.
CPU, VULKAN, CUDA = "cpu", "vulkan", "cuda"
BACKENDS = (CPU, VULKAN, CUDA)
# The oldest Vulkan headers this llama.cpp compiles with: ggml-vulkan.cpp uses VK_EXT_layer_settings,
# which came with 1.3.272. Debian 12's libvulkan-dev is 1.3.239; Debian 13's, 1.4.309.
VULKAN_MIN_HEADERS = (1, 3, 272)
BACKEND_OPTIONS = {
    CPU: [],
    VULKAN: ["-DGGML_VULKAN=ON"],
    # One architecture, the machine's GPU: every architecture would take an hour, not minutes.
    CUDA: ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=native"],
}
BACKEND_LIBRARIES = {
    CPU: [],
    VULKAN: ["ggml/src/ggml-vulkan/libggml-vulkan.a"],
    CUDA: ["ggml/src/ggml-cuda/libggml-cuda.a"],
}
BACKEND_LINK = {CPU: [], VULKAN: ["-lvulkan"], CUDA: ["-lcudart", "-lcublas", "-lcublasLt", "-lcuda"]}
# A change of options builds a new binary, in build trees of their own.
BUILD_KEY = hashlib.sha256(" ".join(CMAKE_OPTIONS).encode()).hexdigest()[:8]
# The shim library a wheel carries, built when the wheel was (setup.py), in the package's _native/.
PACKAGED_LIBRARY = "libstopline-llama.so"


class LlamaBuildError(StoplineError):
    """llama.cpp could not be fetched or built."""


class NoCompiler(LlamaBuildError, UsageError):
    """The machine has no C++ compiler to build llama.cpp with: a setting to change, in one line."""


class BackendUnavailable(LlamaBuildError, UsageError):
    """STOPLINE_GPU asks for a backend this machine cannot build: what to install, in one line."""


@dataclass(frozen=True)
class BuildMachine:
    """What choosing a backend looks at. :func:`probe_machine` fills it in; tests make their own."""

    requested: str = "auto"  # STOPLINE_GPU
    nvcc: str | None = None  # CUDA's compiler
    nvidia_gpu: bool = False  # an NVIDIA device the driver shows
    vulkan_sdk: bool = False  # Vulkan's headers, glslc and SPIR-V's headers
    vulkan_headers: tuple[int, ...] | None = None  # their version, where it could be read
    vulkan_gpu: bool = False  # a Vulkan device other than a CPU one (lavapipe)


@dataclass(frozen=True)
class Backend:
    name: str
    why: str


def choose_backend(machine: BuildMachine) -> Backend:
    """The backend to build, and why, in words the build prints.

    ``auto`` builds for a GPU only where its device is present as well as its compiler: a CUDA build
    on a machine without an NVIDIA GPU (a CI runner with the toolkit installed) is minutes of
    compiling for a library that would run on the CPU anyway, and lavapipe, Mesa's Vulkan device on
    the CPU, is slower than ggml's own CPU code. Asked for by name, a backend is built wherever its
    compiler is, device or not, and its absence is an error naming what to install."""
    requested = machine.requested.strip().lower() or "auto"
    if requested not in (*BACKENDS, "auto"):
        raise BackendUnavailable(f"STOPLINE_GPU={machine.requested!r}: give one of cpu, vulkan, cuda or auto")
    if requested == CPU:
        return Backend(CPU, "STOPLINE_GPU=cpu")
    if requested == CUDA:
        if machine.nvcc is None:
            raise BackendUnavailable(
                "STOPLINE_GPU=cuda, and there is no nvcc: install CUDA's toolkit (or PyPI's nvidia-cuda-nvcc) "
                "and put nvcc on PATH, or build for the CPU with STOPLINE_GPU=cpu"
            )
        device = "" if machine.nvidia_gpu else "; no NVIDIA GPU is visible, so it runs on the CPU here"
        return Backend(CUDA, f"STOPLINE_GPU=cuda, with {machine.nvcc}{device}")
    headers = machine.vulkan_headers
    headers_too_old = headers is not None and headers < VULKAN_MIN_HEADERS
    if requested == VULKAN:
        if machine.vulkan_sdk and headers is not None and headers_too_old:
            found, least = (".".join(map(str, v)) for v in (headers, VULKAN_MIN_HEADERS))
            raise BackendUnavailable(
                f"STOPLINE_GPU=vulkan: Vulkan's headers are version {found}, and this llama.cpp needs {least} "
                "or later (VK_EXT_layer_settings): point VULKAN_SDK at newer ones (LunarG's SDK, or Debian 13's "
                "libvulkan-dev and spirv-headers unpacked), or build for the CPU with STOPLINE_GPU=cpu"
            )
        if not machine.vulkan_sdk:
            raise BackendUnavailable(
                "STOPLINE_GPU=vulkan needs Vulkan's headers, glslc and SPIR-V's headers "
                "(Debian: apt-get install libvulkan-dev glslc spirv-headers), or build for the CPU with "
                "STOPLINE_GPU=cpu"
            )
        return Backend(VULKAN, "STOPLINE_GPU=vulkan")
    if machine.nvcc is not None and machine.nvidia_gpu:
        return Backend(CUDA, f"an NVIDIA GPU and {machine.nvcc} are present")
    if machine.vulkan_sdk and machine.vulkan_gpu and not headers_too_old:
        return Backend(VULKAN, "a Vulkan GPU, Vulkan's headers and glslc are present")
    if machine.nvcc is not None:
        why = f"{machine.nvcc} is present but no NVIDIA GPU is (STOPLINE_GPU=cuda builds it anyway)"
    elif machine.vulkan_sdk and headers_too_old:
        why = "Vulkan's headers are too old for this llama.cpp (VULKAN_SDK can point at newer ones)"
    elif machine.vulkan_sdk:
        why = "Vulkan's headers are present but no Vulkan GPU is (STOPLINE_GPU=vulkan builds it anyway)"
    else:
        why = "no GPU compiler (nvcc, or Vulkan's headers and glslc) is present"
    return Backend(CPU, why)


def probe_machine(environ: Mapping[str, str] = os.environ) -> BuildMachine:
    """What this machine has. Cheap where no GPU tools are installed, as on CI: the device
    checks run only behind a compiler that could use them."""
    requested = environ.get("STOPLINE_GPU", "auto")
    nvcc = shutil.which("nvcc") or next(
        (str(p) for p in (Path(environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc",) if p.is_file()), None
    )
    # The driver's device nodes: no process to start, and no CUDA library to load.
    nvidia_gpu = nvcc is not None and any(Path("/proc/driver/nvidia/gpus").glob("*"))
    vulkan_sdk = (
        shutil.which("glslc") is not None
        and any((Path(d) / "vulkan" / "vulkan.h").is_file() for d in _include_dirs(environ))
        and any((Path(d) / "spirv").is_dir() for d in _include_dirs(environ))
    )
    headers = _vulkan_header_version(environ) if vulkan_sdk else None
    vulkan_gpu = vulkan_sdk and requested.strip().lower() in ("", "auto") and _vulkan_gpu()
    return BuildMachine(requested, nvcc, nvidia_gpu, vulkan_sdk, headers, vulkan_gpu)


def _vulkan_header_version(environ: Mapping[str, str]) -> tuple[int, ...] | None:
    """The version of the first vulkan_core.h on the include path, as (1, 3, 239)."""
    for directory in _include_dirs(environ):
        path = Path(directory) / "vulkan" / "vulkan_core.h"
        if path.is_file():
            text = path.read_text(errors="replace")
            patch = re.search(r"#define VK_HEADER_VERSION (\d+)", text)
            api = re.search(r"#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION\(0, (\d+), (\d+),", text)
            if patch and api:
                return (int(api.group(1)), int(api.group(2)), int(patch.group(1)))
            return None
    return None


def _include_dirs(environ: Mapping[str, str]) -> list[str]:
    sdk = environ.get("VULKAN_SDK")
    return [*([f"{sdk}/include"] if sdk else []), "/usr/include", "/usr/local/include"]


def _vulkan_gpu() -> bool:
    """Whether vulkaninfo lists a discrete or integrated GPU (not lavapipe's CPU device)."""
    vulkaninfo = shutil.which("vulkaninfo")
    if vulkaninfo is None:
        return False
    try:
        result = subprocess.run([vulkaninfo, "--summary"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return re.search(r"PHYSICAL_DEVICE_TYPE_(DISCRETE|INTEGRATED)_GPU", result.stdout) is not None


def selected_backend() -> Backend:
    """The backend this environment builds (STOPLINE_GPU, else what the machine has)."""
    return choose_backend(probe_machine())


def build_root() -> Path:
    return cache_dir() / "llama.cpp" / SDIST_VERSION


def shim_source_dir() -> Path:
    """Where ext/llama_shim.c and ext/llama_abi.h are: the checkout's ext/, or the
    copy an installed package carries as ``stopline/_native``."""
    checkout = Path(__file__).resolve().parents[2] / "ext"
    if (checkout / SHIM_SOURCES[0]).is_file():
        return checkout
    return Path(str(resources.files("stopline") / "_native"))


def _build_key(backend: str) -> str:
    """The build trees' key: the CPU build's is the options' hash alone, as before backends were
    chosen, so its trees (minutes to build) stay valid; a GPU build's adds its name."""
    return BUILD_KEY if backend == CPU else f"{BUILD_KEY}-{backend}"


def _shim_key(edited: bool, backend: str = CPU) -> str:
    digest = hashlib.sha256(_build_key(backend).encode())
    digest.update(edits_key().encode() if edited else b"unedited")
    for name in SHIM_SOURCES:
        digest.update((shim_source_dir() / name).read_bytes())
    return digest.hexdigest()[:12]


def cached_library(edited: bool = True, backend: str = CPU) -> Path:
    """The engine's shim library: built from the edited tree, or (``edited=False``,
    for the benchmark's comparison) from the unedited one, for ``backend``."""
    kind = ("" if backend == CPU else f"-{backend}") + ("" if edited else "-unedited")
    return build_root() / "lib" / f"libstopline-llama{kind}-{_shim_key(edited, backend)}.so"


def packaged_library() -> Path | None:
    """The shim library an installed wheel carries, or None (an editable install, a checkout)."""
    path = Path(str(resources.files("stopline") / "_native" / PACKAGED_LIBRARY))
    return path if path.is_file() else None


def engine_library(progress: bool = True) -> Path:
    """The engine's shim library: the one the installed wheel carries, else the cache's,
    fetched and built on first use."""
    return packaged_library() or ensure_llama_library(progress)


def ensure_llama_library(
    progress: bool = True, jobs: int | None = None, edited: bool = True, backend: Backend | None = None
) -> Path:
    """Return the engine's shim library for ``backend`` (default: :func:`selected_backend`),
    fetching and building llama.cpp on first use."""
    backend = backend or selected_backend()
    library = cached_library(edited, backend.name)
    if library.is_file():
        return library
    _compiler()  # before anything is fetched: without one, nothing could be built
    with _build_lock():
        if library.is_file():  # another process built it meanwhile
            return library
        print(f"llama.cpp backend: {backend.name} ({backend.why})", file=sys.stderr)
        source, build = _tree(edited, progress, backend.name)
        targets = ["llama", "ggml", "ggml-cpu", "ggml-base"] + ([f"ggml-{backend.name}"] if backend.name != CPU else [])
        _cmake_build(source, build, targets, progress, jobs, f"building llama.cpp ({backend.name})", backend.name)
        library.parent.mkdir(parents=True, exist_ok=True)
        temp = library.with_name(f".{library.name}.part")
        _link_shim(source, build, temp, backend.name)
        os.replace(temp, library)  # a library in place means a finished build
    return library


def build_unedited(target: str, progress: bool = True, jobs: int | None = None, backend: str = CPU) -> Path:
    """Build the CMake target ``target`` (a program such as ``llama-server``) of the unedited
    tree, with the engine's options, and return the build tree, whose ``bin/`` holds it."""
    _compiler()
    with _build_lock():
        source, build = _tree(False, progress, backend)
        _cmake_build(source, build, [target], progress, jobs, f"building {target}", backend)
        return build


def llama_source_dir() -> Path:
    """The unedited llama.cpp tree (its ``models/`` holds real vocabularies as GGUF
    files), fetched and extracted on first use."""
    if given := given_source():
        return given
    source = build_root() / "src"
    # An extracted tree is only read from then on: no waiting for the lock, which a build holds for minutes.
    if (source / "CMakeLists.txt").is_file():
        return source
    with _build_lock():
        return _tree(edited=False)[0]


@contextlib.contextmanager
def _build_lock():
    """One build at a time in the shared trees, across processes (test workers, replicas)."""
    root = build_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _tree(edited: bool, progress: bool = True, backend: str = CPU) -> tuple[Path, Path]:
    """The source tree (extracted, and edited when ``edited``) and its build tree for ``backend``.
    The source trees are shared; each backend builds in its own tree."""
    root = build_root()
    given = given_source()
    if not edited:
        pristine = given or _extract(_download_sdist(root, progress), root / "src")
        return pristine, root / f"build-{_build_key(backend)}"
    source = root / "src-edited"
    marker = source / ".stopline-edits"
    if not (marker.is_file() and marker.read_text() == edits_key()):
        # Edits apply to the pristine text only: a tree edited otherwise is extracted again.
        shutil.rmtree(source, ignore_errors=True)
        if given:
            shutil.copytree(given, source)
        else:
            _extract(_download_sdist(root, progress), source)
        try:
            apply_edits(source)
        except LlamaEditError as exc:
            raise LlamaBuildError(str(exc)) from None
        marker.write_text(edits_key())
    # The CPU build keeps the name it had; a GPU build's key ends in its backend's name.
    key = BUILD_KEY if backend == CPU else f"{BUILD_KEY}-edited-{backend}"
    return source, root / (f"build-{key}-edited" if backend == CPU else f"build-{key}")


def given_source() -> Path | None:
    """The tree ``STOPLINE_LLAMA_SOURCE`` names, or None; an error if it names no llama.cpp tree."""
    named = os.environ.get(SOURCE_ENV)
    if not named:
        return None
    source = Path(named).resolve()
    if not (source / "CMakeLists.txt").is_file():
        raise LlamaBuildError(f"{SOURCE_ENV}={named}: no llama.cpp tree there (no CMakeLists.txt)")
    return source


def cached_sdist(progress: bool = True) -> Path:
    """The pinned sdist, verified, from the build cache (downloaded on first use)."""
    return _download_sdist(build_root(), progress)


def _download_sdist(root: Path, progress: bool) -> Path:
    try:
        return download_pinned(progress, SDIST, f"llama.cpp's source ({SDIST.requirement})", root)
    except ModelFetchError as e:
        raise LlamaBuildError(str(e)) from None


def _extract(sdist: Path, source: Path) -> Path:
    """Extract only the vendored llama.cpp tree into ``source`` (once); return it."""
    marker = source / "CMakeLists.txt"
    if marker.is_file():
        return source
    shutil.rmtree(source, ignore_errors=True)
    prefix = VENDORED_SOURCE + "/"
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            if not member.name.startswith(prefix) or not (member.isfile() or member.isdir()):
                continue
            member.name = member.name[len(prefix) :]
            members.append(member)
        archive.extractall(source, members=members, filter="data")
    if not marker.is_file():
        raise LlamaBuildError(f"{sdist.name} has no {VENDORED_SOURCE}")
    return source


def _cmake_build(
    source: Path, build: Path, targets: list[str], progress: bool, jobs: int | None, label: str, backend: str = CPU
) -> None:
    log_path = build.parent / f"{build.name}.log"
    build.mkdir(parents=True, exist_ok=True)
    jobs = jobs or os.cpu_count() or 1
    compiler = _compiler()
    cmake = str(Path(cmake_module.CMAKE_BIN_DIR) / "cmake")
    with open(log_path, "a") as log:
        configure = [
            cmake,
            "-S",
            str(source),
            "-B",
            str(build),
            f"-DCMAKE_MAKE_PROGRAM={Path(ninja.BIN_DIR) / 'ninja'}",
            f"-DCMAKE_CXX_COMPILER={compiler}",
            *CMAKE_OPTIONS,
            *BACKEND_OPTIONS[backend],
            *_vulkan_sdk_options(backend),
        ]
        print(f"configuring llama.cpp (log: {log_path}) ...", file=sys.stderr)
        if subprocess.run(configure, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            raise LlamaBuildError(f"cmake configure failed; see {log_path}")
        command = [cmake, "--build", str(build), "-j", str(jobs)]
        for target in targets:
            command += ["--target", target]
        bar = tqdm(total=100, unit="%", desc=label, disable=not progress, file=sys.stderr, dynamic_ncols=True)
        done = 0
        try:
            with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
                assert proc.stdout is not None
                for line in proc.stdout:
                    log.write(line)
                    # Make prints "[ 42%] Building ..."; Ninja prints "[12/345] ...".
                    if m := re.match(r"\[\s*(\d+)%\]", line):
                        percent = int(m.group(1))
                    elif m := re.match(r"\[(\d+)/(\d+)\]", line):
                        percent = 100 * int(m.group(1)) // int(m.group(2))
                    else:
                        continue
                    if percent > done:
                        bar.update(percent - done)
                        done = percent
        finally:
            bar.close()
        if proc.returncode != 0:
            raise LlamaBuildError(f"building {', '.join(targets)} failed; see {log_path}")


def _compiler() -> str:
    """The C++ compiler that builds llama.cpp and links the shim ($CXX, else g++)."""
    name = os.environ.get("CXX", "g++")
    path = shutil.which(name)
    if path is None:
        raise NoCompiler(
            f"building llama.cpp needs a C++ compiler, and there is no {name}: install g++ "
            "(apt-get install g++, dnf install gcc-c++), or run the 2023 engine, which needs none: "
            "--engine ctransformers"
        )
    return path


def _link_shim(source: Path, build: Path, output: Path, backend: str = CPU) -> None:
    """Compile the shim against llama.cpp's headers and link it with the static
    libraries, exporting nothing but the shim's own functions."""
    ext = shim_source_dir()
    version_script = output.with_suffix(".map")
    version_script.write_text("{ global: sll_*; local: *; };\n")
    command = [
        _compiler(),
        "-shared",
        "-fPIC",
        "-O2",
        "-fvisibility=hidden",
        # The shim is C; g++ is the linker because llama.cpp is C++.
        "-x",
        "c",
        str(ext / "llama_shim.c"),
        "-x",
        "none",
        f"-I{source / 'include'}",
        f"-I{source / 'ggml' / 'include'}",
        f"-I{ext}",
        # A mismatch between the shim and llama_abi.h is an error, not a warning.
        "-Werror=incompatible-pointer-types",
        "-o",
        str(output),
        *(str(build / lib) for lib in STATIC_LIBRARIES[:-1] + BACKEND_LIBRARIES[backend] + STATIC_LIBRARIES[-1:]),
        "-Wl,--exclude-libs,ALL",
        f"-Wl,--version-script={version_script}",
        "-Wl,--no-undefined",
        *_cuda_library_dirs(backend),
        *BACKEND_LINK[backend],
        "-lpthread",
        "-lm",
        "-ldl",
    ]
    try:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        version_script.unlink(missing_ok=True)
    if result.returncode != 0:
        output.unlink(missing_ok=True)
        raise LlamaBuildError(f"linking the llama.cpp shim failed:\n{result.stdout[-3000:]}")


def _vulkan_sdk_options(backend: str) -> list[str]:
    """Vulkan's headers from $VULKAN_SDK (LunarG's SDK, or a newer distribution's headers unpacked)
    ahead of the system's, which may be too old (VULKAN_MIN_HEADERS): SPIR-V's headers beside them."""
    sdk = os.environ.get("VULKAN_SDK")
    if backend != VULKAN or not sdk:
        return []
    return [f"-DVulkan_INCLUDE_DIR={sdk}/include", f"-DCMAKE_PREFIX_PATH={sdk}"]


def _cuda_library_dirs(backend: str) -> list[str]:
    """Where the CUDA runtime's libraries are, beside nvcc (``-L``, and a run path, so the engine finds
    them without LD_LIBRARY_PATH), and the driver's stubs where the link runs without a driver."""
    if backend != CUDA or (nvcc := shutil.which("nvcc")) is None:
        return []
    root = Path(nvcc).resolve().parents[1]
    dirs = [d for d in (root / "lib64", root / "lib", root / "lib64" / "stubs") if d.is_dir()]
    return [f"-L{d}" for d in dirs] + [f"-Wl,-rpath,{d}" for d in dirs if d.name != "stubs"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stopline.engine.llama_build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: every core)")
    parser.add_argument(
        "--gpu",
        choices=[*BACKENDS, "auto"],
        default=None,
        help="the backend to build (default: STOPLINE_GPU, else auto: a GPU backend where its compiler and a "
        "device are present, else the CPU)",
    )
    args = parser.parse_args(argv)
    try:
        machine = probe_machine({**os.environ, **({"STOPLINE_GPU": args.gpu} if args.gpu else {})})
        backend = choose_backend(machine)
        if cached_library(backend=backend.name).is_file():  # else the build says it
            print(f"llama.cpp backend: {backend.name} ({backend.why})", file=sys.stderr)
        print(ensure_llama_library(jobs=args.jobs, backend=backend))
    except LlamaBuildError as exc:
        print(f"stopline: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
