"""A synthetic click data set: dense features and categorical fields whose ids follow a Zipf
law, with a click label from a hidden logistic model, so that the embeddings of the ids that
appear often carry what the label depends on (the shape of a recommendation model's data).

Each sample has `fields` categorical features, one id each. Field f's ids are namespaced,
id = f << 32 | raw, raw in [0, vocabulary), so all fields share one keyed table. The hidden
model gives every (field, raw id) a weight and the dense features a weight vector; the label is
1 with the logistic probability of their sum.
"""

from __future__ import annotations

import numpy as np

FIELD_SHIFT = 32


def synthetic_clicks(samples: int, dense_features: int, fields: int, vocabulary: int, seed: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dense float32 (samples, dense_features), ids int64 (samples, fields), labels 0/1)."""
    rng = np.random.default_rng([seed, 0xC11C])
    # Zipf-like popularity over each field's vocabulary, drawn by inverse transform.
    ranks = np.arange(1, vocabulary + 1, dtype=np.float64)
    popularity = 1.0 / ranks ** 1.1
    cumulative = np.cumsum(popularity / popularity.sum())
    raw = np.searchsorted(cumulative, rng.random((samples, fields)), side="right").clip(0, vocabulary - 1)
    raw = rng.permutation(vocabulary)[raw]  # the popular ids are not the small ones
    ids = (np.arange(fields, dtype=np.int64)[None, :] << FIELD_SHIFT) | raw.astype(np.int64)
    id_weight = rng.normal(0.0, 1.0, size=(fields, vocabulary))
    dense = rng.normal(0.0, 1.0, size=(samples, dense_features))
    dense_weight = rng.normal(0.0, 0.5, size=dense_features)
    logit = id_weight[np.arange(fields)[None, :], raw].sum(axis=1) / np.sqrt(fields) + dense @ dense_weight - 0.5
    labels = (rng.random(samples) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    return dense.astype(np.float32), ids, labels
