"""``cairn.optim.losses``: the loss functions under ``optax.losses``' names (re-exports).

>>> import jax.numpy as jnp
>>> from cairn.optim import losses
>>> float(losses.l2_loss(jnp.array(2.0), jnp.array(0.0)))
2.0
"""

from cairn.optim._losses import (
    convex_kl_divergence,
    cosine_distance,
    cosine_similarity,
    ctc_loss,
    ctc_loss_with_forward_probs,
    generalized_kl_divergence,
    hinge_loss,
    huber_loss,
    kl_divergence,
    kl_divergence_with_log_targets,
    l2_loss,
    log_cosh,
    multiclass_hinge_loss,
    multiclass_perceptron_loss,
    perceptron_loss,
    poly_loss_cross_entropy,
    ranking_softmax_loss,
    safe_softmax_cross_entropy,
    sigmoid_binary_cross_entropy,
    sigmoid_focal_loss,
    smooth_labels,
    softmax_cross_entropy,
    softmax_cross_entropy_with_integer_labels,
    squared_error,
    triplet_margin_loss,
)

__all__ = [
    "convex_kl_divergence", "cosine_distance", "cosine_similarity", "ctc_loss",
    "ctc_loss_with_forward_probs", "hinge_loss", "huber_loss", "kl_divergence", "l2_loss",
    "log_cosh", "poly_loss_cross_entropy", "ranking_softmax_loss", "safe_softmax_cross_entropy",
    "sigmoid_binary_cross_entropy", "sigmoid_focal_loss", "smooth_labels",
    "softmax_cross_entropy", "softmax_cross_entropy_with_integer_labels", "squared_error",
    "triplet_margin_loss", "kl_divergence_with_log_targets", "generalized_kl_divergence",
    "perceptron_loss", "multiclass_perceptron_loss", "multiclass_hinge_loss",
]
