"""Fused layers of the custom path. Import each op from its module (accel.runtime.nn.quick_gelu, ...);
only the bias-dropout-add functions are re-exported here, as TorchAcc's guide imports them from this
package. Nothing is built until an op is first called."""
from accel.runtime.nn.bias_dropout_add import bias_dropout_add, dropout_add_fused, dropout_add_fused_train

__all__ = ["bias_dropout_add", "dropout_add_fused", "dropout_add_fused_train"]
