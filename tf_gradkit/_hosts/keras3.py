"""The Keras 3 host: what Keras 3 does differently (see `protocol`).

Every difference between Keras 3 and tf_keras lives in this module and its
sibling `tf_keras.py`. Keras 3's ways: ``keras.Variable`` wrapping a
``tf.Variable`` (the core gets the ``tf.Variable``), ``variable.path``,
``apply(grads, variables)`` beside ``apply_gradients``, ``build`` once, its
own ``LossScaleOptimizer`` that compile adds around any optimizer under a
``mixed_float16`` policy, and backends other than TensorFlow (refused).
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from tf_gradkit import _optimizer_tree, _registration
from tf_gradkit._hosts import protocol
# Host functions both flavours share (see `protocol.HOST_FUNCTIONS`).
from tf_gradkit._hosts.protocol import (  # noqa: F401
    built_variables, compiled_loss_weights, dataset_graph, is_built, loss_fn_kwargs,
    optimizer_map)

FLAVOUR = "keras3"
Optimizer = keras.optimizers.Optimizer
register = keras.saving.register_keras_serializable
_SYNC = {"sum": ("on_read", "sum"), "first": ("on_read", "only_first_replica"),
         "none": ("auto", "none")}


# Members of this Keras's optimizers that exist only on instances: Keras 3's Optimizer sets these in ``__init__``; the wrapper host
# overrides them as properties.
KERAS_INSTANCE_ATTRIBUTES = ("loss_scale_factor", "built")


def serves(obj):
    """Whether ``obj`` belongs to keras (a layer or model, optimizer,
    variable, loss or callback of it)."""
    return isinstance(obj, (keras.layers.Layer, keras.optimizers.Optimizer, keras.Variable, keras.losses.Loss, keras.callbacks.Callback))


def check_backend(owner):
    """Raises unless Keras 3 runs on TensorFlow (one clear error)."""
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise RuntimeError(
            f"{owner} needs Keras's TensorFlow backend; this process runs Keras "
            f"on {backend!r}. Set the environment variable KERAS_BACKEND="
            "tensorflow before Keras is imported (or \"backend\": "
            "\"tensorflow\" in ~/.keras/keras.json).")


class OptimizerHost(protocol.OptimizerHost):
    FLAVOUR = FLAVOUR
    KERAS = keras
    OPTIMIZER_KIND = "Keras 3 (keras.optimizers.Optimizer)"
    MODEL_KIND = "keras.Model (Keras 3)"
    # Under a mixed_float16 policy compile wraps any optimizer that is not a
    # LossScaleOptimizer in one: a wrapper holding one gets unscaled twice.
    WRAPS_LOSS_SCALE = False
    # keras.layers.DepthwiseConv1D/2D name their kernel `kernel`.
    DEPTHWISE_NAMED_KERNEL = True

    def _check_backend(self):
        check_backend(type(self).__name__)

    # Keras 3 deserialises a loaded model's optimizer in the model's
    # compile_from_config (.keras files).
    _LOADERS = {"compile_from_config": ("self", None)}

    def _init_base(self, name, learning_rate=0.0, **kwargs):
        # name None: Keras's own unique name from the class name
        # ("gradient_accumulator", then "gradient_accumulator_1"), as for Adam.
        Optimizer.__init__(self, learning_rate=learning_rate, name=name, **kwargs)
        self._note_loading()

    def _filter_empty(self, grads, variables):
        """Keras 3's warning (and error) for None gradients."""
        return self._filter_empty_gradients(grads, variables)

    def _new_variable(self, shape, dtype, name, initial=0.0, sync="none",
                      reference=None):
        """A non-trainable ``tf.Variable`` tracked by this optimizer.

        ``sync``: "none" (one value for all replicas), "sum" (per replica,
        summed when read across replicas) or "first" (per replica, read from
        the first). ``reference``: the model variable it belongs to (named
        after it)."""
        if reference is not None:
            name = f"{self._path(reference).replace('/', '_')}_{name}"
        dtype = tf.as_dtype(dtype)
        value = np.broadcast_to(np.asarray(initial, dtype.as_numpy_dtype), tuple(shape))
        synchronization, aggregation = _SYNC[sync]
        scope = (contextlib.nullcontext() if tf.distribute.has_strategy()
                 else self._distribution_strategy.scope())
        with scope:
            var = keras.Variable(initializer=np.array(value), shape=tuple(shape),
                                 dtype=dtype.name, trainable=False, name=name,
                                 synchronization=synchronization,
                                 aggregation=aggregation)
        self._track_variable(var)
        return var.value  # the tf.Variable: the core speaks plain TensorFlow

    @staticmethod
    def _path(variable):
        """A Keras 3 variable's path; a plain ``tf.Variable``'s name."""
        return getattr(variable, "path", None) or variable.name

    @classmethod
    def _path_below_model(cls, variable):
        """The path without the model's name (a rebuilt model may be named
        ``sequential_1``)."""
        path = cls._path(variable)
        return path.split("/", 1)[1] if "/" in path else path

    @staticmethod
    def _tf_variable(variable):
        return variable.value if isinstance(variable, keras.Variable) else variable

    def _variable_index(self, variable):
        return self._get_variable_index(variable)

    @staticmethod
    def _index_in(owner, variable):
        return owner._get_variable_index(variable)

    @staticmethod
    def _report(model, x, y, y_pred, sample_weight):
        """The logs Keras's train step would give for this batch."""
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred,
                                  sample_weight=sample_weight, training=False)
        # Keras 3 divides the loss by the replica count (for gradients); the
        # reported loss is unscaled, as Keras's own train_step does.
        loss = loss * tf.cast(tf.distribute.get_strategy().num_replicas_in_sync,
                              loss.dtype)
        model._loss_tracker.update_state(  # pylint: disable=protected-access
            loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    @classmethod
    def _loss_terms(cls, model, y, y_pred, sample_weight):
        """Each loss ``compile`` gave ``model`` (its ``CompileLoss``), as a
        `protocol.LossTerm` for this batch; one unknown term when the losses
        cannot be matched to the outputs the way Keras matches them."""
        from keras.src import tree  # noqa: PLC0415
        from keras.src.backend import get_keras_mask  # noqa: PLC0415

        flat = getattr(getattr(model, "_compile_loss", None), "_flat_losses", None)
        if not flat:
            return [protocol.LossTerm("loss", None, unknown="no loss was compiled")]
        terms = []
        y = _by_output_name(model._compile_loss.output_names, y, y_pred)
        for path, loss, _, name in flat:
            try:
                y_t, y_p = _resolve(path, y, y_pred)
            except (KeyError, IndexError, TypeError, ValueError):
                return [protocol.LossTerm(name, None, unknown=(
                    "the targets could not be matched to the outputs"))]
            sw = sample_weight
            if sw is not None and tree.is_nested(sw):
                sw = _at(path, sw)
            mask = get_keras_mask(y_p) if tf.is_tensor(y_p) else None
            reduction = {"sum_over_batch_size": "mean", "mean": "mean", "sum": "sum",
                         "mean_with_sample_weight": "weighted_mean"}.get(loss.reduction)
            terms.append(cls._term(name, loss, y_t, y_p, reduction, mask, sw))
        return terms

    @classmethod
    def _output_losses(cls, model, y, y_pred):
        """Keras 3's ``CompileLoss`` after its build (``fit`` builds it
        before the first step): its flat losses, each with its output's path
        and the weight Keras multiplies it by."""
        from keras.src import tree  # noqa: PLC0415

        compile_loss = getattr(model, "_compile_loss", None)
        if compile_loss is None:
            return None
        names = compile_loss.output_names
        if not compile_loss.built:
            compile_loss.build(_by_output_name(names, y, y_pred), y_pred)
        reductions = {"sum_over_batch_size": "mean", "mean": "mean", "sum": "sum",
                      "mean_with_sample_weight": "weighted_mean"}

        def selector(path):
            def select(y, y_pred, sample_weight):
                y_t, y_p = _resolve(path, _by_output_name(names, y, y_pred), y_pred)
                sw = sample_weight
                if sw is not None and tree.is_nested(sw):
                    sw = _at(path, sw)
                return y_t, y_p, sw
            return select

        return [protocol.OutputLoss(name, loss, weight, reductions.get(loss.reduction),
                                    selector(path))
                for path, loss, weight, name in compile_loss._flat_losses]

    @staticmethod
    def _loss_inputs(loss, y_true, y_pred):
        # Keras 3's Loss.__call__ converts both to the loss's dtype first.
        convert = lambda x: keras.ops.convert_to_tensor(x, dtype=loss.dtype)  # noqa: E731
        if not (tf.is_tensor(y_true) and tf.is_tensor(y_pred)):
            return y_true, y_pred
        return convert(y_true), convert(y_pred)

    @staticmethod
    def _divisor_weights(loss, sample_weight, mask):
        """The weights "mean_with_sample_weight" divides by, merged with the
        mask by Keras's own ``apply_mask``."""
        from keras.src.losses import loss as loss_module  # noqa: PLC0415

        dtype = loss.dtype
        return loss_module.apply_mask(
            None if sample_weight is None else tf.cast(sample_weight, dtype),
            None if mask is None else tf.cast(mask, dtype), dtype=dtype,
            reduction=loss.reduction)

    @staticmethod
    def _extra_losses(model):
        """``(all, data_dependent)``: how many losses the model adds to the
        compiled ones (``model.losses``) and how many of them depend on the
        batch (``add_loss``, activity regularizers) rather than on weights."""
        total = len(model.losses)
        weights = sum(1 for v in model.trainable_weights
                      if getattr(v, "regularizer", None) is not None)
        return total, total - weights

    @classmethod
    def _slots_of(cls, optimizer, var_list):
        """Maps each weight's key to its per-entry slots in ``optimizer``'s
        chain (as ``tf.Variable``s).

        Keras 3 names a variable made by ``add_variable_from_reference(v,
        name)`` ``<v.path with / as _>_<name>``, with ``v``'s shape (Adam's
        momentum and velocity, SGD's momentum, EMA averages); the longest
        matching path wins. tf_gradkit's own state (window sums, masks) is
        not a slot: variables of tf_gradkit optimizers are skipped."""
        from tf_gradkit._optimizer_tree import optimizer_chain  # noqa: PLC0415

        ours = {id(cls._tf_variable(v)) for o in optimizer_chain(optimizer)
                if type(o).__module__.startswith("tf_gradkit.")
                for v in o._variables}  # pylint: disable=protected-access
        prefixes = sorted(((cls._path(v).replace("/", "_") + "_", v) for v in var_list),
                          key=lambda pv: -len(pv[0]))
        slots = {optimizer._var_key(v): [] for v in var_list}
        for s in optimizer.variables:
            tf_s = cls._tf_variable(s)
            if id(tf_s) in ours:
                continue
            name = getattr(s, "name", "")
            for prefix, v in prefixes:
                if name.startswith(prefix) and tuple(s.shape) == tuple(v.shape):
                    slots[optimizer._var_key(v)].append(tf_s)
                    break
        return slots

    @staticmethod
    def _ema_momentum(owner):
        # Keras 3 uses momentum 0 on its first step; `iterations` has been
        # incremented by the update that just ran.
        first = tf.equal(tf.cast(owner.iterations, tf.int64), 1)
        return tf.where(first, 0.0, float(owner.ema_momentum))

    @staticmethod
    def _update_happened(optimizer):
        steps = getattr(optimizer, "gradient_accumulation_steps", None)
        if not steps:
            return None
        # `iterations` counts real updates there; the raw counter counts
        # calls: the call just made updated when it reached a multiple.
        calls = optimizer._iterations  # pylint: disable=protected-access
        return tf.equal(tf.math.floormod(calls, steps), 0)


def _at(path, structure):
    for key in path:
        structure = structure[key]
    return structure


def _by_output_name(output_names, y, y_pred):
    """``y`` as Keras 3's ``CompileLoss.call`` reads it for a list of
    outputs: targets given as a dict by output name become a list in the
    outputs' order (plain ``fit`` accepts them so)."""
    if (isinstance(y_pred, (list, tuple)) and isinstance(y, dict) and output_names
            and set(output_names) == set(y)):
        return [y[name] for name in output_names]
    return y


def _resolve(path, y, y_pred):
    """The target and prediction of the output at ``path``, matched as
    Keras 3's ``CompileLoss`` matches them (the same structure, else the
    targets flattened into the predictions' structure)."""
    from keras.src import tree  # noqa: PLC0415

    y_p = _at(path, y_pred)
    if not tree.is_nested(y_pred):
        return y, y_p
    if not tree.is_nested(y):
        y = [y]
    try:
        return _at(path, y), y_p
    except (KeyError, IndexError, TypeError):
        if not isinstance(y, (list, tuple)):
            raise
        return _at(path, tree.pack_sequence_as(y_pred, tree.flatten(y))), y_p


class WrapperHost(protocol.WrapperHost, OptimizerHost):
    """Keras 3 glue of an optimizer that wraps ``inner_optimizer``."""

    def build(self, var_list):
        if self.built:
            return
        var_list = list(var_list)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        # A MultiOptimizer given a function knows its optimizers only now.
        self.check_inner(self.inner_optimizer)
        _optimizer_tree.check_groups(self.inner_optimizer)
        self._build_own(var_list)
        Optimizer.build(self, var_list)

    @property
    def variables(self):
        return self._variables[:] + self.inner_optimizer.variables

    def apply_gradients(self, grads_and_vars, **options):
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables, **options)
        return self.iterations

    def apply(self, grads, trainable_variables=None, **options):
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    f"{type(self).__name__}.apply: pass `trainable_variables` "
                    "on the first call, or call `build(variables)` first.")
            trainable_variables = list(self._trainable_variables)
        trainable_variables = list(trainable_variables)
        if not self.built:
            # Eagerly, as tf_keras builds: state made while a step is traced
            # stays uninitialised if that trace then fails (a refusal).
            with tf.init_scope(), keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        self._apply_grads(list(grads), trainable_variables, aggregated=False, **options)

    def _inner_apply(self, grads, variables, aggregated=False):
        del aggregated  # Keras 3 aggregates in apply_gradients, never in apply
        self.inner_optimizer.apply(grads, variables)

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def _inner_loss_scale(self):
        """What the inner optimizer chain multiplies the loss by and divides
        the gradients by (its static ``loss_scale_factor``s; 1.0 without)."""
        return self.inner_optimizer.scale_loss(1.0)

    @property
    def loss_scale_factor(self):
        """The inner optimizer's: ``scale_loss`` and the unscaling are its."""
        inner = vars(self).get("inner_optimizer")
        return None if inner is None else inner.loss_scale_factor

    @loss_scale_factor.setter
    def loss_scale_factor(self, value):
        inner = vars(self).get("inner_optimizer")
        if inner is not None:
            inner.loss_scale_factor = value
        elif value is not None:  # Keras's base __init__ sets None first
            raise TypeError(f"{type(self).__name__}: set loss_scale_factor on the "
                            f"inner optimizer. Received: loss_scale_factor={value!r}")

    def _is_built(self):
        return self.built


