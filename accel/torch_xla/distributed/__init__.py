"""``torchacc.torch_xla.distributed``: parallel_loader and xla_backend."""
