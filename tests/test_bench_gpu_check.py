"""python -m bench gpu-check: the pack it makes, the runs it asks for, the table it writes, and the one
line it says where the machine cannot run it. The measurement itself needs an NVIDIA GPU."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench import gpu_check
from bench.drivers.llama_server import ENGINE as LLAMA_SERVER
from bench.drivers.llama_server import LlamaServerDriver
from bench.launch import ROOT
from bench.run import parse_args
from stopline.engine import llama_build
from stopline.engine.llama_build import CPU, CUDA, SDIST_FILENAME, BuildMachine, build_root


@pytest.mark.parametrize(
    "path",
    [
        "CMakeLists.txt",
        "cmake/build-info.cmake",
        "common/CMakeLists.txt",
        "ggml/CMakeLists.txt",
        "ggml/src/ggml.c",
        "ggml/src/ggml-cpu/CMakeLists.txt",
        "ggml/src/ggml-cuda/CMakeLists.txt",
        "ggml/src/ggml-cuda/template-instances/fattn-vec-instance-q4_0-q4_0.cu",
        "include/llama.h",
        "src/llama.cpp",
        "tools/CMakeLists.txt",
        "tools/server/server.cpp",
        "tools/mtmd/CMakeLists.txt",
        "tools/ui/CMakeLists.txt",
        "vendor/cpp-httplib/httplib.h",
        "scripts/ui-assets.cmake",
        "models/ggml-vocab-llama-bpe.gguf",
    ],
)
def test_the_pack_keeps_what_the_build_reads(path):
    assert gpu_check.kept(path)


@pytest.mark.parametrize(
    "path",
    [
        "ggml/src/ggml-vulkan/ggml-vulkan.cpp",
        "ggml/src/ggml-metal/CMakeLists.txt",
        "ggml/src/ggml-sycl/CMakeLists.txt",
        "models/ggml-vocab-gpt-2.gguf",
        "docs/build.md",
        "tests/CMakeLists.txt",
        "examples/CMakeLists.txt",
        "gguf-py/gguf/gguf.py",
        "tools/ui/src/app.html",
        "scripts/sync-ggml.sh",
    ],
)
def test_the_pack_leaves_out_what_the_build_never_reads(path):
    assert not gpu_check.kept(path)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """The pack, made from the sdist the llama.cpp build keeps; never downloaded by a test."""
    if not (build_root() / SDIST_FILENAME).is_file():
        pytest.skip(f"no {SDIST_FILENAME} in the build cache (python -m stopline.engine.llama_build fetches it)")
    folder = tmp_path_factory.mktemp("pack")
    gpu_check.pack(folder, progress=False)
    return folder / gpu_check.PACK_SOURCE


def test_the_pack_is_under_the_limit_and_holds_one_tree(packed):
    assert packed.stat().st_size < gpu_check.PACK_LIMIT_BYTES
    with tarfile.open(packed) as archive:
        names = archive.getnames()
    assert all(name.startswith(gpu_check.PACK_ROOT + "/") for name in names)
    assert f"{gpu_check.PACK_ROOT}/tools/server/CMakeLists.txt" in names
    assert not any("/ggml-vulkan/" in name for name in names)


def test_cmake_configures_the_packed_tree(packed, tmp_path):
    """What CMake reads at configure time is all there; CUDA's part is configured on the GPU machine."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ to configure llama.cpp with")
    import cmake
    import ninja

    tree = gpu_check.unpack(packed, tmp_path)
    configure = [
        str(Path(cmake.CMAKE_BIN_DIR) / "cmake"),
        *("-S", str(tree), "-B", str(tmp_path / "build")),
        f"-DCMAKE_MAKE_PROGRAM={Path(ninja.BIN_DIR) / 'ninja'}",
        *llama_build.CMAKE_OPTIONS,
    ]
    result = subprocess.run(configure, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_a_named_source_tree_replaces_the_sdist(tmp_path, monkeypatch):
    (tmp_path / "CMakeLists.txt").write_text("")
    monkeypatch.setenv(llama_build.SOURCE_ENV, str(tmp_path))
    assert llama_build.given_source() == tmp_path.resolve()
    assert llama_build.llama_source_dir() == tmp_path.resolve()
    monkeypatch.setenv(llama_build.SOURCE_ENV, str(tmp_path / "nothing"))
    with pytest.raises(llama_build.LlamaBuildError, match="no llama.cpp tree"):
        llama_build.given_source()


def test_without_nvcc_or_a_gpu_it_says_so_in_one_line():
    with pytest.raises(gpu_check.GpuCheckError, match="no nvcc") as no_nvcc:
        gpu_check.check_machine(CUDA, BuildMachine(nvcc=None, nvidia_gpu=True))
    with pytest.raises(gpu_check.GpuCheckError, match="no NVIDIA GPU") as no_gpu:
        gpu_check.check_machine(CUDA, BuildMachine(nvcc="/usr/local/cuda/bin/nvcc"))
    assert "\n" not in str(no_nvcc.value) and "\n" not in str(no_gpu.value)
    assert gpu_check.check_machine(CPU, BuildMachine()).name == CPU
    assert gpu_check.check_machine(CUDA, BuildMachine(nvcc="nvcc", nvidia_gpu=True)).name == CUDA


def test_the_command_ends_with_that_line_and_no_traceback(tmp_path):
    """On a machine without an NVIDIA GPU (this one, or one without CUDA's compiler)."""
    if any(Path("/proc/driver/nvidia/gpus").glob("*")) and shutil.which("nvcc"):
        pytest.skip("this machine has an NVIDIA GPU and nvcc: the check would run")
    result = subprocess.run(
        [sys.executable, "-m", "bench", "gpu-check", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("bench gpu-check: no ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr


def test_each_model_runs_both_servers_offloaded_with_room_for_the_long_prompt(tmp_path):
    argv = gpu_check.run_arguments("llama-8b-shaped", CUDA, gpu_check.GPU_COUNTS, tmp_path, threads=16)
    args = parse_args(argv)
    assert args.engines == f"{gpu_check.ENGINE},{LLAMA_SERVER}"
    assert args.model == "llama-8b-shaped" and args.gpu_layers == "999"
    assert args.plan.long_tokens == gpu_check.LONG_PROMPT_TOKENS < args.context
    assert set(args.scenarios.split(",")) == {"decode", "prefill_long", "throughput", "prefill_speed"}
    cpu = parse_args(gpu_check.run_arguments("smollm2", CPU, gpu_check.CPU_COUNTS, tmp_path, threads=2))
    assert cpu.gpu_layers is None and cpu.plan.requests == gpu_check.CPU_COUNTS.requests


def test_llama_server_is_told_to_offload_only_when_asked(tmp_path):
    driver = LlamaServerDriver(Path("llama-server"), Path("m.gguf"), tmp_path, 1, 4, 5024)
    assert "--n-gpu-layers" not in driver.command()
    driver.gpu_layers = "999"
    command = driver.command()
    assert command[command.index("--n-gpu-layers") + 1] == "999"


def test_the_table_has_a_row_per_server_and_the_ratio_to_llama_server():
    def sample(target, scenario, **values):
        return {"target": target, "scenario": scenario, **values}

    samples = []
    servers = ((gpu_check.ENGINE, 190.0, 9000.0, 0.5), (LLAMA_SERVER, 200.0, 9500.0, None))
    for target, rate, prompt_rate, server_ms in servers:
        samples += [sample(target, "throughput", tokens_per_s_server=rate)]
        samples += [sample(target, "prefill_speed", prompt_tokens_per_s=prompt_rate)]
        samples += [sample(target, s, server_ms=server_ms, client_ms=3.0) for s in ("decode", "prefill_long")]
    rows = [("8B-shaped", {t: gpu_check.figures(samples, t) for t in (gpu_check.ENGINE, LLAMA_SERVER)})]
    text = gpu_check.markdown(rows, 4000)
    lines = text.splitlines()
    assert "4,000-token prompt" in lines[0] and len(lines) == 4
    assert "| 8B-shaped | Stopline | 190 (0.95×) | 9000 (0.95×) | 0.500 / 3.00 (n=1) |" in text
    assert "| 8B-shaped | llama-server | 200 | 9500 | – / 3.00 (n=1) |" in text


@pytest.mark.skipif(not shutil.which("nvcc"), reason="no nvcc: the CUDA check needs CUDA's compiler")
@pytest.mark.skipif(
    not any(Path("/proc/driver/nvidia/gpus").glob("*")), reason="no NVIDIA GPU: python -m bench gpu-check runs on one"
)
def test_the_check_runs_on_a_gpu():
    pytest.skip("the check takes minutes: run python -m bench gpu-check (docs/benchmarks.md, 'The GPU check')")


def test_smollm2_is_joined_from_its_parts_only_when_they_make_the_pinned_file(tmp_path, monkeypatch):
    import hashlib

    from stopline.engine import model as embedded

    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path / "cache"))
    parts = tmp_path / gpu_check.SMOLLM2_PARTS
    parts.mkdir()
    for n, text in ((1, b"first "), (2, b"second "), (10, b"tenth")):
        (parts / f"part{n}").write_bytes(text)
    monkeypatch.setattr(embedded, "GGUF_SHA256", hashlib.sha256(b"wrong").hexdigest())
    with pytest.raises(gpu_check.GpuCheckError, match="do not make SmolLM2"):
        gpu_check.place_smollm2(parts)
    # In the parts' order by number: part10 after part2.
    monkeypatch.setattr(embedded, "GGUF_SHA256", hashlib.sha256(b"first second tenth").hexdigest())
    gpu_check.place_smollm2(parts)
    assert (tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == b"first second tenth"
