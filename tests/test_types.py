"""The typed contracts hold under a type checker: mypy checks the families against `Family`'s Callable signatures
and the chat formats against `ChatFormat`. A family whose function takes the wrong arguments is an error (the
negative control, checked in the same run)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("kernels", "stages", "cluster", "deploy", "tools", "models", "protos")
WRONG = '''from raymoe.stages.families.contract import Family
from raymoe.stages.families.gptoss import FAMILY, GptOssConfig


def rope(cfg: GptOssConfig, scale: float): ...


WRONG = Family(arch="x", hf_model_types=(), tokenizer_pre="x", chat_format="harmony",
               config_from_gguf=FAMILY.config_from_gguf, config_from_hf=FAMILY.config_from_hf,
               gguf_metadata=FAMILY.gguf_metadata, hf_weights=FAMILY.hf_weights, layer_mixer=FAMILY.layer_mixer,
               rope=rope, layer_ffn=FAMILY.layer_ffn)
'''


def test_the_families_and_chat_formats_type_check(tmp_path):
    # mypy finds modules by folder: a raymoe/ folder of links to the top-level ones (the installed mapping);
    # what the checked folders import from elsewhere (torch, the layers) is Any: seconds, not a minute
    os.mkdir(tmp_path / "raymoe")
    for folder in FOLDERS:
        os.symlink(os.path.join(ROOT, folder), tmp_path / "raymoe" / folder)
    (tmp_path / "wrong_family.py").write_text(WRONG)
    proc = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=skip", "--ignore-missing-imports",
                           "--namespace-packages", "--explicit-package-bases", "--cache-dir", str(tmp_path / "cache"),
                           "raymoe/stages/families", "raymoe/stages/text/formats", "wrong_family.py"],
                          cwd=tmp_path, env={**os.environ, "MYPYPATH": str(tmp_path)}, capture_output=True, text=True,
                          timeout=600)
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("wrong_family.py:11: error: Argument \"rope\""), proc.stdout
