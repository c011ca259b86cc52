"""Tools around the product: benchmarks, the soak test, the model makers and trainers, GPU checks' helpers."""
