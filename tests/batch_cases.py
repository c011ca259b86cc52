"""Batch lines that the fault tests and the multi-node test run: every kind of prompt and sampling control."""


def batch_lines(n: int = 200) -> list[dict]:
    """Greedy and seeded lines with every sampling control that keeps per-sequence state (penalties over the
    tokens so far, stop strings, stop tokens), prompts as text, token ids and chats; short outputs."""
    out = []
    for i in range(n):
        line = {"id": f"r{i}", "max_tokens": 6 + i % 7}
        kind = i % 3
        if kind == 0:
            line["prompt"] = f"Line {i}: the " + "import statement " * (i % 5)
        elif kind == 1:
            line["prompt_token_ids"] = [(i * 37 + k * 11) % 500 + 3 for k in range(3 + i % 29)]
        else:
            line["messages"] = [{"role": "user", "content": f"What is item {i}?"}]
        if i % 2:
            line.update(temperature=0.9, top_p=0.9, seed=1000 + i)
        else:
            line["temperature"] = 0
        if i % 5 == 1:
            line.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
        if i % 11 == 3:
            line["stop"] = ["e"]
        out.append(line)
    return out
