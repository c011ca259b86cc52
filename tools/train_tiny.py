"""Train the embedded default models (tiny-qwen35moe, tiny-gptoss) on CPU and write them as GGUF.

    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb /tmp/pydoc
    python -m raymoe.tools.train_tiny --docs /tmp/pydoc/usr/share/doc/python3.11/html/_sources --out models

The corpus is the English prose of the Python 3.11 documentation as Debian ships it (docs/tiny-models.md
says exactly which files and how they are cleaned). Every 20th paragraph is held out; the tokenizer and
the models see only the rest. Each model keeps its family's real architecture, small, and is trained
with transformers' own model class. Training is deterministic: fixed seeds, fixed batches, two threads,
torch's deterministic algorithms; a rerun on the same machine writes the same files.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import re
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # before torch loads: idle threads sleep, not spin
import torch  # noqa: E402

CORPUS_PACKAGE = "python3.11-doc"
CORPUS_VERSION = "3.11.2-6+deb12u8"     # Debian 12 (bookworm); licence: PSF License Version 2
SECTIONS = ("tutorial", "faq", "howto", "reference", "using", "extending", "library")
HELD_OUT_EVERY = 20        # paragraph i (counted over the whole corpus) is held out when i % 20 == 19
VOCAB_SIZE = 2048          # byte alphabet (256) + merges; special tokens come after
SEQ_LEN = 128
BATCH = 8
STEPS = {"qwen35moe": 1200, "gptoss": 1200}
LR = {"qwen35moe": 3e-3, "gptoss": 3e-3}
MTP_STEPS = 600             # the qwen35moe model's MTP head, trained after it on the same stream
MTP_LR = 3e-3
THREADS = 2
SEED = 0

# --- corpus --------------------------------------------------------------------------------------------

_ROLE = re.compile(r":[\w:.-]+:`([^`]*)`")


def _role_text(m: re.Match) -> str:
    """What Sphinx shows for :role:`text`: `title <target>` shows the title, `~a.b.c` the last part."""
    t = m.group(1).lstrip("!")
    if "<" in t and not t.startswith("<"):
        t = re.sub(r"\s*<[^>]*>$", "", t)
    if t.startswith("~"):
        t = t[1:].split(".")[-1]
    return t


def clean_inline(text: str) -> str:
    """reStructuredText inline markup to plain text, whitespace collapsed."""
    text = _ROLE.sub(_role_text, text)
    text = re.sub(r"``([^`]+)``", r"\1", text)                      # literals
    text = re.sub(r"`([^`<]*?)\s*<[^>]*>`__?", r"\1", text)          # `title <url>`_
    text = re.sub(r"`([^`]+)`_{0,2}", r"\1", text)                   # `ref`_ and plain `text`
    text = re.sub(r"\s*\[#\w*\]_", "", text)                         # footnote marks
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1", text)
    text = re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"\1", text)
    text = text.replace("|version|", "3.11").replace("|release|", "3.11")
    text = re.sub(r"\s*::$", ":", text)                              # "example::" introduces a code block
    text = text.replace("\\ ", "")
    return re.sub(r"\s+", " ", text).strip()


def paragraphs(rst: str):
    """The prose paragraphs of one .rst file: unindented blocks that start with a letter, quote or
    parenthesis. Headings, directives, lists, tables and every indented block (code, directive bodies)
    are dropped; so are paragraphs under 40 characters after cleaning."""
    for block in re.split(r"\n\s*\n", rst):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines or any(line[:1].isspace() for line in lines):
            continue
        if not re.match(r"[A-Za-z(\"']", lines[0]) or re.fullmatch(r"[=\-~^\"#*+]{3,}", lines[-1].strip()):
            continue
        text = clean_inline(" ".join(lines))
        if len(text) >= 40:
            yield text


def corpus_files(docs: str) -> list[str]:
    files = []
    for section in SECTIONS:
        files += sorted(glob.glob(os.path.join(docs, section, "**", "*.rst.txt"), recursive=True))
    if not files:
        raise SystemExit(f"error: no {SECTIONS[0]}/*.rst.txt under {docs} (extract {CORPUS_PACKAGE} first)")
    return files


def load_corpus(docs: str) -> tuple[list[str], list[str]]:
    """(training paragraphs, held-out paragraphs)."""
    train, held_out = [], []
    i = 0
    for path in corpus_files(docs):
        with open(path, encoding="utf-8") as f:
            for p in paragraphs(f.read()):
                (held_out if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(p)
                i += 1
    return train, held_out


def token_stream(tokenizer, paras: list[str]) -> torch.Tensor:
    """Paragraphs one per line, as one stream of token ids."""
    return torch.tensor([t for enc in tokenizer.encode_batch([p + "\n" for p in paras]) for t in enc.ids])


# --- models --------------------------------------------------------------------------------------------

# make_tiny's shapes, with fewer layers and experts so that training fits the time budget
SMALLER = {"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2}


def qwen35moe_model(vocab: int):
    """Qwen3.5-MoE: Gated DeltaNet layers with full attention every 4th layer, routed + shared experts."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from raymoe.tools.make_tiny import qwen35moe_config

    cfg = {k: v for k, v in qwen35moe_config(vocab).items() if k not in ("architectures", "torch_dtype")}
    cfg.update(SMALLER, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(4)])
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**cfg, output_router_logits=True))


