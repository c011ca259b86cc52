import json
import re

import gguf
import numpy as np
import pytest
import tokenizers

from raymoe.tools.tiny_tokenizer import build_tiny_tokenizer
from raymoe.stages.errors import ModelFormatError
from raymoe.stages.files.gguf_file import GGUFFile
from raymoe.stages.text.tokenizer import (QWEN2_SPLIT, QWEN35_SPLIT, Tokenizer, gguf_tokenizer_fields,
                                          write_tokenizer_to_gguf)

FAMILIES = {"qwen35moe": "qwen35", "gptoss": "gpt-4o"}  # family -> GGUF pre-type

TEXTS = [
    "",
    "Hello, world!",
    "don't I'LL we've THEY'RE she'd it'S",
    "cafe\u0301 nai\u0308ve e\u0301e\u0301 a\u0300 Ångström re\u0301sume\u0301",
    "नमस्ते दुनिया। किताब",
    "你好，世界！ こんにちは 안녕하세요 Привет",
    "🙂👍🏽 👨‍👩‍👧 🇩🇪 ❤️ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ƒ",
    "12345 3.14159 1,000,000 007 2024-01-31",
    "   leading spaces, trailing   ",
    "tabs\tand\t\tmore\n\nnewlines\r\n\r\nwindows\n",
    "a/b/c\n/path/to/file.py  \n\n\n   x",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm</think>\n\nok<|im_end|><|endoftext|>",
    "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>ok<|return|><|call|>",
]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    family = request.param
    path = build_tiny_tokenizer(tmp_path_factory.mktemp(family), family)
    return family, path


def write_gguf(path, tok, pre, vocab_size=None):
    writer = gguf.GGUFWriter(str(path), "llama")
    write_tokenizer_to_gguf(writer, tok, pre, vocab_size=vocab_size)
    writer.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(str(path)).metadata


def test_matches_tokenizers_library(tiny):
    family, path = tiny
    reference = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok = Tokenizer.from_hf_dir(path)
    assert 600 <= tok.vocab_size <= 1000
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_single_ids(tiny):
    family, path = tiny
    tok = Tokenizer.from_hf_dir(path)
    name = {"qwen35moe": "<|im_end|>", "gptoss": "<|return|>"}[family]
    assert tok.encode(f"a{name}b")[1] == tok.token_to_id(name)
    assert tok.id_to_token(tok.token_to_id(name)) == name
    if family == "qwen35moe":
        assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
        assert tok.bos_token_id is None
        # <think> is added but not special: matched whole, kept when special tokens are skipped.
        assert tok.decode(tok.encode("<think>x<|im_end|>"), skip_special_tokens=True) == "<think>x"
    else:
        ends = {tok.token_to_id(t) for t in ("<|return|>", "<|call|>", "<|endoftext|>")}
        assert set(tok.eos_token_ids) == ends and tok.eos_token_ids[0] == tok.token_to_id("<|return|>")
        assert tok.token_to_id("<|end|>") not in tok.eos_token_ids  # harmony's <|end|> does not end a reply
        assert tok.bos_token_id == tok.token_to_id("<|startoftext|>")
        assert tok.encode("hi")[0] != tok.bos_token_id  # no BOS unless add_bos_token


def test_training_is_deterministic(tiny, tmp_path):
    family, path = tiny
    again = build_tiny_tokenizer(tmp_path, family)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (path / name).read_bytes()


@pytest.mark.parametrize("pad", [0, 7])
def test_gguf_round_trip(tiny, tmp_path, pad):
    family, path = tiny
    reference = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok = Tokenizer.from_hf_dir(path)
    meta = write_gguf(tmp_path / "t.gguf", tok, FAMILIES[family], tok.vocab_size + pad)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == FAMILIES[family]
    back = Tokenizer.from_gguf_metadata(meta)
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=False).ids
        assert back.encode(text) == ids, text
        assert back.decode(ids) == text
        assert back.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert back.vocab_size == tok.vocab_size + pad
    last = back.vocab_size - 1  # a padding row when pad > 0: no token, decodes to nothing
    assert (back.id_to_token(last), back.decode([last])) == (tok.id_to_token(last), tok.decode([last]))
    assert back.eos_token_ids == tok.eos_token_ids
    assert (back.bos_token_id, back.pad_token_id) == (tok.bos_token_id, tok.pad_token_id)
    assert back.chat_template == tok.chat_template
    assert gguf_tokenizer_fields(back, FAMILIES[family])["tokenizer.ggml.merges"] == tok.merges()


