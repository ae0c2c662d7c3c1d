"""Tokenization must be exactly the model's own, and streamed text must be exact.

Prompt ids come from ``stopline/engine/tokenizer.py`` (the ``tokenizers`` library rebuilt
from the GGUF). They are checked here against an independent, deliberately
plain Python implementation of byte-level BPE (the GPT-2 algorithm) that reads
the same vocab and merges from the original GGUF. Generated text comes from
the token bytes ctransformers returns, turned into text by ``TextStream``.
"""

from __future__ import annotations

import dataclasses
import functools
import unicodedata

import gguf
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stopline import _core
from stopline.engine.tokenizer import ChatTokenizer, TextStream, compile_chat_template, load_chat_template
from support import CHAT_FRANCE

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

CORPUS = [
    "",
    "Hello world",
    "Hello  world   three    four",
    "   leading and trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\nparagraph\n\n\n",
    "windows\r\nline\r\nendings\r\n",
    " \n \t\r\n ",
    "12345 and 3.14159 and 1,000,000 and 2024-01-02",
    "x1y22z333",
    "I'm sure you'll see they've said it's John's and we'd 'd 're",
    "DON'T SHOUT, IT'S LOUD",
    "Punctuation!!! ...?? (a) [b] {c} <d> --- *** ### @@@ ~~~",
    "party 🎉 time 🎉🎉",
    "family 👩‍👩‍👧 and flags 🇫🇷🇯🇵 and skin tones 👍🏽",
    "你好世界",
    "日本語のテキスト、句読点。",
    "مرحبا بالعالم",
    "Ελληνικά και русский текст",
    "combining: e\u0301 a\u0308 n\u0303 and precomposed é ä ñ",
    "zero\u200bwidth and nbsp\u00a0here and ideographic\u3000space",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '<html><body class="x">&amp;</body></html>',
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|im_start|><|im_start|>",
    "<|im_start|> spaced <|im_end|>",
    "partial <|im_start and im_end|> markers",
    "<|endoftext|>",
    "Ünïcödé ŝţŕïñĝ with ÿ and \u00ff\u0100\u0101",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math ∑∫∂ √2 ≠ ∞",
    "½ ¾ ² ³ ① Ⅻ ٣ ४",
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, codes)}


