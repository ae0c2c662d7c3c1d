"""The Python face of the native loop: load a model, open slots, stream generations.

    engine = Engine.load()                      # the embedded model, on llama.cpp
    engine = Engine.load(path)                  # any GGUF llama.cpp runs
    engine = Engine.load(engine="ctransformers")  # the 2023 engine
    slot = engine.open_slot()                   # one native context
    stream = engine.start(slot, engine.encode(messages=[...]), SamplingParams(max_tokens=64))
    async for text in stream:                   # or: for text in stream
        ...
    stream.result                               # the way out, counts, timestamps

Each slot is one native context: a ctransformers model instance (contexts of
one file share its weights through mmap), or a llama.cpp context over one
loaded model. Each adds its own KV cache and scratch buffers (see
``docs/engine.md`` for the measured memory per slot). Both engines run the same
loop (``_core.Generation``); everything above :class:`Engine` cannot tell them
apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path

import structlog

from stopline import _core

from ..protocol.errors import SettingError
from ..protocol.requests import GenerationResult, SamplingParams
from ..protocol.vocabulary import AbortMode, Batching, EngineName, PromptSteps
from ..settings import DEFAULT_CONTEXT_LENGTH, GPU_LAYERS_ALL, Settings, physical_memory
from . import conversion
from . import model as embedded
from .cores import usable_cores
from .errors import EngineError, ModelLoadError
from .model_check import ModelFileError, check_model_file, read_gguf_metadata
from .prompt_cache import PromptCache, model_key
from .tokenizer import ChatTokenizer, LlamaTokenizer, NativeTokenizer, TextStream, TokenizerError, chat_template_of

log = structlog.get_logger("stopline")

__all__ = ["DEFAULT_PREFILL_CHUNK", "Engine", "Stream"]

# Prompt tokens per evaluation, by engine and abort mode. On ctransformers, whose
# evaluations stop between graph nodes, a chunk bounds stop latency through its
# longest node, so chunks grow only while prompt speed still gains; on llama.cpp,
# whose evaluations stop inside nodes, a chunk costs a stop nothing and takes
# llama-server's batch. Without a stop inside the evaluation, a stop waits for the
# chunk in progress, so each chunk costs one decode step. docs/engine.md has the
# measurements.
DEFAULT_PREFILL_CHUNK = {
    EngineName.CTRANSFORMERS: {AbortMode.IN_STEP: 64, AbortMode.BETWEEN_STEPS: 1},
    EngineName.LLAMA_CPP: {AbortMode.IN_STEP: 512, AbortMode.BETWEEN_STEPS: 1},
}

# The pieces llama.cpp computes a prompt chunk in. A stop that cuts a chunk short keeps the
# pieces finished before it (a resend, or the prompt cache, starts after them), so a piece
# bounds what a stop throws away; smaller ones cost prompt speed. docs/engine.md has the
# measurements.
DEFAULT_UBATCH = 128

# The share of the machine's memory that the llama.cpp engine's KV cache may take when no
# context length is asked for: every sequence gets the model's trained context, shortened
# to fit this share (the cache is allocated whole when the context is created).
KV_MEMORY_SHARE = 0.25

# Generations served at once when --workers is not given: llama-server's 4 parallel sequences
# at least, so that nobody who would be served there waits here. On llama.cpp, up to
# MAX_SEQUENCES where each still holds its whole context in the KV cache's share of memory:
# a 5th to 8th user then starts at once, in the running step, instead of waiting for a whole
# answer. Beyond that, every sequence added makes each running stream's step longer, for
# everyone; the queue (and priority) serve the rest.
DEFAULT_SEQUENCES = 4
MAX_SEQUENCES = 8


def _result_of(loop: _core.LoopResult) -> GenerationResult:
    """The native loop's result, field for field, as the protocol reads it."""
    return GenerationResult(**{f.name: getattr(loop, f.name) for f in fields(GenerationResult)})


def _ctransformers_library_path() -> str:
    # ctransformers_abi.h declares the binary interface of one release exactly.
    installed = importlib.metadata.version("ctransformers")
    if installed != _core.CTRANSFORMERS_VERSION:
        raise EngineError(
            f"ctransformers {installed} is installed; the native loop is built for "
            f"{_core.CTRANSFORMERS_VERSION} exactly"
        )
    # The same CPU build (avx2, avx or basic) that ctransformers would load.
    from ctransformers.lib import find_library

    return find_library()


