"""GPU offload: which backend the build chooses, --gpu-layers, and what a CPU build reports.

The backend rule is tested on made-up machines. The engine's tests run on the CPU build, which
every machine has; the Vulkan test runs where that build exists (STOPLINE_GPU=vulkan python -m
stopline.engine.llama_build), on Mesa's lavapipe where no GPU is present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stopline import _core
from stopline.__main__ import parse_args, settings_from
from stopline.engine import llama_build
from stopline.engine.llama_build import (
    CPU,
    CUDA,
    VULKAN,
    BackendUnavailable,
    BuildMachine,
    cached_library,
    choose_backend,
)
from stopline.engine.loop import Engine
from stopline.engine.model import original_gguf_path
from stopline.protocol.vocabulary import EngineName
from stopline.settings import GPU_LAYERS_ALL
from support import http_get

NVCC = "/usr/local/cuda/bin/nvcc"


@pytest.mark.parametrize(
    ("machine", "backend", "why"),
    [
        # Nothing to build a GPU backend with: the CPU, as everywhere today.
        (BuildMachine(), CPU, "no GPU compiler"),
        # CUDA's compiler without a GPU (a CI runner with the toolkit): minutes of compiling saved.
        (BuildMachine(nvcc=NVCC), CPU, "no NVIDIA GPU"),
        (BuildMachine(nvcc=NVCC, nvidia_gpu=True), CUDA, "NVIDIA GPU"),
        # An NVIDIA GPU but no compiler for it: the CPU, or Vulkan where it can be built and sees a GPU.
        (BuildMachine(nvidia_gpu=True), CPU, "no GPU compiler"),
        (BuildMachine(nvidia_gpu=True, vulkan_sdk=True, vulkan_gpu=True), VULKAN, "Vulkan GPU"),
        # Vulkan's headers with lavapipe alone: slower than ggml's CPU code, so not unasked.
        (BuildMachine(vulkan_sdk=True), CPU, "no Vulkan GPU"),
        (BuildMachine(vulkan_sdk=True, vulkan_gpu=True), VULKAN, "Vulkan GPU"),
        # Both: CUDA, the faster of the two on NVIDIA hardware.
        (BuildMachine(nvcc=NVCC, nvidia_gpu=True, vulkan_sdk=True, vulkan_gpu=True), CUDA, "NVIDIA GPU"),
        # Asked for by name: built wherever it can be, device or not.
        (BuildMachine("vulkan", vulkan_sdk=True), VULKAN, "STOPLINE_GPU=vulkan"),
        (BuildMachine("cuda", nvcc=NVCC), CUDA, "no NVIDIA GPU is visible"),
        (BuildMachine("CPU", nvcc=NVCC, nvidia_gpu=True), CPU, "STOPLINE_GPU=cpu"),
        (BuildMachine("", vulkan_sdk=True, vulkan_gpu=True), VULKAN, "Vulkan GPU"),
        # Headers older than this llama.cpp needs (Debian 12's): not unasked, even with a GPU.
        (BuildMachine(vulkan_sdk=True, vulkan_headers=(1, 3, 239), vulkan_gpu=True), CPU, "too old"),
        (BuildMachine(vulkan_sdk=True, vulkan_headers=(1, 4, 309), vulkan_gpu=True), VULKAN, "Vulkan GPU"),
    ],
)
def test_the_backend_is_a_gpu_one_only_where_its_compiler_and_a_device_are(machine, backend, why):
    chosen = choose_backend(machine)
    assert chosen.name == backend and why in chosen.why


@pytest.mark.parametrize(
    ("machine", "names"),
    [
        (BuildMachine("cuda"), "nvcc"),
        (BuildMachine("vulkan", nvcc=NVCC, nvidia_gpu=True), "libvulkan-dev glslc spirv-headers"),
        (BuildMachine("metal"), "cpu, vulkan, cuda or auto"),
        (BuildMachine("vulkan", vulkan_sdk=True, vulkan_headers=(1, 3, 239)), "1.3.239, .* 1.3.272 .* VULKAN_SDK"),
    ],
)
def test_a_backend_asked_for_and_not_buildable_says_what_to_install(machine, names):
    with pytest.raises(BackendUnavailable, match=names):
        choose_backend(machine)


def test_the_machine_probe_reads_stopline_gpu_and_looks_for_no_device_when_told(monkeypatch):
    monkeypatch.setattr(llama_build, "_vulkan_gpu", lambda: pytest.fail("no device check when told"))
    assert llama_build.probe_machine({"STOPLINE_GPU": "cpu"}).requested == "cpu"


def test_the_vulkan_headers_version_is_read_from_vulkan_sdk_first(tmp_path):
    headers = tmp_path / "include" / "vulkan"
    headers.mkdir(parents=True)
    (headers / "vulkan_core.h").write_text(
        "#define VK_HEADER_VERSION 309\n"
        "#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, 4, VK_HEADER_VERSION)\n"
    )
    assert llama_build._vulkan_header_version({"VULKAN_SDK": str(tmp_path)}) == (1, 4, 309)


def test_each_backend_builds_and_links_in_trees_of_its_own(monkeypatch, tmp_path):
    monkeypatch.setattr(llama_build, "build_root", lambda: tmp_path)
    monkeypatch.setattr(llama_build, "_download_sdist", lambda root, progress: tmp_path / "sdist")
    monkeypatch.setattr(llama_build, "_extract", lambda sdist, source: source)
    # The CPU build's trees and library keep the names they had before backends were chosen.
    assert llama_build._tree(False)[1].name == f"build-{llama_build.BUILD_KEY}"
    cpu = cached_library()
    assert cpu.name.startswith("libstopline-llama-") and cpu == cached_library(backend=CPU)
    names = {cpu, cached_library(backend=VULKAN), cached_library(backend=CUDA), cached_library(False, VULKAN)}
    assert len(names) == 4
    trees = {llama_build._tree(False, backend=b)[1] for b in (CPU, VULKAN, CUDA)}
    assert len(trees) == 3


@pytest.mark.parametrize(
    ("argv", "layers"),
    [([], None), (["--gpu-layers", "all"], GPU_LAYERS_ALL), (["-ngl", "12"], 12), (["--gpu-layers", "0"], 0)],
)
def test_gpu_layers_is_a_count_or_all_and_ngl_spells_it_too(argv, layers):
    assert settings_from(parse_args(argv)).gpu_layers == layers


def test_gpu_layers_reads_its_variable_and_refuses_what_is_not_a_count(monkeypatch, capsys):
    monkeypatch.setenv("STOPLINE_GPU_LAYERS", "ALL")
    assert settings_from(parse_args([])).gpu_layers == GPU_LAYERS_ALL
    with pytest.raises(SystemExit):
        parse_args(["--gpu-layers", "-3"])
    assert "'-3' is not a layer count" in capsys.readouterr().err


@pytest.fixture(scope="module")
def cpu_library() -> Path:
    return llama_build.ensure_llama_library(progress=False, backend=llama_build.Backend(CPU, "the tests"))


def test_a_cpu_build_offloads_nothing_and_knows_the_models_layers(llama_engine, cpu_library):
    # The engine's fixture loaded the library; with no GPU backend there is no device.
    assert _core.llama_gpu_device() is None
    assert llama_engine.gpu_device is None and llama_engine.gpu_layers == 0
    model = _core.LlamaModel(str(original_gguf_path(progress=False)), GPU_LAYERS_ALL)
    try:
        # SmolLM2: 30 repeating layers and the output layer.
        assert model.gpu_layers == 0 and model.layer_count == 31
    finally:
        model.close()


def test_layers_asked_for_without_a_gpu_warn_and_run_on_the_cpu(llama_engine, logs):
    engine = Engine.load(engine=EngineName.LLAMA_CPP, threads=1, context_length=256, progress=False, gpu_layers=8)
    assert engine.gpu_layers == 0 and engine.gpu_device is None
    [warning] = logs.records("gpu_unavailable")
    assert warning["gpu_layers"] == 8 and "runs on the CPU" in warning["detail"]
    # Unasked, no warning: offloading every layer is only the default where there is a device.
    logs.clear()
    Engine.load(engine=EngineName.LLAMA_CPP, threads=1, context_length=256, progress=False)
    assert not logs.records("gpu_unavailable")


@pytest.mark.both_engines(why="only llama.cpp offloads; ctransformers says it runs on the CPU")
async def test_healthz_says_where_the_layers_run(server):
    status, body = await http_get(server, "/healthz")
    health = json.loads(body)
    assert status == 200 and health["gpu"] is None and health["gpu_layers"] == 0


VULKAN_PROBE = """
import json, sys, threading, time
sys.path.insert(0, "tests")
from stopline.engine.loop import Engine
from support import make_generation, started_running
engine = Engine.load(engine="llama.cpp", threads=2, context_length=512, progress=False,
                     llama_library=sys.argv[1], gpu_layers=-1, prefill_chunk=64)
