"""Model formats, models, stages, sampling and scheduling: no Ray."""
