"""Per-(layer, KV head) scorers: each maps cached keys/values to a float32 score `r[t]`."""

from kvpop.scorers.mlp import MLPScorer
from kvpop.scorers.mlstm import MLSTMScorer

__all__ = ["MLPScorer", "MLSTMScorer"]
