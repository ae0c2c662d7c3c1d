"""python -m bench aiperf: Stopline and llama-server under NVIDIA's AIPerf, an outside serving benchmark.

Starts Stopline as its README runs it (``python -m stopline``: the llama.cpp
engine, its default slots and threads; its OpenAI API at the HTTP port's /v1)
and llama-server with its defaults for parallel serving (``--parallel 4``, one
unified KV cache, the model's trained context, as many threads as the cores
it is given), on the same GGUF file, each pinned to the same cores. For every
concurrency level, AIPerf profiles each server in turn (the order alternating
from level to level, the other server paused): ``aiperf profile
--endpoint-type chat --streaming`` with synthetic prompts of ``--input-tokens``
tokens and answers of ``--output-tokens`` tokens (``ignore_eos`` sent, so that
every answer has that length), then the same again with a share of the
requests cancelled (``--request-cancellation-rate``).

AIPerf is not one of Stopline's dependencies (it pins versions of shared
packages that Stopline's own pins exclude): it is installed once into a
virtual environment of its own in the user cache and run as a subprocess. It
counts tokens with the model's own tokenizer, written for it as a directory
that ``transformers`` loads. Each run's artifacts are kept under ``--out``; the
tables are built from AIPerf's JSON export (``profile_export_aiperf.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from stopline.engine.tokenizer import ChatTokenizer, TokenizerError
from stopline.settings import cache_dir

from .drivers.llama_server import LlamaServerDriver, call_json, ensure_llama_server
from .launch import ServerProcess, confine_to
from .machine import load_average, machine
from .report import BENCH_DIR, write_results_section
from .tables import fmt, table

AIPERF_VERSION = "0.13.0"
STOPLINE = "stopline"
LLAMA_SERVER = "llama-server"
SERVERS = (STOPLINE, LLAMA_SERVER)
# llama-server's default for parallel serving: 4 slots sharing one unified KV cache.
LLAMA_SERVER_SLOTS = 4
EXPORT = "profile_export_aiperf.json"
DEFAULT_REQUEST_RATE = 200.0


def venv_dir() -> Path:
    """AIPerf's own virtual environment, in Stopline's user cache."""
    return cache_dir() / "bench-aiperf-venv"


def ensure_aiperf(venv: Path | None = None) -> Path:
    """The ``aiperf`` command, installed on first use (``pip install aiperf==AIPERF_VERSION``
    into a virtual environment of its own, so that its pins never touch Stopline's)."""
    venv = venv or venv_dir()
    binary, marker = venv / "bin" / "aiperf", venv / "aiperf-version"
    if binary.is_file() and marker.is_file() and marker.read_text().strip() == AIPERF_VERSION:
        return binary
    print(f"installing aiperf=={AIPERF_VERSION} into {venv} (once) ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, f"aiperf=={AIPERF_VERSION}"], check=True)
    marker.write_text(AIPERF_VERSION + "\n")
    return binary


def write_tokenizer(tokenizer: ChatTokenizer, directory: Path, context_length: int) -> Path:
    """The model's tokenizer as ``transformers``' AutoTokenizer loads it from a directory:
    tokenizer.json (the ``tokenizers`` form) and tokenizer_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer.tokenizer.to_str(), "utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token or None,
        "eos_token": tokenizer.eos_token or None,
        "chat_template": tokenizer.chat_template,
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1), "utf-8")
    return directory


@dataclass(frozen=True)
class Profile:
    """One ``aiperf profile`` run against one server."""

    url: str  # the server's base URL; AIPerf adds /v1/chat/completions
    model: str  # the model name sent in each request
    tokenizer: Path
    concurrency: int
    requests: int
    artifact_dir: Path
    warmup: int = 0
    input_tokens: int = 200
    output_tokens: int = 64
    cancellation_rate: float | None = None  # percent of requests cancelled
    cancellation_delay_s: float | None = None  # after the request is sent (AIPerf's default: 0)
    seed: int = 0
    goodput: str | None = None  # AIPerf's SLOs, e.g. "time_to_first_token:500 inter_token_latency:50"
    # The most requests per second AIPerf starts, evenly spaced. Without a rate, AIPerf's sender
    # polls for a free concurrency slot in a loop that never sleeps: a core taken from the servers.
    # With one, it sleeps between attempts; a rate far above what the servers finish only spaces
    # the attempts, and each server waits for it alike.
    request_rate: float = DEFAULT_REQUEST_RATE


def profile_command(aiperf: Path | str, p: Profile) -> list[str]:
    """The ``aiperf profile`` command line of ``p``."""
    command = [
        *(str(aiperf), "profile", "--model", p.model, "--url", p.url),
        *("--endpoint-type", "chat", "--streaming", "--tokenizer", str(p.tokenizer)),
        *("--concurrency", str(p.concurrency), "--request-count", str(p.requests)),
        *("--request-rate", f"{p.request_rate:g}", "--arrival-pattern", "constant"),
        *("--synthetic-input-tokens-mean", str(p.input_tokens), "--synthetic-input-tokens-stddev", "0"),
        *("--output-tokens-mean", str(p.output_tokens), "--output-tokens-stddev", "0"),
        # Every answer as long as asked: the model's end-of-text token is not allowed to end it.
        *("--extra-inputs", "ignore_eos:true"),
        *("--random-seed", str(p.seed), "--artifact-dir", str(p.artifact_dir)),
        # No progress screen, no GPU or /metrics polling: nothing but the requests loads the server.
        *("--ui", "none", "--no-gpu-telemetry", "--no-server-metrics"),
    ]
    if p.warmup:
        command += ["--warmup-request-count", str(p.warmup)]
    if p.cancellation_rate:
        command += ["--request-cancellation-rate", f"{p.cancellation_rate:g}"]
        if p.cancellation_delay_s is not None:
            command += ["--request-cancellation-delay", f"{p.cancellation_delay_s:g}"]
    if p.goodput:
        command += ["--goodput", *p.goodput.split()]
    return command


# AIPerf's JSON export, read -------------------------------------------------------------


def _metric(export: dict, tag: str, key: str = "avg") -> float | None:
    """One figure of one of the export's metrics (None where AIPerf did not report it)."""
    metric = export.get(tag)
    if not isinstance(metric, dict):
        return None
    value = metric.get(key)
    return float(value) if isinstance(value, int | float) else None


def _count(export: dict, tag: str) -> int | None:
    value = _metric(export, tag)
    return None if value is None else int(value)


def cancelled_count(export: dict) -> int:
    """Requests AIPerf cancelled itself (``--request-cancellation-rate``): it counts them among
    the errors, as RequestCancellationError (HTTP 499) in the export's error summary."""
    return sum(
        int(entry.get("count", 0))
        for entry in export.get("error_summary") or []
        if (entry.get("error_details") or {}).get("type") == "RequestCancellationError"
    )


def parse_export(export: dict) -> dict:
    """The figures the report shows from one run's ``profile_export_aiperf.json``: tokens/s,
    TTFT and ITL in ms, requests/s, goodput (with ``--goodput``), and how many requests
    completed, were cancelled by AIPerf, or failed otherwise."""
    cancelled = cancelled_count(export)
    return {
        "output_tokens_per_s": _metric(export, "output_token_throughput"),
        "ttft_p50_ms": _metric(export, "time_to_first_token", "p50"),
        "ttft_p99_ms": _metric(export, "time_to_first_token", "p99"),
        "itl_p50_ms": _metric(export, "inter_token_latency", "p50"),
        "requests_per_s": _metric(export, "request_throughput"),
        "goodput_per_s": _metric(export, "goodput"),
        "completed": _count(export, "request_count") or 0,
        "cancelled": cancelled,
        "errors": (_count(export, "error_request_count") or 0) - cancelled,
        "output_tokens_per_request": _metric(export, "output_sequence_length"),
        "duration_s": _metric(export, "benchmark_duration"),
    }


# The report -----------------------------------------------------------------------------


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "–" if ours is None or theirs is None or theirs <= 0 else f"{ours / theirs:.2f}"


def _show(value) -> str:
    return "–" if value is None else str(value) if isinstance(value, int) else fmt(value)


def _by_level(rows: list[dict], cancelled: bool) -> dict[int, dict[str, dict]]:
    levels: dict[int, dict[str, dict]] = {}
    for row in rows:
        if bool(row.get("cancellation_rate")) == cancelled:
            levels.setdefault(row["concurrency"], {})[row["server"]] = row
    return dict(sorted(levels.items()))


def tables(rows: list[dict]) -> str:
    """The report's Markdown: per concurrency and server, then Stopline ÷ llama-server."""
    sections = []
    for cancelled in (False, True):
        levels = _by_level(rows, cancelled)
        body = [
            [
                str(c),
                server,
                *(
                    _show(row[k])
                    for k in ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "requests_per_s")
                ),
                *((_show(row["goodput_per_s"]), _show(row["cancelled"])) if cancelled else ()),
                _show(row["completed"]),
                _show(row["errors"]),
            ]
            for c, servers in levels.items()
            for server, row in sorted(servers.items(), key=lambda item: SERVERS.index(item[0]))
        ]
        header = "concurrency|server|output tokens/s|TTFT p50 (ms)|TTFT p99 (ms)|ITL p50 (ms)|requests/s"
        header += "|goodput (req/s)|cancelled" if cancelled else ""
        header += "|completed|errors"
        if rendered := table(header, body):
            rate = next((r["cancellation_rate"] for r in rows if r.get("cancellation_rate")), None)
            title = f"With {rate:g}% of requests cancelled" if cancelled else "Every request to its end"
            sections.append(f"### {title}\n\n{rendered}")
    ratio_rows = []
    for cancelled in (False, True):
        for c, servers in _by_level(rows, cancelled).items():
            ours, theirs = servers.get(STOPLINE), servers.get(LLAMA_SERVER)
            if ours is None or theirs is None:
                continue
            figures = ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "requests_per_s")
            label = f"{c}" + (f", {ours['cancellation_rate']:g}% cancelled" if cancelled else "")
            ratio_rows.append([label, *(_ratio(ours[k], theirs[k]) for k in figures)])
    ratios = table("concurrency|output tokens/s|TTFT p50|TTFT p99|ITL p50|requests/s", ratio_rows)
    if ratios:
        sections.append(
            "### Stopline ÷ llama-server\n\nAbove 1: Stopline produced more tokens or requests per second, "
            f"or took longer to its first token or between tokens.\n\n{ratios}"
        )
    return "\n\n".join(sections)


