"""Prompt tokenization and chat templates, built from the GGUF itself.

Token ids come from the model's own byte-level BPE, rebuilt with the
``tokenizers`` library from the GGUF's vocab and merges (a SentencePiece vocab,
which has no merges, is rebuilt from its scores for the bench's counting). Special tokens such as
``<|im_start|>`` stay single ids. Generated text is not decoded here: the token
loop hands over each token's raw bytes, and :class:`TextStream` turns them into
whole UTF-8 text.
"""

from __future__ import annotations

import codecs
import copy
import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ..protocol.errors import StoplineError
from ..protocol.vocabulary import BuiltinTemplate
from .model_check import read_gguf_metadata

# The format of a saved tokenizer (ChatTokenizer.dumps). Bump it whenever that
# format or the way from_fields builds a tokenizer changes, so saved ones are rebuilt.
SAVED_FORMAT = 1


class TokenizerError(StoplineError, ValueError):
    """The GGUF holds no tokenizer this module can rebuild."""


@dataclass(frozen=True)
class ChatTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str
    eos_token: str

    @classmethod
    def from_gguf(cls, path: str | Path) -> ChatTokenizer:
        """The GGUF's tokenizer, byte-level BPE or SentencePiece (:meth:`from_sentencepiece_fields`)."""
        fields = read_gguf_metadata(Path(path)).fields
        if "tokenizer.ggml.model" in fields and fields["tokenizer.ggml.model"].contents() == "llama":
            return cls.from_sentencepiece_fields(fields, str(path))
        return cls.from_fields(fields, str(path))

    @classmethod
    def from_fields(cls, fields: dict, source: str) -> ChatTokenizer:
        """Build from the metadata of a GGUF already read (:func:`~.model_check.read_gguf_metadata`)."""
        kind = fields["tokenizer.ggml.model"].contents() if "tokenizer.ggml.model" in fields else None
        if kind != "gpt2":
            raise TokenizerError(f"{source}: tokenizer model {kind!r} is not byte-level BPE ('gpt2')")
        tokens = fields["tokenizer.ggml.tokens"].contents()
        token_types = fields["tokenizer.ggml.token_type"].contents()
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
        pre = fields["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in fields else "default"

        bpe = models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
        tokenizer = Tokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in ("smollm", "starcoder", "refact", "codeshell"):
            # These vocabularies split every digit on its own before the GPT-2 regex.
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            tokenizer.pre_tokenizer = byte_level
        tokenizer.decoder = decoders.ByteLevel()
        special = [
            t
            for t, kind in zip(tokens, token_types)
            if kind in (int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED))
        ]
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

        return cls(tokenizer, *chat_template_of(fields, tokens))

    @classmethod
    def from_sentencepiece_fields(cls, fields: dict, source: str) -> ChatTokenizer:
        """A SentencePiece vocabulary ('llama': pieces with scores, no merges), rebuilt
        as the BPE that llama.cpp runs on it: of the adjacent pairs whose concatenation is
        a piece, the one making the highest-scoring piece merges first. Text that no piece
        covers falls back to the vocabulary's byte pieces (``<0x41>``)."""
        kind = fields["tokenizer.ggml.model"].contents() if "tokenizer.ggml.model" in fields else None
        if kind != "llama":
            raise TokenizerError(f"{source}: tokenizer model {kind!r} is not SentencePiece ('llama')")
        tokens = fields["tokenizer.ggml.tokens"].contents()
        scores = fields["tokenizer.ggml.scores"].contents()
        token_types = fields["tokenizer.ggml.token_type"].contents()
        normal = int(gguf.TokenType.NORMAL)
        vocab = {t: i for i, t in enumerate(tokens)}
        pieces = {t for t, kind in zip(tokens, token_types) if kind == normal}
        merges = []
        for piece in pieces:
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in pieces and right in pieces:
                    merges.append((-scores[vocab[piece]], vocab[left], vocab[right], left, right))
        merges.sort()
        unk_key = "tokenizer.ggml.unknown_token_id"
        unk = fields[unk_key].contents() if unk_key in fields else None
        bpe = models.BPE(
            vocab=vocab,
            merges=[(left, right) for *_, left, right in merges],
            unk_token=tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None,
            fuse_unk=True,
            byte_fallback=True,
        )
        tokenizer = Tokenizer(bpe)
        add_space = "tokenizer.ggml.add_space_prefix" in fields and bool(
            fields["tokenizer.ggml.add_space_prefix"].contents()
        )
        steps = [normalizers.Prepend("\u2581")] if add_space else []
        tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if add_space else [])
        )
        control, user = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)
        # llama.cpp matches user-defined pieces whole wherever they occur, as it does control ones.
        tokenizer.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, token_types) if kind == user]
        )
        tokenizer.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, token_types) if kind == control]
        )
        return cls(tokenizer, *chat_template_of(fields, tokens))

    def dumps(self, source_sha256: str) -> str:
        """Save this tokenizer, built from the GGUF whose sha256 is ``source_sha256``, as text
        that :meth:`loads` accepts only for that same file, format and ``tokenizers`` version."""
        payload = json.dumps(
            {
                "tokenizer": self.tokenizer.to_str(),
                "chat_template": self.chat_template,
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
            }
        )
        return json.dumps({**_saved_key(source_sha256), "payload_sha256": _sha256(payload), "payload": payload})

    @classmethod
    def loads(cls, text: str, source_sha256: str) -> ChatTokenizer:
        """The tokenizer :meth:`dumps` saved for the GGUF whose sha256 is ``source_sha256``.

        Raises ValueError for anything else: another file, format or ``tokenizers``
        version, or a damaged copy (its payload's sha256 no longer matches)."""
        saved = json.loads(text)
        key = _saved_key(source_sha256)
        if not isinstance(saved, dict) or any(saved.get(name) != value for name, value in key.items()):
            raise ValueError("saved for another file, format or tokenizers version")
        payload = saved.get("payload")
        if not isinstance(payload, str) or _sha256(payload) != saved.get("payload_sha256"):
            raise ValueError("damaged: the payload does not match its sha256")
        fields = json.loads(payload)
        try:
            tokenizer = Tokenizer.from_str(fields["tokenizer"])
        except Exception as exc:  # tokenizers raises plain Exceptions
            raise ValueError(f"unreadable tokenizer: {exc}") from exc
        return cls(tokenizer, fields["chat_template"], fields["bos_token"], fields["eos_token"])

    def encode(self, text: str) -> list[int]:
        # The batch calls release the GIL while they work; the single ones do not.
        ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        # The vocabulary lacks a few bytes (some control characters, some 4-byte
        # UTF-8 leads); BPE would drop them silently, so refuse instead.
        if self.tokenizer.decode_batch([ids], skip_special_tokens=False)[0] != text:
            raise TokenizerError("the text has characters this model's vocabulary cannot represent")
        return ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for: a text of n bytes has at least n / this many tokens."""
        return max(
            len(self.tokenizer.decode([i], skip_special_tokens=False).encode("utf-8", "surrogatepass"))
            for i in range(self.tokenizer.get_vocab_size(with_added_tokens=True))
        )

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def render_chat(self, messages: list[dict]) -> str:
        """Render chat messages through the model's template, opening the assistant turn."""
        return render_chat(self.chat_template, messages, self.bos_token, self.eos_token)

    def with_chat_template(self, template: str) -> ChatTokenizer:
        return dataclasses.replace(self, chat_template=template)


