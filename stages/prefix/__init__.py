"""The prefix cache: its index of token blocks, the stage's store of cached states, and the engine's side."""
