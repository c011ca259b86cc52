"""Incremental detokenisation (stages/text/detokenizer.py): the text grows a few tokens at a time, only
ever by appending, and once finished equals a full decode — for byte-level BPE with random ids
(partial UTF-8 characters, special tokens) and for a decoder that strips a leading space."""
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from raymoe.stages.text.detokenizer import Detokenizer
from raymoe.stages.files.loader import open_model


def check(tokenizer, ids):
    d, text = Detokenizer(tokenizer), ""
    for n, token in enumerate(ids, 1):
        text += d.add(token)
        assert tokenizer.decode(ids[:n], skip_special_tokens=True).startswith(text)
    text += d.finish()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", ["tiny-qwen35moe", "tiny-gptoss"])
def test_byte_level_bpe(name):
    tokenizer = open_model(name).tokenizer

    @given(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40))
    @settings(max_examples=200, deadline=None)
    def run(ids):
        check(tokenizer, ids)

    run()


def test_a_decoder_that_strips_the_leading_space():
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁": 3, "lo": 4, "x": 5}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = tokenizers.decoders.Metaspace(replacement="▁", prepend_scheme="always")

    class Wrapped:
        def decode(self, ids, skip_special_tokens=True):
            return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    assert Wrapped().decode([1, 2]) == "hello world"
    for ids in ([1, 2, 3, 4, 5], [3, 1, 1], [4, 1, 5, 2], [2], [1, 4, 3, 5, 2] * 9):   # the last: past WINDOW
        check(Wrapped(), ids)
