"""flashtune: autotuned FlashAttention-2 kernels generated in Triton."""
from .api import attention, attention_varlen
from .block_mask import BlockMask
from .dispatch import explain, force
from .kvcache import attention_with_kvcache
from .problem import Bucket, Problem
from .reference import reference

__version__ = "0.1.0"
__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "reference", "force",
           "explain", "Problem", "Bucket", "BlockMask", "__version__"]