def _loads(loads) -> str:
    return " / ".join(f"{x:.1f}" for x in loads)


def report(results: dict) -> str:
    meta = results["meta"]
    lines = [
        f"## AIPerf {meta['aiperf_version']}: {meta['model']}",
        "",
        f"`{meta['command']}`, {meta['started_at']}, on cores {','.join(map(str, meta['cpus']))} "
        f"({meta['machine'].get('cpu', 'cpu unknown')}); load averages {_loads(meta['load_average_start'])} at the "
        f"start, {_loads(meta['load_average_end'])} at the end.",
        "",
        f"Each run: `aiperf profile --endpoint-type chat --streaming`, {meta['requests']} requests"
        f" (after {meta['warmup']} warm-up; at most {meta.get('request_rate', DEFAULT_REQUEST_RATE):g} started per"
        f" second), {meta['input_tokens']}-token synthetic prompts, "
        f"{meta['output_tokens']}-token answers with `ignore_eos`. The servers took turns level by level.",
        "",
        *(
            f"- {name}: `{shlex.join(info['command'])}`" + (f", {info['slots']} slots" if info.get("slots") else "")
            for name, info in meta["servers"].items()
        ),
        "",
        tables(results["rows"]),
        *(
            f"\nFailed: {f['server']} at concurrency {f['concurrency']}: {f['error']} ({f['artifacts']})"
            for f in results.get("failures", [])
        ),
    ]
    return "\n".join(lines) + "\n"


