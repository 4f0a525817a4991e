"""The tf_keras host: what tf_keras (the Keras 2 line that
tensorflow-model-optimization needs) does differently (see `protocol`).

tf_keras's ways: plain ``tf.Variable`` state in ``_variables``, variable names
as paths, ``apply_gradients(grads_and_vars, skip_gradients_aggregation=...)``
and ``compute_gradients`` (where its LossScaleOptimizer scales the loss and
unscales the gradients), an assignable ``iterations``, ``_built``, and
optimizer weights that HDF5 files key by name (so every name is unique).
Legacy ``tf_keras.optimizers.legacy`` optimizers are not accepted: they
predate the distribution-aware API the wrappers rely on.
"""

import contextlib

import tensorflow as tf
import tf_keras
from tf_keras.src.optimizers import utils as optimizer_utils
from tf_keras.src.optimizers.optimizer import CallableList
from tf_keras.src.utils import generic_utils

from tf_gradkit._hosts import protocol
# Host functions both flavours share (see `protocol.HOST_FUNCTIONS`).
from tf_gradkit._hosts.protocol import (  # noqa: F401
    built_variables, compiled_loss_weights, dataset_graph, is_built, is_variable,
    loss_fn_kwargs, optimizer_map)
from tf_gradkit import _optimizer_tree, _registration

FLAVOUR = "tf_keras"
Optimizer = tf_keras.optimizers.Optimizer
register = tf_keras.saving.register_keras_serializable
_SYNC = {"sum": (tf.VariableSynchronization.ON_READ, tf.VariableAggregation.SUM),
         "first": (tf.VariableSynchronization.ON_READ,
                   tf.VariableAggregation.ONLY_FIRST_REPLICA),
         "none": (tf.VariableSynchronization.AUTO, tf.VariableAggregation.NONE)}


# Members of this Keras's optimizers that exist only on instances: tf_keras sets these on an optimizer instance (its LossScaleOptimizer
# the first); the hosts override them as properties.
KERAS_INSTANCE_ATTRIBUTES = ("_is_wrapped_by_loss_scale_optimizer", "built")


def serves(obj):
    """Whether ``obj`` belongs to tf_keras (a layer or model, optimizer,
    variable, loss or callback of it)."""
    return isinstance(obj, (tf_keras.layers.Layer, tf_keras.optimizers.Optimizer, tf_keras.losses.Loss, tf_keras.callbacks.Callback,
                           tf_keras.mixed_precision.LossScaleOptimizer))


def check_backend(owner):
    del owner  # tf_keras runs on TensorFlow only


