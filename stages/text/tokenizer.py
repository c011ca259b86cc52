"""Byte-level BPE tokenizers from an HF model directory or from GGUF metadata.

Both sources become the same `tokenizers.Tokenizer` (the HF Rust library), so a model encodes
identically whichever format it was loaded from. GGUF has no `tokenizer.json`: it names the
pre-tokenizer by a llama.cpp "pre" type, which maps to the split regex below.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from raymoe.stages.text.chat import ChatPrompt
from raymoe.stages.errors import ModelFormatError, RequestError

# llama.cpp's regexes, letter for letter (its engine has no `(?i:)`, hence the explicit classes).
QWEN35_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (tiktoken), used by gpt-oss.
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_SPLITS = {"qwen2": QWEN2_SPLIT, "qwen35": QWEN35_SPLIT, "gpt-4o": GPT4O_SPLIT}

# Special tokens that end generation in the chat formats we serve (ChatML, harmony). llama.cpp
# treats the same names as end-of-generation. Harmony's `<|end|>` is deliberately absent: it closes
# the analysis message, after which the model goes on to the final one.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|return|>", "<|call|>")

# Text that exercises every branch of the split regexes; used to check a tokenizer's own
# pre-tokenizer against the one a GGUF "pre" type will rebuild.
_PROBE = "Hello, world! I'LL don't 12345 naïve cafe\u0301 नमस्ते 你好 \t\n\n  x  🙂 a/b\r\n"


def byte_level_backend(vocab: dict[str, int], merges: list[tuple[str, str]], split: str) -> tokenizers.Tokenizer:
    """A GPT-2 style byte-level BPE tokenizer with a custom pre-split regex."""
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=False, fuse_unk=False, unk_token=None)
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_id: int | None,
        bos_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        extra_eos_ids: tuple[int, ...] | list[int] = (),
        vocab_size: int | None = None,
    ):
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        # a server's default template variables (stages.text.requests.chat_prompt)
        self.chat_template_kwargs: dict = {}
        # the chat format of the model's family (Family.chat_format), for templates that do not say theirs
        self.family_chat_format: str | None = None
        # Ids may have holes (padded vocabularies), so the size is at least the largest id + 1.
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        if vocab_size is not None:
            self.vocab_size = max(self.vocab_size, vocab_size)
        specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        ends = [eos_token_id, *extra_eos_ids, *(specials[name] for name in END_TOKENS if name in specials)]
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in ends if i is not None))
        self._specials = specials
        self._plain: tokenizers.Tokenizer | None = None     # encodes special-token strings as text

    # --- loading -------------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelFormatError(f"{path}: no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust library reports parse errors as plain Exceptions
            raise ModelFormatError(f"{file}: cannot load tokenizer ({_one_line(e)})") from None
        config = _read_json(path / "tokenizer_config.json")
        _add_config_tokens(backend, config.get("added_tokens_decoder", {}), path)

        def token_id(key):
            content = _token_content(config.get(key))
            if content is None:
                return None
            token = backend.token_to_id(content)
            if token is None:
                raise ModelFormatError(f"{path}: {key} {content!r} is not in the vocabulary")
            return token

        extra = _read_json(path / "generation_config.json").get("eos_token_id", [])
        extra = [extra] if isinstance(extra, int) else extra
        if not (isinstance(extra, list) and all(isinstance(i, int) for i in extra)):
            raise ModelFormatError(f"{path}: generation_config.json eos_token_id must be an int or a list of ints")
        return cls(
            backend,
            eos_token_id=token_id("eos_token"),
            bos_token_id=token_id("bos_token"),
            pad_token_id=token_id("pad_token"),
            add_bos=bool(config.get("add_bos_token", False)),
            chat_template=_hf_chat_template(path, config),
            extra_eos_ids=extra,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFormatError("GGUF has no tokenizer (tokenizer.ggml.model is missing)")
        if model != "gpt2":
            raise ModelFormatError(
                f"unsupported GGUF tokenizer model {model!r} (only 'gpt2' byte-level BPE is supported)"
            )
        pre = meta.get("tokenizer.ggml.pre")
        if pre not in PRE_SPLITS:
            raise ModelFormatError(
                f"unsupported GGUF tokenizer pre-type {pre!r} (supported: {', '.join(sorted(PRE_SPLITS))})"
            )
        tokens = _str_list(meta, "tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFormatError("GGUF tokenizer.ggml.tokens is empty")
        merges = _str_list(meta, "tokenizer.ggml.merges")
        types = meta.get("tokenizer.ggml.token_type", [gguf.TokenType.NORMAL] * len(tokens))
        if not isinstance(types, list) or len(types) != len(tokens):
            raise ModelFormatError("GGUF tokenizer.ggml.token_type does not match tokenizer.ggml.tokens")
        pairs = [tuple(m.split(" ")) for m in merges]
        if any(len(p) != 2 for p in pairs):
            raise ModelFormatError("GGUF tokenizer.ggml.merges has an entry that is not 'left right'")
        # Unused (padding) entries stay out of the vocabulary so they decode to nothing, as in llama.cpp.
        # the enum members as plain ints: looking them up per token took ~1 s of a 200k vocabulary's load
        unused, control = int(gguf.TokenType.UNUSED), int(gguf.TokenType.CONTROL)
        whole = {control, int(gguf.TokenType.USER_DEFINED)}
        vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind != unused}
        try:
            backend = byte_level_backend(vocab, pairs, PRE_SPLITS[pre])
        except Exception as e:
            raise ModelFormatError(f"GGUF tokenizer merges do not fit its tokens ({_one_line(e)})") from None
        # Control and user-defined tokens are matched whole in text (e.g. `<|im_end|>`, `<think>`);
        # their text is already in the vocabulary, so they keep their ids.
        backend.add_tokens(
            [
                AddedToken(token, special=kind == control, normalized=False)
                for token, kind in zip(tokens, types)
                if kind in whole
            ]
        )

        def token_id(name):
            value = meta.get(f"tokenizer.ggml.{name}")
            if value is not None and not (isinstance(value, int) and 0 <= value < len(tokens)):
                raise ModelFormatError(f"GGUF tokenizer.ggml.{name} {value!r} is not a token id")
            return value

        return cls(
            backend,
            eos_token_id=token_id("eos_token_id"),
            bos_token_id=token_id("bos_token_id"),
            pad_token_id=token_id("padding_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
            extra_eos_ids=[i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None],
            vocab_size=len(tokens),
        )

    # --- use -----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids, except inside the
        messages of a ChatPrompt, whose text is always encoded as text. RequestError for text that is
        not valid Unicode (a lone surrogate, which JSON's \\ud800 escapes can produce)."""
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(f"the text is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} "
                                   f"at character {e.start}") from None
        ids = self._encode_chat(text) if isinstance(text, ChatPrompt) else self._encode(self.backend, text)
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    @staticmethod
    def _encode(backend: tokenizers.Tokenizer, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not), so a server's event loop goes on meanwhile
        return backend.encode_batch([text], add_special_tokens=False)[0].ids

    def _encode_chat(self, prompt: ChatPrompt) -> list[int]:
        if not self._specials:
            return self._encode(self.backend, prompt)
        pattern = re.compile("|".join(re.escape(s) for s in sorted(self._specials, key=len, reverse=True)))
        protected = prompt.protect(pattern)
        if protected is None:        # no special-token string in any message
            return self._encode(self.backend, prompt)
        if self._plain is None:
            self._plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
            self._plain.encode_special_tokens = True
        # the template's own special tokens are control tokens; the text between them (message text
        # with its special strings put back) is encoded as text
        ids: list[int] = []
        start = 0
        for m in pattern.finditer(protected):
            ids += self._encode(self._plain, prompt.restore(protected[start:m.start()]))
            ids.append(self._specials[m.group(0)])
            start = m.end()
        return ids + self._encode(self._plain, prompt.restore(protected[start:]))

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text that one token covers: text of n bytes has at
        least n / max_token_bytes tokens."""
        return max((len(t.encode("utf-8")) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def special_tokens(self) -> dict[str, int]:
        """{text: id} of the special (control) tokens, which decoding with skip_special_tokens drops."""
        return self._specials

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """bos/eos/pad token texts, the variables transformers hands to chat templates."""
        ids = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id, "pad_token": self.pad_token_id}
        return {name: self.id_to_token(i) for name, i in ids.items() if i is not None}

    def merges(self) -> list[str]:
        """BPE merges as "left right" strings, highest priority first."""
        model = json.loads(self.backend.to_str())["model"]
        if model.get("type") != "BPE":
            raise ModelFormatError(f"tokenizer model {model.get('type')!r} is not BPE")
        # tokenizer.json stores merges as ["a", "b"] pairs (newer) or "a b" strings (older).
        return [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


# --- GGUF writing --------------------------------------------------------------------------------


def gguf_tokenizer_fields(tok: Tokenizer, pre: str, vocab_size: int | None = None) -> dict[str, Any]:
    """GGUF tokenizer key/values for `tok`, with the vocabulary padded to `vocab_size` entries
    (the embedding rows) as llama.cpp's converter does. `pre` must describe `tok`'s own split."""
    if pre not in PRE_SPLITS:
        raise ModelFormatError(
            f"unsupported GGUF tokenizer pre-type {pre!r} (supported: {', '.join(sorted(PRE_SPLITS))})"
        )
    # The pre-type is all a GGUF keeps of the pre-tokenizer, so a wrong one would silently change encodings.
    ours = byte_level_backend({}, [], PRE_SPLITS[pre]).pre_tokenizer.pre_tokenize_str(_PROBE)
    theirs = tok.backend.pre_tokenizer.pre_tokenize_str(_PROBE) if tok.backend.pre_tokenizer else None
    if ours != theirs:
        raise ModelFormatError(f"the tokenizer's pre-tokenizer does not split text like GGUF pre-type {pre!r}")
    vocab_size = tok.vocab_size if vocab_size is None else vocab_size
    if vocab_size < tok.vocab_size:
        raise ModelFormatError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tok.vocab_size} tokens")
    added = tok.backend.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(vocab_size):
        token = tok.id_to_token(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(token)
            if i in added:
                types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
            else:
                types.append(gguf.TokenType.NORMAL)
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.merges": tok.merges(),
        "tokenizer.ggml.eos_token_id": tok.eos_token_id,
        "tokenizer.ggml.bos_token_id": tok.bos_token_id,
        "tokenizer.ggml.padding_token_id": tok.pad_token_id,
        "tokenizer.ggml.add_bos_token": tok.add_bos,
        "tokenizer.chat_template": tok.chat_template,
    }
    return {key: value for key, value in fields.items() if value is not None}


def write_tokenizer_to_gguf(
    writer: gguf.GGUFWriter, tok: Tokenizer, pre: str, vocab_size: int | None = None
) -> None:
    fields = gguf_tokenizer_fields(tok, pre, vocab_size)
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_add_bos_token(fields["tokenizer.ggml.add_bos_token"])
    setters = {
        "tokenizer.ggml.eos_token_id": writer.add_eos_token_id,
        "tokenizer.ggml.bos_token_id": writer.add_bos_token_id,
        "tokenizer.ggml.padding_token_id": writer.add_pad_token_id,
        "tokenizer.chat_template": writer.add_chat_template,
    }
    for key, setter in setters.items():
        if key in fields:
            setter(fields[key])


# --- helpers -------------------------------------------------------------------------------------


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def _read_json(file: Path) -> dict:
    """A JSON object file's contents, or {} when the file is absent."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{file}: invalid JSON ({_one_line(e)})") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{file}: expected a JSON object")
    return data