def test_qwen2_regex_differs_on_combining_marks(tmp_path):
    # Negative control: the pre-type is not cosmetic. qwen2 splits marks off their letters.
    tok = Tokenizer.from_hf_dir(build_tiny_tokenizer(tmp_path, "qwen35moe"))
    fields = gguf_tokenizer_fields(tok, "qwen35")
    qwen35 = Tokenizer.from_gguf_metadata(fields)
    qwen2 = Tokenizer.from_gguf_metadata({**fields, "tokenizer.ggml.pre": "qwen2"})
    text = "cafe\u0301 नमस्ते"
    split = lambda regex: [p for p, _ in tokenizers.pre_tokenizers.Split(  # noqa: E731
        tokenizers.Regex(regex), behavior="isolated").pre_tokenize_str(text)]
    assert split(QWEN35_SPLIT) == ["cafe\u0301", " नमस्ते"]
    assert split(QWEN2_SPLIT) != split(QWEN35_SPLIT)
    assert qwen35.encode(text) == tok.encode(text)
    assert qwen2.encode(text) != qwen35.encode(text)
    assert qwen2.encode("plain ascii text") == qwen35.encode("plain ascii text")


def test_wrong_pre_type_is_refused(tmp_path):
    tok = Tokenizer.from_hf_dir(build_tiny_tokenizer(tmp_path, "qwen35moe"))
    with pytest.raises(ModelFormatError, match="gpt-4o"):
        gguf_tokenizer_fields(tok, "gpt-4o")
    with pytest.raises(ModelFormatError, match="llama-bpe"):
        gguf_tokenizer_fields(tok, "llama-bpe")


def test_gguf_metadata_errors(tmp_path):
    tok = Tokenizer.from_hf_dir(build_tiny_tokenizer(tmp_path, "gptoss"))
    meta = gguf_tokenizer_fields(tok, "gpt-4o")
    cases = {
        "'llama'": {**meta, "tokenizer.ggml.model": "llama"},
        "'t5'": {**meta, "tokenizer.ggml.model": "t5"},
        "tokenizer.ggml.model is missing": {k: v for k, v in meta.items() if k != "tokenizer.ggml.model"},
        "'deepseek-llm'": {**meta, "tokenizer.ggml.pre": "deepseek-llm"},
        "tokens": {**meta, "tokenizer.ggml.tokens": 5},
        "token_type": {**meta, "tokenizer.ggml.token_type": [1, 1]},
        "left right": {**meta, "tokenizer.ggml.merges": ["a b c"]},
        "merges do not fit": {**meta, "tokenizer.ggml.merges": ["zzz qqq"]},
        "eos_token_id": {**meta, "tokenizer.ggml.eos_token_id": 10**6},
    }
    for message, bad in cases.items():
        with pytest.raises(ModelFormatError, match=message):
            Tokenizer.from_gguf_metadata(bad)


def test_hf_dir_extras(tmp_path):
    path = build_tiny_tokenizer(tmp_path, "qwen35moe")
    config = json.loads((path / "tokenizer_config.json").read_text())
    base = Tokenizer.from_hf_dir(path)
    # A token only tokenizer_config.json knows about is added with its id.
    config["added_tokens_decoder"][str(base.vocab_size)] = {"content": "<tool_call>", "special": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 802]}))
    tok = Tokenizer.from_hf_dir(path)
    assert tok.encode("a<tool_call>")[-1] == base.vocab_size
    assert tok.chat_template == "{{ messages[0].content }}"  # chat_template.jinja wins over the config
    assert tok.eos_token_ids == [802, 7, 800]


def test_hf_dir_errors(tmp_path):
    with pytest.raises(ModelFormatError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "missing")
    path = build_tiny_tokenizer(tmp_path / "a", "gptoss")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|nope|>"}))
    with pytest.raises(ModelFormatError, match=re.escape("eos_token '<|nope|>' is not in the vocabulary")):
        Tokenizer.from_hf_dir(path)
    (path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="invalid JSON"):
        Tokenizer.from_hf_dir(path)
    (path / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ModelFormatError, match="cannot load tokenizer"):
        Tokenizer.from_hf_dir(path)