class OptimizerHost(protocol.OptimizerHost):
    FLAVOUR = FLAVOUR
    KERAS = tf_keras
    OPTIMIZER_KIND = "tf_keras (tf_keras.optimizers.Optimizer)"
    MODEL_KIND = "tf_keras.Model"
    # tf_keras unscales in compute_gradients: wrapping a LossScaleOptimizer is
    # exact (and compile's own wrap around the wrapper does not unscale twice).
    WRAPS_LOSS_SCALE = True

    # tf_keras deserialises a loaded model's optimizer in compile_from_config
    # (.keras), in the SavedModel loader's `load` and in HDF5's loader.
    _LOADERS = {"compile_from_config": ("self", None), "load": ("model", "path"),
                "load_model_from_hdf5": ("model", None)}

    def _init_base(self, name, learning_rate=None, **kwargs):
        if name is None:  # tf_keras names its own by class, never uniquified
            name = generic_utils.to_snake_case(type(self).__name__)
        Optimizer.__init__(self, name=name, **kwargs)
        if learning_rate is not None:
            self._learning_rate = self._build_learning_rate(learning_rate)
        self._note_loading()

    @staticmethod
    def _filter_empty(grads, variables):
        """tf_keras's warning (and error) for None gradients."""
        return optimizer_utils.filter_empty_gradients(list(zip(grads, variables)))

    def _create_iteration_variable(self):
        # tf_keras's base makes an "iteration" variable: named after the
        # optimizer, as HDF5 files key optimizer weights by name.
        with tf.init_scope():
            self._iterations = tf.Variable(
                0, name=f"{self.name}/iteration", dtype=tf.int64, trainable=False,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self._variables.append(self._iterations)

    def _new_variable(self, shape, dtype, name, initial=0.0, sync="none",
                      reference=None):
        """A non-trainable ``tf.Variable`` tracked by this optimizer (see the
        Keras 3 host). Named ``<optimizer>/<name>[.<weight>]``: unique, and
        not like a slot's ``<prefix>/<weight>`` (`pruning.MaskAware` masks
        slots, not these)."""
        name = f"{self.name}/{name}"
        if reference is not None:
            name += "." + reference.name.split(":")[0].replace("/", ".")
        synchronization, aggregation = _SYNC[sync]
        scope = (contextlib.nullcontext() if tf.distribute.has_strategy()
                 else self._distribution_strategy.scope())
        with scope:
            var = tf.Variable(tf.broadcast_to(tf.cast(initial, dtype), shape),
                              trainable=False, name=name,
                              synchronization=synchronization, aggregation=aggregation)
        self._variables.append(var)
        return var

    @staticmethod
    def _path(variable):
        return variable.name

    @staticmethod
    def _tf_variable(variable):
        return variable

    def _variable_index(self, variable):
        return self._index_dict[self._var_key(variable)]

    @staticmethod
    def _index_in(owner, variable):
        return owner._index_dict[owner._var_key(variable)]

    @staticmethod
    def _report(model, x, y, y_pred, sample_weight):
        model.compute_loss(x, y, y_pred, sample_weight)
        return model.compute_metrics(x, y, y_pred, sample_weight)

    @classmethod
    def _loss_terms(cls, model, y, y_pred, sample_weight):
        """Each loss ``compile`` gave ``model`` (its ``LossesContainer``),
        matched to the outputs by the container itself, as a
        `protocol.LossTerm` for this batch."""
        from tf_keras.src.engine import compile_utils  # noqa: PLC0415
        from tf_keras.src.utils import losses_utils  # noqa: PLC0415

        container = getattr(model, "compiled_loss", None)
        if not isinstance(container, compile_utils.LossesContainer) or not container.built:
            return [protocol.LossTerm("loss", None, unknown="no loss was compiled")]
        y_true = tf.nest.flatten(container._conform_to_outputs(y_pred, y))
        weights = tf.nest.flatten(container._conform_to_outputs(y_pred, sample_weight))
        reductions = {losses_utils.ReductionV2.AUTO: "mean",
                      losses_utils.ReductionV2.SUM_OVER_BATCH_SIZE: "mean",
                      losses_utils.ReductionV2.SUM: "sum"}
        terms = []
        for y_t, y_p, sw, loss, name in zip(y_true, tf.nest.flatten(y_pred), weights,
                                            container._losses, container._output_names):
            if y_t is None or loss is None:  # an output without a loss
                continue
            y_t, y_p, _ = compile_utils.match_dtype_and_rank(y_t, y_p, sw)
            terms.append(cls._term(name, loss, y_t, y_p, reductions.get(loss.reduction),
                                   losses_utils.get_mask(y_p)))
        return terms

    @classmethod
    def _output_losses(cls, model, y, y_pred):
        """tf_keras's ``LossesContainer`` after its build: one loss and one
        weight per flat output, matched by the container (a dict of losses
        or weights by output name, one loss broadcast to every output)."""
        from tf_keras.src.engine import compile_utils  # noqa: PLC0415
        from tf_keras.src.utils import losses_utils  # noqa: PLC0415

        del y
        container = getattr(model, "compiled_loss", None)
        if not isinstance(container, compile_utils.LossesContainer):
            return None
        if not container.built:
            container.build(y_pred)
        reductions = {losses_utils.ReductionV2.AUTO: "mean",
                      losses_utils.ReductionV2.SUM_OVER_BATCH_SIZE: "mean",
                      losses_utils.ReductionV2.SUM: "sum"}

        def selector(index):
            def select(y, y_pred, sample_weight):
                conform = container._conform_to_outputs
                y_t = tf.nest.flatten(conform(y_pred, y))[index]
                sws = tf.nest.flatten(conform(y_pred, sample_weight))
                return (y_t, tf.nest.flatten(y_pred)[index],
                        sws[index] if len(sws) > index else sws[0])
            return select

        return [protocol.OutputLoss(name, loss, weight, reductions.get(loss.reduction),
                                    selector(index))
                for index, (loss, weight, name) in enumerate(zip(
                    container._losses, container._loss_weights, container._output_names))
                if loss is not None]

    @staticmethod
    def _divisor_weights(loss, sample_weight, mask):
        """Never asked: tf_keras has no reduction that divides by the sample
        weights (`_loss_terms` gives none), so this refuses, naming it."""
        del sample_weight, mask
        raise ValueError(f"tf_keras has no 'weighted_mean' reduction; the loss "
                         f"{type(loss).__name__} reduces with {loss.reduction!r}.")

    @staticmethod
    def _extra_losses(model):
        """``(all, data_dependent)``: see the Keras 3 host. tf_keras keeps
        weight regularizers as callables, the others as tensors."""
        total = len(model.losses)
        weights = sum(len(layer._callable_losses)  # pylint: disable=protected-access
                      for layer in model._flatten_layers())  # pylint: disable=protected-access
        return total, total - weights

    @classmethod
    def _slots_of(cls, optimizer, var_list):
        """Maps each weight's key to its per-entry slots in ``optimizer``.

        An optimizer variable ``s`` is a slot of model variable ``v`` when
        ``s.shape == v.shape`` and ``s``'s name is ``<prefix>/<v's name>``,
        the name tf_keras gives every variable made by
        ``add_variable_from_reference(v, prefix)`` (Adam's ``m/`` and ``v/``,
        SGD's ``m/``, RMSprop, Adagrad, Lion, EMA ``average/``); when several
        weights' names are suffixes of one slot's name, the longest wins.
        Others (scalars, Adafactor's factored statistics, tf_gradkit's own
        ``<optimizer>/<name>.<weight>`` state) are never touched."""
        return _slots_by_name(optimizer.variables, var_list, optimizer._var_key)

    @staticmethod
    def _ema_momentum(owner):
        return float(owner.ema_momentum)  # tf_keras: the same every step


class WrapperHost(protocol.WrapperHost, OptimizerHost):
    """tf_keras glue of an optimizer that wraps ``inner_optimizer``."""

    # tf_keras's LossScaleOptimizer sets this on the optimizer it wraps (and
    # refuses one already wrapped): the one moment a wrapper learns that a
    # loss-scale optimizer is outside it. Under a mixed_float16 policy
    # compile wraps whatever it is given in one, without a word.
    @property
    def _is_wrapped_by_loss_scale_optimizer(self):
        return self.__dict__.get("_loss_scale_outside", False)

    @_is_wrapped_by_loss_scale_optimizer.setter
    def _is_wrapped_by_loss_scale_optimizer(self, value):
        if value:
            self._note_loss_scale_outside()

    def _note_loss_scale_outside(self):
        """Refuses a loss-scale optimizer inside this wrapper when another
        is put outside (two scales, two overflow tests, the inner one's
        skips and scale changes out of step with the outer one's: the loss
        then ends elsewhere), and tells the wrappers below."""
        me = type(self).__name__
        for inner in _optimizer_tree.optimizer_chain(self.inner_optimizer):
            if self._is_loss_scale(inner):
                raise TypeError(
                    f"{me}({type(inner).__name__}(...)) is being wrapped in another "
                    f"{type(inner).__name__} (tf_keras's compile does that under a "
                    "mixed_float16 policy): the loss would be scaled twice and the two "
                    "scales' skips would disagree. Give the loss-scale optimizer only "
                    f"once, outside: compile a plain {me}(optimizer, ...) under the "
                    f"policy (compile wraps it), or write LossScaleOptimizer({me}"
                    "(optimizer, ...)).")
        self.__dict__["_loss_scale_outside"] = True
        below = getattr(self.inner_optimizer, "_note_loss_scale_outside", None)
        if below is not None:
            below()

    @property
    def iterations(self):
        """The inner optimizer's updates. Under a tf_keras LossScaleOptimizer
        an accumulator's are read through a counter of its own: that
        optimizer counts a step it skips by adding one to its inner
        optimizer's ``iterations``, which for an accumulator is a
        micro-batch, not an update; the counter takes the inner count again
        on every read, so neither it nor the inner optimizer counts the
        skipped micro-batch (a checkpoint may store the counter one high
        for each; it is never read back)."""
        if not (self.__dict__.get("_loss_scale_outside")
                and getattr(type(self), "accumulates_gradients", False)):
            return self.inner_optimizer.iterations
        self._iterations.assign(self.inner_optimizer.iterations)
        return self._iterations

    @iterations.setter
    def iterations(self, variable):  # tf_keras assigns it
        self.inner_optimizer.iterations = variable

    def build(self, var_list):
        Optimizer.build(self, var_list)
        if getattr(self, "_built", False):
            return
        var_list = list(var_list)
        self.inner_optimizer.build(var_list)  # idempotent in tf_keras
        self.check_inner(self.inner_optimizer)  # as the Keras 3 host does
        self._trainable_variables = var_list
        self._build_own(var_list)
        self._built = True
        self._restore_after_load()

    @property
    def variables(self):
        return CallableList(list(self._variables) + list(self.inner_optimizer.variables))

    def _is_built(self):
        return getattr(self, "_built", False)

    @staticmethod
    def _inner_loss_scale():
        """1.0: tf_keras optimizers have no ``loss_scale_factor``, and a
        LossScaleOptimizer inside unscales in ``compute_gradients``."""
        return 1.0

    def compute_gradients(self, loss, var_list, tape=None):
        return self.inner_optimizer.compute_gradients(loss, var_list, tape=tape)

    def apply_gradients(self, grads_and_vars, name=None,
                        skip_gradients_aggregation=False, **options):
        del name  # tf_keras's name scope argument
        options.pop("experimental_aggregate_gradients", None)
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        grads, variables = zip(*grads_and_vars)
        with tf.init_scope():
            self.build(variables)
        self._apply_grads(list(grads), list(variables),
                          aggregated=skip_gradients_aggregation, **options)
        return self.iterations

    def _inner_apply(self, grads, variables, aggregated=False):
        self.inner_optimizer.apply_gradients(zip(grads, variables),
                                             skip_gradients_aggregation=aggregated)


class StateHost(protocol.StateHost, OptimizerHost):
    """tf_keras glue of an optimizer with state of its own (``_build_own``)."""

    def build(self, var_list):
        Optimizer.build(self, var_list)
        if getattr(self, "_built", False):
            return
        self._build_own(list(var_list))
        self._built = True
        self._restore_after_load()

    @property
    def built(self):
        return getattr(self, "_built", False)


class SlotHost(protocol.SlotHost, OptimizerHost):
    """tf_keras glue of a per-variable optimizer (``update_step``)."""

    def build(self, var_list):
        var_list = list(var_list)
        if not getattr(self, "_built", False):  # may raise before building
            own = self._prepare(var_list)
        Optimizer.build(self, var_list)
        if getattr(self, "_built", False):
            return
        self._build_slots(var_list, own)
        self._built = True
        self._restore_after_load()

    def _new_slot(self, reference, shape, initial, name):
        return self.add_variable_from_reference(reference, name, shape=shape,
                                                initial_value=initial)

    def update_step(self, gradient, variable):
        self._update_one(gradient, variable, self.learning_rate)

    @staticmethod
    def _assign(variable, value):
        variable.assign(value)

    @staticmethod
    def _read(slot):
        return slot

    def _learning_rate_config(self):
        return {"learning_rate": self._serialize_hyperparameter(self._learning_rate)}



def _base_name(variable):
    name = getattr(variable, "_shared_name", None) or variable.name
    return name[:-2] if name.endswith(":0") else name


def _slots_by_name(optimizer_variables, var_list, key):
    """Maps ``key(v)`` of each model variable to its slots (the rule above)."""
    names = {}
    for v in var_list:
        names.setdefault(_base_name(v), []).append(v)
    slots = {key(v): [] for v in var_list}
    model_keys = set(slots)
    for s in optimizer_variables:
        if key(s) in model_keys:
            continue
        name = _base_name(s)
        parts = name.split("/")
        for start in range(1, len(parts)):  # longest suffix first
            owners = [v for v in names.get("/".join(parts[start:]), ())
                      if tuple(v.shape) == tuple(s.shape)]
            if len(owners) > 1:
                raise ValueError(
                    f"Masked update: optimizer variable {name!r} could belong to "
                    f"{len(owners)} model variables named "
                    f"{_base_name(owners[0])!r}; give the layers unique names "
                    "so that each slot maps to one weight.")
            if owners:
                slots[key(owners[0])].append(s)
                break
    return slots


def constraint_class(set_class):
    """The tf_keras constraint made from a `core.sets` set class."""
    return protocol.constraint_class(set_class, tf_keras, "tf_gradkit.tf_keras.constraints",
                                     check_backend)


def layer_kinds():
    """This flavour's layer classes the gradient tools know
    (`protocol.layer_kinds`)."""
    kinds = protocol.layer_kinds(tf_keras.layers)
    # Models whose call is their graph of layers (no call of their own).
    from tf_keras.src.engine.functional import Functional  # pylint: disable=import-outside-toplevel
    kinds["graph_models"] = (tf_keras.Sequential, Functional)
    return kinds


def pruning_layers(model):
    """tfmot's ``PruneLowMagnitude`` layers in ``model`` (nested models too),
    in order. Recognised by what they hold, not by their class, so that
    nothing imports tensorflow-model-optimization (whose import sets
    ``TF_USE_LEGACY_KERAS=1`` for the process): a ``pruning_obj``, a
    ``pruning_step`` and a ``pruning_vars`` list."""
    return [layer for layer in model.submodules
            if hasattr(layer, "pruning_obj") and hasattr(layer, "pruning_step")
            and isinstance(getattr(layer, "pruning_vars", None), list)]


def pruning_masks(layers):
    """``(weight, mask)`` of each built pruning layer: tfmot keeps its
    ``pruning_vars`` as ``(weight, mask, threshold)`` (none until built)."""
    return [(weight, mask) for layer in layers for weight, mask, _ in layer.pruning_vars]


def watch_applied_gradients(optimizer, record):
    """Makes ``record(grads, variables)`` see every gradient ``optimizer``
    applies (tf_keras: its ``apply_gradients``, which ``minimize`` and
    wrappers call). Returns the function that removes the watch."""
    original = optimizer.apply_gradients

    def apply_gradients(grads_and_vars, *args, **kwargs):
        pairs = list(grads_and_vars)
        record([g for g, _ in pairs], [v for _, v in pairs])
        return original(pairs, *args, **kwargs)

    object.__setattr__(optimizer, "apply_gradients", apply_gradients)
    return lambda: object.__delattr__(optimizer, "apply_gradients")


# ------------------------------------------- where fit starts (exact_resume)
class _StartAt:
    """What tf_keras's ``fit`` asks ``model._training_state`` (as its own
    ``BackupAndRestore`` leaves there) for the epoch and step to start at."""

    def __init__(self, epoch, step):
        self.epoch, self.step = epoch, step

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode):
        del steps_per_epoch, initial_epoch, mode
        return self.epoch, self.step