def _gguf_version(path: Path) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8)[4:8], "little")


class Engine:
    """A loaded model: its file, its tokenizer and the settings every slot shares.

    :meth:`load` returns one of the two engines; they differ only in how they load a
    model and open a slot."""

    kind: EngineName
    # How it evaluates generations that run at once, unless told (--batching).
    batching: Batching
    name: str
    model_path: Path
    # The slots it is sized for: what the server opens unless --workers says otherwise.
    sequences: int = DEFAULT_SEQUENCES
    context_length: int
    vocab_size: int
    threads: int
    abort_mode: AbortMode
    prefill_chunk: int
    trim_output: bool
    tokenizer: ChatTokenizer | NativeTokenizer | LlamaTokenizer
    # Saved KV states across requests (llama.cpp only; stopline/engine/prompt_cache.py); None: off.
    prompt_cache: PromptCache | None = None
    # The GPU device the model's layers were offloaded to ("Vulkan0 (...)"), and how many; None, 0: the CPU.
    gpu_device: str | None = None
    gpu_layers: int = 0

    @classmethod
    def load(
        cls,
        model_path: str | os.PathLike | None = None,
        model_type: str | None = None,
        *,
        engine: EngineName | str = Settings.engine,
        context_length: int | None = Settings.context_length,
        threads: int | None = None,
        prefill_chunk: int | None = None,
        abort_mode: AbortMode | str = Settings.abort_mode,
        progress: bool = True,
        llama_library: str | os.PathLike | None = None,
        sequences: int | None = Settings.workers,
        gpu_layers: int | None = Settings.gpu_layers,
    ) -> Engine:
        """Load ``model_path`` (default: the embedded SmolLM2 model, fetched once) on ``engine``.

        ``sequences`` are the slots the engine is sized for (:attr:`sequences`), and
        ``context_length`` is each slot's; by default, on llama.cpp, both are sized from the model
        and the memory (:func:`sized_slots`), and on ctransformers they are DEFAULT_SEQUENCES of
        DEFAULT_CONTEXT_LENGTH. ``prefill_chunk`` defaults to the size that suits the abort mode in
        force. ``gpu_layers`` are offloaded (llama.cpp only; GPU_LAYERS_ALL: every one; None: every
        one where there is a device)."""
        if context_length is not None and context_length < 1:
            raise ValueError("context_length must be positive")
        threads = threads or usable_cores()
        abort_mode = AbortMode(abort_mode)
        if EngineName(engine) is EngineName.LLAMA_CPP:
            if model_type is not None:
                raise ValueError("--model-type names a GGML file's type, which only the ctransformers engine loads")
            return LlamaEngine.from_file(
                model_path,
                context_length,
                threads,
                prefill_chunk,
                abort_mode,
                progress,
                llama_library,
                sequences,
                gpu_layers,
            )
        if gpu_layers:
            _gpu_unavailable(gpu_layers, "the ctransformers engine computes on the CPU only")
        loaded = CtransformersEngine.from_file(
            model_path,
            model_type,
            context_length or DEFAULT_CONTEXT_LENGTH,
            threads,
            prefill_chunk,
            abort_mode,
            progress,
        )
        loaded.sequences = sequences or DEFAULT_SEQUENCES
        return loaded

    def open_slot(self) -> _core.Slot:
        """A new native context for this model. Close it with ``slot.close()``."""
        raise NotImplementedError

    def open_slots(
        self, count: int, batching: Batching | None = None, prompt_steps: PromptSteps = PromptSteps.MIXED
    ) -> Sequence[_core.Slot]:
        """``count`` slots for generations that run at the same time (``batching``: the
        engine's own, :attr:`batching`, unless given; ``prompt_steps`` matters to shared steps only)."""
        if (batching or self.batching) is not Batching.PER_SLOT:
            raise SettingError("--batching shared needs the llama.cpp engine")
        return [self.open_slot() for _ in range(count)]

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        """Token ids for raw ``prompt`` text, or for ``messages`` through the chat template."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        text = self.tokenizer.render_chat(messages) if messages is not None else prompt
        assert text is not None
        return self.tokenizer.encode(text)

    def start(
        self,
        slot: _core.Slot,
        prompt_tokens: list[int],
        params: SamplingParams,
        *,
        window: int = Settings.window,
        started_ns: int | None = None,
        threads: int | None = None,
        urgent: bool = False,
    ) -> Stream:
        """Prepare a generation on ``slot``, computing on ``threads`` (default: the engine's);
        it runs when the stream is iterated or run. ``urgent``: it preempted another, and does
        not wait for the step under way (Generation's ``urgent``)."""
        # time.monotonic_ns() reads CLOCK_MONOTONIC, the clock the native loop stamps with.
        now = started_ns if started_ns is not None else time.monotonic_ns()
        generation = _core.Generation(
            slot,
            prompt_tokens,
            params,
            prefill_chunk=self.prefill_chunk,
            threads=threads or self.threads,
            window=window,
            deadline_ns=_deadline(now, params.timeout_s),
            first_token_deadline_ns=_deadline(now, params.ttft_timeout_s),
            step_abort=self.abort_mode is AbortMode.IN_STEP,
            trim_output=self.trim_output,
            urgent=urgent,
        )
        prepare = None
        cache = self.prompt_cache
        if cache is not None and isinstance(slot, _core.LlamaSequence):
            key, tokens, chunk = self._prompt_cache_key(slot), list(prompt_tokens), self.prefill_chunk

            def prepare() -> int:
                return cache.prepare(key, slot, tokens, chunk)

        return Stream(generation, TextStream(list(generation.stop_sequences)), slot.token_bytes, prepare=prepare)

    def keep_in_prompt_cache(self, slots: Sequence[_core.Slot]) -> None:
        """Save what each of ``slots`` (idle) holds into the prompt cache, as a server stops,
        so that its disk tier keeps the last turn of each conversation too."""
        cache = self.prompt_cache
        if cache is None:
            return
        for slot in slots:
            if isinstance(slot, _core.LlamaSequence):
                cache.keep(self._prompt_cache_key(slot), slot, self.prefill_chunk)

    def _prompt_cache_key(self, slot: _core.Slot) -> str:
        """The prompt cache's key for states of ``slot``: what makes one KV state fit another context."""
        raise NotImplementedError


def _logprob_entry(piece: bytes, logprob: float) -> dict:
    return {"token": piece.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(piece)}


def _gpu_unavailable(asked: int, detail: str) -> None:
    """Layers asked for with nowhere to offload them: the model runs on the CPU, as llama-server's does."""
    log.warning(
        "gpu_unavailable",
        gpu_layers="all" if asked == GPU_LAYERS_ALL else asked,
        detail=detail + "; the model runs on the CPU",
    )


def _step_abort_unavailable(detail: str, cause: object) -> None:
    log.warning(
        "step_abort_unavailable",
        abort_mode=str(AbortMode.BETWEEN_STEPS),
        detail=detail,
        cause=str(cause) if cause is not None else None,
    )


class CtransformersEngine(Engine):
    """ctransformers 0.2.27: each slot is one model instance, stopped inside an
    evaluation by the step hook (ext/step_abort.h)."""

    kind = EngineName.CTRANSFORMERS
    batching = Batching.PER_SLOT

    def __init__(
        self,
        model_path: Path,
        model_type: str,
        tokenizer: ChatTokenizer | None,
        name: str,
        context_length: int,
        threads: int,
        prefill_chunk: int | None,
        abort_mode: AbortMode,
    ):
        self.model_path = model_path
        self.model_type = model_type
        self.name = name
        self.threads = threads
        _core.load_ctransformers_library(_ctransformers_library_path())
        # The first context proves the model loads and gives the real context length.
        probe = _core.CtransformersSlot(str(model_path), model_type, context_length)
        # Handed out as the first slot.
        self._probe: _core.CtransformersSlot | None = probe
        self.context_length = probe.context_length
        self.vocab_size = probe.vocab_size
        if tokenizer is None:
            # A context of its own (with a tiny KV cache), so tokenizing never touches a busy slot.
            self._tokenizer_context = _core.CtransformersSlot(str(model_path), model_type, 8)
            self.tokenizer = NativeTokenizer(self._tokenizer_context.tokenize)
        else:
            self.tokenizer = tokenizer
        self.abort_mode, self.trim_output = self._prove_step_abort(probe, abort_mode)
        self.prefill_chunk = prefill_chunk or DEFAULT_PREFILL_CHUNK[self.kind][self.abort_mode]

    def _prove_step_abort(self, probe: _core.CtransformersSlot, wanted: AbortMode) -> tuple[AbortMode, bool]:
        """Abort a real evaluation before relying on the step hook, and check that
        computing only the last token's logits changes no bit of them."""
        if wanted is AbortMode.BETWEEN_STEPS:
            return wanted, False
        aborts, trim_exact = probe.probe_step_abort(self.tokenizer.encode("Stop means stop, right now."))
        probe.forget()
        if not aborts:
            _step_abort_unavailable(
                "this ctransformers build cannot stop inside an evaluation; "
                "generations stop between evaluations instead",
                _core.step_abort_failure(),
            )
            return AbortMode.BETWEEN_STEPS, False
        if not trim_exact:
            log.warning("output_trim_unavailable", detail="prompt chunks compute logits for every token")
        return AbortMode.IN_STEP, trim_exact

    @classmethod
    def from_file(
        cls,
        model_path: str | os.PathLike | None,
        model_type: str | None,
        context_length: int,
        threads: int,
        prefill_chunk: int | None,
        abort_mode: AbortMode,
        progress: bool,
    ) -> CtransformersEngine:
        """The embedded model (fetched and converted once) when ``model_path`` is None."""
        tokenizer: ChatTokenizer | None
        if model_path is None:
            path = conversion.embedded_model_path(progress)
            tokenizer = embedded.embedded_tokenizer(progress)
            return cls(
                path,
                "llama",
                tokenizer,
                embedded.EMBEDDED_MODEL_NAME,
                context_length,
                threads,
                prefill_chunk,
                abort_mode,
            )
        path = Path(model_path)
        # Checked before C sees it: the 2023 loader does not survive every malformed file.
        fields = check_model_file(path, model_type)
        tokenizer = None
        if fields is not None:
            try:
                tokenizer = ChatTokenizer.from_fields(fields, str(path))
            except (TokenizerError, KeyError, ValueError):  # UnicodeDecodeError is a ValueError
                tokenizer = None
            limit = _gguf_context_limit(fields)
            if limit and context_length > limit:
                raise SettingError(f"context_length {context_length} exceeds the model's limit of {limit}")
            if _gguf_version(path) >= 3:
                # The bundled loader reads GGUF v1/v2 only: convert once into the cache.
                converted = conversion.converted_copy(path)
                fresh = not converted.is_file()
                if fresh:
                    conversion.convert_for_ctransformers(path, converted, progress=progress)
                conversion.mark_used(converted)
                try:
                    loaded = cls(
                        converted,
                        model_type or "llama",
                        tokenizer,
                        path.stem,
                        context_length,
                        threads,
                        prefill_chunk,
                        abort_mode,
                    )
                except BaseException:
                    # A copy the loader refuses is no use to the next start either.
                    if fresh:
                        converted.unlink(missing_ok=True)
                    raise
                conversion.prune_converted(spare=converted)
                return _with_file_template(loaded, fields)
        loaded = cls(
            path,
            model_type or "llama",
            tokenizer,
            Path(model_path).stem,
            context_length,
            threads,
            prefill_chunk,
            abort_mode,
        )
        return _with_file_template(loaded, fields)

    def open_slot(self) -> _core.CtransformersSlot:
        if self._probe is not None:
            slot, self._probe = self._probe, None
            return slot
        return _core.CtransformersSlot(str(self.model_path), self.model_type, self.context_length)


class LlamaEngine(Engine):
    """Today's llama.cpp, through Stopline's shim (ext/llama_abi.h): one loaded
    model; a slot is one sequence of a llama.cpp context, alone in it or beside
    the other slots opened with it (whose running generations are then evaluated
    in one batch per step); every evaluation is stopped part-way by llama.cpp's
    official abort callback. Any GGUF the build knows loads as it is: the model's
    own vocabulary tokenizes, and its chat template renders."""

    kind = EngineName.LLAMA_CPP
    batching = Batching.SHARED

    def __init__(
        self,
        model: _core.LlamaModel,
        model_path: Path,
        name: str,
        context_length: int | None,
        threads: int,
        prefill_chunk: int | None,
        abort_mode: AbortMode,
        sequences: int | None = Settings.workers,
    ):
        self.model = model
        self.model_path = model_path
        self.name = name
        self._cache_keys: dict[tuple, str] = {}
        self.threads = threads
        if model.context_limit and context_length is not None and context_length > model.context_limit:
            raise SettingError(f"context_length {context_length} exceeds the model's limit of {model.context_limit}")
        self.sequences, context_length = sized_slots(model, sequences, context_length, physical_memory() or 0)
        # A context's batch bounds its prefill chunk, whichever abort mode ends up in force.
        self._batch = prefill_chunk or DEFAULT_PREFILL_CHUNK[self.kind][AbortMode.IN_STEP]
        probe = _core.LlamaContext(model, context_length, self._batch, threads, ubatch=DEFAULT_UBATCH).sequences[0]
        self._probe: _core.LlamaSequence | None = probe
        self.context_length = probe.context_length
        self.vocab_size = model.vocab_size
        self.tokenizer = LlamaTokenizer(model)
        self.abort_mode = self._prove_abort(probe, abort_mode)
        self.prefill_chunk = prefill_chunk or DEFAULT_PREFILL_CHUNK[self.kind][self.abort_mode]
        self.trim_output = False

    def _prove_abort(self, probe: _core.LlamaSequence, wanted: AbortMode) -> AbortMode:
        """Abort a real evaluation through the callback before relying on it."""
        if wanted is AbortMode.BETWEEN_STEPS:
            return wanted
        tokens = self.tokenizer.encode("Stop means stop, right now.")[: probe.max_batch]
        aborts, _ = probe.probe_step_abort(tokens)
        if not aborts:
            _step_abort_unavailable(
                "this llama.cpp build did not stop an evaluation through its abort callback; "
                "generations stop between evaluations instead",
                None,
            )
            return AbortMode.BETWEEN_STEPS
        return AbortMode.IN_STEP

    @classmethod
    def from_file(
        cls,
        model_path: str | os.PathLike | None,
        context_length: int | None,
        threads: int,
        prefill_chunk: int | None,
        abort_mode: AbortMode,
        progress: bool,
        library: str | os.PathLike | None = None,
        sequences: int | None = Settings.workers,
        gpu_layers: int | None = Settings.gpu_layers,
    ) -> LlamaEngine:
        """The embedded model's original GGUF when ``model_path`` is None. The engine's
        library is ``library``, else the one an installed wheel carries, else the one built on
        first use (``python -m stopline.engine.llama_build``)."""
        from .llama_build import LlamaBuildError, NoCompiler, engine_library

        if model_path is None:
            path, name = embedded.original_gguf_path(progress), embedded.EMBEDDED_MODEL_NAME
        else:
            path = Path(model_path)
            check_model_file(path, None, engine=EngineName.LLAMA_CPP)
            name = path.stem
        try:
            _core.load_llama_library(str(library or engine_library(progress)))
        except NoCompiler:
            raise  # a usage error: one line, naming what to install or run instead
        except LlamaBuildError as exc:
            raise EngineError(str(exc)) from None
        device = _core.llama_gpu_device()
        if gpu_layers and device is None:
            _gpu_unavailable(
                gpu_layers,
                "this llama.cpp build has no GPU backend, or its backend finds no device "
                "(STOPLINE_GPU=vulkan or cuda builds one: docs/configuration.md)",
            )
        try:
            model = _core.LlamaModel(str(path), GPU_LAYERS_ALL if gpu_layers is None else gpu_layers)
        except ModelLoadError as exc:
            # llama.cpp checked the file and said why it cannot run it: a usage error, in one line.
            raise ModelFileError(path, f"llama.cpp cannot load it ({exc})", engine=EngineName.LLAMA_CPP) from None
        if not model.can_truncate:
            # A stop inside the prompt, a shared step handed back and a reused prefix all cut a
            # sequence's cache back to a position; a recurrent model's state cannot be cut.
            model.close()
            raise ModelFileError(
                path,
                "it is a recurrent or hybrid model (Mamba, RWKV and the like), whose state cannot be cut "
                "back to an earlier token, which stopping mid-prompt and reusing a prompt need",
                engine=EngineName.LLAMA_CPP,
            )
        engine = cls(model, path, name, context_length, threads, prefill_chunk, abort_mode, sequences)
        if model.gpu_layers:
            engine.gpu_device, engine.gpu_layers = device, model.gpu_layers
        return engine

    def _prompt_cache_key(self, slot: _core.Slot) -> str:
        assert isinstance(slot, _core.LlamaSequence)
        # The template decides no KV, but a state is only ever shared within one.
        parts = (
            str(self.kind),
            self.context_length,
            self.prefill_chunk,
            slot.owner.ubatch,
            len(slot.owner.sequences),
            self.tokenizer.chat_template,
        )
        key = self._cache_keys.get(parts)
        if key is None:
            key = self._cache_keys[parts] = model_key(self.model_path, *parts)
        return key

    def open_slot(self) -> _core.LlamaSequence:
        if self._probe is not None:
            slot, self._probe = self._probe, None
            return slot
        return _core.LlamaContext(
            self.model, self.context_length, self._batch, self.threads, ubatch=DEFAULT_UBATCH
        ).sequences[0]

    def open_slots(
        self, count: int, batching: Batching | None = None, prompt_steps: PromptSteps = PromptSteps.MIXED
    ) -> Sequence[_core.LlamaSequence]:
        """``count`` contexts of one sequence each, or with ``Batching.SHARED`` (the
        default) the ``count`` sequences of one context, whose steps take a prompt's
        last chunk as ``prompt_steps`` says."""
        if (batching or self.batching) is Batching.PER_SLOT:
            return [self.open_slot() for _ in range(count)]
        if self._probe is not None:
            # The probe's cache would sit unused beside the shared context's.
            self._probe.close()
            self._probe = None
        context = _core.LlamaContext(self.model, self.context_length, self._batch, self.threads, count, DEFAULT_UBATCH)
        context.prompts_first = prompt_steps is PromptSteps.ALONE
        return list(context.sequences)


def kv_bytes_per_token(model: _core.LlamaModel | _FileMetadata) -> int | None:
    """What one position of one sequence takes in the (f16) KV cache, from the file's
    shapes; None when the file does not say them."""
    arch = model.metadata("general.architecture")

    def number(key: str) -> int | None:
        value = model.metadata(f"{arch}.{key}")
        return int(value) if value is not None and value.isdigit() else None

    layers, heads, width = number("block_count"), number("attention.head_count"), number("embedding_length")
    if not (layers and heads and width):
        return None
    kv_heads = number("attention.head_count_kv") or heads
    key = number("attention.key_length") or width // heads
    value = number("attention.value_length") or width // heads
    return layers * kv_heads * (key + value) * 2


def _fitted(
    model: _core.LlamaModel | _FileMetadata, sequences: int | None, context_length: int | None, memory: int
) -> tuple[int, int, str]:
    """The sequences and each one's context that :func:`sized_slots` chooses, and why."""
    trained = model.context_limit or DEFAULT_CONTEXT_LENGTH
    per_token = kv_bytes_per_token(model)
    budget = int(memory * KV_MEMORY_SHARE)
    whys = []
    if sequences is None:
        whole = context_length or trained
        fit = budget // (per_token * whole) if per_token else DEFAULT_SEQUENCES
        sequences = min(MAX_SEQUENCES, max(DEFAULT_SEQUENCES, fit))
        whys.append(
            f"{sequences} sequences: "
            + (
                "llama-server's parallel sequences"
                if sequences == DEFAULT_SEQUENCES
                else f"as many as fit, up to {MAX_SEQUENCES}"
            )
        )
    if context_length is None:
        fits = budget // (per_token * sequences) // 256 * 256 if per_token else trained
        context_length = min(trained, max(fits, DEFAULT_CONTEXT_LENGTH))
        whys.append(
            "the model's trained context"
            if context_length == trained
            else "the context that fits the KV cache's share of memory"
        )
    return sequences, context_length, "; ".join(whys)


def sized_slots(
    model: _core.LlamaModel, sequences: int | None, context_length: int | None, memory: int
) -> tuple[int, int]:
    """The slots and each one's context, where either is not asked for (None). Sequences:
    DEFAULT_SEQUENCES, or up to MAX_SEQUENCES while each holds its context in KV_MEMORY_SHARE of
    ``memory``. Context: the model's trained context, shortened (to a multiple of 256, and never
    under DEFAULT_CONTEXT_LENGTH) until the sequences fit that share. Says in one line what it
    chose and why."""
    chosen, context, why = _fitted(model, sequences, context_length, memory)
    if why:
        per_token = kv_bytes_per_token(model)
        log.info(
            "slots_sized",
            sequences=chosen,
            context_length=context,
            trained_context=model.context_limit or None,
            kv_bytes=per_token * chosen * context if per_token else None,
            kv_budget_bytes=int(memory * KV_MEMORY_SHARE),
            why=why,
        )
    return chosen, context


class _FileMetadata:
    """A GGUF file's metadata read from its header alone, shaped as :class:`_core.LlamaModel`'s
    (``metadata``, ``context_limit``), so that a model's size is known before it loads."""

    def __init__(self, path: Path):
        self._fields = read_gguf_metadata(path).fields

    def metadata(self, key: str) -> str | None:
        found = self._fields.get(key)
        return None if found is None else str(found.contents())

    @property
    def context_limit(self) -> int:
        limit = self.metadata(f"{self.metadata('general.architecture')}.context_length")
        return int(limit) if limit is not None and limit.isdigit() else 0


def file_memory_bytes(path: Path, sequences: int | None, context_length: int | None) -> int:
    """What serving the model file ``path`` takes in memory, known before it loads: the file (its
    weights) and the KV cache of ``sequences`` slots of ``context_length`` tokens, or of those
    :func:`sized_slots` would choose. A file whose header says no shapes (a GGML file) counts its
    size alone."""
    size = path.stat().st_size
    try:
        header = _FileMetadata(path)
    except (ValueError, struct.error):
        return size
    per_token = kv_bytes_per_token(header)
    if not per_token:
        return size
    sequences, context, _ = _fitted(header, sequences, context_length, physical_memory() or 0)
    return size + per_token * sequences * context


def engine_memory_bytes(engine: Engine, sequences: int) -> int:
    """What a loaded engine takes in memory with ``sequences`` slots open: its file and their KV cache."""
    size = engine.model_path.stat().st_size
    per_token = kv_bytes_per_token(engine.model) if isinstance(engine, LlamaEngine) else None
    return size + (per_token or 0) * sequences * engine.context_length


def _with_file_template(engine: CtransformersEngine, fields: dict | None) -> CtransformersEngine:
    """ctransformers' tokenizer (a SentencePiece GGUF) renders chats through the file's own template too."""
    if fields is not None and isinstance(engine.tokenizer, NativeTokenizer):
        engine.tokenizer = engine.tokenizer.with_chat_template(*chat_template_of(fields))
    return engine


def _gguf_context_limit(fields: dict) -> int | None:
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    key = f"{arch}.context_length"
    return int(fields[key].contents()) if key in fields else None


def _deadline(now_ns: int, seconds: float | None) -> int:
    return 0 if seconds is None else now_ns + int(seconds * 1e9)


class Stream:
    """Text chunks of one generation, consumed from asyncio or synchronously.

    The native loop runs in a worker thread; the stream reads published tokens
    whenever the generation's eventfd becomes readable, and turns their bytes
    into text (holding back partial UTF-8 and possible stop-sequence starts).

    The loop only learns that it must stop, and so does the stream: why a stop
    was asked for is the protocol's to remember.
    """

    def __init__(
        self,
        generation: _core.Generation,
        text: TextStream,
        token_bytes=None,
        prepare: Callable[[], int] | None = None,
    ):
        self.generation = generation
        # Run on the loop's thread before the loop: the prompt cache's work on the slot,
        # returning how many prompt tokens it restored.
        self._prepare = prepare
        self._cancel_asked = False
        # Prompt tokens restored from the prompt cache for this generation (counted in
        # the result's prompt_tokens_reused).
        self.prompt_tokens_cached = 0
        self._text = text
        self._token_bytes = token_bytes
        # Log probabilities of tokens read and not yet taken (with logprobs asked for).
        self._logprobs: list[dict] = []
        self.tokens_read = 0
        self.ended = False
        self._result: GenerationResult | None = None
        self._exited: asyncio.Future | None = None

    @property
    def result(self) -> GenerationResult | None:
        """How the generation ended, once it has; None before."""
        if self._result is None:
            loop = self.generation.result
            if loop is None:
                return None
            self._result = _result_of(loop)
        return self._result

    def cancel(self) -> bool:
        """Stop the generation. Thread-safe and idempotent: only the first call that
        reaches a running or not-yet-started loop counts, and returns True."""
        self._cancel_asked = True
        return self.generation.cancel()

    def _run(self, yield_to_reader: bool) -> _core.LoopResult:
        # A stop asked for before the loop starts skips the cache's copies, which it would wait for.
        if self._prepare is not None and not self._cancel_asked:
            try:
                self.prompt_tokens_cached = self._prepare()
            except Exception:
                log.exception("prompt_cache_failed")
        return self.generation.run(yield_to_reader)

    def read_available(self) -> list[str]:
        """Text ready now (possibly none). Once the loop has ended, the first call
        also returns the final text and sets :attr:`ended`: stop reading then."""
        # Check before taking: a loop that had ended has published everything.
        finished = self.generation.finished
        pieces = self.generation.take()
        if pieces and self._token_bytes is not None:
            self._read_logprobs(pieces)
        self.tokens_read += len(pieces)
        out = [t for t in (self._text.feed(p) for p in pieces) if t]
        if finished and not self.ended:
            self.ended = True
            loop = self.generation.result
            assert loop is not None  # the loop publishes its result before it reads as finished
            tail = self._text.finish(loop.text_kept_bytes)
            if tail:
                out.append(tail)
        return out

    def _read_logprobs(self, pieces: list[bytes]) -> None:
        start = self.tokens_read
        found = self.generation.logprobs(start, start + len(pieces))
        if found is None:
            return
        for piece, (logprob, top) in zip(pieces, found, strict=True):
            entry = _logprob_entry(piece, logprob)
            entry["top_logprobs"] = [_logprob_entry(self._token_bytes(token), value) for token, value in top]
            self._logprobs.append(entry)

    def take_logprobs(self) -> list[dict] | None:
        """The log probabilities of the tokens read since the last call, in OpenAI's
        shape (``token``, ``logprob``, ``bytes``, ``top_logprobs``); None when not asked for."""
        if self.generation.logprobs(0, 0) is None:
            return None
        taken, self._logprobs = self._logprobs, []
        return taken

    # asyncio -------------------------------------------------------------

    async def batches(self, executor=None):
        """Run the loop on ``executor`` and yield the text ready at each wake-up
        (a non-empty list), until :attr:`ended`: the loop has published its result,
        and its thread is returning (:meth:`exited`). Use it under
        ``contextlib.aclosing``: a consumer that leaves early cancels the loop and
        waits for it to exit."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        fd = self.generation.fileno()
        loop.add_reader(fd, wake.set)
        # At the end the loop's thread keeps out of the GIL until exited() lets it
        # return: the frames the end calls for go out first (yield_to_reader).
        self._exited = loop.run_in_executor(executor, self._run, True)
        # A loop that could not start never publishes: its exception wakes the reader instead.
        self._exited.add_done_callback(lambda _: wake.set())
        try:
            while not self.ended:
                await wake.wait()
                wake.clear()
                texts = self.read_available()
                if texts:
                    yield texts
                if not self.ended and self._exited.done():
                    await self._exited
        finally:
            loop.remove_reader(fd)
            if not self.ended:
                self.cancel()
                await asyncio.shield(self.exited())

    async def exited(self) -> None:
        """Let the loop's thread return (an ended loop waits for this: the caller has done
        what the end asked of it) and wait for it; then the generation can be closed."""
        if self._exited is not None:
            self.generation.let_return()
            await self._exited

    async def __aiter__(self):
        try:
            async with contextlib.aclosing(self.batches()) as batches:
                async for texts in batches:
                    for text in texts:
                        yield text
        finally:
            # Text is all this reader does: the loop's thread may return at once.
            self.generation.let_return()

    # synchronous ---------------------------------------------------------

    def __iter__(self):
        worker = threading.Thread(target=self._run, args=(True,), name="stopline-generation", daemon=True)
        worker.start()
        fd = self.generation.fileno()
        try:
            while True:
                select.select([fd], [], [])
                yield from self.read_available()
                if self.ended:
                    return
        finally:
            if worker.is_alive():
                self.cancel()
            self.generation.let_return()
            worker.join()