class ReferenceBPE:
    """Byte-level BPE as GPT-2 wrote it, with SmolLM's digit splitting and special tokens."""

    def __init__(self, fields: dict):
        tokens = fields["tokenizer.ggml.tokens"].contents()
        types = fields["tokenizer.ggml.token_type"].contents()
        merges = fields["tokenizer.ggml.merges"].contents()
        assert fields["tokenizer.ggml.model"].contents() == "gpt2"
        assert fields["tokenizer.ggml.pre"].contents() == "smollm"
        self.tokens = tokens
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): rank for rank, m in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        control = {int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)}
        self.specials = [t for t, kind in zip(tokens, types) if kind in control]
        alternatives = "|".join(regex.escape(s) for s in sorted(self.specials, key=len, reverse=True))
        self.special_re = regex.compile(f"({alternatives})")
        self.digit_re = regex.compile(r"(\p{N})")
        self.word_re = regex.compile(GPT2_PATTERN)

    def encode(self, text: str) -> list[int]:
        ids = []
        # Special tokens first: split them out, each is one id.
        for i, part in enumerate(self.special_re.split(text)):
            if i % 2:
                ids.append(self.vocab[part])
                continue
            # Then every digit on its own, then the GPT-2 pattern inside each piece.
            for piece in self.digit_re.split(part):
                for word in self.word_re.findall(piece):
                    ids.extend(self.vocab[s] for s in self._bpe(word))
        return ids

    @functools.cache  # noqa: B019 - one reference tokenizer lives for the whole session
    def _bpe(self, word: str) -> tuple[str, ...]:
        symbols = [self.byte_encoder[b] for b in word.encode("utf-8")]
        while len(symbols) > 1:
            # The pair with the lowest merge rank, merged everywhere left to right.
            best = min(zip(symbols, symbols[1:]), key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return tuple(symbols)

    def token_bytes(self, token: int) -> bytes:
        text = self.tokens[token]
        if text in self.specials:
            return text.encode("utf-8")
        return bytes(self.byte_decoder[c] for c in text)


@pytest.fixture(scope="module")
def reference(original_gguf_fields) -> ReferenceBPE:
    return ReferenceBPE(original_gguf_fields)


@pytest.fixture(scope="module")
def tokenizer(ctransformers_engine) -> ChatTokenizer:
    # The ``tokenizers`` library rebuilt from the GGUF: the ctransformers engine's tokenizer, which
    # this module is about. The llama.cpp engine tokenizes with llama.cpp's own (LlamaTokenizer);
    # test_special_tokens_are_single_ids checks a chat prompt of each engine against the reference.
    return ctransformers_engine.tokenizer


@pytest.fixture(scope="module")
def token_table(ctransformers_engine) -> list[bytes]:
    """Every token's bytes as the ctransformers engine's loop sees them (ctransformers' detokenize,
    which the tests below are about)."""
    context = _core.CtransformersSlot(str(ctransformers_engine.model_path), ctransformers_engine.model_type, 16)
    try:
        return [context.token_bytes(i) for i in range(context.vocab_size)]
    finally:
        context.close()


def stream_through(table: list[bytes], ids: list[int], stop: list[bytes] = ()) -> list[str]:
    """Feed each token's bytes to a TextStream, one token at a time, as Stream does."""
    text = TextStream(list(stop))
    chunks = [text.feed(table[i]) for i in ids]
    chunks.append(text.finish(sum(len(table[i]) for i in ids)))
    return chunks


# SmolLM2's vocab has no token for these bytes, so no tokenizer of this model can
# encode them (see test_characters_outside_the_vocab): control characters, and
# the lead bytes 0xF1 and 0xF2 of code points U+40000..U+BFFFF.
UNENCODABLE_CONTROLS = "\x04\x06\x13\x14\x16\x1d"


# The reference's character classes (\p{L}, \p{N}) come from the `regex` module's
# Unicode tables, the tokenizer's from those inside `tokenizers`; the two differ in
# version and disagree on characters only the newer one has assigned (U+12550 was
# one, with an older `regex`). Generated text keeps to characters that Python's own,
# older tables assign (Unicode 14.0 on Python 3.11), on which both agree: measured
# over every code point, they now disagree only on characters new in Unicode 17.
NEWEST_SHARED_UNICODE = (16, 0)


def _texts(excluded: str):
    # Random text rich in the things tokenizers get wrong: whitespace runs, digits,
    # contractions, multi-byte characters and special-token markup.
    assigned = {"codec": "utf-8", "exclude_categories": ("Cn",)}
    chars = st.one_of(
        st.characters(max_codepoint=0x3FFFF, exclude_characters=excluded, **assigned),
        st.characters(min_codepoint=0xC0000, **assigned),
    )
    fragments = st.sampled_from(
        [
            " ",
            "  ",
            "\n",
            "\n\n",
            "\r\n",
            "\t",
            " \t ",
            "'s",
            "'ll",
            "'T",
            "123",
            "0",
            "🎉",
            "👩‍👩‍👧",
            "你好",
            "é",
            "e\u0301",
            "<|im_start|>",
            "<|im_end|>",
            "<|im_",
            "|>",
            "Hello",
            " world",
            "!",
            "...",
            "٣",
        ]
    )
    return st.lists(st.one_of(st.text(chars, max_size=12), fragments), max_size=12).map("".join)


TEXTS = _texts(UNENCODABLE_CONTROLS)
# NUL is left out of streamed text: see test_nul_byte_token_streams.
STREAMABLE_TEXTS = _texts(UNENCODABLE_CONTROLS + "\x00")


# --- prompt ids ------------------------------------------------------------------


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_reference_bpe(tokenizer, reference, text):
    assert tokenizer.encode(text) == reference.encode(text)


@pytest.mark.parametrize("text", CORPUS)
def test_decode_inverts_encode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_reference_agrees_on_known_ids(reference, tokenizer):
    # Anchor the reference itself: digits split one by one, special tokens are ids 1 and 2.
    assert reference.encode("12345") == [reference.vocab[d] for d in "12345"]
    assert reference.encode("<|im_start|><|im_end|>") == [1, 2]
    assert len(reference.encode("Hello world")) == 2


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=TEXTS)
def test_random_text_matches_reference_and_round_trips(tokenizer, reference, text):
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text)
    assert tokenizer.decode(ids) == text


def test_generated_text_keeps_to_unicode_both_tables_know():
    # A newer Python's tables could assign characters the tokenizer's do not know yet.
    assert tuple(map(int, unicodedata.unidata_version.split(".")[:2])) <= NEWEST_SHARED_UNICODE


def test_vocab_covers_all_but_a_few_bytes(reference):
    missing = {b for b, c in reference.byte_encoder.items() if c not in reference.vocab}
    expected = {ord(c) for c in UNENCODABLE_CONTROLS} | {0xC0, 0xC1, 0xF1, 0xF2} | set(range(0xF5, 0x100))
    assert missing == expected


