"""Entry points: batch generation, serving, conversion, tiny models, benchmarks."""
