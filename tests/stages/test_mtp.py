"""Qwen's MTP head (stages/runtime/mtp.py) against a head built from transformers' own modules (tools/mtp_head.py)
on the tiny oracle models: loaded from the checkpoint and from the GGUF deploy.convert writes (llama.cpp's names),
or from a separate GGUF of the head; its drafts, and the greedy tokens with it, at 1/2/4 stages."""
import json
import os
import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from gguf_edit import rewrite_gguf
from hf_models import randomise
from raymoe.deploy.convert import convert
from raymoe.stages.errors import ModelFormatError
from raymoe.stages.files.loader import open_model, open_mtp_head
from raymoe.stages.runtime import speculation as speculation_module
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.runtime.scheduler import Scheduler
from raymoe.stages.runtime.speculation import SpeculativeConfig, Speculation
from raymoe.stages.text.sampling_params import SamplingParams
from raymoe.tools.make_tiny import make_tiny
from raymoe.tools.mtp_head import HFMtpHead, greedy_drafts

MTP = SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 3}')
FAMILIES = ["qwen35moe", "qwen3next"]


class Head:
    def __init__(self, family, root, oracle):
        """The oracle's model with a random MTP head: its checkpoint (Qwen3-Next's config does not count the head's
        layers, as the released one does not) and the GGUF deploy.convert writes from it."""
        self.family, self.model, self.prompt = family, oracle.model, oracle.prompt
        self.dir = os.path.join(root, family)
        shutil.copytree(oracle.dir, self.dir)
        self.head = HFMtpHead(oracle.model).float().eval()
        randomise(self.head, 5, scale=0.3)
        tensors = load_file(os.path.join(self.dir, "model.safetensors"))
        save_file({**tensors, **self.head.hf_tensors()}, os.path.join(self.dir, "model.safetensors"),
                  metadata={"format": "pt"})
        if family == "qwen35moe":
            path = os.path.join(self.dir, "config.json")
            config = json.load(open(path))
            json.dump({**config, "mtp_num_hidden_layers": 1}, open(path, "w"))
        self.gguf = convert(self.dir, os.path.join(root, f"{family}-mtp.gguf"), "f32", progress=False)
        self.n = oracle.model.config.num_hidden_layers


@pytest.fixture(scope="module")
def heads(oracle, tmp_path_factory):
    root, built = str(tmp_path_factory.mktemp("mtp")), {}

    def get(family):
        if family not in built:
            built[family] = Head(family, root, oracle(family))
        return built[family]
    return get


def always_draft(monkeypatch):
    """Every step drafts as many as it may (the tiny model's steps are too cheap for drafts to pay otherwise)."""
    monkeypatch.setattr(Speculation, "length", lambda self, acceptance, rows, most: most)


def run(path_or_files, prompt, n_stages=1, mode="float32", speculation=MTP, max_tokens=20, chunk=16):
    files = open_model(path_or_files) if isinstance(path_or_files, str) else path_or_files
    engine = LocalEngine(files, n_stages, mode, scheduler=Scheduler(64, chunk), speculation=speculation)
    seq = engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    engine.run_until_done()
    return seq


def test_convert_writes_the_head_as_llama_cpps_converter_does(heads):
    """blk.{n}.nextn.{eh_proj, enorm, hnorm, shared_head_norm} beside the block's own tensors, block_count counting
    the head, nextn_predict_layers 1; the norms with their +1 as every other norm of the family."""
    h = heads("qwen35moe")
    reader = gguf.GGUFReader(h.gguf)
    assert reader.fields["qwen35moe.block_count"].contents() == h.n + 1
    assert reader.fields["qwen35moe.nextn_predict_layers"].contents() == 1
    tensors = {t.name: t for t in reader.tensors}
    p = f"blk.{h.n}."
    for name in ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight",
                 "attn_q.weight", "attn_k_norm.weight", "ffn_gate_inp.weight", "ffn_up_exps.weight",
                 "ffn_gate_inp_shexp.weight", "attn_norm.weight"):
        assert p + name in tensors, name
    hidden = h.model.config.hidden_size
    assert list(tensors[p + "nextn.eh_proj.weight"].shape) == [2 * hidden, hidden]      # ggml order: ne
    enorm = torch.from_numpy(tensors[p + "nextn.enorm.weight"].data.copy())
    assert torch.equal(enorm, h.head.pre_fc_norm_embedding.weight.detach() + 1)
    files = open_model(h.gguf)
    assert files.n_layers == h.n and files.config.mtp_layers == 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("n_stages", [1, 2])
def test_drafts_are_the_reference_heads(heads, family, source, n_stages, monkeypatch):
    """Every step's drafts, through prompt chunks (a chunk's last row waits for the next chunk's first token), verify
    steps and their rollback, on the last of 1 or 2 stages: those of the reference head chaining its argmax over the
    same tokens."""
    h = heads(family)
    always_draft(monkeypatch)
    proposed = []
    real = Speculation.proposed
    monkeypatch.setattr(Speculation, "proposed", lambda self, seq, drafts: (
        proposed.append((seq.prompt_ids + seq.output_ids, list(drafts))), real(self, seq, drafts)))
    seq = run(h.dir if source == "hf" else h.gguf, h.prompt[:40], n_stages, max_tokens=12)
    assert seq.verify_steps >= 3 and len(proposed) >= 4
    for tokens, drafts in proposed:
        assert drafts == greedy_drafts(h.head, tokens, len(drafts)), len(tokens)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["float32", "auto"])