@pytest.mark.parametrize("text", ["end of\x04transmission", "plane 4 \U00040000 character"])
def test_characters_outside_the_vocab(tokenizer, text):
    # Either the prompt survives intact or encoding says it cannot.
    try:
        ids = tokenizer.encode(text)
    except ValueError:
        return
    assert tokenizer.decode(ids) == text


# --- token bytes and streamed text ----------------------------------------------


def test_token_bytes_are_the_byte_level_vocab(reference, token_table):
    # The converted model detokenizes every token to the raw bytes its byte-level
    # string stands for; NUL is the one exception. Control tokens carry no text.
    specials = {reference.vocab[t] for t in reference.specials}
    mismatched = [
        (i, reference.tokens[i])
        for i, data in enumerate(token_table)
        if i not in specials and data != reference.token_bytes(i) and reference.token_bytes(i) != b"\x00"
    ]
    assert mismatched == []
    assert [token_table[i] for i in sorted(specials)] == [b""] * len(specials)
    assert len(token_table) == len(reference.tokens)


@pytest.mark.parametrize("text", [t for t in CORPUS if "<|" not in t])
def test_streamed_token_bytes_round_trip(reference, token_table, text):
    ids = reference.encode(text)
    chunks = stream_through(token_table, ids)
    assert "".join(chunks) == text
    # No chunk ever shows a replacement character for half a character.
    assert not any("\ufffd" in c for c in chunks)


def test_multibyte_characters_split_across_tokens(reference, token_table):
    # These characters are split into several byte tokens: the stream must hold the
    # partial bytes back and release each character whole.
    for text in ["🎉", "👩‍👩‍👧", "你好世界", "𝔘𝔫𝔦"]:
        ids = reference.encode(text)
        assert any(not _is_complete_utf8(token_table[i]) for i in ids), text
        chunks = stream_through(token_table, ids)
        assert "".join(chunks) == text and "\ufffd" not in "".join(chunks)


def _is_complete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=STREAMABLE_TEXTS)
def test_random_text_streams_back_exactly(reference, token_table, text):
    chunks = stream_through(token_table, reference.encode(text))
    # Control tokens such as <|im_start|> carry no text.
    assert "".join(chunks) == reference.special_re.sub("", text)
    if "\ufffd" not in text:
        assert not any("\ufffd" in c for c in chunks)


@pytest.mark.xfail(
    strict=True,
    reason="ctransformers' detokenize returns a C string, so the token for byte "
    "0x00 comes back empty and the loop publishes it as b''",
)
def test_nul_byte_token_streams(reference, token_table):
    ids = reference.encode("a\x00b")
    assert "".join(stream_through(token_table, ids)) == "a\x00b"


# --- TextStream and stop sequences -------------------------------------------------


def test_text_stream_holds_back_a_possible_stop_prefix():
    stream = TextStream([b"STOP"])
    assert stream.feed(b"Hello ST") == "Hello "  # "ST" could begin "STOP"
    assert stream.feed(b"ART") == "START"  # it did not
    assert stream.feed(b" now S") == " now "
    assert stream.feed(b"TO") == ""
    assert stream.feed(b"P and more") == ""  # the stop sequence is never released
    assert stream.finish(len(b"Hello START now ")) == ""


def test_text_stream_holds_back_partial_utf8():
    data = "你".encode()
    stream = TextStream()
    assert stream.feed(data[:1]) == ""
    assert stream.feed(data[1:2]) == ""
    assert stream.feed(data[2:]) == "你"
    assert stream.finish(3) == ""


def test_text_stream_stop_inside_one_chunk():
    stream = TextStream([b"</s>", b"\n\n"])
    assert stream.feed(b"one two</s>three") == "one two"
    assert stream.finish(len(b"one two")) == ""


