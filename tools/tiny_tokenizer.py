"""Tiny byte-level BPE tokenizers for the tiny test models, trained here so no hub is needed.

`build_tiny_tokenizer(out_dir, family)` writes `tokenizer.json` and `tokenizer_config.json` shaped
like the real model family's: the same pre-tokenizer regex, special tokens and (simplified) chat
template, with a vocabulary of a few hundred tokens learned from the small corpus below. Training
is deterministic, so every run writes the same files.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from raymoe.stages.errors import RaymoeError
from raymoe.stages.text.tokenizer import GPT4O_SPLIT

# Qwen3.5's tokenizer.json spelling; llama.cpp's qwen35 regex (stages.text.tokenizer.QWEN35_SPLIT) writes the
# contractions as character classes instead of (?i:) and splits the same text.
QWEN35_HF_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2/Qwen3/Qwen3-Next's tokenizer.json spelling of llama.cpp's qwen2 regex (stages.text.tokenizer.QWEN2_SPLIT).
QWEN2_HF_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

VOCAB_SIZE = 800  # byte alphabet (256) + merges; the special tokens come after

CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog didn't mind; it's a lazy dog, after all.\n"
    "I'm sure you'll find that we've done what we'd said we would. They're here, aren't they?\n"
    "DON'T SHOUT. I'LL BE THERE. She's WE'VE YOU'D THEY'RE it'S.\n"
    "A language model reads text as tokens. Each token is a piece of a word, a whole word, or a symbol.\n"
    "Tokenizers split text with a regular expression first, then merge bytes into larger pieces.\n"
    "Mixture-of-experts models route every token to a few experts out of many, and add the results.\n"
    "Pipeline parallelism cuts the layers into stages; each stage runs on its own device.\n"
    "The coordinator keeps several micro-batches in flight so that all stages work at the same time.\n"
    "Attention looks back over the cache; linear attention keeps a small state instead of the whole past.\n"
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 4096 12345 65536 3.14159 2.71828 1e-6\n"
    "Dates and times: 2024-01-31, 12:30:45, 1999/12/31, 07:00 am, the 21st of March, 3rd place.\n"
    "Prices: $9.99, EUR 15,00, 100% sure, 50/50 odds, 1,000,000 users, #1 rank, @user, a+b=c.\n"
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n\n"
    "if (x > 0 && y < 10) { return x; } else { return -y; }\n\tindented with a tab\n\t\ttwo tabs\n"
    "    four spaces    and     more      spaces\n\n\n\nblank lines above\r\nwindows line end\r\n"
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": true, "b": null}}\n'
    "<html><body><p>Hello, world!</p></body></html>\n"
    "Café, naïve, résumé, façade, jalapeño, über, Ångström, coöperate, smörgåsbord, crème brûlée.\n"
    "Decomposed: cafe\u0301, nai\u0308ve, re\u0301sume\u0301, fac\u0327ade, jalapen\u0303o, u\u0308ber, A\u030angstro\u0308m.\n"
    "Combining marks: e\u0301 a\u0300 o\u0302 n\u0303 u\u0308 c\u0327 i\u0301 e\u0301e\u0301 a\u0301a\u0301.\n"
    "Tiếng Việt có nhiều dấu: người, được, những, trường, nước, Việt Nam.\n"
    "नमस्ते दुनिया। हिन्दी में मात्राएँ संयुक्त होती हैं: किताब, स्कूल, प्रेम, शिक्षा।\n"
    "Привет, мир! Как дела? Всё хорошо, спасибо. Москва, Санкт-Петербург.\n"
    "Γειά σου κόσμε! Καλημέρα, τι κάνεις; Ελλάδα, Αθήνα, φιλοσοφία.\n"
    "مرحبا بالعالم. كيف حالك؟ السلام عليكم.\n"
    "שלום עולם. מה שלומך?\n"
    "你好，世界！今天天气很好。我们一起去公园散步吧。中文分词很有意思。\n"
    "こんにちは、世界。ひらがなとカタカナと漢字を使います。東京、大阪、京都。\n"
    "안녕하세요, 세계! 한국어는 한글로 씁니다. 서울, 부산.\n"
    "ภาษาไทย สวัสดีครับ ขอบคุณมาก\n"
    "Emoji: 🙂 😀 🚀 🎉 👍🏽 ❤️ 👨‍👩‍👧 🇩🇪 🇯🇵 ✨ 🔥 💡 ✅ ❌ → ← ↑ ↓ ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ π µ Ω °C €\n"
    "Math: x² + y² = z², α + β = γ, ∀x ∈ ℝ: x² ≥ 0, f(x) = eˣ, ½ + ¼ = ¾.\n"
    "Quotes: “double”, ‘single’, «guillemets», „German“ — em dash – en dash … ellipsis.\n"
    "Once upon a time, in a land far away, there lived a small robot who loved to count.\n"
    "It counted stars at night and grains of sand by day, and it never grew tired of counting.\n"
    "One day the robot met a cat. The cat asked: why do you count? The robot said: because numbers are fun!\n"
    "The cat thought about it and said: I'd rather sleep. And so the cat slept, and the robot kept counting.\n"
    "Questions and answers: What is the capital of France? Paris. What is two plus two? Four.\n"
    "Who wrote Hamlet? Shakespeare. How many legs does a spider have? Eight. Why is the sky blue? Scattering.\n"
    "The assistant thinks step by step before it answers, and then gives a short, clear answer.\n"
    "Let me think. First, add the numbers. Then, divide by the count. The average is therefore 7.5.\n"
    "user: hello there!\nassistant: Hi! How can I help you today?\nuser: tell me a joke\n"
    "assistant: Why did the scarecrow win an award? Because he was outstanding in his field.\n"
    "system: You are a helpful assistant. Answer briefly and politely.\n"
)

SPECIAL_TOKENS = {
    "qwen35moe": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "qwen3next": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "gptoss": [
        "<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>",
        "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>",
    ],
}
# Qwen marks the thinking tags as added but not special: they are matched whole, yet kept on decode.
PLAIN_ADDED_TOKENS = {"qwen35moe": ["<think>", "</think>"], "qwen3next": ["<think>", "</think>"], "gptoss": []}

SPLITS = {"qwen35moe": QWEN35_HF_SPLIT, "qwen3next": QWEN2_HF_SPLIT, "gptoss": GPT4O_SPLIT}

# ChatML as in Qwen3.5's template, simplified: no tools; earlier assistant turns keep only their answer;
# the generation prompt opens a thinking block unless enable_thinking is false.
QWEN_CHAT_TEMPLATE = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
        {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""

# Harmony, simplified: no model identity block, no tools, answers only on the final channel.
HARMONY_CHAT_TEMPLATE = r"""{%- for message in messages %}
    {%- if message.role in ['system', 'user'] %}
        {{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start|>assistant' }}
{%- endif %}
"""

CONFIGS = {
    "qwen35moe": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                  "chat_template": QWEN_CHAT_TEMPLATE},
    "qwen3next": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                  "chat_template": QWEN_CHAT_TEMPLATE},
    "gptoss": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
               "chat_template": HARMONY_CHAT_TEMPLATE},
}


def train_tokenizer(family: str, corpus: list[str] | None = None, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE of `vocab_size` learned from `corpus` (lines with their endings; default: CORPUS)."""
    if family not in SPLITS:
        raise RaymoeError(f"unknown tokenizer family {family!r} (known: {', '.join(sorted(SPLITS))})")
    tok = Tokenizer(models.BPE(byte_fallback=False, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLITS[family]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    # Lines keep their endings so that newline and whitespace runs get merges too.
    tok.train_from_iterator(CORPUS.splitlines(keepends=True) if corpus is None else corpus, trainer)
    # Added after training, so they take the ids after the learned vocabulary, as in the real models.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[family]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS[family]])
    return tok


def build_tiny_tokenizer(out_dir, family: str, corpus: list[str] | None = None, vocab_size: int = VOCAB_SIZE) -> Path:
    tok = train_tokenizer(family, corpus, vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # decoding must give back the exact text
        "model_max_length": 131072,
        "added_tokens_decoder": added,
        **CONFIGS[family],
    }
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return out