def test_greedy_tokens_are_the_same_with_the_head_at_1_2_4_stages(heads, family, mode, monkeypatch):
    """Drafts of the head, half of them replaced by the right tokens (so that verify steps keep some): the tokens of
    decoding without drafts, at every pipeline depth."""
    h = heads(family)
    files = open_model(h.gguf)
    plain = run(files, h.prompt, mode=mode, speculation=None, max_tokens=24).output_ids
    always_draft(monkeypatch)
    g = torch.Generator().manual_seed(3)
    real = Speculation.proposed

    def half_right(self, seq, drafts):
        done = len(seq.output_ids)
        right = plain[done:done + len(drafts)]
        real(self, seq, right if torch.rand(1, generator=g).item() < 0.5 and len(right) == len(drafts) else drafts)
    monkeypatch.setattr(Speculation, "proposed", half_right)
    for n_stages in (1, 2, 4):
        seq = run(files, h.prompt, n_stages, mode, max_tokens=24)
        assert seq.output_ids == plain, (n_stages, mode)
        assert seq.accepted_tokens > 0 and seq.verify_steps > 0


def test_the_prefix_cache_keeps_the_tokens(heads, monkeypatch):
    """A second request that starts from cached blocks: its head has not seen them (its own cache is not kept), the
    tokens stay those without drafts."""
    h = heads("qwen35moe")
    files = open_model(h.gguf)
    always_draft(monkeypatch)
    outputs = []
    for speculation in (None, MTP):
        engine = LocalEngine(files, 1, "float32", scheduler=Scheduler(64, 16), prefix_cache_bytes=1 << 24,
                             speculation=speculation)
        seqs = []
        for tail in ([1, 2, 3], [4, 5, 6, 7]):
            seqs.append(engine.add_request(len(seqs), h.prompt[:48] + tail,
                                           SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)))
            engine.run_until_done()
        assert seqs[1].cached_tokens == 48
        outputs.append([s.output_ids for s in seqs])
    assert outputs[0] == outputs[1]


def test_a_separate_head_file_as_llama_cpps_mtp_export(heads, tmp_path, monkeypatch):
    """The model's GGUF without its head, and the head alone (its block, the embedding, output norm and LM head, the
    model's metadata): the drafts of the head in the model's own file."""
    h = heads("qwen35moe")
    reader = gguf.GGUFReader(h.gguf)
    head_block = f"blk.{h.n}."
    trunk = rewrite_gguf(h.gguf, str(tmp_path / "trunk.gguf"),
                         drop={t.name for t in reader.tensors if t.name.startswith(head_block)},
                         set_kv={"qwen35moe.block_count": h.n, "qwen35moe.nextn_predict_layers": 0})
    alone = rewrite_gguf(h.gguf, str(tmp_path / "mtp-head.gguf"),
                         drop={t.name for t in reader.tensors if t.name.startswith("blk.")
                               and not t.name.startswith(head_block)})
    always_draft(monkeypatch)
    proposed = []
    real = Speculation.proposed
    monkeypatch.setattr(Speculation, "proposed", lambda self, seq, drafts: (proposed.append(list(drafts)),
                                                                            real(self, seq, drafts)))
    run(h.gguf, h.prompt[:30], max_tokens=8)
    with_file = list(proposed)
    proposed.clear()
    run(trunk, h.prompt[:30], max_tokens=8, speculation=SpeculativeConfig.parse({"method": "mtp", "model": alone}))
    assert proposed == with_file and len(proposed) >= 3
    with pytest.raises(ModelFormatError, match="no MTP head"):
        open_mtp_head(open_model(trunk))
    with pytest.raises(ModelFormatError, match="a gpt-oss file"):
        open_mtp_head(open_model(trunk), make_tiny("gptoss", str(tmp_path / "gptoss")))
    with pytest.raises(ModelFormatError, match="no such file"):
        open_mtp_head(open_model(trunk), str(tmp_path / "missing.gguf"))


def test_a_model_without_a_head_is_refused_in_one_line(oracle):
    with pytest.raises(ModelFormatError, match="no MTP head") as e:
        open_mtp_head(open_model(oracle("qwen35moe").gguf))
    assert "\n" not in str(e.value)
    with pytest.raises(ModelFormatError, match="gpt-oss models have no MTP head"):
        open_mtp_head(open_model(oracle("gptoss").gguf))


def test_asks_for_drafts_only_where_the_next_step_would_send_them():
    spec = Speculation(MTP)
    from raymoe.stages.runtime.sequence import Sequence
    seq = Sequence(0, "r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=100), None, set(), 4096)
    assert spec.asks(seq, 0) == 0                   # no plain step measured yet: the next one sends none
    spec.observe(1, 0.010)
    assert spec.asks(seq, 0) == 3
    seq.spec.acceptance = 0.01
    spec.observe(4, 0.040)
    spec.observe(2, 0.020)
    spec.observe(3, 0.030)
    assert spec.asks(seq, 0) == 0
    seq.spec.idle = speculation_module.PROBE_EVERY - 1
    assert spec.asks(seq, 0) == 1                   # the next step probes
    penalised = Sequence(1, "r", [1, 2], SamplingParams(temperature=0, presence_penalty=0.5), None, set(), 4096)
    assert spec.asks(penalised, 0) == 0
