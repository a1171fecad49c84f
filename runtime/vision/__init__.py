"""Image input: preprocessing as the HF processor does it, the vision tower (its own compiled library),
M-RoPE positions, and the per-request media payload the executor feeds into a prefill."""
