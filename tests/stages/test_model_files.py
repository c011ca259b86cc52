"""GGUF files as llama.cpp writes them: mixed types per tensor, trailing unit dimensions, MTP/nextn
layers, split files; weights kept in their blocks; a model too big for the cluster refused at once."""
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from hf_models import run_one

from raymoe.kernels.weights import BlockWeight, ConcatWeight, DenseWeight, Loading
from raymoe.stages.errors import ModelFormatError
from raymoe.stages.files.gguf_file import GGUFFile
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.stage import Stage
from raymoe.tools.make_tiny import make_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory):
    return make_tiny("qwen35moe", str(tmp_path_factory.mktemp("qwen")))


def rewrite(src: str, dst: str, change=lambda name, data, qtype: (data, qtype), set_kv=None, extra_tensors=(),
            split_after=None):
    """Copy a GGUF, passing each tensor (torch-order float32 or raw bytes) through `change`, setting
    integer metadata `set_kv` and adding float32 `extra_tensors`; with split_after, tensors from that
    index on go to a second part, as gguf-split names them."""
    set_kv = dict(set_kv or {})
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    parts = [dst] if split_after is None else [dst.replace(".gguf", f"-0000{i}-of-00002.gguf") for i in (1, 2)]
    writers = [gguf.GGUFWriter(p, arch) for p in parts]
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writers[0].add_key_value(name, set_kv.pop(name, field.contents()), field.types[0], sub_type=sub)
    for name, value in set_kv.items():
        writers[0].add_uint32(name, value)
    for i, t in enumerate(reader.tensors):
        qtype = T(t.tensor_type)
        data = np.array(t.data) if qtype == T.F32 else np.array(t.data).view(np.uint8)
        data, qtype = change(t.name, data, qtype)
        w = writers[0 if split_after is None or i < split_after else 1]
        w.add_tensor(t.name, data, raw_dtype=None if qtype == T.F32 else qtype)
    for name, data in extra_tensors:
        writers[-1].add_tensor(name, data)
    for w in writers:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return parts[0]


def prompt_logprobs(path: str, mode: str = "float32"):
    prompt = list(range(3, 40))
    r = run_one(open_model(path), prompt, mode=mode, prompt_logprobs=0, max_tokens=4, temperature=0)
    return torch.tensor([e["logprob"] for e in r["prompt_logprobs"][1:]]), r["token_ids"]