class StateHost(protocol.StateHost, OptimizerHost):
    """Keras 3 glue of an optimizer with state of its own (``_build_own``)."""

    def build(self, var_list):
        if self.built:
            return
        var_list = list(var_list)
        with tf.init_scope():  # whoever builds it (a MultiOptimizer in a trace)
            self._build_own(var_list)
        Optimizer.build(self, var_list)


class SlotHost(protocol.SlotHost, OptimizerHost):
    """Keras 3 glue of a per-variable optimizer (``update_step``)."""

    def build(self, var_list):
        if self.built:
            return
        var_list = list(var_list)
        own = self._prepare(var_list)  # may raise before anything is built
        Optimizer.build(self, var_list)
        self._build_slots(var_list, own)

    def _new_slot(self, reference, shape, initial, name):
        return self.add_variable(
            shape=shape, dtype=reference.dtype,
            initializer=lambda shape, dtype=None: initial,
            name=f"{self._path(reference).replace('/', '_').replace(':', '_')}_{name}")

    def update_step(self, gradient, variable, learning_rate):
        self._update_one(gradient, variable, learning_rate)

    def _assign(self, variable, value):
        self.assign(variable, value)

    @staticmethod
    def _read(slot):
        return slot.value

    def _learning_rate_config(self):
        return {}  # Keras 3's own get_config saves it



