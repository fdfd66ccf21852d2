"""The Triton ops of `delta_implementation="triton"`: a whole Delta residual and each read of an expanded state as one
op each, forward and backward.

| op | custom op | entry point (`DeltaKernels` field) | module |
| --- | --- | --- | --- |
| a whole Delta residual (gate, value, write) | `ddl_hf::delta_residual` | `residual` | `residual_op`, its kernels |
| the linear read `state @ w` | `ddl_hf::delta_read` | `read` | `linear_read` |
| the TC read (and the next window) | `ddl_hf::temporal_read` | `temporal_conv_read` (`temporal_read`) | `tc_read` |
| the CC read | `ddl_hf::channel_read` | `channel_conv_read` (`channel_read`) | `cc_read` |

`launch` holds what they share: block and launch sizes, the accumulation dtype, the device guard, and the plumbing
that makes each a `torch.library` custom op (one node for torch.compile and export) with an eager autograd node.
Each op's readable reference is the tensor ops (`DeltaResidual`, `delta_fused.py`, with the math in `delta_ops.py`);
the tests compare the two under Triton's interpreter on the CPU (tests/ops/test_triton_delta.py).

Triton is imported with this package; the model files never import it (`ddl_hf.kernels` loads it for a model whose
`delta_implementation` asks for it).
"""

from .cc_read import channel_conv_read, channel_read, channel_read_backward
from .linear_read import delta_read, delta_read_backward, read
from .residual_op import delta_residual, delta_residual_backward, residual
from .tc_read import temporal_conv_read, temporal_read, temporal_read_backward

__all__ = [
    "channel_conv_read",
    "channel_read",
    "channel_read_backward",
    "delta_read",
    "delta_read_backward",
    "delta_residual",
    "delta_residual_backward",
    "read",
    "residual",
    "temporal_conv_read",
    "temporal_read",
    "temporal_read_backward",
]
