"""Running top-k of the retention rule: eviction positions and boundary tokens.

`reference.py` is the dense definition; `wavelet.py` the O(S log S) form used everywhere else;
`kernel.py` Triton kernels, which `eviction_positions` selects on CUDA: for tokens stored in position order
(`ordered=True`: the teacher-forced training path) directly, for others (a cache's slots plus a chunk) on a
copy of each row sorted by position.
"""

from kvpop.ops.topk.predicate import mask_from_eviction
from kvpop.ops.topk.reference import eviction_times_from_mask, retention_mask_reference
from kvpop.ops.topk.wavelet import NEVER, boundary_tokens, eviction_positions, prefix_kth_smallest

__all__ = [
    "NEVER",
    "boundary_tokens",
    "eviction_positions",
    "eviction_times_from_mask",
    "mask_from_eviction",
    "prefix_kth_smallest",
    "retention_mask_reference",
]
