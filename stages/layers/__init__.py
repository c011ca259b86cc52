"""The layers' parts: attention, Gated DeltaNet, the MoE feed-forward, their caches, the pre-norm block."""