def test_text_stream_multibyte_stop_sequence():
    stop = "。終".encode()
    stream = TextStream([stop])
    out = [stream.feed(b) for b in [("文" + "。").encode(), "終わり".encode()]]
    assert out == ["文", ""]
    assert stream.finish(len("文".encode())) == ""


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    text=TEXTS, stop=st.text(min_size=1, max_size=4), cuts=st.lists(st.integers(0, 200), max_size=10), data=st.data()
)
def test_text_stream_never_releases_a_stop_sequence(text, stop, cuts, data):
    # Optionally plant the stop sequence somewhere in the text.
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(text)))
        text = text[:at] + stop + text[at:]
    raw, stop_bytes = text.encode(), stop.encode()
    # Split into arbitrary byte chunks (even inside characters), as tokens may.
    bounds = sorted({min(c, len(raw)) for c in cuts} | {0, len(raw)})
    pieces = [raw[a:b] for a, b in zip(bounds, bounds[1:])]

    stream, released, received = TextStream([stop_bytes]), "", b""
    for piece in pieces:
        received += piece
        released += stream.feed(piece)
        assert stop not in released
        if stop_bytes in received:
            break  # the loop ends the generation in the token that completes the match
    kept = received.find(stop_bytes) if stop_bytes in received else len(received)
    released += stream.finish(kept)

    expected = text[: text.index(stop)] if stop in text else text
    assert released == expected


# --- chat template --------------------------------------------------------------------


def test_chat_template_renders_chatml_with_the_assistant_turn_open(tokenizer):
    rendered = tokenizer.render_chat(CHAT_FRANCE)
    question = CHAT_FRANCE[0]["content"]
    assert rendered.endswith(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")  # SmolLM's template adds its default system turn
    # An explicit system message replaces the default one.
    rendered = tokenizer.render_chat([{"role": "system", "content": "Be brief."}, *CHAT_FRANCE])
    assert rendered == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_chat_template_is_compiled_once_for_every_request(tokenizer):
    compile_chat_template.cache_clear()
    first = tokenizer.render_chat(CHAT_FRANCE)
    again = tokenizer.render_chat([*CHAT_FRANCE, {"role": "assistant", "content": "Paris."}])
    assert again.startswith(first)
    info = compile_chat_template.cache_info()
    assert (info.misses, info.hits) == (1, 1)


def test_a_final_assistant_message_is_continued(tokenizer):
    # The reply turn is opened with the partial answer in it, not closed and followed by a new one.
    partial = [*CHAT_FRANCE, {"role": "assistant", "content": "The capital of France is"}]
    assert tokenizer.render_chat(partial) == tokenizer.render_chat(CHAT_FRANCE) + "The capital of France is"
    # Without a template, the partial answer follows the question's text as it was generated.
    plain = dataclasses.replace(tokenizer, chat_template=None)
    assert plain.render_chat(partial) == CHAT_FRANCE[0]["content"] + "The capital of France is"
    # Earlier assistant turns stay closed.
    earlier = [*partial, {"role": "user", "content": "And Spain?"}]
    assert "The capital of France is<|im_end|>" in tokenizer.render_chat(earlier)


def test_without_a_template_a_chat_is_its_plain_text(tokenizer):
    # A base model knows no roles and no ChatML markers: it completes the conversation's text.
    plain = dataclasses.replace(tokenizer, chat_template=None)
    assert plain.render_chat(CHAT_FRANCE) == CHAT_FRANCE[0]["content"]
    chat = [
        {"role": "system", "content": "A story."},
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": " there was a dragon."},
        {"role": "user", "content": "Then"},
    ]
    # An answer follows its prompt as it was generated; every other message starts a paragraph.
    assert plain.render_chat(chat) == "A story.\n\nOnce upon a time there was a dragon.\n\nThen"
    assert "<|im_" not in plain.render_chat(chat)
    # The named template stays the way to get ChatML.
    chatml = plain.with_chat_template(load_chat_template("chatml"))
    assert chatml.render_chat(CHAT_FRANCE).startswith("<|im_start|>user\n")


@pytest.mark.both_engines(why="each engine reads its own copy of the vocabulary")
def test_special_tokens_are_single_ids(engine, tokenizer, reference):
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    ids = engine.encode(messages=CHAT_FRANCE)
    assert ids == reference.encode(tokenizer.render_chat(CHAT_FRANCE))
    tail = [1] + tokenizer.encode("assistant\n")
    assert ids[0] == 1 and ids[-len(tail) :] == tail
    assert ids.count(1) == 3 and ids.count(2) == 2  # system, user, assistant opened; two closed
    # The markup never reaches the BPE as text.
    assert not any(b"<|" in reference.token_bytes(i) for i in ids if i not in (1, 2))


def test_unicode_normalization_is_not_applied(tokenizer):
    # The model's tokenizer has no normalizer: NFC and NFD spellings stay distinct.
    nfc, nfd = unicodedata.normalize("NFC", "é"), unicodedata.normalize("NFD", "é")
    assert tokenizer.encode(nfc) != tokenizer.encode(nfd)
    assert tokenizer.decode(tokenizer.encode(nfd)) == nfd
