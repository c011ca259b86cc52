"""tools.make_synthetic: random GGUFs with released models' shapes that raymoe loads and runs."""
import dataclasses
import hashlib
import math
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from raymoe.tools import make_synthetic as ms
from raymoe.kernels.dequant import dequantize
from raymoe.stages.runtime.batch import StepBatch
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.stage import Stage

QWEN, QWEN3NEXT, GPTOSS = "qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "gpt-oss-20b"
# gpt-oss rows (2880, 320, 128) are whole 32-blocks but not 256-blocks: llama.cpp's substitutes,
# with Q4_0 for its IQ4_NL
GPTOSS_K_FALLBACK = {"q2_k": Q.Q4_0, "q3_k": Q.Q4_0, "q4_k": Q.Q5_0, "q5_k": Q.Q5_1, "q6_k": Q.Q8_0}
F32_SUFFIXES = ("norm.weight", ".bias", "ssm_a", "ssm_conv1d.weight", "attn_sinks.weight", "ffn_gate_inp.weight",
                "ffn_gate_inp_shexp.weight")


def small_config(model):
    """The model's config made narrow (all the tensor kinds, a few MB), for tests of types and bytes."""
    if model in (QWEN, QWEN3NEXT):
        cfg = ms.MODELS[model].make_config(4, 1024)     # layer 3 is full attention
        return dataclasses.replace(cfg, hidden=256, n_head=2, n_kv_head=1, n_expert=4, n_expert_used=2,
                                   expert_ff=256, shared_ff=256, n_k_heads=1, n_v_heads=2)
    cfg = ms.MODELS[GPTOSS].make_config(2, 1024)
    return dataclasses.replace(cfg, n_head=2, n_kv_head=1, n_expert=2, n_expert_used=2, expert_ff=320)


def write_small(model, path, seed=0, qtype=None, mix=None):
    spec = ms.MODELS[model]
    cfg = small_config(model)
    mix = None if qtype is not None else mix or spec.default_mix
    plan = ms.tensor_plan(spec.family, cfg, qtype, mix)
    ms.write_synthetic(str(path), model, cfg, plan, ms.synthetic_tokenizer(spec.tokenizer_family),
                       ms.FILE_TYPES[mix or qtype], seed, progress=False)
    return plan


def finite_logits(path, n_tokens=6):
    """Prefill then one decode step through a whole-model Stage; both logits must be finite."""
    model = open_model(str(path))
    stage = Stage(model, range(model.n_layers))
    ids = torch.tensor(model.tokenizer.encode("The quick brown fox jumps over")[:n_tokens])
    n = len(ids)
    prefill = stage.forward(StepBatch([0], [0], [n], ids, list(range(n))))
    decode = stage.forward(StepBatch([0], [n], [1], ids[:1], [0]))
    assert prefill.shape == (n, model.config.vocab)
    assert torch.isfinite(prefill).all() and torch.isfinite(decode).all()
    assert 0.1 < prefill.std().item() < 10          # of unit size: no scale ran away
    return model


def file_types(path):
    reader = gguf.GGUFReader(str(path))
    return {t.name: (Q(t.tensor_type), tuple(reversed([int(x) for x in t.shape]))) for t in reader.tensors}


@pytest.mark.parametrize("model", [QWEN, GPTOSS])
def test_cli_file_runs_at_full_width(model, tmp_path):
    """The released widths and expert counts, one layer and a short vocabulary: raymoe loads the file
    and its logits are finite."""
    path = tmp_path / "model.gguf"
    try:
        assert ms.main(["--model", model, "--out", str(path), "--layers", "1", "--vocab", "1024"]) == 0
        loaded = finite_logits(path)
        spec = ms.MODELS[model]
        released = spec.make_config(spec.n_layers, spec.vocab)
        assert loaded.family is spec.family and loaded.config.n_layers == 1 and loaded.config.vocab == 1024
        for field in ("hidden", "n_head", "n_kv_head", "head_dim", "n_expert", "n_expert_used", "expert_ff", "rms_eps"):
            assert getattr(loaded.config, field) == pytest.approx(getattr(released, field)), field
        assert loaded.source.metadata[f"{spec.family.arch}.context_length"] == released.context_length
        assert loaded.tokenizer.vocab_size == 1024 and loaded.tokenizer.chat_template
        assert loaded.tokenizer.eos_token_ids
        types = file_types(path)
        assert len(types) == len(ms.tensor_plan(spec.family, loaded.config, mix=spec.default_mix))
        assert not os.path.exists(str(path) + ".partial")
    finally:
        path.unlink(missing_ok=True)


