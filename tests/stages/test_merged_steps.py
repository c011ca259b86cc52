"""Decode steps of several sequences as one (cluster/coordinator.py _submit_held): up to
kernels.weights.rows_computed_alone sequences, each sequence's logits are the bits it gets in a step of its own,
so a one-stage pipeline may merge its micro-batch groups' decode steps without changing any output. Checked
here on the stage, in every mode, on the embedded models and on full-width layers of both released shapes; the
cluster tests check the whole path (tests/cluster/test_cluster.py: PP=1, which merges, against PP=2 and 4)."""
import pytest
import torch

from raymoe.kernels.weights import rows_computed_alone
from raymoe.stages.runtime.batch import StepBatch, merge_decode_steps
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.sampling_params import SamplingParams
from raymoe.stages.runtime.sampler import ChunkSampling
from raymoe.stages.runtime.stage import Stage
from thread_runs import full_width

MODES = ["auto", "float32", "int8"]


def decode(stage: Stage, seq_ids: list[int], positions: list[int], tokens: list[int]) -> torch.Tensor:
    return stage.forward(StepBatch(seq_ids=seq_ids, start_pos=positions, lengths=[1] * len(seq_ids), token_ids=tokens,
                                   logit_rows=list(range(len(seq_ids)))))


def assert_rows_computed_alone(path: str, mode: str):
    n = rows_computed_alone(mode)
    assert n >= 2, "this host lacks the compiled few-row kernels"
    model = open_model(path)
    together, alone = (Stage(model, range(model.n_layers), mode) for _ in range(2))
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 40, (n,), generator=g).tolist()
    for sid, length in enumerate(lengths):          # each prompt prefilled alone, alike in both
        prompt = torch.randint(0, 1000, (length,), generator=g).tolist()
        for stage in (together, alone):
            stage.forward(StepBatch(seq_ids=[sid], start_pos=[0], lengths=[length], token_ids=prompt,
                                    logit_rows=[length - 1]))
    for step in range(3):
        tokens = torch.randint(0, 1000, (n,), generator=g).tolist()
        positions = [length + step for length in lengths]
        merged = decode(together, list(range(n)), positions, tokens)
        for sid in range(n):
            assert torch.equal(merged[sid], decode(alone, [sid], [positions[sid]], [tokens[sid]])[0]), (step, sid)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", ["tiny-qwen35moe", "tiny-gptoss"])
def test_embedded_models_compute_each_decode_row_as_alone(model, mode):
    assert_rows_computed_alone(model, mode)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3.5-35b-a3b", "gpt-oss-20b"])
def test_full_width_layers_compute_each_decode_row_as_alone(model, tmp_path):
    path = full_width(model, tmp_path / "model.gguf")
    for mode in MODES:
        assert_rows_computed_alone(path, mode)


def test_merged_steps_keep_each_chunks_rows():
    """Sampling rows and logit rows move by what the steps before hold; the originals are left alone."""
    def step(sid, first):
        c = ChunkSampling(first=first, tip=first, params=SamplingParams(), seq_id=sid)
        return StepBatch(seq_ids=[sid], start_pos=[10 + sid], lengths=[1], token_ids=[sid], logit_rows=[0],
                         sampling=[c])
    a, b = step(0, 0), StepBatch(seq_ids=[1, 2], start_pos=[5, 6], lengths=[1, 1], token_ids=[7, 8],
                                 logit_rows=[0, 1], sampling=[step(1, 0).sampling[0], step(2, 1).sampling[0]])
    merged = merge_decode_steps([a, b])
    assert merged.seq_ids == [0, 1, 2] and merged.start_pos == [10, 5, 6] and merged.token_ids == [0, 7, 8]
    assert merged.logit_rows == [0, 1, 2]
    assert [(c.first, c.tip, c.seq_id) for c in merged.sampling] == [(0, 0, 0), (1, 1, 1), (2, 2, 2)]
    assert [(c.first, c.tip) for c in b.sampling] == [(0, 0), (1, 1)]
