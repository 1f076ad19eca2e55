"""``torchacc.torch_xla.core``: see xla_model."""
