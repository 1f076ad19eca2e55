"""TorchAcc-compatible import paths (``torchacc.torch_xla.*`` -> ``accel.torch_xla.*``): re-exports only.

    import accel.torch_xla.core.xla_model as xm
    import accel.torch_xla.distributed.parallel_loader as pl
    import accel.torch_xla.distributed.xla_backend          # registers the "xla" process group
    from accel.torch_xla.amp import autocast, GradScaler, syncfree
"""
