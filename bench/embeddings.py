"""python -m bench embeddings: all-MiniLM-L6-v2 served by Stopline and by llama-server, both by llama.cpp.

The model.zip is converted to a GGUF file (``stopline.engine.minilm_gguf``), which
llama-server serves with ``--embedding --pooling mean``; Stopline serves the file it writes the
same way into its cache. Both are confined to the same cores with as many compute threads
(llama-server's ``--threads``; Stopline takes one per core). Both get the same 20 sentences in
one request, and the cosine of each pair of vectors is reported. Then a batch of 32 sentences
(``POST /v1/embeddings``, one request) is sent ``--reps`` times to each, the servers taking
turns, alternating which goes first, each request SETTLE_S after the one before; the latency
is the client's, from sending the request to the last byte of its answer.

    python -m bench embeddings --build-llama-server [--reps 50] [--cpus 0,1] [--results-md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import sys
import time
import zipfile
from pathlib import Path

import aiohttp
import numpy as np

from stopline.engine.embeddings import MAX_TOKENS, TOKENS_PER_BATCH, model_zip_path
from stopline.engine.minilm_gguf import MODEL_NAME, write_gguf
from stopline.settings import EMBEDDING_MODELS

from .drivers.llama_server import LlamaServerDriver, ensure_llama_server
from .launch import ServerProcess
from .machine import load_average, machine
from .report import BENCH_DIR, write_json, write_results_section
from .tables import fmt, stat, table

OURS, LLAMA_SERVER = "stopline", "llama-server"
# The batch: sentences of a few words to a few dozen, as a search index or a RAG pipeline sends them.
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A cheetah is running behind its prey.",
    "The stock market fell sharply on Monday after the central bank raised interest rates again.",
    "How do I reset my password if I no longer have access to the email address on my account?",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The train to Lyon leaves from platform 4 at 7:42.",
    "Our quarterly revenue grew 12% year over year, driven mostly by subscriptions in Europe.",
    "Mix the flour and butter until it looks like breadcrumbs, then add cold water a spoonful at a time.",
    "Is it safe to take ibuprofen together with paracetamol?",
    "The museum is closed on Tuesdays.",
    "A cancelled request should free its slot within a millisecond, even in the middle of a long prompt.",
    "Le chat dort sur le canapé.",
    "In 1969, Apollo 11 landed on the Moon and Neil Armstrong became the first person to walk on its surface.",
    "Please send the signed contract back by Friday.",
    "The function returns None when the key is missing instead of raising KeyError.",
    "Heavy rain is expected across the north of the country tonight, with flooding possible near rivers.",
    "What is the difference between a virus and a bacterium?",
    "She parked the bike outside the library and went in to return two overdue books.",
    "The orchestra tuned up while the audience found their seats.",
    "Reduce the sauce over a low heat until it coats the back of a spoon.",
    "Kubernetes restarts a container whose liveness probe fails three times in a row.",
    "The hotel room had a view of the harbour.",
    "Can you recommend a good book about the history of mathematics?",
    "The defendant pleaded not guilty to all charges.",
    "Tomatoes grow best in full sun with regular watering.",
    "The new phone's battery lasts two days on a single charge.",
    "He forgot his umbrella at the station.",
]
COMPARED = 20
BATCH = 32
# The pause before each timed request.
SETTLE_S = 0.2


class EmbeddingLlamaServer(LlamaServerDriver):
    """llama-server serving embeddings: one slot per sentence of a batch, each with room for the
    longest input Stopline takes, and a micro-batch as large as Stopline's own batches of tokens."""

    def command(self) -> list[str]:
        size = str(TOKENS_PER_BATCH)
        return [*super().command(), "--embedding", "--pooling", "mean", "--batch-size", size, "--ubatch-size", size]


async def embed(session: aiohttp.ClientSession, url: str, texts: list[str]) -> tuple[np.ndarray, float, int]:
    """The vectors, in input order, the client's latency in ms, and the tokens the server counted."""
    started = time.perf_counter_ns()
    async with session.post(url, json={"model": EMBEDDING_MODELS[0], "input": texts}) as response:
        body = await response.read()
    latency_ms = (time.perf_counter_ns() - started) / 1e6
    if response.status != 200:
        raise RuntimeError(f"{url}: HTTP {response.status}: {body[:300]!r}")
    answer = json.loads(body)
    rows = sorted(answer["data"], key=lambda row: row["index"])
    vectors = np.array([row["embedding"] for row in rows], dtype=np.float64)
    return vectors, latency_ms, int(answer["usage"]["prompt_tokens"])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


async def measure(urls: dict[str, str], reps: int) -> dict:
    async with aiohttp.ClientSession() as session:
        # The first request loads Stopline's model; neither server is timed on it.
        for url in urls.values():
            await embed(session, url, SENTENCES[:1])
        compared = {name: await embed(session, url, SENTENCES[:COMPARED]) for name, url in urls.items()}
        pair = cosines(compared[OURS][0], compared[LLAMA_SERVER][0])
        latencies: dict[str, list[float]] = {name: [] for name in urls}
        tokens = {}
        for rep in range(reps):
            order = list(urls) if rep % 2 == 0 else list(urls)[::-1]
            for name in order:
                # The other server's compute threads wind down first: llama-server's spin for a
                # while after each request, on the cores the next request needs.
                await asyncio.sleep(SETTLE_S)
                _, latency_ms, tokens[name] = await embed(session, urls[name], SENTENCES[:BATCH])
                latencies[name].append(latency_ms)
    return {
        "cosines": [float(c) for c in pair],
        "prompt_tokens": {name: compared[name][2] for name in urls},
        "batch_tokens": tokens,
        "latency_ms": latencies,
    }