def test_mtp_head_at_full_width(tmp_path):
    """--mtp: the head after the layers as llama.cpp writes it, which raymoe loads and drafts with (the tokens as
    without drafts); gpt-oss has none."""
    from raymoe.stages.files.loader import open_model, open_mtp_head
    from raymoe.stages.runtime.engine import LocalEngine
    from raymoe.stages.runtime.speculation import SpeculativeConfig
    from raymoe.stages.text.sampling_params import SamplingParams

    path = tmp_path / "model.gguf"
    try:
        assert ms.main(["--model", QWEN, "--out", str(path), "--layers", "1", "--vocab", "1024", "--mtp"]) == 0
        types = file_types(path)
        assert "blk.1.nextn.eh_proj.weight" in types and types["blk.1.ffn_gate_exps.weight"][0] == Q.Q3_K
        files = open_model(str(path))
        assert files.n_layers == 1 and open_mtp_head(files) is files
        outputs = []
        for spec in (None, SpeculativeConfig(method="mtp", num_speculative_tokens=2)):
            engine = LocalEngine(files, speculation=spec)
            if spec:
                engine.speculation.length = lambda acceptance, rows, most: most
            seq = engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
            engine.run_until_done()
            outputs.append(seq.output_ids)
        assert outputs[0] == outputs[1] and seq.draft_tokens > 0
    finally:
        path.unlink(missing_ok=True)
    with pytest.raises(SystemExit):
        ms.main(["--model", GPTOSS, "--out", str(tmp_path / "g.gguf"), "--mtp"])


@pytest.mark.parametrize("kind", sorted(set(ms.TYPES) - {"f32", "f16", "bf16"}))
@pytest.mark.parametrize("row", [512, 2048, 4096])
def test_blocks_decode_to_unit_spread(kind, row):
    """Random codes under the fixed scale fields decode to mean ~0 and std ~1/sqrt(row)."""
    qtype = ms.TYPES[kind]
    t = ms.PlannedTensor("blk.0.ffn_up_exps.weight", (64, row), qtype)
    data = np.concatenate(list(ms.tensor_chunks(t, seed=0)))
    assert data.nbytes == t.n_bytes
    x = dequantize(torch.from_numpy(data.reshape(64, -1)), qtype) * math.sqrt(row)
    assert torch.isfinite(x).all()
    assert abs(x.mean().item()) < 0.15
    low, high = (0.7, 1.42) if qtype == Q.MXFP4 else (0.95, 1.05)     # MXFP4 scales are powers of two
    assert low < x.std().item() < high


@pytest.mark.parametrize("kind", sorted(ms.TYPES))
def test_every_type_writes_its_ggml_type(kind, tmp_path):
    """--type sets every weight matrix; rows that are not whole blocks take llama.cpp's substitutes;
    vectors, biases, the conv kernel and routers stay F32; raymoe reads and runs every type."""
    for model in (QWEN, GPTOSS):
        path = tmp_path / f"{model}.gguf"
        plan = write_small(model, path, qtype=ms.TYPES[kind])
        types = file_types(path)
        assert list(types) == [t.name for t in plan]
        expected = GPTOSS_K_FALLBACK.get(kind, ms.TYPES[kind]) if model == GPTOSS else ms.TYPES[kind]
        for t in plan:
            qtype, shape = types[t.name]
            assert shape == t.shape
            assert qtype == (Q.F32 if t.name.endswith(F32_SUFFIXES) else expected), t.name
        assert gguf.GGUFReader(str(path)).fields["general.file_type"].contents() == ms.FILE_TYPES[ms.TYPES[kind]]
        if model == QWEN:
            finite_logits(path)
        path.unlink()


def test_qwen3_next_file_runs(tmp_path):
    """Qwen3-Next's released shapes, narrowed: llama.cpp's qwen3next tensors (one ssm_ba, no ssm_beta), and
    raymoe runs the file."""
    path = tmp_path / "model.gguf"
    plan = write_small(QWEN3NEXT, path)
    types = file_types(path)
    assert list(types) == [t.name for t in plan]
    assert "blk.0.ssm_ba.weight" in types and "blk.0.ssm_beta.weight" not in types
    assert finite_logits(path).family.arch == "qwen3next"


def plan_types(model, mix):
    spec = ms.MODELS[model]
    cfg = spec.make_config(spec.n_layers, spec.vocab)
    return {t.name: t.qtype for t in ms.tensor_plan(spec.family, cfg, mix=mix)}


