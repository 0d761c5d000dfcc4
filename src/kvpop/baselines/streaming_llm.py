"""StreamingLLM (Xiao et al., 2023): attention sinks plus the most recent tokens, nothing else.

The rule with `topk = 0`: the whole budget beyond the sinks is the window, so no priority is
ever consulted. `streaming_llm_plus` is the same pattern with the base model distilled to it
(`kvpop train --policy streaming_llm_plus`), the paper's trained fixed-pattern baseline. A sliding-window
layer of a hybrid model is the same pattern without sinks (`SlidingWindowPolicy`).
"""

from kvpop.policy import LayerPolicy


class RecencyPolicy(LayerPolicy):
    """No scorer: with `topk = 0` the base class's constant priority is never used."""


class SlidingWindowPolicy(RecencyPolicy):
    """A sliding-window layer of a hybrid model (`kvpop.layer_kinds`): no sinks, its window `W`, top-k 0, no parameters.

    Whatever policy the model's full-attention layers run, this layer keeps exactly what the model itself attends
    (`q - t < W`); it is never captured for training, having nothing to learn."""

    sliding = True