# The servers ----------------------------------------------------------------------------


class LlamaServerDefaults(LlamaServerDriver):
    """llama-server as it serves in parallel by default: 4 slots in one unified KV cache, the
    model's trained context (``--ctx-size 0``), its compute threads one per core it is given."""

    def command(self) -> list[str]:
        threads = str(self.threads)
        return [
            *(str(self.binary), "--model", str(self.model), "--host", "127.0.0.1", "--port", "0"),
            *("--parallel", str(self.slots), "--kv-unified", "--ctx-size", "0"),
            *("--threads", threads, "--threads-batch", threads, "--log-colors", "off"),
        ]


class StoplineDefaults:
    """``python -m stopline`` with its defaults but the ports (any free ones) and, for any model
    but the embedded one, ``--model``."""

    def __init__(self, model: Path | None, cpus: frozenset[int], log_path: Path, prompt_cache_dir: Path):
        # The prompt cache's disk tier in a folder of the run's own: states kept by an earlier run
        # would answer prompts that llama-server, started afresh, evaluates.
        self.args = ["--port", "0", "--http-port", "0", "--prompt-cache-dir", str(prompt_cache_dir)]
        self.args += ["--model", str(model)] if model else []
        self.cpus, self.log_path = cpus, log_path
        self.process: ServerProcess | None = None
        self.base_url = ""
        self.pid: int | None = None
        self.info: dict = {}  # its server_started record: slots, threads, context

    async def start(self) -> StoplineDefaults:
        self.process = ServerProcess(*self.args, stderr_path=self.log_path, cpus=self.cpus)
        await self.process.started()
        self.pid, self.info = self.process.pid, self.process.start_record
        self.base_url = self.process.api_url.removesuffix("/").removesuffix("/v1")
        return self

    @property
    def command(self) -> list[str]:
        return ["python", "-m", "stopline", *self.args]

    def pause(self, paused: bool) -> None:
        if self.process is not None:
            self.process.pause(paused)

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.pause(False)
            await self.process.stopped()
            (self.log_path.with_suffix(".jsonl")).write_text(self.process.stdout)