def chat_template_of(fields: dict, tokens: list[str] | None = None) -> tuple[str | None, str, str]:
    """A GGUF's own chat template (None if it has none) and its BOS and EOS token texts."""
    if tokens is None:
        try:
            tokens = fields["tokenizer.ggml.tokens"].contents() if "tokenizer.ggml.tokens" in fields else []
        except ValueError:  # a vocabulary of raw bytes (a converted copy): no token texts to name
            tokens = []

    def token(key: str) -> str:
        index = fields[key].contents() if key in fields else None
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else ""

    template = fields["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in fields else None
    return template, token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")


def _saved_key(source_sha256: str) -> dict:
    return {"format": SAVED_FORMAT, "source_sha256": source_sha256, "tokenizers": tokenizers.__version__}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class NativeTokenizer:
    """ctransformers' own tokenizer, for models whose file has no byte-level BPE
    vocab (SentencePiece GGUFs, GGML files). Chat messages go through the file's
    own template, else become plain text."""

    def __init__(self, tokenize, chat_template: str | None = None, bos_token: str = "", eos_token: str = ""):
        self._tokenize = tokenize
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token

    def encode(self, text: str) -> list[int]:
        return self._tokenize(text)

    def render_chat(self, messages: list[dict]) -> str:
        return render_chat(self.chat_template, messages, self.bos_token, self.eos_token)

    def with_chat_template(self, template: str | None, bos_token: str | None = None, eos_token: str | None = None):
        return NativeTokenizer(
            self._tokenize,
            template,
            self.bos_token if bos_token is None else bos_token,
            self.eos_token if eos_token is None else eos_token,
        )


class LlamaTokenizer:
    """llama.cpp's tokenizer for the model it loaded (special tokens written in the
    text stay whole), with the file's own chat template (plain text if it has none)."""

    def __init__(self, model):
        self._model = model
        self.chat_template = model.metadata("tokenizer.chat_template")
        self._bos, eos, self._add_bos = model.special_tokens
        self.bos_token = self._token_text(self._bos)
        self.eos_token = self._token_text(eos)

    def _token_text(self, token: int) -> str:
        return self._model.token_bytes(token, special=True).decode("utf-8", "replace") if token >= 0 else ""

    def encode(self, text: str) -> list[int]:
        ids = self._model.tokenize(text)
        # A template that writes the bos token itself already put it there.
        if self._add_bos and self._bos >= 0 and ids[:1] != [self._bos]:
            ids.insert(0, self._bos)
        return ids

    def render_chat(self, messages: list[dict]) -> str:
        return render_chat(self.chat_template, messages, self.bos_token, self.eos_token)

    def with_chat_template(self, template: str) -> LlamaTokenizer:
        other = copy.copy(self)
        other.chat_template = template
        return other


def render_chat(template: str | None, messages: list[dict], bos_token: str = "", eos_token: str = "") -> str:
    """Render ``messages`` through ``template``, opening the assistant turn; without a
    template (a base model's file), as plain text (:func:`plain_text`).

    A final assistant message is continued: its text goes into the opened turn, so
    a stopped answer can be picked up where it ended."""
    if template is None:
        return plain_text(messages)
    prefix = ""
    if messages and messages[-1]["role"] == "assistant":
        messages, prefix = messages[:-1], messages[-1]["content"]
    variables = {"messages": messages, "add_generation_prompt": True, "bos_token": bos_token, "eos_token": eos_token}
    return compile_chat_template(template).render(variables) + prefix


def plain_text(messages: list[dict]) -> str:
    """A chat as the text a base model completes: the messages' contents in order. An
    assistant message follows the text before it with nothing between, as it was generated
    (so a stopped answer is continued where it ended); any other message after the first
    starts a new paragraph. A model with no chat template knows no roles: this marks none."""
    text = ""
    for index, message in enumerate(messages):
        if index and message["role"] != "assistant":
            text += "\n\n"
        text += message["content"]
    return text


_CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


_LLAMA2 = (
    "{% if messages and messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' }}"
    "{% if loop.first and system %}{{ '<<SYS>>\n' + system + '\n<</SYS>>\n\n' }}{% endif %}"
    "{{ message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
_ZEPHYR = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# Templates --chat-template can name instead of a file.
CHAT_TEMPLATES: dict[str, str] = {
    BuiltinTemplate.CHATML: _CHATML,
    BuiltinTemplate.LLAMA2: _LLAMA2,
    BuiltinTemplate.ZEPHYR: _ZEPHYR,
}


def load_chat_template(name_or_path: str) -> str:
    """A template named in CHAT_TEMPLATES, or the Jinja text of a file; raises OSError or
    TokenizerError (a template that does not compile) with one line."""
    if name_or_path in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"{name_or_path!r} is neither a template file nor one of {', '.join(CHAT_TEMPLATES)}")
    template = path.read_text("utf-8")
    try:
        compile_chat_template(template)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"{name_or_path}: not a Jinja template: {exc}") from None
    return template