def test_weights_stay_in_their_blocks_and_fuse_only_when_types_match(f32_file, tmp_path):
    """Q8_0 qkv beside F32 gate (a mix llama.cpp writes): computed exactly as the dequantised values."""
    quantised = {}

    def to_q8(name, data, qtype):
        if name.endswith(("attn_qkv.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "output.weight")):
            raw = gguf.quants.quantize(data, T.Q8_0)
            quantised[name] = gguf.quants.dequantize(raw, T.Q8_0)
            return raw, T.Q8_0
        return data, qtype

    mixed = rewrite(f32_file, str(tmp_path / "mixed.gguf"), to_q8)
    # the same values, all float32: what the exact mode must reproduce
    same = rewrite(f32_file, str(tmp_path / "same.gguf"),
                   lambda name, data, qtype: (quantised.get(name, data).astype(np.float32), qtype))
    stage = Stage(open_model(mixed), range(8), "float32")
    mixer = stage.layers[0].mixer
    assert isinstance(mixer.inputs, ConcatWeight)                                  # Q8_0 qkv | F32 gate, beta, alpha
    assert [type(p) for p in mixer.inputs.parts] == [BlockWeight, DenseWeight]     # the F32 ones fused together
    assert isinstance(stage.head, BlockWeight) and stage.head.raw.dtype == torch.uint8
    assert stage.parameter_bytes() < 0.8 * Stage(open_model(same), range(8), "float32").parameter_bytes()
    a, ids_a = prompt_logprobs(mixed)
    b, ids_b = prompt_logprobs(same)
    # float32 rounding only: the two layouts take other product paths (fused F32 parts, 8- or 16-lane sums)
    assert ids_a == ids_b and (a - b).abs().max() < 1e-3
    # the fast mode (8-bit activations, prompt products included) is a different computation, close
    # to the exact one: the tiny random models amplify rounding (bfloat16 activations alone moved
    # these logprobs ~0.2 nats on average; measured 0.38 here, and the same 0.38 with every prompt
    # product through the few-row kernel instead of the many-row one)
    fast, _ = prompt_logprobs(mixed, "auto")
    assert 0 < (fast - a).abs().mean() < 0.5


@pytest.mark.parametrize("populate", [True, False], ids=["madvise", "written"])
def test_direct_reads_give_the_files_bytes(f32_file, tmp_path, monkeypatch, populate):
    """Large tensors are read past the page cache (O_DIRECT, straight into pages faulted in ahead,
    by madvise or, where it is refused, by writing them): with the size limit lowered, every tensor
    and an expert slice come back as the file holds them, whatever their offsets, whether read at
    once or left running until their Loading waits; a file cut short is refused either way."""
    import raymoe.stages.files.direct_io as gf
    try:
        os.close(os.open(f32_file, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system takes no O_DIRECT reads: reads go through the page cache")
    direct = []
    read = gf._read_direct
    monkeypatch.setattr(gf, "_read_direct", lambda *a: direct.append(1) or read(*a))
    monkeypatch.setattr(gf, "DIRECT_MIN", 1)
    monkeypatch.setattr(gf, "DIRECT_CHUNK", 8192)        # several chunks per tensor
    if not populate:
        monkeypatch.setattr(gf, "MADV_POPULATE_WRITE", -1)     # an advice every kernel refuses
    g = GGUFFile(f32_file)
    file_bytes = np.memmap(f32_file, dtype=np.uint8, mode="r")
    loading, later = Loading(), []
    for name, t in g.tensors.items():
        expected = file_bytes[t.data_offset:t.data_offset + t.n_bytes]
        raw, _ = g.raw(name)
        assert np.array_equal(raw.numpy().reshape(-1), expected), name
        later.append((g.raw(name, loading=loading)[0], expected, name))
    assert loading.wait()
    for raw, expected, name in later:
        assert np.array_equal(raw.numpy().reshape(-1), expected), name
    name = "blk.0.ffn_up_exps.weight"
    whole, _ = g.raw(name)
    assert torch.equal(g.raw(name, range(3, 6))[0], whole[3:6])
    assert len(direct) > 2 * len(g.tensors)
    cut = tmp_path / "cut.gguf"           # cut short after it was opened (opening checks the sizes)
    cut.write_bytes(open(f32_file, "rb").read())
    g = GGUFFile(str(cut))
    os.truncate(cut, os.path.getsize(cut) - 100)
    last = max(g.tensors, key=lambda n: g.tensors[n].data_offset)
    with pytest.raises(ModelFormatError, match="truncated"):
        g.raw(last)
    g.raw(last, loading=loading)
    assert not loading.wait()


def test_weights_joined_while_their_reads_run_get_the_files_bytes(f32_file, monkeypatch):
    """Fused weights (qkv beside gate, the MoE router beside the shared expert's inputs) join parts
    whose bytes may still be on their way: with every tensor read in the background, and each read
    held back, the model computes exactly what it does read at once."""
    import time

    import raymoe.stages.files.direct_io as gf
    try:
        os.close(os.open(f32_file, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system takes no O_DIRECT reads: every tensor is read at once")
    at_once, ids = prompt_logprobs(f32_file)
    read = gf._read_chunk
    monkeypatch.setattr(gf, "_read_chunk", lambda *a: time.sleep(0.002) or read(*a))
    monkeypatch.setattr(gf, "DIRECT_MIN", 1)
    in_background, ids_b = prompt_logprobs(f32_file)
    assert ids_b == ids and torch.equal(in_background, at_once)


def test_trailing_unit_dimensions_are_absent(f32_file, tmp_path):
    """A vector stored as [n_embd, 1] (llama.cpp's converter writes ffn_gate_inp_shexp so) is a vector."""
    hidden = GGUFFile(f32_file).metadata["qwen35moe.embedding_length"]
    odd = rewrite(f32_file, str(tmp_path / "odd.gguf"), lambda name, data, qtype: (
        (data.reshape(1, -1), qtype) if name.endswith("ffn_gate_inp_shexp.weight") else (data, qtype)))
    assert [int(x) for x in next(t for t in gguf.GGUFReader(odd).tensors
                                 if t.name == "blk.0.ffn_gate_inp_shexp.weight").shape] == [hidden, 1]
    assert GGUFFile(odd).ggml_shape("blk.0.ffn_gate_inp_shexp.weight") == (hidden,)
    assert torch.equal(prompt_logprobs(odd)[0], prompt_logprobs(f32_file)[0])


def test_nextn_layers_are_never_loaded(f32_file, tmp_path):
    """An MTP layer after the real ones counts in block_count; its tensors are skipped."""
    meta = GGUFFile(f32_file).metadata
    n, hidden = meta["qwen35moe.block_count"], meta["qwen35moe.embedding_length"]
    nextn = rewrite(f32_file, str(tmp_path / "nextn.gguf"),
                    set_kv={"qwen35moe.block_count": n + 1, "qwen35moe.nextn_predict_layers": 1},
                    extra_tensors=[(f"blk.{n}.nextn.eh_proj.weight", np.ones((hidden, 2 * hidden), np.float32))])
    assert open_model(nextn).n_layers == n
    assert torch.equal(prompt_logprobs(nextn)[0], prompt_logprobs(f32_file)[0])


def test_split_files_open_from_their_first_part(f32_file, tmp_path):
    split = rewrite(f32_file, str(tmp_path / "split.gguf"), split_after=60)
    assert split.endswith("-00001-of-00002.gguf") and len(GGUFFile(split).tensors) == len(GGUFFile(f32_file).tensors)
    assert torch.equal(prompt_logprobs(split)[0], prompt_logprobs(f32_file)[0])
    with pytest.raises(ModelFormatError, match="opens from its first part"):
        open_model(split.replace("-00001-", "-00002-"))
    os.remove(split.replace("-00001-", "-00002-"))
    with pytest.raises(ModelFormatError, match="part .*-00002-of-00002.gguf is missing"):
        open_model(split)


@pytest.mark.cluster
def test_a_model_too_big_for_the_cluster_is_refused_at_once(f32_file):
    """A cluster with 64 MiB of memory: one line naming the need, what Ray has, and what to change,
    before any weight is read."""
    code = ("import ray, sys; from raymoe.cluster.engine import ClusterEngine, EngineArgs\n"
            "from raymoe.stages.errors import RaymoeError\n"
            "ray.init(address='local', num_cpus=2, _memory=64 << 20, include_dashboard=False, logging_level='ERROR')\n"
            "try:\n    ClusterEngine(EngineArgs(sys.argv[1], pp=2))\nexcept RaymoeError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code, f32_file], cwd=ROOT, capture_output=True, text=True, timeout=120)
    line = proc.stdout.strip()
    assert line.startswith("the model does not fit: its 2 stage(s) need"), proc.stdout + proc.stderr
    assert "Ray has 0.1 GiB" in line and "--max-running" in line and "--max-model-len" in line and "--pp" in line


@pytest.mark.slow
def test_a_full_width_file_loads_within_its_bytes_plus_a_gigabyte(tmp_path):
    """Two layers of Qwen3.5-35B-A3B at full width and vocabulary (~1.4 GB of Q3_K/Q4_K/Q6_K blocks): a
    stage's peak RSS stays within the file's bytes + 1 GiB (no caches: nothing has run)."""
    path = str(tmp_path / "qwen-2l.gguf")
    subprocess.run([sys.executable, "-m", "raymoe.tools.make_synthetic", "--model", "qwen3.5-35b-a3b", "--layers", "2",
                    "--out", path], cwd=ROOT, check=True, capture_output=True, timeout=300)
    code = ("import resource, sys, torch; from raymoe.stages.files.loader import open_model\n"
            "from raymoe.stages.runtime.stage import Stage\n"
            "m = open_model(sys.argv[1]); s = Stage(m, range(m.n_layers))\n"
            "print(s.parameter_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n")
    proc = subprocess.run([sys.executable, "-c", code, path], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    held, peak = map(int, proc.stdout.split())
    size = os.path.getsize(path)
    assert held <= size and peak <= size + (1 << 30), (held, peak, size)


def test_weights_load_on_one_torch_thread_except_requantising(f32_file, monkeypatch):
    """Loading moves bytes: no second torch thread (an OpenMP worker left spinning would take a core
    from the reader threads), except where --dtype int8 requantises every matrix; the stage then
    computes on the threads it was given."""
    import raymoe.stages.runtime.stage as st
    seen = []
    matrix = st.StageWeights.matrix
    monkeypatch.setattr(st.StageWeights, "matrix", lambda self, *a, **k: seen.append(torch.get_num_threads())
                        or matrix(self, *a, **k))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for mode, expected in (("auto", 1), ("float32", 1), ("int8", 2)):
            seen.clear()
            Stage(open_model(f32_file), range(2), mode)
            assert set(seen) == {expected}, mode
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