async def served_model(base_url: str) -> str:
    """The name the server lists first under /v1/models."""
    return (await call_json(base_url, "/v1/models"))["data"][0]["id"]


# The run --------------------------------------------------------------------------------


def levels(concurrency: list[int], cancel_concurrency: list[int], rate: float) -> list[tuple[int, float | None]]:
    """(concurrency, cancellation rate or None) of every level, in the order they run."""
    return [(c, None) for c in concurrency] + [(c, rate) for c in cancel_concurrency if rate]


def turns(level: int) -> tuple[str, ...]:
    """The servers' order at the ``level``-th level: alternating, so that a drift in the machine's
    load favours neither."""
    return SERVERS if level % 2 == 0 else SERVERS[::-1]


def run_aiperf(command: list[str], artifact_dir: Path, cpus: frozenset[int] | None, timeout: float) -> dict:
    """Run one profile; its JSON export, read."""
    artifact_dir.mkdir(parents=True, exist_ok=True)
    (artifact_dir / "command.txt").write_text(shlex.join(command) + "\n")
    # No telemetry and no hub look-ups: the tokenizer is a local directory.
    env = os.environ | {"HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}
    with open(artifact_dir / "aiperf.log", "wb") as log:
        code = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=artifact_dir,
            start_new_session=True,
            preexec_fn=lambda: _as_client(cpus),
            timeout=timeout,
        ).returncode
    export = artifact_dir / EXPORT
    if code != 0 or not export.is_file():
        tail = (artifact_dir / "aiperf.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"aiperf exited with {code}; see {artifact_dir / 'aiperf.log'}:\n{tail}")
    return json.loads(export.read_text())


def _as_client(cpus: frozenset[int] | None) -> None:
    """AIPerf's own processes run at the lowest priority, so that on cores the servers share they
    take nothing from whichever server they measure. Where the kernel groups processes by session
    (autogroup), a nice value counts only inside the group, and a server started in a session of
    its own would share the cores with AIPerf's group half and half; so AIPerf runs in a session
    of its own (``start_new_session``) whose group is lowered as well."""
    os.nice(19)
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:  # no autogroup: the nice value alone orders the processes
        pass
    confine = confine_to(cpus)
    if confine is not None:
        confine()


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    from .run import MODELS

    p = argparse.ArgumentParser(
        prog="python -m bench aiperf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=list(MODELS), default="smollm2")
    p.add_argument("--concurrency", type=parse_ints, default=[1, 2, 4, 8, 16], help="levels, e.g. 1,2,4,8,16")
    p.add_argument(
        "--cancel-concurrency",
        type=parse_ints,
        default=None,
        help="levels of the runs with cancels (default: those of --concurrency; empty: none)",
    )
    p.add_argument("--cancellation-rate", type=float, default=30.0, help="percent of requests cancelled (0: none)")
    p.add_argument("--cancellation-delay", type=float, default=None, help="seconds after sending (AIPerf's: 0)")
    p.add_argument("--requests", type=int, default=100, help="requests per run")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per run, not counted")
    p.add_argument("--input-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument(
        "--request-rate",
        type=float,
        default=DEFAULT_REQUEST_RATE,
        help="the most requests per second AIPerf starts, evenly spaced (spares the client's polling loop)",
    )
    p.add_argument("--goodput", help="AIPerf's SLOs, e.g. 'time_to_first_token:1000 inter_token_latency:100'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpus", help="the cores both servers are confined to, e.g. 0,1 (default: all available)")
    p.add_argument("--client-cpus", help="the cores AIPerf is confined to (default: not confined)")
    p.add_argument("--llama-server", metavar="PATH", help="the llama-server binary")
    p.add_argument("--build-llama-server", action="store_true", help="build llama-server from a pinned source (once)")
    p.add_argument("--aiperf", metavar="PATH", help="an aiperf command to use (default: installed into the cache)")
    p.add_argument("--run-timeout", type=float, default=3600, help="seconds one aiperf run may take")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench/out/aiperf)")
    p.add_argument("--results-md", action="store_true", help="also write the run's section of bench/RESULTS.md")
    args = p.parse_args(argv)
    if not (args.llama_server or args.build_llama_server):
        p.error("llama-server needs --llama-server PATH or --build-llama-server")
    if args.cancel_concurrency is None:
        args.cancel_concurrency = args.concurrency
    args.cpu_set = frozenset(parse_ints(args.cpus)) if args.cpus else frozenset(os.sched_getaffinity(0))
    args.client_cpu_set = frozenset(parse_ints(args.client_cpus)) if args.client_cpus else None
    return args


def model_tokenizer(choice: str, gguf: Path) -> ChatTokenizer:
    """The tokenizer AIPerf counts with: the embedded model's, or one built from the GGUF's vocabulary."""
    from stopline.engine import model as embedded

    if choice == "smollm2":
        return embedded.embedded_tokenizer(progress=False)
    try:
        return ChatTokenizer.from_gguf(gguf)
    except TokenizerError as exc:
        raise SystemExit(f"--model {choice}: no tokenizer AIPerf can load: {exc}") from None


def plan_profile(
    args, url: str, model: str, tokenizer: Path, out: Path, concurrency: int, rate: float | None, level: int
) -> Profile:
    """The profile of the ``level``-th level against one server, its artifacts in ``out``. Both
    servers get the same prompts at a level, and new ones at each level (the seed counts the
    levels): a prompt seen at an earlier level would be answered from either server's prompt cache."""
    return Profile(
        url=url,
        model=model,
        tokenizer=tokenizer,
        concurrency=concurrency,
        requests=args.requests,
        warmup=args.warmup,
        artifact_dir=out / (f"c{concurrency}" + (f"-cancel{rate:g}" if rate else "")),
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        cancellation_rate=rate,
        cancellation_delay_s=args.cancellation_delay if rate else None,
        seed=args.seed + level,
        goodput=args.goodput,
        request_rate=args.request_rate,
    )


async def run(args) -> dict:
    from stopline.settings import DEFAULT_CONTEXT_LENGTH

    from .report import BENCH_DIR
    from .run import MODELS

    model = MODELS[args.model]
    out = args.out or BENCH_DIR / "out" / "aiperf"
    out.mkdir(parents=True, exist_ok=True)
    aiperf = Path(args.aiperf) if args.aiperf else ensure_aiperf()
    binary = Path(args.llama_server) if args.llama_server else ensure_llama_server()
    gguf = model.gguf()
    tokenizer = write_tokenizer(model_tokenizer(args.model, gguf), out / "tokenizer", DEFAULT_CONTEXT_LENGTH)
    load_at_start = load_average()
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    prompt_cache = out / "stopline-prompt-cache"
    shutil.rmtree(prompt_cache, ignore_errors=True)
    stopline = StoplineDefaults(
        None if args.model == "smollm2" else gguf, args.cpu_set, out / "server-stopline.log", prompt_cache
    )
    llama = LlamaServerDefaults(
        binary, gguf, out, LLAMA_SERVER_SLOTS, len(args.cpu_set), DEFAULT_CONTEXT_LENGTH, cpus=args.cpu_set
    )
    print("starting stopline and llama-server ...", file=sys.stderr)
    servers = {STOPLINE: stopline, LLAMA_SERVER: llama}
    rows: list[dict] = []
    failures: list[dict] = []
    try:
        await asyncio.gather(stopline.start(), llama.start())
        urls = {STOPLINE: stopline.base_url, LLAMA_SERVER: llama.http_url}
        names = {name: await served_model(url) for name, url in urls.items()}
        plan = levels(args.concurrency, args.cancel_concurrency, args.cancellation_rate)
        for index, (concurrency, rate) in enumerate(plan):
            for name in turns(index):
                for other, server in servers.items():
                    server.pause(other != name)
                profile = plan_profile(args, urls[name], names[name], tokenizer, out / name, concurrency, rate, index)
                print(f"aiperf: {name}, concurrency {concurrency}{f', {rate:g}% cancelled' if rate else ''}")
                command = profile_command(aiperf, profile)
                timeout = args.run_timeout
                row = {"server": name, "concurrency": concurrency, "cancellation_rate": rate}
                try:
                    export = await asyncio.to_thread(
                        run_aiperf, command, profile.artifact_dir, args.client_cpu_set, timeout
                    )
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    # One failed run costs its row, not the others'.
                    print(f"aiperf failed: {exc}", file=sys.stderr)
                    failures.append(row | {"error": str(exc).splitlines()[0], "artifacts": str(profile.artifact_dir)})
                    continue
                rows.append(row | parse_export(export))
    finally:
        for server in servers.values():
            server.pause(False)
        await asyncio.gather(stopline.stop(), llama.stop())
    meta = {
        "command": "python -m bench aiperf " + shlex.join(sys.argv[2 if sys.argv[1:2] == ["aiperf"] else 1 :]),
        "started_at": started_at,
        "aiperf_version": AIPERF_VERSION,
        "machine": machine(),
        "model": model.title,
        "cpus": sorted(args.cpu_set),
        "client_cpus": sorted(args.client_cpu_set) if args.client_cpu_set else None,
        "requests": args.requests,
        "warmup": args.warmup,
        "request_rate": args.request_rate,
        "input_tokens": args.input_tokens,
        "output_tokens": args.output_tokens,
        "load_average_start": load_at_start,
        "load_average_end": load_average(),
        "servers": {
            STOPLINE: {
                "command": stopline.command,
                "model_name": names[STOPLINE],
                "slots": stopline.info.get("workers"),
                "threads": stopline.info.get("threads"),
                "context_length": stopline.info.get("context_length"),
            },
            LLAMA_SERVER: {
                "command": llama.info.get("command", []),
                "source": llama.info.get("source"),
                "slots": LLAMA_SERVER_SLOTS,
                "threads": llama.threads,
            },
        },
    }
    return {"meta": meta, "rows": rows, "failures": failures, "out": str(out)}


def main(argv=None) -> int:
    args = parse_args(argv)
    results = asyncio.run(run(args))
    out = Path(results.pop("out"))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    markdown = report(results)
    (out / "report.md").write_text(markdown)
    if args.results_md:
        write_results_section(BENCH_DIR / "RESULTS.md", f"aiperf-{args.model}", markdown)
    print(markdown)
    print(f"results: {out / 'results.json'}\nreport: {out / 'report.md'}", file=sys.stderr)
    return 0