def _token_content(value) -> str | None:
    # tokenizer_config.json spells a special token as text or as a serialised AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ModelFormatError(f"special token {value!r} is not text")
    return value


def _add_config_tokens(backend: tokenizers.Tokenizer, decoder: dict, path: Path) -> None:
    """Add tokens listed in tokenizer_config.json's added_tokens_decoder but missing from tokenizer.json."""
    flags = ("special", "normalized", "lstrip", "rstrip", "single_word")
    try:
        entries = sorted(
            ((int(key), AddedToken(spec["content"], **{f: bool(spec.get(f, False)) for f in flags}))
             for key, spec in decoder.items()),
            key=lambda entry: entry[0],
        )
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(f"{path}: malformed added_tokens_decoder ({type(e).__name__}: {_one_line(e)})") from None
    for token_id, token in entries:
        if backend.token_to_id(token.content) is None:
            backend.add_tokens([token])
            if backend.token_to_id(token.content) != token_id:
                raise ModelFormatError(f"{path}: added token {token.content!r} cannot take id {token_id}")


def _hf_chat_template(path: Path, config: dict) -> str | None:
    # Newer transformers save the template beside the config rather than inside it.
    file = path / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one is the chat template
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
        raise ModelFormatError(f"{path}: chat_template is not text")
    return template


def _str_list(meta: dict, key: str) -> list[str]:
    value = meta.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelFormatError(f"GGUF {key} is missing or not a list of strings")
    return value