def resume_fit_at(model, epoch, step):
    """Makes the next ``fit`` start at ``step`` of ``epoch`` (tf_keras's
    ``fit`` counts its steps from there): returns False."""
    _check_no_other_start(model)
    model._training_state = _StartAt(epoch, step)  # pylint: disable=protected-access
    return False


def forget_resume(model):
    """Once ``fit`` has read it. Refuses tf_keras's own ``BackupAndRestore``
    in the same ``fit`` (it would set the start too)."""
    _check_no_other_start(model)
    model._training_state = None  # pylint: disable=protected-access


def _check_no_other_start(model):
    state = getattr(model, "_training_state", None)
    if state is not None and not isinstance(state, _StartAt):
        raise ValueError(
            "ExactBackupAndRestore cannot run with tf_keras's BackupAndRestore in the "
            "same fit (both set where fit starts); use one of them.")


def steps_per_execution(model):
    value = getattr(model, "_steps_per_execution", None)
    return 1 if value is None else int(value.numpy())


# Last: the registration of this flavour's classes that its Keras's import
# asked for while this module was still running (see `_registration.register`).
_registration.host_ready(FLAVOUR)


def layer_call_kwargs(layer):
    """See `HOST_FUNCTIONS` (tf_keras keeps them on each node's ``call_kwargs``)."""
    return [dict(getattr(node, "call_kwargs", None) or {})
            for node in getattr(layer, "_inbound_nodes", None) or []]
