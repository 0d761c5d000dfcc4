"""Per-(layer, KV head) scorers: each maps cached keys/values to a float32 score `r[t]`."""

from kvpop.scorers.evidence import EvidenceScorer
from kvpop.scorers.mlp import MLPScorer
from kvpop.scorers.mlstm import MLSTMScorer

__all__ = ["EvidenceScorer", "MLPScorer", "MLSTMScorer"]