slot = engine.open_slot()
generation = make_generation(slot, engine.encode(messages=[{"role": "user", "content":
    "What is the capital of France? Answer in one word."}]), max_tokens=8, temperature=0)
generation.run()
report = {"device": engine.gpu_device, "layers": engine.gpu_layers, "of": engine.model.layer_count,
          "text": b"".join(generation.take()).decode()}
# One prompt chunk, evaluated whole, then stopped a quarter of the way through.
prompt = engine.encode(prompt="The history of bread is long. " * 40)[: engine.prefill_chunk]
slot.forget()
start = time.monotonic()
make_generation(slot, prompt, max_tokens=1, prefill_chunk=engine.prefill_chunk).run()
report["whole_s"] = time.monotonic() - start
slot.forget()
generation = make_generation(slot, prompt, max_tokens=8, prefill_chunk=engine.prefill_chunk)
worker = threading.Thread(target=generation.run)
worker.start()
started_running(generation)
time.sleep(report["whole_s"] / 4)
start = time.monotonic()
generation.cancel()
worker.join()
report["stop_s"] = time.monotonic() - start
result = generation.result
report.update(exit=result.exit.name, evaluated=result.prompt_tokens_evaluated, kv=slot.kv_positions,
              held=slot.n_held)
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def on_vulkan() -> dict:
    """What SmolLM2 did with every layer on a Vulkan device, in a process of its own (one llama.cpp
    library per process). ggml lists a CPU Vulkan device (lavapipe) only when named, as device 0
    where no GPU is present."""
    library = cached_library(backend=VULKAN)
    if not library.is_file():
        pytest.skip("no Vulkan build here: STOPLINE_GPU=vulkan python -m stopline.engine.llama_build builds it")
    environ = {**os.environ, "GGML_VK_VISIBLE_DEVICES": os.environ.get("GGML_VK_VISIBLE_DEVICES", "0")}
    done = subprocess.run(
        [sys.executable, "-c", VULKAN_PROBE, str(library)], capture_output=True, text=True, env=environ, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_every_layer_runs_on_a_vulkan_device(on_vulkan):
    assert on_vulkan["device"].startswith("Vulkan") and on_vulkan["layers"] == on_vulkan["of"] == 31
    assert "Paris" in on_vulkan["text"]


def test_a_stop_ends_a_gpu_evaluation_part_way(on_vulkan):
    # The GPU's nodes are computed in pieces, with the stop asked between them: the stop waits for
    # the piece under way, not for the rest of the evaluation, and the chunk's positions are dropped.
    assert on_vulkan["exit"] == "CANCELLED" and on_vulkan["evaluated"] == on_vulkan["kv"] == on_vulkan["held"] == 0
    assert on_vulkan["stop_s"] < on_vulkan["whole_s"] / 4, on_vulkan
