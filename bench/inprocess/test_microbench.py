"""Microbenchmarks of the per-token path between the native loop and the socket.

    python -m pytest bench/ --benchmark-only

Per token, the server takes the published bytes from the native log
(``Generation.take``), turns them into text (``TextStream.feed``), builds a
token frame and serializes it (``encode_frame``); these measure those steps.
"""

from __future__ import annotations

from stopline.engine.tokenizer import TextStream
from stopline.protocol.frames import Token, encode_frame
from stopline.protocol.requests import SamplingParams

TOKENS_PER_ROUND = 32


def test_encode_token_frame(benchmark):
    frame = Token("3f2b9c1e-request", 41, " bread")
    assert benchmark(encode_frame, frame) == '{"type":"token","id":"3f2b9c1e-request","index":41,"text":" bread"}'


def test_encode_token_frame_non_ascii(benchmark):
    frame = Token("r1", 7, " crème brûlée 🍞")
    assert "🍞" in benchmark(encode_frame, frame)


def test_text_stream_feed(benchmark):
    pieces = [b" The", b" dragon", b" baked", b" bread", b" \xe2\x80", b"\x94", b" again", b"."]

    def feed_all():
        stream = TextStream([b"\n\n"])
        return [stream.feed(p) for p in pieces]

    out = benchmark(feed_all)
    assert "".join(out) == " The dragon baked bread — again."
    benchmark.extra_info["tokens_per_round"] = len(pieces)


def _published_stream(engine, slot):
    """A finished generation whose tokens are all published and not yet read (a window larger than them)."""
    prompt = engine.encode(messages=[{"role": "user", "content": "Write a very long story about a dragon."}])
    params = SamplingParams(max_tokens=TOKENS_PER_ROUND, temperature=0.7, seed=1)
    stream = engine.start(slot, prompt, params, window=4096)
    stream.generation.run()
    return stream


def test_take_published_tokens(benchmark, engine, slot):
    """Generation.take(): copy the published tokens' bytes out of the native log."""
    streams = []

    def setup():
        streams.append(_published_stream(engine, slot))
        return (streams[-1].generation,), {}

    benchmark.pedantic(lambda generation: generation.take(), setup=setup, rounds=15, iterations=1)
    tokens = streams[-1].generation.result.tokens_generated
    benchmark.extra_info["tokens_per_round"] = tokens
    assert tokens > 0


def test_read_available_published_tokens(benchmark, engine, slot):
    """Stream.read_available(): take() plus TextStream.feed for each token, as the scheduler calls it."""
    streams = []

    def setup():
        streams.append(_published_stream(engine, slot))
        return (streams[-1],), {}

    benchmark.pedantic(lambda stream: stream.read_available(), setup=setup, rounds=15, iterations=1)
    benchmark.extra_info["tokens_per_round"] = streams[-1].generation.result.tokens_generated


def test_take_when_nothing_is_new(benchmark, engine, slot):
    """The cost of a wake-up that finds no new token (eventfd read and an empty list)."""
    generation = _published_stream(engine, slot).generation
    generation.take()
    assert benchmark(generation.take) == []
