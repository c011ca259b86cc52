"""The one registry of model families: a new family is its own module plus one line in FAMILIES."""
from __future__ import annotations

from raymoe.stages.errors import ModelFormatError
from raymoe.stages.families import gptoss, qwen35moe, qwen3next
from raymoe.stages.families.contract import Family

FAMILIES: tuple[Family, ...] = (qwen35moe.FAMILY, gptoss.FAMILY, qwen3next.FAMILY)


def families() -> tuple[Family, ...]:
    """Every family raymoe runs: the one registry (imported when asked: each family module imports this one)."""
    from raymoe.stages.families import gptoss, qwen35moe, qwen3next
    return qwen35moe.FAMILY, gptoss.FAMILY, qwen3next.FAMILY


def find_family(where: str, gguf_arch: str | None = None, hf_model_type: str | None = None) -> Family:
    """The family of a GGUF architecture or of an HF config.json model_type, or a ModelFormatError naming
    the ones supported."""
    for family in families():
        if (gguf_arch is not None and gguf_arch == family.arch) or hf_model_type in family.hf_model_types:
            return family
    if gguf_arch is not None:
        supported = sorted(f.arch for f in families())
        raise ModelFormatError(f"{where}: unknown architecture {gguf_arch!r} (supported: {', '.join(supported)})")
    supported = sorted(t for f in families() for t in f.hf_model_types)
    raise ModelFormatError(f"{where}: unknown architecture (config.json model_type {hf_model_type!r}; "
                           f"supported: {', '.join(supported)})")