def gptoss_model(vocab: int):
    """gpt-oss: attention sinks, sliding window on every other layer, YaRN; experts become MXFP4 at export."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from raymoe.tools.make_tiny import gptoss_config

    cfg = {k: v for k, v in gptoss_config(vocab).items()
           if k not in ("architectures", "torch_dtype", "quantization_config", "rope_scaling", "rope_theta")}
    cfg["rope_parameters"] = {**gptoss_config(vocab)["rope_scaling"], "rope_theta": gptoss_config(vocab)["rope_theta"]}
    cfg.update(SMALLER, num_local_experts=SMALLER["num_experts"], experts_per_token=SMALLER["num_experts_per_tok"],
               sliding_window=64, layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(4)])
    return GptOssForCausalLM(GptOssConfig(**cfg, output_router_logits=True))


FAMILIES = {"qwen35moe": qwen35moe_model, "gptoss": gptoss_model}

# --- MXFP4 (docs/model-formats.md §4): blocks of 32 values, e2m1 codes, one power-of-two scale ------------

FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] float -> (blocks [E, rows, cols/32, 16] u8, low nibble = even element; scales
    [E, rows, cols/32] u8, e8m0). The scale puts the block's largest magnitude at most at 6; each value
    takes the nearest code."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1).clamp_min(2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.pow(2.0, exp)[..., None]
    codes = (scaled[..., None] - FP4_VALUES).abs().argmin(-1).to(torch.uint8)     # ties: the lower code
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()
    values = FP4_VALUES[codes].reshape(*blocks.shape[:-1], 32) * torch.pow(2.0, scales.float() - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


# --- training ------------------------------------------------------------------------------------------

def fit(params: list, loss_of, stream: torch.Tensor, steps: int, lr: float, seed: int, log, label: str = "") -> None:
    """AdamW on `params` over random windows of the stream (seeded by `seed`), warmup then cosine decay to a tenth;
    loss_of(ids [BATCH, SEQ_LEN]) is a window batch's loss."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup
        else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup))))
    start, cpu, avg = time.time(), time.process_time(), None
    for step in range(steps):
        offsets = torch.randint(0, len(stream) - SEQ_LEN - 1, (BATCH,), generator=g)
        ids = torch.stack([stream[o:o + SEQ_LEN] for o in offsets.tolist()])
        loss = loss_of(ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        avg = loss.item() if avg is None else 0.98 * avg + 0.02 * loss.item()
        if step % 50 == 0 or step == steps - 1:
            log(f"{label}step {step}/{steps} loss {avg:.3f} ({time.time() - start:.0f} s, "
                f"{time.process_time() - cpu:.0f} s CPU)")


def train(model, stream: torch.Tensor, steps: int, lr: float, log) -> None:
    """The model on next-token prediction (fit)."""
    model.train()
    fit(list(model.parameters()), lambda ids: model(input_ids=ids, labels=ids).loss, stream, steps, lr, SEED, log)
    model.eval()


def train_mtp(model, stream: torch.Tensor, steps: int, lr: float, log):
    """The MTP head (tools/mtp_head.py) of the trained model, the model frozen: at each position it learns the token
    after next from the model's final hidden state there and the next token's embedding (fit, its own windows).
    Returns the head."""
    from raymoe.tools.mtp_head import HFMtpHead, model_hidden

    torch.manual_seed(SEED)
    head = HFMtpHead(model).float()
    head.apply(model._init_weights)         # transformers' own initialisation (expert weights start empty)
    for p in model.parameters():
        p.requires_grad_(False)
    positions = torch.arange(1, SEQ_LEN)[None].expand(BATCH, -1)

    def loss_of(ids):
        with torch.no_grad():
            hidden = model_hidden(model, ids)
        # row p joins the hidden state at p with token p + 1 and predicts token p + 2
        logits = head.logits(head(ids[:, 1:], hidden[:, :-1], positions)[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 2:].reshape(-1))
    head.train()
    fit(list(head.parameters()), loss_of, stream, steps, lr, SEED + 1, log, "mtp ")
    head.eval()
    return head


def mtp_accuracy(head, chunks: list[list[int]]) -> float:
    """How often the head's argmax is the held-out token after next (the model's own hidden states before it)."""
    from raymoe.tools.mtp_head import model_hidden

    right = total = 0
    with torch.no_grad():
        for i in range(0, len(chunks), 32):
            ids = torch.tensor(chunks[i:i + 32])
            hidden = model_hidden(head.trunk[0], ids)
            positions = torch.arange(1, ids.shape[1])[None].expand(ids.shape[0], -1)
            best = head.logits(head(ids[:, 1:], hidden[:, :-1], positions)[:, :-1]).argmax(-1)
            right += (best == ids[:, 2:]).sum().item()
            total += best.numel()
    return right / total


def raymoe_mtp_acceptance(gguf_path: str, tokenizer) -> dict:
    """raymoe's speculation counts when it decodes the PROMPTS greedily with the head's drafts (two a step)."""
    from raymoe.stages.files.loader import open_model
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.runtime.speculation import SpeculativeConfig, speculation_load
    from raymoe.stages.text.sampling_params import SamplingParams

    engine = LocalEngine(open_model(gguf_path), mode="float32",
                         speculation=SpeculativeConfig(method="mtp", num_speculative_tokens=2))
    engine.speculation.length = lambda acceptance, rows, most: most    # measure the head, not the cost model
    seqs = [engine.add_request(p, tokenizer.encode(p).ids, SamplingParams(max_tokens=64, temperature=0))
            for p in PROMPTS]
    engine.run_until_done()
    return speculation_load(sum(s.draft_tokens for s in seqs), sum(s.accepted_tokens for s in seqs),
                            sum(s.verify_steps for s in seqs))


def eval_chunks(stream: torch.Tensor) -> list[list[int]]:
    """The held-out stream cut into SEQ_LEN-token chunks, each scored on its own."""
    n = len(stream) // SEQ_LEN
    return stream[:n * SEQ_LEN].reshape(n, SEQ_LEN).tolist()


def hf_perplexity(model, chunks: list[list[int]]) -> float:
    """exp(mean negative log-likelihood of every token after the first of each chunk)."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(chunks), 32):
            ids = torch.tensor(chunks[i:i + 32])
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
            nll -= logp[:, :-1].gather(-1, ids[:, 1:, None]).sum().item()
            count += ids[:, 1:].numel()
    return math.exp(nll / count)


def raymoe_perplexity(gguf_path: str, chunks: list[list[int]]) -> float:
    """The same measure from raymoe's engine on the GGUF (exact float32 mode), via prompt logprobs."""
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.files.loader import open_model
    from raymoe.stages.text.sampling_params import SamplingParams

    engine = LocalEngine(open_model(gguf_path), mode="float32")
    seqs = [engine.add_request(f"c{i}", c, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
            for i, c in enumerate(chunks)]
    engine.run_until_done()
    nll = -sum(e["logprob"] for s in seqs for e in s.result()["prompt_logprobs"][1:])
    return math.exp(nll / sum(len(c) - 1 for c in chunks))


# --- export --------------------------------------------------------------------------------------------

def save_hf(model, family: str, hf_dir: str, mtp=None) -> None:
    """The HF checkpoint deploy.convert reads, with the MTP head (`mtp`) as `mtp.*` tensors as Qwen's checkpoints
    hold it. gpt-oss experts are written as MXFP4 blocks and scales, as the released checkpoints hold them, and the
    model's own experts are set to the dequantised values, so that it computes what the file holds."""
    from safetensors.torch import load_file, save_file

    if family == "qwen35moe":
        model.save_pretrained(hf_dir)
        if mtp is not None:
            path = os.path.join(hf_dir, "model.safetensors")
            save_file({**load_file(path), **mtp.hf_tensors()}, path, metadata={"format": "pt"})
            with open(os.path.join(hf_dir, "config.json")) as f:
                config = json.load(f)
            with open(os.path.join(hf_dir, "config.json"), "w") as f:
                json.dump({**config, "mtp_num_hidden_layers": 1}, f, indent=2)
        return
    tensors = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = mxfp4_quantize(p.transpose(1, 2))                   # HF [E, in, out] -> [E, out, in]
                p.copy_(mxfp4_dequantize(blocks, scales).transpose(1, 2))
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            else:
                tensors[name] = p.detach().clone().contiguous()
    save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(hf_dir)
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def greedy(model, tokenizer, prompt: str, n: int = 40) -> str:
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1]:].tolist())


