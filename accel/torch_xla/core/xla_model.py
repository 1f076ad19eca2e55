"""``torchacc.torch_xla.core.xla_model`` as ``xm``: everything from accel.xla, aliases included."""
from accel.xla import *  # noqa: F401,F403
from accel.xla import __all__  # noqa: F401
