"""cairn.optim: chainable gradient transformations, schedules and losses."""

# public submodules, one per Optax concept (thin re-exports of the private modules)
from cairn.optim import (
    assignment,
    contrib,
    losses,
    projections,
    schedules,
    transforms,
    tree,
    tree_utils,
)
from cairn.optim._adam import (
    ScaleByAdamState,
    adabelief,
    adam,
    adamax,
    adamaxw,
    adamw,
    amsgrad,
    lamb,
    lion,
    nadam,
    nadamw,
    novograd,
    radam,
    scale_by_adam,
    scale_by_adamax,
    scale_by_amsgrad,
    scale_by_belief,
    scale_by_lion,
    scale_by_novograd,
    scale_by_radam,
    scale_by_yogi,
    yogi,
)
from cairn.optim._adan import ScaleByAdanState, adan, scale_by_adan
from cairn.optim._adding import AddDecayedWeightsState, add_decayed_weights, add_noise
from cairn.optim._base import (
    EmptyState,
    GradientTransformation,
    GradientTransformationExtraArgs,
    ScalarOrSchedule,
    StateMismatchError,
    apply_updates,
    chain,
    global_norm,
    identity,
    incremental_update,
    init_empty_state,
    named_chain,
    periodic_update,
    set_to_zero,
    stateless,
    stateless_with_tree_map,
    with_extra_args_support,
)
from cairn.optim._clipping import (
    adaptive_grad_clip,
    clip,
    clip_by_block_rms,
    clip_by_global_norm,
    per_example_global_norm_clip,
    per_example_layer_norm_clip,
    zero_nans,
)
from cairn.optim._combine import (
    InjectHyperparamsState,
    PartitionState,
    flatten,
    get_hyperparams,
    inject_hyperparams,
    multi_transform,
    partition,
    set_hyperparams,
)
from cairn.optim._factorized import adafactor, scale_by_factored_rms
from cairn.optim._lbfgs import ScaleByLBFGSState, lbfgs, scale_by_lbfgs
from cairn.optim._linesearch import (
    BacktrackingLinesearchInfo,
    ScaleByBacktrackingLinesearchState,
    ScaleByZoomLinesearchState,
    ZoomLinesearchInfo,
    scale_by_backtracking_linesearch,
    scale_by_zoom_linesearch,
    value_and_grad_from_state,
)
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
from cairn.optim._masking import MaskedNode, MaskedState, freeze, masked
from cairn.optim._momentum import ema, lars, noisy_sgd, sgd, signum, trace
from cairn.optim._muon import muon, orthogonalize_via_newton_schulz, scale_by_muon
from cairn.optim._optimistic import (
    ScaleByOptimisticGradientState,
    optimistic_adam,
    optimistic_adam_v2,
    optimistic_gradient_descent,
    scale_by_optimistic_gradient,
)
from cairn.optim._packed_state import pack, safe_increment
from cairn.optim._packing import Packed, layout_of, unpack
from cairn.optim._polyak import polyak_sgd, scale_by_polyak
from cairn.optim._rms import (
    adadelta,
    adagrad,
    rmsprop,
    scale_by_adadelta,
    scale_by_rms,
    scale_by_rss,
    scale_by_sm3,
    scale_by_stddev,
    sm3,
)
from cairn.optim._scaling import (
    ScaleByLearningRateState,
    centralize,
    fromage,
    rprop,
    scale,
    scale_by_learning_rate,
    scale_by_param_block_norm,
    scale_by_param_block_rms,
    scale_by_rprop,
    scale_by_schedule,
    scale_by_sign,
    scale_by_trust_ratio,
    sign_sgd,
)
from cairn.optim._schedule_free import (
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
    schedule_free_sgd,
)
from cairn.optim._schedules import (
    constant_schedule,
    cosine_decay_schedule,
    cosine_onecycle_schedule,
    exponential_decay,
    join_schedules,
    linear_onecycle_schedule,
    linear_schedule,
    piecewise_constant_schedule,
    piecewise_interpolate_schedule,
    polynomial_schedule,
    sgdr_schedule,
    warmup_constant_schedule,
    warmup_cosine_decay_schedule,
    warmup_exponential_decay_schedule,
)
from cairn.optim._selective import selective_transform
from cairn.optim._shampoo import matrix_inverse_root, scale_by_shampoo, shampoo
from cairn.optim._tree import (
    bias_correction,
    update_infinity_moment,
    update_moment,
    update_moment_per_elem_norm,
)
from cairn.optim._tree_state import map_params as tree_map_params
from cairn.optim._types import (
    ArrayTree,
    OptState,
    Params,
    Schedule,
    TransformInitFn,
    TransformUpdateExtraArgsFn,
    TransformUpdateFn,
    Updates,
)
from cairn.optim._wrappers import (
    ApplyIfFiniteState,
    LookaheadParams,
    LookaheadState,
    MultiSteps,
    MultiStepsState,
    apply_every,
    apply_if_finite,
    lookahead,
    skip_not_finite,
)

