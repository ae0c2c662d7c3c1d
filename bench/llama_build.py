"""Build llama.cpp's ``llama-server`` once, into the user cache, for the benchmark.

llama.cpp's source is taken from the ``llama-cpp-python`` source distribution on
PyPI, which vendors llama.cpp (``vendor/llama.cpp``) at the commit pinned by that
release; the archive is verified against a pinned sha256. Only the
``llama-server`` target is built, for the CPU, with every optional network
feature off (no HTTPS, no web UI download). Nothing of llama.cpp is part of
this repository.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from tqdm import tqdm

from stopline.model import ModelFetchError, _verify, cache_dir

SDIST_VERSION = "0.3.36"
SDIST_REQUIREMENT = f"llama-cpp-python=={SDIST_VERSION}"
SDIST_FILENAME = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDORED_SOURCE = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp"
# What the peer is called in reports: the llama.cpp that release vendors.
SOURCE_LABEL = f"llama.cpp as vendored by llama-cpp-python {SDIST_VERSION}"

CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
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
# A change of options builds a new binary (in the same build tree, so only what changed is rebuilt).
BUILD_KEY = hashlib.sha256(" ".join(CMAKE_OPTIONS).encode()).hexdigest()[:8]


class LlamaBuildError(RuntimeError):
    """llama-server could not be fetched or built."""


def build_dir() -> Path:
    return cache_dir() / "llama-server" / SDIST_VERSION


def cached_binary() -> Path:
    return build_dir() / "bin" / f"llama-server-{BUILD_KEY}"


def ensure_llama_server(progress: bool = True, jobs: int | None = None) -> Path:
    """Return the cached llama-server binary, fetching and building it on first use."""
    binary = cached_binary()
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    root = build_dir()
    source = _extract(_download_sdist(root), root)
    built = _cmake_build(source, root / "build", progress, jobs or os.cpu_count() or 1)
    binary.parent.mkdir(parents=True, exist_ok=True)
    temp = binary.with_name(f".{binary.name}.part")
    shutil.copy2(built, temp)
    os.replace(temp, binary)  # a binary in place means a finished build
    return binary


def _download_sdist(root: Path) -> Path:
    sdist = root / SDIST_FILENAME
    if not sdist.is_file():
        root.mkdir(parents=True, exist_ok=True)
        print(f"fetching {SDIST_REQUIREMENT} (llama.cpp's source) ...", file=sys.stderr)
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary=:all:",
            "--disable-pip-version-check",
            "-d",
            str(root),
            SDIST_REQUIREMENT,
        ]
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0 or not sdist.is_file():
            raise LlamaBuildError(f"could not download {SDIST_REQUIREMENT}:\n{result.stdout[-2000:]}")
    try:
        _verify(sdist, SDIST_SHA256)
    except ModelFetchError as e:
        raise LlamaBuildError(str(e)) from None
    return sdist


def _extract(sdist: Path, root: Path) -> Path:
    """Extract only the vendored llama.cpp tree; return its directory."""
    source = root / "src"
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


def _cmake_build(source: Path, build: Path, progress: bool, jobs: int) -> Path:
    log_path = build.parent / "build.log"
    build.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        configure = ["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS]
        print(f"configuring llama.cpp (log: {log_path}) ...", file=sys.stderr)
        if subprocess.run(configure, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            raise LlamaBuildError(f"cmake configure failed; see {log_path}")
        command = ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]
        bar = tqdm(
            total=100, unit="%", desc="building llama-server", disable=not progress, file=sys.stderr, dynamic_ncols=True
        )
        done = 0
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
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
        bar.close()
        if proc.returncode != 0:
            raise LlamaBuildError(f"building llama-server failed; see {log_path}")
    built = build / "bin" / "llama-server"
    if not built.is_file():
        raise LlamaBuildError(f"the build produced no {built}")
    return built


if __name__ == "__main__":
    print(ensure_llama_server())
