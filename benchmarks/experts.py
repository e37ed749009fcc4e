"""Routed-expert ids shaped like a real MoE capture, for the join benchmarks.

Uniformly random ids are the wrong test data: real routers are skewed per layer (a few hot experts,
a long cold tail) and every layer's hot set is different. The generator here draws, for each layer,
a Zipf popularity over the experts (weight of the r-th most popular ``1 / r**s``) under its own
random permutation of expert ids, then picks each token's top-k *distinct* experts by the
Gumbel-top-k trick (sampling k without replacement proportionally to the weights), ordered by
their perturbed score as SGLang's ``topk_ids`` are. ``s = 0`` is uniform routing; ``s = 1`` is the
default (the hottest of 256 experts ~16x the median one, a DeepSeek-V3 layer without perfect
balancing). Ids are little-endian int32, SGLang's default ``routed_experts_dtype``.
"""

from __future__ import annotations

import numpy as np

LAYERS, TOP_K, EXPERTS = 58, 8, 256  # DeepSeek-V3's MoE layers and routing
ZIPF_S = 1.0


def routed_experts(rows: int, *, layers: int = LAYERS, top_k: int = TOP_K, experts: int = EXPERTS,
                   s: float = ZIPF_S, seed: int = 7) -> bytes:
    """``rows`` token positions x ``layers`` x ``top_k`` int32 ids, skewed per layer (see module doc)."""
    rng = np.random.default_rng(seed)
    out = np.empty((rows, layers, top_k), dtype="<i4")
    log_weight = -s * np.log(np.arange(1, experts + 1, dtype=np.float64))
    for layer in range(layers):
        logits = np.empty(experts)
        logits[rng.permutation(experts)] = log_weight  # this layer's hot experts
        keys = logits + rng.gumbel(size=(rows, experts))
        top = np.argpartition(-keys, top_k, axis=1)[:, :top_k]
        order = np.argsort(-np.take_along_axis(keys, top, axis=1), axis=1)
        out[:, layer, :] = np.take_along_axis(top, order, axis=1)
    return out.tobytes()