def constraint_class(set_class):
    """The keras3 constraint made from a `core.sets` set class."""
    return protocol.constraint_class(set_class, keras, "tf_gradkit.keras3.constraints",
                                     check_backend)


def layer_kinds():
    """This flavour's layer classes the gradient tools know
    (`protocol.layer_kinds`)."""
    kinds = protocol.layer_kinds(keras.layers)
    # Models whose call is their graph of layers (no call of their own).
    from keras.src.models.functional import Functional  # pylint: disable=import-outside-toplevel
    kinds["graph_models"] = (keras.Sequential, Functional)
    return kinds


def pruning_layers(model):
    """None: no Keras 3 layer keeps pruning masks of its own
    (tensorflow-model-optimization prunes tf_keras models only); Keras 3
    masks are `MagnitudePruning`'s or given explicitly to `MaskAware`."""
    del model
    return []


def pruning_masks(layers):
    """None (see `pruning_layers`)."""
    del layers
    return []


def is_variable(obj):
    """A Keras 3 variable (``keras.Variable``) or anything with TensorFlow's
    variable identity (`protocol.is_variable`)."""
    return isinstance(obj, keras.Variable) or protocol.is_variable(obj)


def watch_applied_gradients(optimizer, record):
    """Makes ``record(grads, variables)`` see every gradient ``optimizer``
    applies (Keras 3: its ``apply``, which ``apply_gradients`` and wrappers
    call). Returns the function that removes the watch."""
    original = optimizer.apply

    def apply(grads, trainable_variables=None):
        grads = list(grads)
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(optimizer._trainable_variables))
        record(grads, variables)
        return original(grads, trainable_variables)

    object.__setattr__(optimizer, "apply", apply)
    return lambda: object.__delattr__(optimizer, "apply")


# ------------------------------------------- where fit starts (exact_resume)
def resume_fit_at(model, epoch, step):
    """Makes the next ``fit`` start at ``epoch`` (Keras 3's own
    ``BackupAndRestore`` does the same). Keras 3's ``fit`` has no first step:
    it runs that epoch from its first step, so returns True."""
    del step
    model._initial_epoch = epoch  # pylint: disable=protected-access
    return True


def forget_resume(model):
    """Once ``fit`` has read it: a later ``fit`` starts where it is told."""
    model._initial_epoch = None  # pylint: disable=protected-access


def steps_per_execution(model):
    return int(model.steps_per_execution or 1)


# Last: the registration of this flavour's classes that its Keras's import
# asked for while this module was still running (see `_registration.register`).
_registration.host_ready(FLAVOUR)


def layer_call_kwargs(layer):
    """See `HOST_FUNCTIONS` (Keras 3 keeps them on each node's ``arguments``)."""
    return [dict(getattr(getattr(node, "arguments", None), "kwargs", None) or {})
            for node in getattr(layer, "_inbound_nodes", None) or []]
