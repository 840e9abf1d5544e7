"""``cairn.optim.losses``: the loss functions under ``optax.losses``' names (re-exports).

>>> import jax.numpy as jnp
>>> from cairn.optim import losses
>>> float(losses.l2_loss(jnp.array(2.0), jnp.array(0.0)))
2.0

Besides Optax's, the post-training losses: ``token_logprobs``, ``sequence_logprobs``,
``dpo_loss``, ``ipo_loss``, ``orpo_loss``, ``simpo_loss`` (returning a
``PreferenceLossOutput``), ``clipped_policy_loss`` (a ``PolicyLossOutput``),
``kl_penalty`` and ``group_relative_advantages``.
"""

from cairn.optim._logprobs import sequence_logprobs, token_logprobs
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
    multiclass_sparsemax_loss,
    perceptron_loss,
    poly_loss_cross_entropy,
    ranking_softmax_loss,
    safe_softmax_cross_entropy,
    sigmoid_binary_cross_entropy,
    sigmoid_focal_loss,
    smooth_labels,
    softmax_cross_entropy,
    softmax_cross_entropy_with_integer_labels,
    sparsemax_loss,
    squared_error,
    triplet_margin_loss,
)
from cairn.optim._policy_losses import (
    PolicyLossOutput,
    clipped_policy_loss,
    group_relative_advantages,
    kl_penalty,
)
from cairn.optim._preference_losses import (
    PreferenceLossOutput,
    dpo_loss,
    ipo_loss,
    orpo_loss,
    simpo_loss,
)

__all__ = [
    "convex_kl_divergence", "cosine_distance", "cosine_similarity", "ctc_loss",
    "ctc_loss_with_forward_probs", "hinge_loss", "huber_loss", "kl_divergence", "l2_loss",
    "log_cosh", "poly_loss_cross_entropy", "ranking_softmax_loss", "safe_softmax_cross_entropy",
    "sigmoid_binary_cross_entropy", "sigmoid_focal_loss", "smooth_labels",
    "softmax_cross_entropy", "softmax_cross_entropy_with_integer_labels", "squared_error",
    "triplet_margin_loss", "kl_divergence_with_log_targets", "generalized_kl_divergence",
    "perceptron_loss", "multiclass_perceptron_loss", "multiclass_hinge_loss",
    "sparsemax_loss", "multiclass_sparsemax_loss",
    # post-training (not in Optax)
    "token_logprobs", "sequence_logprobs", "PreferenceLossOutput", "dpo_loss", "ipo_loss",
    "orpo_loss", "simpo_loss", "PolicyLossOutput", "clipped_policy_loss", "kl_penalty",
    "group_relative_advantages",
]