def _raise(message: str):
    raise TokenizerError(message)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """``template`` compiled, once per text. Compiling takes milliseconds and holds the
    GIL, so it would hold up the event loop, and every stream on it, at each request;
    rendering a compiled template takes far less. Jinja renders one
    compiled template from several threads at once."""
    # Chat templates come from model files: render them sandboxed.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


class TextStream:
    """Turn streamed token bytes into text chunks that are safe to show.

    Bytes are held back while they end inside a UTF-8 character, or while they
    could be the beginning of a stop sequence; the native loop decides whether a
    stop sequence actually matched and where the kept text ends.
    """

    def __init__(self, stop: Sequence[bytes] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._stop = [s for s in stop if s]
        self._received = bytearray()
        self._released = 0

    def feed(self, data: bytes) -> str:
        self._received += data
        end = len(self._received) - self._stop_prefix_length()
        for stop in self._stop:
            # A whole stop sequence inside the newest bytes: release nothing from its start on.
            found = self._received.find(stop, max(0, self._released - len(stop)))
            if found != -1:
                end = min(end, found)
        return self._release(max(end, self._released), final=False)

    def finish(self, kept_bytes: int) -> str:
        """Release the rest of the text, which ends at byte ``kept_bytes`` (before any stop sequence)."""
        return self._release(max(kept_bytes, self._released), final=True)

    def _release(self, end: int, final: bool) -> str:
        text = self._decoder.decode(bytes(self._received[self._released : end]), final=final)
        self._released = end
        return text

    def _stop_prefix_length(self) -> int:
        data = self._received
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(data)), longest, -1):
                if data.endswith(stop[:size]):
                    longest = size
                    break
        return longest
