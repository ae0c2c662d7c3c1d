"""Shared fixtures: the real model, real servers on port 0, a browser, the service's logs;
and the hooks that let the tests that measure a wait run alone. The plain helpers the tests
share are in the ``support`` package beside this file.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import tempfile
import time
from pathlib import Path

import aiohttp
import gguf
import pytest
import pytest_asyncio
from playwright.async_api import async_playwright

from stopline import settings as settings_module
from stopline.engine.loop import Engine
from stopline.engine.model import original_gguf_path
from stopline.observability import configure_logging
from stopline.protocol.vocabulary import EngineName
from support import UNIT, LogCapture, open_fds, running_server
from support.web import close_page, new_page

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]


def pytest_collection_modifyitems(config, items) -> None:
    # Browser tests are all slow: the fast tier (-m "not slow") runs without a browser.
    for item in items:
        if item.get_closest_marker("browser"):
            item.add_marker(pytest.mark.slow)


@contextlib.contextmanager
def taking_turns(run_id: str, alone: bool):
    """Across the test processes of one run (pytest-xdist's ``-n``): any number of tests at once,
    or one marked ``alone`` with nothing beside it. A test that measures how long a stop waits
    must not share the cores with another test's model. The turnstile keeps a test that waits to
    run alone from being passed over by the other processes' next tests."""
    directory = Path(tempfile.gettempdir())
    with (
        open(directory / f"stopline-tests-{run_id}.turnstile", "a") as turnstile,
        open(directory / f"stopline-tests-{run_id}.running", "a") as running,
    ):
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(running, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Set in each process of a run with -n; a run in one process has no one to take turns with.
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        return (yield)
    with taking_turns(run_id, alone=item.get_closest_marker("alone") is not None):
        return (yield)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def browser():
    """One headless Chromium for the whole session; each test opens its own context in it."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed")
    async with async_playwright() as p:
        chromium = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            await chromium.close()


@pytest.fixture(scope="session", autouse=True)
def prompt_cache_apart(tmp_path_factory):
    """A server built with the default settings keeps its prompt cache's disk tier in a folder
    of its own, never in the user's cache, where it would serve one test's prompts to another."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(settings_module, "default_prompt_cache_dir", lambda: tmp_path_factory.mktemp("prompt-cache"))
        yield


@pytest.fixture(scope="session")
def llama_engine() -> Engine:
    """The embedded SmolLM2 on the llama.cpp engine, the default: one compute thread per slot,
    as on two cores by default, and 4 slots of 2,048 tokens, which every test fits (slots sized
    from the model and the memory are 8 of 4 times as many tokens, slower to create for each
    test's server; a test that fills every slot and queues one more does it on one connection,
    whose live requests are 8 at most)."""
    return Engine.load(engine=EngineName.LLAMA_CPP, threads=1, context_length=2048, progress=False, sequences=4)


@pytest.fixture(scope="session")
def ctransformers_engine() -> Engine:
    """The embedded SmolLM2 on the ctransformers engine (its converted file), one compute thread
    per slot: for the tests about that engine, and the second run of each test marked ``both_engines``."""
    return Engine.load(engine=EngineName.CTRANSFORMERS, threads=1, progress=False)


ENGINE_FIXTURES = {EngineName.LLAMA_CPP: "llama_engine", EngineName.CTRANSFORMERS: "ctransformers_engine"}


def pytest_generate_tests(metafunc) -> None:
    """A test that takes ``engine``, or the ``server`` built on it, runs on llama.cpp, the default.
    One marked ``both_engines`` runs on ctransformers too, and the mark says why: what it checks
    passes through the engine, not only the layers above it. A module that defines its own
    ``engine`` fixture has chosen its engine."""
    if "engine" not in metafunc.fixturenames or hasattr(metafunc.module, "engine"):
        return
    marker = metafunc.definition.get_closest_marker("both_engines")
    if marker is not None and not marker.kwargs.get("why"):
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: both_engines(why=...) says why")
    engines = list(ENGINE_FIXTURES) if marker else [EngineName.LLAMA_CPP]
    metafunc.parametrize("engine", engines, indirect=True, ids=[e.value for e in engines], scope="session")


@pytest.fixture(scope="session")
def engine(request) -> Engine:
    """The embedded SmolLM2 on the engine ``pytest_generate_tests`` chose for the test, llama.cpp
    (the default) first. Each engine is loaded once."""
    return request.getfixturevalue(ENGINE_FIXTURES[request.param])


@pytest.fixture(scope="session")
def original_gguf_fields(llama_engine) -> dict:
    """The embedded model's original GGUF metadata (``GGUFReader.fields``), read once: reading takes
    seconds. Loading the llama.cpp engine has fetched the file."""
    return gguf.GGUFReader(str(original_gguf_path(progress=False))).fields


@pytest.fixture(scope="session")
def log_capture() -> LogCapture:
    capture = LogCapture()
    configure_logging("debug", stream=capture)
    return capture


@pytest.fixture
def logs(log_capture) -> LogCapture:
    """The service's JSON log records, starting empty for each test."""
    log_capture.clear()
    return log_capture


@pytest_asyncio.fixture
async def server(engine, logs):
    fds_before = open_fds()
    async with running_server(engine) as s:
        yield s
    # eventfds and sockets are all closed again.
    deadline = time.monotonic() + 2 * UNIT
    while open_fds() - fds_before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    leaked = {
        fd: os.readlink(f"/proc/self/fd/{fd}")
        for fd in open_fds() - fds_before
        if os.path.exists(f"/proc/self/fd/{fd}")
    }
    assert not leaked, leaked


@pytest.fixture
async def http():
    """A real aiohttp client session."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120 * UNIT)) as session:
        yield session


@pytest_asyncio.fixture
async def page(browser, server):
    """The web client, loaded from the ``server`` fixture and connected."""
    p = await new_page(browser, server.http_url + "/")
    try:
        yield p
    finally:
        await close_page(p)
