"""The embedded default models: trained tiny GGUFs shipped in this folder (tools/train_tiny.py wrote them;
docs/tiny-models.md says from what). Each name maps to its file and the file's sha256."""
from __future__ import annotations

import os

FOLDER = os.path.dirname(os.path.abspath(__file__))

EMBEDDED = {
    "tiny-qwen35moe": ("tiny-qwen35moe.gguf", "6a8dc0f4a1430530ac217a05e907ddea99220477cd1bcf61fa6398715e6993e3"),
    "tiny-gptoss": ("tiny-gptoss.gguf", "666b141bb616144fe31be8f54589d9dc8d07b0d31a6ec1b2e494cb8aef18e748"),
}


def embedded_model_path(name: str) -> str:
    return os.path.join(FOLDER, EMBEDDED[name][0])
