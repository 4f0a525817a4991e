"""Gradient tools: per-example gradients and norms, Jacobians of any tensor,
gradient hooks, weighted aggregation, backward-pass cost and precise
batch-norm statistics. Importing this module imports no Keras."""

from tf_gradkit.gradients.aggregation import weighted_average
from tf_gradkit.gradients.batch_norm import recompute_batch_norm_statistics
from tf_gradkit.gradients.cost import BackwardCost, backward_cost
from tf_gradkit.gradients.jacobians import gradient_of, jacobian, layer_jacobian
from tf_gradkit.gradients.per_example import per_example_gradient_norms
from tf_gradkit.gradients.per_example import per_example_gradients
from tf_gradkit.gradients.per_example import per_example_norm_plan

__all__ = [
    "BackwardCost",
    "backward_cost",
    "gradient_of",
    "jacobian",
    "layer_jacobian",
    "per_example_gradient_norms",
    "per_example_gradients",
    "per_example_norm_plan",
    "recompute_batch_norm_statistics",
    "weighted_average",
]
