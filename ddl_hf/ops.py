"""The delta rule over time (DeltaNet), as plain tensor functions.

`delta_rule_recurrent` is the one-token-at-a-time reference (and the decoding step); `delta_rule_chunkwise` is
the chunkwise-parallel WY/UT form used for training and prefill. They live in the Hub file
`modeling_delta_gpt.py` (which may import only torch and transformers) and are re-exported here.
"""

from .modeling_delta_gpt import delta_rule_chunkwise, delta_rule_recurrent

__all__ = ["delta_rule_chunkwise", "delta_rule_recurrent"]