safe_int32_increment = safe_increment

__version__ = "0.2.0"

__all__ = [
    # core
    "GradientTransformation", "GradientTransformationExtraArgs", "EmptyState", "chain",
    "named_chain", "partition", "multi_transform", "masked", "freeze", "identity",
    "set_to_zero", "stateless", "stateless_with_tree_map", "apply_updates",
    "incremental_update", "periodic_update", "global_norm", "tree", "flatten",
    "inject_hyperparams", "get_hyperparams", "set_hyperparams", "InjectHyperparamsState",
    "PartitionState", "MaskedState", "MaskedNode", "Packed", "pack", "unpack", "layout_of",
    "StateMismatchError", "ScalarOrSchedule", "selective_transform", "with_extra_args_support",
    "init_empty_state", "safe_increment", "safe_int32_increment", "tree_map_params",
    "bias_correction", "update_moment", "update_moment_per_elem_norm", "update_infinity_moment",
    # types (annotations only)
    "Params", "Updates", "OptState", "Schedule", "ArrayTree", "TransformInitFn",
    "TransformUpdateFn", "TransformUpdateExtraArgsFn",
    # submodules
    "tree_utils", "transforms", "losses", "schedules", "contrib", "projections", "assignment",
    # transforms
    "scale", "scale_by_learning_rate", "scale_by_schedule", "scale_by_adam", "scale_by_amsgrad",
    "scale_by_adamax", "scale_by_rms", "scale_by_stddev", "scale_by_belief", "scale_by_radam",
    "scale_by_yogi", "scale_by_lion", "scale_by_factored_rms", "scale_by_trust_ratio",
    "scale_by_sign", "scale_by_novograd", "scale_by_sm3", "scale_by_rss", "scale_by_adadelta",
    "scale_by_rprop", "scale_by_param_block_rms", "scale_by_param_block_norm",
    "scale_by_muon", "scale_by_shampoo", "add_decayed_weights", "add_noise", "trace", "ema",
    "clip", "clip_by_global_norm", "clip_by_block_rms", "adaptive_grad_clip", "centralize",
    "zero_nans", "apply_if_finite", "skip_not_finite", "apply_every", "MultiSteps",
    "MultiStepsState", "lookahead", "LookaheadParams", "LookaheadState", "ApplyIfFiniteState",
    "ScaleByAdamState", "ScaleByLearningRateState", "AddDecayedWeightsState",
    "orthogonalize_via_newton_schulz", "matrix_inverse_root", "scale_by_adan",
    "ScaleByAdanState", "scale_by_optimistic_gradient", "ScaleByOptimisticGradientState",
    "per_example_global_norm_clip", "per_example_layer_norm_clip",
    # optimizers
    "sgd", "adam", "adamw", "nadam", "nadamw", "adamax", "adamaxw", "amsgrad", "adagrad",
    "adadelta", "adafactor", "adabelief", "lamb", "lars", "lion", "novograd", "radam",
    "rmsprop", "rprop", "sm3", "yogi", "fromage", "noisy_sgd", "sign_sgd", "signum", "muon",
    "shampoo", "polyak_sgd", "scale_by_polyak", "lbfgs", "scale_by_lbfgs", "ScaleByLBFGSState",
    "scale_by_backtracking_linesearch", "scale_by_zoom_linesearch", "value_and_grad_from_state",
    "BacktrackingLinesearchInfo", "ScaleByBacktrackingLinesearchState",
    "ScaleByZoomLinesearchState", "ZoomLinesearchInfo", "schedule_free", "schedule_free_adamw", "schedule_free_sgd",
    "schedule_free_eval_params", "adan", "optimistic_gradient_descent", "optimistic_adam",
    "optimistic_adam_v2",
    # schedules
    "constant_schedule",
    "linear_schedule",
    "polynomial_schedule",
    "exponential_decay",
    "cosine_decay_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
    "warmup_constant_schedule",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
    "join_schedules",
    "linear_onecycle_schedule",
    "cosine_onecycle_schedule",
    "sgdr_schedule",
    # losses
    "l2_loss",
    "squared_error",
    "huber_loss",
    "log_cosh",
    "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels",
    "safe_softmax_cross_entropy",
    "sigmoid_binary_cross_entropy",
    "sigmoid_focal_loss",
    "hinge_loss",
    "cosine_similarity",
    "cosine_distance",
    "kl_divergence",
    "convex_kl_divergence",
    "smooth_labels",
    "ctc_loss",
    "ctc_loss_with_forward_probs",
    "poly_loss_cross_entropy",
    "triplet_margin_loss",
    "ranking_softmax_loss",
    "kl_divergence_with_log_targets",
    "generalized_kl_divergence",
    "perceptron_loss",
    "multiclass_perceptron_loss",
    "multiclass_hinge_loss",
]
