"""Model files: GGUF and safetensors readers, direct reads, and the loader that picks a family."""