PROMPTS = ["The Python interpreter", "A list is", "When an exception is raised,", "The import statement"]


def run_family(family: str, train_paras, held_out, out_dir: str, work: str, steps: int, lr: float) -> dict:
    from tokenizers import Tokenizer

    from raymoe.deploy.convert import convert
    from raymoe.tools.tiny_tokenizer import build_tiny_tokenizer

    def log(msg):
        print(f"[{family}] {msg}", file=sys.stderr, flush=True)

    hf_dir = os.path.join(work, f"tiny-{family}")
    os.makedirs(hf_dir, exist_ok=True)
    build_tiny_tokenizer(hf_dir, family, [p + "\n" for p in train_paras], VOCAB_SIZE)
    tokenizer = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    train_stream, held_stream = token_stream(tokenizer, train_paras), token_stream(tokenizer, held_out)
    log(f"{len(train_stream)} training tokens, {len(held_stream)} held-out tokens")
    torch.manual_seed(SEED)
    model = FAMILIES[family](tokenizer.get_vocab_size()).float()
    log(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    start = time.time()
    train(model, train_stream, steps, lr, log)
    train_s = time.time() - start
    chunks = eval_chunks(held_stream)
    mtp = None
    if family == "qwen35moe":
        start = time.time()
        mtp = train_mtp(model, train_stream, min(MTP_STEPS, steps), MTP_LR, log)
        mtp_s = time.time() - start
    save_hf(model, family, hf_dir, mtp)
    result = {"family": family, "train_seconds": round(train_s), "steps": steps,
              "train_tokens": len(train_stream), "held_out_tokens": len(held_stream),
              "held_out_perplexity_hf": round(hf_perplexity(model, chunks), 3)}
    gguf_path = convert(hf_dir, os.path.join(out_dir, f"tiny-{family}.gguf"), "f32", progress=False)
    result["held_out_perplexity_raymoe"] = round(raymoe_perplexity(gguf_path, chunks), 3)
    if mtp is not None:
        result.update(mtp_train_seconds=round(mtp_s), mtp_steps=min(MTP_STEPS, steps),
                      mtp_held_out_accuracy=round(mtp_accuracy(mtp, chunks), 4),
                      mtp_raymoe_speculation=raymoe_mtp_acceptance(gguf_path, tokenizer))
    with open(gguf_path, "rb") as f:
        result["sha256"] = hashlib.sha256(f.read()).hexdigest()
    result["gguf_bytes"] = os.path.getsize(gguf_path)
    result["samples"] = {p: greedy(model, tokenizer, p) for p in PROMPTS}
    log(json.dumps(result, indent=2))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raymoe.tools.train_tiny", description=__doc__.split("\n")[0])
    p.add_argument("--docs", required=True, help=f"the html/_sources folder of {CORPUS_PACKAGE} {CORPUS_VERSION}")
    p.add_argument("--out", default="models", help="folder for tiny-<family>.gguf")
    p.add_argument("--work", default="/tmp/raymoe-train-tiny", help="folder for the HF checkpoints")
    p.add_argument("--family", choices=sorted(FAMILIES), action="append", help="default: both")
    p.add_argument("--steps", type=int, default=None, help="override the training steps (for trials)")
    args = p.parse_args(argv)

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    train_paras, held_out = load_corpus(args.docs)
    text = "\n".join(train_paras + held_out)
    print(f"corpus: {len(train_paras)} training and {len(held_out)} held-out paragraphs, {len(text)} characters, "
          f"sha256 {hashlib.sha256(text.encode()).hexdigest()}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    results = [run_family(f, train_paras, held_out, args.out, args.work, args.steps or STEPS[f], LR[f])
               for f in args.family or sorted(FAMILIES)]
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
