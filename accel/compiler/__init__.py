"""The compiler path on CUDA and CPU: torch.compile with static shapes."""