def gguf_path(out: Path) -> Path:
    path = out / f"{MODEL_NAME}.f32.gguf"
    with zipfile.ZipFile(model_zip_path(progress=True)) as files:
        write_gguf(files, path)
    return path


def argv_tail() -> list[str]:
    return sys.argv[2 if sys.argv[1:2] == ["embeddings"] else 1 :]


async def run(args) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    model = gguf_path(args.out)
    threads = len(args.cpu_set)
    binary = Path(args.llama_server) if args.llama_server else ensure_llama_server()
    llama = EmbeddingLlamaServer(binary, model, args.out, BATCH, threads, MAX_TOKENS, cpus=args.cpu_set)
    # Stopline computes embeddings with one thread per core it may use: as many as llama-server's.
    ours = ServerProcess(
        *("--port", "0", "--http-port", "0"), cpus=args.cpu_set, stderr_path=args.out / "server-stopline.log"
    )
    meta = {
        "command": "python -m bench embeddings " + shlex.join(argv_tail()),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "cpus": sorted(args.cpu_set),
        "threads": threads,
        "reps": args.reps,
        "load_average_start": load_average(),
    }
    try:
        await asyncio.gather(llama.start(), ours.started())
        meta["llama_server"] = " ".join(llama.info["command"][1:])
        meta["llama_server_source"] = llama.info["source"]
        urls = {OURS: f"{ours.api_url}/embeddings", LLAMA_SERVER: f"{llama.http_url}/v1/embeddings"}
        result = await measure(urls, args.reps)
    finally:
        await asyncio.gather(llama.stop(), ours.stopped())
    meta["load_average_end"] = load_average()
    results = {"meta": meta, **result}
    write_json(results, args.out / "results.json")
    return results


def section(results: dict) -> str:
    meta, m = results["meta"], results["meta"]["machine"]
    loads = "/".join(f"{x:.1f}" for x in (meta["load_average_start"][0], meta["load_average_end"][0]))
    pair = results["cosines"]
    rows = []
    for name in (OURS, LLAMA_SERVER):
        latencies = results["latency_ms"][name]
        p50, p99 = stat(latencies, "p50", "p99")
        per_s = BATCH * len(latencies) / (sum(latencies) / 1000)
        tokens = results["batch_tokens"][name]
        rows.append([name, str(len(latencies)), str(tokens), fmt(p50), fmt(p99), fmt(per_s)])
    latency_table = table("server|batches|tokens per batch|latency p50 (ms)|latency p99 (ms)|sentences/s", rows)
    assert latency_table is not None
    return "\n".join(
        [
            "## Embeddings: all-MiniLM-L6-v2, Stopline and llama-server",
            "",
            f"`{meta['command']}`",
            "",
            f"{m.get('cpu', 'CPU')}, {m.get('cores_available', '?')} cores available, 1-minute load average "
            f"{loads} at the start/end; both servers confined to cores {','.join(map(str, meta['cpus']))} with "
            f"{meta['threads']} compute threads each. Both serve the float32 GGUF file converted from the pinned "
            "model.zip (`stopline.engine.minilm_gguf`) by llama.cpp: Stopline the copy in its cache, llama-server "
            f"as `llama-server {meta['llama_server']}` ({meta['llama_server_source']}).",
            "",
            f"The same {len(pair)} sentences to both in one request: the cosine of each pair of vectors is "
            f"{min(pair):.6f} at the least, {float(np.median(pair)):.6f} at the median.",
            "",
            f"A batch of {BATCH} sentences in one `POST /v1/embeddings`, {meta['reps']} times to each, the servers "
            f"taking turns, each request {SETTLE_S:g} s after the one before (llama-server's threads spin a while "
            "after each request); latency from sending the request to the last byte of the answer:",
            "",
            latency_table,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench embeddings", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=50, help="batches of 32 sentences sent to each server")
    parser.add_argument("--llama-server", metavar="PATH", help="the llama-server binary")
    parser.add_argument("--build-llama-server", action="store_true", help="build llama-server from a pinned source")
    parser.add_argument("--cpus", help="the cores both servers are confined to, e.g. 0,1 (default: all available)")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "out" / "embeddings", help="output directory")
    parser.add_argument("--results-md", action="store_true", help="also write this run's section of bench/RESULTS.md")
    parser.add_argument("--render", action="store_true", help="no measurement: the report again from --out")
    args = parser.parse_args(argv)
    if not (args.render or args.llama_server or args.build_llama_server):
        parser.error("give --llama-server PATH or --build-llama-server")
    args.cpu_set = frozenset(int(c) for c in args.cpus.split(",")) if args.cpus else frozenset(os.sched_getaffinity(0))
    results = json.loads((args.out / "results.json").read_text()) if args.render else asyncio.run(run(args))
    text = section(results)
    (args.out / "report.md").write_text(text)
    print(text)
    if args.results_md:
        write_results_section(BENCH_DIR / "RESULTS.md", "embeddings", text)
    return 0
