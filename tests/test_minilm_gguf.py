"""all-MiniLM-L6-v2 as a BERT GGUF file: what llama.cpp's loader reads, every tensor as in the
safetensors, and the same embeddings from either, in Stopline's numpy and in llama-server."""

from __future__ import annotations

import asyncio
import json
import zipfile

import gguf
import numpy as np
import pytest
from safetensors.numpy import load

from bench.drivers.llama_server import call_json, llama_server_binary
from bench.embeddings import COMPARED, SENTENCES, EmbeddingLlamaServer, cosines
from stopline.engine.embeddings import MAX_TOKENS, SentenceEncoder, gguf_named, model_zip_path
from stopline.engine.llama_embeddings import LlamaEncoder
from stopline.engine.minilm_gguf import ARCH, CONTINUATION, WORD_START, field_value, read_gguf, write_gguf

BERT = f"{ARCH}."
TOKENIZER = gguf.Keys.Tokenizer


@pytest.fixture(scope="module")
def files():
    with zipfile.ZipFile(model_zip_path()) as opened:
        yield opened


@pytest.fixture(scope="module")
def converted(files, tmp_path_factory):
    path = tmp_path_factory.mktemp("minilm") / "all-MiniLM-L6-v2.gguf"
    write_gguf(files, path)
    return path


@pytest.fixture(scope="module")
def reader(converted):
    return gguf.GGUFReader(converted)


@pytest.fixture(scope="module")
def reference(files) -> np.ndarray:
    return SentenceEncoder.from_model_zip(files).embed(SENTENCES[:COMPARED]).vectors


def test_the_metadata_is_what_llama_cpps_bert_loader_reads(reader, files):
    config = json.loads(files.read("config.json"))
    expected = {
        "general.architecture": "bert",
        BERT + "context_length": config["max_position_embeddings"],
        BERT + "embedding_length": config["hidden_size"],
        BERT + "feed_forward_length": config["intermediate_size"],
        BERT + "block_count": config["num_hidden_layers"],
        BERT + "attention.head_count": config["num_attention_heads"],
        BERT + "attention.causal": False,
        BERT + "pooling_type": int(gguf.PoolingType.MEAN),
        "tokenizer.ggml.model": "bert",
        "tokenizer.ggml.token_type_count": config["type_vocab_size"],
        TOKENIZER.BOS_ID: 101,  # [CLS]
        TOKENIZER.SEP_ID: 102,
        TOKENIZER.UNK_ID: 100,
        TOKENIZER.PAD_ID: 0,
        TOKENIZER.MASK_ID: 103,
        TOKENIZER.ADD_BOS: True,
        TOKENIZER.ADD_SEP: True,
    }
    assert {key: field_value(reader, key) for key in expected} == expected
    assert field_value(reader, BERT + "attention.layer_norm_epsilon") == pytest.approx(config["layer_norm_eps"])


def test_the_vocabulary_is_wordpiece_in_llama_cpps_spelling(reader, files):
    vocab = json.loads(files.read("tokenizer.json"))["model"]["vocab"]
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    types = field_value(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == len(vocab) == 30522
    # A word's first piece starts with the word-start mark; a continuation loses its "##".
    assert tokens[vocab["the"]] == WORD_START + "the"
    assert tokens[vocab[CONTINUATION + "ing"]] == "ing"
    for special in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"):
        assert (tokens[vocab[special]], types[vocab[special]]) == (special, gguf.TokenType.CONTROL)
    assert types.count(gguf.TokenType.CONTROL) == 5
    assert types.count(gguf.TokenType.NORMAL) == len(vocab) - 5


def test_every_tensor_equals_its_safetensors_source(reader, files):
    config = json.loads(files.read("config.json"))
    source = load(files.read("model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, config["num_hidden_layers"])
    expected = {
        names.get_name(name, try_suffixes=(".weight", ".bias")): value
        for name, value in source.items()
        if not (name.startswith("pooler.") or name == "embeddings.position_ids")
    }
    # 5 embedding tensors, 16 per block.
    assert len(expected) == 5 + 16 * config["num_hidden_layers"] == len(reader.tensors)
    for tensor in reader.tensors:
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, tensor.name
        np.testing.assert_array_equal(np.asarray(tensor.data), expected[tensor.name], err_msg=tensor.name)
    assert gguf_named(source, config["num_hidden_layers"]).keys() == expected.keys()


def test_the_gguf_files_tensors_embed_as_the_safetensors_do(converted, files, reference):
    vectors = read_gguf(converted, files.read("tokenizer.json").decode("utf-8")).embed(SENTENCES[:COMPARED]).vectors
    assert len(SENTENCES[:COMPARED]) == 20
    assert cosines(vectors, reference).min() >= 0.999


def test_a_file_that_is_not_bert_is_refused(tmp_path, files):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="not a bert file"):
        read_gguf(path, files.read("tokenizer.json").decode("utf-8"))


@pytest.mark.slow
def test_llama_server_embeds_the_file_as_the_reference_and_stopline_do(converted, reference, tmp_path):
    binary = llama_server_binary()
    if not binary.is_file():
        pytest.skip(f"no llama-server built at {binary} (python -m bench embeddings --build-llama-server builds it)")

    async def served() -> np.ndarray:
        server = EmbeddingLlamaServer(binary, converted, tmp_path, 4, 1, MAX_TOKENS)
        await server.start()
        try:
            answer = await call_json(server.http_url, "/v1/embeddings", {"input": SENTENCES[:COMPARED]})
        finally:
            await server.stop()
        return np.array([row["embedding"] for row in sorted(answer["data"], key=lambda row: row["index"])])

    vectors = asyncio.run(served())
    assert cosines(vectors, reference).min() >= 0.999
    # Stopline serves the file through the same llama.cpp.
    encoder = LlamaEncoder(converted)
    try:
        assert cosines(vectors, encoder.embed(SENTENCES[:COMPARED]).vectors).min() >= 0.9999
    finally:
        encoder.close()