def test_mixes_give_llama_cpp_like_types():
    def by_role(types, experts, head, others):
        for name, qtype in types.items():
            if name.endswith(F32_SUFFIXES):
                assert qtype == Q.F32, name
            else:
                assert qtype == (experts if "_exps." in name else head if name == "output.weight" else others), name

    by_role(plan_types(QWEN, "q3_k_m"), Q.Q3_K, Q.Q6_K, Q.Q4_K)
    by_role(plan_types(GPTOSS, "mxfp4"), Q.MXFP4, Q.Q8_0, Q.Q8_0)
    by_role(plan_types(QWEN, "mxfp4"), Q.MXFP4, Q.Q8_0, Q.Q8_0)
    # K-quants on gpt-oss's 2880-wide rows fall back as llama.cpp's do; attn_output's rows are 4096 wide
    g3 = plan_types(GPTOSS, "q3_k_m")
    assert g3["blk.0.ffn_down_exps.weight"] == g3["blk.0.ffn_up_exps.weight"] == Q.Q4_0
    assert g3["blk.0.attn_q.weight"] == Q.Q5_0 and g3["blk.0.attn_output.weight"] == Q.Q4_K
    assert g3["output.weight"] == Q.Q8_0

    # q4_k_m: Q6_K for ffn_down in llama.cpp's more-bits layers (of 40) and attn_v in its more-bits
    # attention layers (of 10: blk.3 is the first, blk.39 the last)
    q4 = plan_types(QWEN, "q4_k_m")
    assert q4["output.weight"] == Q.Q6_K and q4["token_embd.weight"] == Q.Q4_K
    assert [i for i in range(40) if q4[f"blk.{i}.ffn_down_exps.weight"] == Q.Q6_K] == \
        [0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 35, 36, 37, 38, 39]
    assert all(q4[f"blk.{i}.ffn_down_shexp.weight"] == q4[f"blk.{i}.ffn_down_exps.weight"] for i in range(40))
    assert q4["blk.0.ffn_gate_exps.weight"] == q4["blk.0.ffn_up_exps.weight"] == Q.Q4_K
    assert [i for i in range(3, 40, 4) if q4[f"blk.{i}.attn_v.weight"] == Q.Q6_K] == [3, 15, 27, 35, 39]



def test_same_seed_same_bytes(tmp_path):
    def digest(seed):
        path = tmp_path / f"seed{seed}.gguf"
        write_small(QWEN, path, seed)
        return hashlib.sha256(path.read_bytes()).hexdigest()

    assert digest(0) == digest(0) != digest(1)


@pytest.mark.parametrize("model,mix,released", [(QWEN, "q3_k_m", 15.4e9), (GPTOSS, "mxfp4", 12.1e9)])
def test_full_size_matches_llama_cpp_files(model, mix, released, capsys):
    """The full-size files' exact sizes (header written aside, data counted) are within 1% of the
    synthetic files of these shapes that llama.cpp loads."""
    assert ms.main(["--model", model, "--mix", mix, "--dry-run"]) == 0
    size = int(capsys.readouterr().out.split(" bytes")[0].split()[-1])
    assert abs(size - released) / released < 0.01


def test_partial_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"old")

    def failing(t, seed):
        raise OSError("disk full")

    monkeypatch.setattr(ms, "tensor_chunks", failing)
    with pytest.raises(OSError):
        write_small(QWEN, path)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["model.gguf"]
    monkeypatch.undo()
    write_small(QWEN, path)
    assert path.read_bytes()[:4] == b"GGUF" and os.listdir(tmp_path) == ["model.gguf"]


@pytest.mark.parametrize("args,message", [
    (["--layers", "0"], "--layers: must be at least 1"),
    (["--layers", "41"], "qwen3.5-35b-a3b has 40 layers"),
    (["--vocab", "12"], "the tokenizer has"),
    (["--type", "q9_k"], "invalid choice"),
    (["--type", "q4_k", "--mix", "q3_k_m"], "not allowed with argument"),
    (["--seed", "x"], "not an integer"),
])
def test_bad_arguments_fail_in_one_line(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ms.main(["--model", QWEN, "--out", str(tmp_path / "x.gguf"), *args])
    assert e.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("python -m raymoe.tools.make_synthetic: error:") and message in error
    assert os.listdir(tmp_path) == []


def test_out_is_required_and_its_directory_must_exist(tmp_path, capsys):
    for args in ([], ["--out", str(tmp_path / "missing" / "x.gguf")], ["--out", str(tmp_path)]):
        with pytest.raises(SystemExit):
            ms.main(["--model", GPTOSS, *args])
        assert "error:" in capsys.readouterr().err
