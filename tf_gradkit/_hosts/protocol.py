"""The host protocol: every hook an algorithm, a callback or a gradient tool
may call on a Keras flavour, declared once, with its contract.

A host module (`keras3.py`, `tf_keras.py`) subclasses the classes below and
implements each hook that raises ``NotImplementedError`` here (in the manner
of Keras 3's ``_backend_*`` hooks); a hook with a body here is the same for
every flavour (it goes through ``KERAS``, the flavour's Keras module, whose
``saving``, ``optimizers``, ``constraints`` and ``utils`` functions are the
same in both, or reads a member both Keras flavours name alike) and a host
overrides it only where its Keras differs. Nothing outside ``_hosts/`` reads
a private member of Keras or TensorFlow: it calls one of these hooks
(`tests/test_host_contract.py` checks both).

The parts:

- `OptimizerHost` (every tf_gradkit optimizer): the Keras base (``_init_base``,
  ``_check_backend``), state variables (``_new_variable``, ``_tf_variable``,
  ``_path``, ``_variable_key``, ``_variable_index``, ``_built_variables``,
  ``_strategy``, ``_untracked``), other optimizers' slots and averages
  (``_slots_of``, ``_index_in``, ``_ema_average``, ``_ema_momentum``,
  ``_update_happened``, ``_preserves_zeros``), the model's loss terms
  (``_loss_terms``, ``_extra_losses``, ``_report``, ``_unpack``), saving
  (``_serialize``, ``_deserialize_*``, ``_registered``, ``_saved_function``,
  ``_load_function``) and loading (``_note_loading``, ``_model_loaded_for``,
  ``_restore_after_load``).
- `WrapperHost`: a wrapper's ``iterations``, ``learning_rate``, build order and
  entry points (Keras's ``build``, ``variables``, ``apply_gradients``), which
  call the algorithm's ``_apply_grads(grads, variables, aggregated,
  **options)``; and ``_inner_apply``, ``_inner_loss_scale``, ``_is_built``.
- `StateHost`: ``build`` for an optimizer with its own state (``_build_own``).
- `SlotHost`: ``build``, ``update_step`` and slots (``_new_slot``, ``_assign``,
  ``_read``, ``_learning_rate_config``) for a per-variable optimizer
  (``_prepare``, ``_build_slots``, ``_update_one``).
- `HOST_FUNCTIONS`: what a host module gives tools that hold a model, a layer
  or an optimizer rather than being one (layer kinds, gradient watching,
  where fit starts, a dispatcher's map); the host serving an object is
  `tf_gradkit._hosts.host_of(obj)`.
"""

import inspect
import os
import sys
import weakref
from typing import Any, NamedTuple, Optional


class LossTerm(NamedTuple):
    """One compiled loss of a model, as its flavour's Keras reduces it.

    Attributes:
      name: the output's name, for messages.
      reduction: ``"mean"`` (divided by its elements, or by the unmasked
        ones under a Keras mask), ``"weighted_mean"`` (divided by the sum of
        its sample weights: Keras 3's ``"mean_with_sample_weight"``),
        ``"sum"`` (divided by nothing), or None when it cannot be known.
      mask: the Keras mask the loss applies (``"mean"``), or None.
      weights: the sample weights it divides by (``"weighted_mean"``, mask
        merged in as Keras merges it), or None.
      unknown: why the denominator cannot be known (``reduction`` None).
    """

    name: str
    reduction: Optional[str]
    mask: Any = None
    weights: Any = None
    unknown: Optional[str] = None


class OutputLoss(NamedTuple):
    """One output's compiled loss, matched to the output as the flavour's
    Keras matches it (by name, by position or by the outputs' structure).

    Attributes:
      name: the output's name, for messages.
      loss: the Keras ``Loss`` object the compiled loss calls.
      weight: its ``loss_weights`` entry (a float), or None.
      reduction: as `LossTerm.reduction` (``"mean"``, ``"sum"``,
        ``"weighted_mean"``), or None when it is another.
      select: ``select(y, y_pred, sample_weight) -> (y_true, y_pred,
        sample_weight)`` of this output for a batch (the model's whole
        output and targets in, this output's out), so that a step can run
        the model again and find the output there.
    """

    name: str
    loss: Any
    weight: Any
    reduction: Optional[str]
    select: Any


def traced_values(call, y_true, y_pred):
    """``(rank, masked)`` of ``call(y_true, y_pred)``'s result (a loss's
    per-element values): its rank, and whether it carries a Keras mask of
    its own (``ignore_class``), traced in a scratch graph where nothing runs;
    None when it cannot be traced there."""
    import tensorflow as tf  # noqa: PLC0415

    if not (tf.is_tensor(y_true) and tf.is_tensor(y_pred)):
        return None
    try:
        with tf.Graph().as_default():
            y_t = tf.compat.v1.placeholder(y_true.dtype, y_true.shape)
            y_p = tf.compat.v1.placeholder(y_pred.dtype, y_pred.shape)
            values = call(y_t, y_p)
            return (tf.convert_to_tensor(values).shape.rank,
                    getattr(values, "_keras_mask", None) is not None)
    except Exception:  # noqa: BLE001 - a loss that only runs eagerly, say
        return None


# Keras optimizers whose update leaves an entry with a zero gradient and a
# zero state (slots) exactly zero (SGD's momentum, Adam's moments over an
# epsilon, decoupled weight decay of a zero weight, ...): checked one by one.
# Not Muon (it orthogonalises the momentum matrix) nor ScheduleFreeAdamW (it
# interpolates between sequences).
_ZERO_PRESERVING = ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad",
                    "Adadelta", "Ftrl", "Lion", "Lamb", "Adafactor", "LossScaleOptimizer",
                    "MultiOptimizer")


class OptimizerHost:
    """The flavour-free part of every host (see the module doc)."""

    FLAVOUR = None             # "keras3", "tf_keras"
    KERAS = None               # the flavour's Keras module
    MODEL_KIND = None          # for errors: "keras.Model (Keras 3)"
    OPTIMIZER_KIND = None      # for errors: "Keras 3 (keras.optimizers.Optimizer)"
    WRAPS_LOSS_SCALE = True    # whether a wrapper may hold a LossScaleOptimizer
    # Whether a depthwise convolution names its kernel `kernel`, like a
    # convolution: then only the layer (its kind) tells them apart.
    DEPTHWISE_NAMED_KERNEL = False
    # The classes an algorithm checks against, set from ``KERAS`` below.
    _OPTIMIZER = _LOSS_SCALE = _CALLBACK = _DEFAULT_MODEL = _SGD = None
    _ZERO_PRESERVING = ()

    def __init_subclass__(cls, **kwargs):
        # The classes an algorithm checks against, from the flavour's Keras.
        super().__init_subclass__(**kwargs)
        keras = cls.KERAS
        if keras is not None and "KERAS" in vars(cls):
            cls._OPTIMIZER = keras.optimizers.Optimizer
            cls._LOSS_SCALE = keras.mixed_precision.LossScaleOptimizer
            cls._CALLBACK = keras.callbacks.Callback
            cls._DEFAULT_MODEL = keras.Model
            cls._SGD = keras.optimizers.SGD
            cls._ZERO_PRESERVING = tuple(
                getattr(keras.optimizers, name) for name in _ZERO_PRESERVING
                if hasattr(keras.optimizers, name))

    # The functions of the flavour's Keras that deserialise a model's
    # optimizer while loading a saved model: name -> (the local holding the
    # model, the local holding a SavedModel directory or None).
    _LOADERS = {}

    @staticmethod
    def _describe(obj):
        return f"{type(obj).__module__}.{type(obj).__name__}"

    # ------------------------------------------ the Keras base, state variables
    def _init_base(self, name, learning_rate=None, **kwargs):
        """Initialises the flavour's Keras ``Optimizer`` base (then `_note_loading`)."""
        raise NotImplementedError

    def _new_variable(self, shape, dtype, name, initial=0.0, sync="none", reference=None):
        """A non-trainable ``tf.Variable`` tracked (saved) by this optimizer;
        ``sync``: "none", "sum" or "first" across replicas; ``reference``:
        the model variable it belongs to (named after it)."""
        raise NotImplementedError

    @staticmethod
    def _tf_variable(variable):
        """The ``tf.Variable`` behind a model or optimizer variable."""
        raise NotImplementedError

    @staticmethod
    def _path(variable):
        """A variable's path (Keras 3) or name (tf_keras), for names and matching."""
        raise NotImplementedError

    def _variable_key(self, variable):
        """The key this optimizer files ``variable``'s state under (Keras's
        own key, the same for a variable and its distributed copies)."""
        return self._var_key(variable)  # pylint: disable=protected-access

    def _variable_index(self, variable):
        """``variable``'s index among the variables this optimizer was built with."""
        raise NotImplementedError

    @staticmethod
    def _index_in(owner, variable):
        """``variable``'s index among the variables ``owner`` was built with."""
        raise NotImplementedError

    def _built_variables(self):
        """The model variables this optimizer was built with, in order."""
        return list(self._trainable_variables)  # pylint: disable=protected-access

    def _strategy(self):
        """The ``tf.distribute`` strategy this optimizer was made under."""
        return self._distribution_strategy  # pylint: disable=protected-access

    def _untracked(self, value):
        """``value`` kept as an attribute without being tracked (saved)."""
        return self._no_dependency(value)  # pylint: disable=protected-access

    def _forget_own_variables(self):
        """Drops the variables the Keras base made for this optimizer (one
        whose ``variables`` are its inner optimizer's only)."""
        self._variables = []  # pylint: disable=protected-access

    @staticmethod
    def _filter_empty(grads, variables):
        """The flavour's own warning (and error) for None gradients."""
        raise NotImplementedError

    # ------------------------------------------- other optimizers, the model
    @classmethod
    def _slots_of(cls, optimizer, var_list):
        """Maps each weight's `_variable_key` to its per-entry slots in
        ``optimizer``'s chain (as ``tf.Variable``s)."""
        raise NotImplementedError

    @staticmethod
    def _ema_momentum(owner):
        """The momentum ``owner``'s EMA (``use_ema``) used in the step just made."""
        raise NotImplementedError

    @staticmethod
    def _report(model, x, y, y_pred, sample_weight):
        """The logs the flavour's train step would give for this batch."""
        raise NotImplementedError

    @classmethod
    def _loss_terms(cls, model, y, y_pred, sample_weight):
        """Each loss ``compile`` gave ``model``, as a `LossTerm` for this batch."""
        raise NotImplementedError

    @staticmethod
    def _extra_losses(model):
        """``(all, data_dependent)``: how many losses ``model`` adds to the
        compiled ones, and how many of them depend on the batch."""
        raise NotImplementedError

    @classmethod
    def _output_losses(cls, model, y, y_pred):
        """Each compiled loss of ``model`` as an `OutputLoss`, matched to
        ``y_pred``'s outputs as the flavour's compiled loss matches them
        (``loss_weights`` by output name where Keras takes them by name);
        None when no loss was compiled."""
        raise NotImplementedError

    @classmethod
    def _given_losses(cls, model):
        """``[(output name, Loss object)]``: the losses ``compile`` was given,
        resolved as Keras resolves a name or function, before any batch (a
        fit checks them there, outside any graph). The names are the
        ``loss`` dict's keys, else ``model.output_names`` by position."""
        loss = getattr(model, "loss", None)
        names = list(getattr(model, "output_names", None) or [])
        if isinstance(loss, dict):
            pairs = list(loss.items())
        elif isinstance(loss, (list, tuple)):
            pairs = [(names[i] if i < len(names) else str(i), item)
                     for i, item in enumerate(loss)]
        elif loss is None:
            return []
        else:
            pairs = [(", ".join(names) or "output", loss)]
        resolved = []
        for name, item in pairs:
            if item is None:
                continue
            if not isinstance(item, cls.KERAS.losses.Loss):
                try:
                    item = cls.KERAS.losses.get(item)
                except (ValueError, TypeError):
                    pass
            resolved.append((name, item))
        return resolved

    @classmethod
    def _keras_loss_function(cls, loss):
        """The name of the flavour's own loss function that ``loss`` is or
        wraps (``mean_squared_error`` for ``"mse"``, ``MeanSquaredError()``
        and the function alike), else None (a loss of the user's own, even
        one named like Keras's)."""
        fn = getattr(loss, "fn", loss)
        name = getattr(fn, "__name__", None)
        if name is None or getattr(cls.KERAS.losses, name, None) is not fn:
            return None
        return name

    # ------------------------------------------------------ after a load
    @classmethod
    def _loading(cls):
        """``(model, saved_model_dir)`` while the flavour's Keras loads a
        saved model and deserialises its optimizer (this constructor's
        caller), else ``(None, None)``. Read from the loader's frame: Keras
        tells an optimizer nothing of the model it is loaded for, and a
        loaded optimizer belongs to exactly that model."""
        root = os.path.dirname(cls.KERAS.__file__) + os.sep
        # Kept here, in the hosts, on purpose: neither Keras passes the
        # model to the optimizer it deserialises, and the alternatives
        # (wrapping each flavour's loader functions, or asking users to
        # call `attach` after every load) would patch Keras globally or
        # break `load_model` alone. Each host names its loaders (`_LOADERS`).
        frame = sys._getframe(1)  # pylint: disable=protected-access
        while frame is not None:
            code = frame.f_code
            names = cls._LOADERS.get(code.co_name)
            if names is not None and code.co_filename.startswith(root):
                local = frame.f_locals
                model = local.get(names[0])
                if model is not None and cls._is_model(model):
                    directory = local.get(names[1]) if names[1] else None
                    return model, None if directory is None else os.fspath(directory)
            frame = frame.f_back
        return None, None

    def _note_loading(self):
        model, directory = self._loading()
        self._loaded_for = None if model is None else weakref.ref(model)
        self._saved_model_dir = directory

    def _model_loaded_for(self):
        """The model this optimizer was loaded with (None if it was made)."""
        ref = getattr(self, "_loaded_for", None)
        return None if ref is None else ref()

    def _restore_after_load(self):
        """Restores, once built, the state of the optimizers from this one
        down that the SavedModel directory it was loaded from holds (tf_keras
        reads a SavedModel's weights back but not its optimizer's). Left to
        an optimizer above this one that was loaded too: it restores all."""
        from tf_gradkit import _optimizer_tree  # noqa: PLC0415

        model = self._model_loaded_for()
        directory = getattr(self, "_saved_model_dir", None)
        if model is None or directory is None:
            return
        path = _optimizer_tree.path_to(getattr(model, "optimizer", None), self)
        if path is None or any(getattr(o, "_saved_model_dir", None) for o in path[:-1]):
            return
        import tensorflow as tf  # noqa: PLC0415

        # The checkpoint's objects from the model down to this optimizer.
        node = self
        for parent, child in reversed(list(zip([model] + path[:-1], path))):
            name = next(n for n, c in parent._trackable_children().items()  # noqa: SLF001
                        if c is child)
            node = tf.train.Checkpoint(**{name: node})
        with tf.init_scope():
            node.restore(os.path.join(directory, "variables", "variables")).expect_partial()
        for optimizer in _optimizer_tree.optimizer_chain(self):
            if getattr(optimizer, "_saved_model_dir", None):
                optimizer._saved_model_dir = None  # pylint: disable=protected-access

    def _check_backend(self):
        """Raises unless Keras runs on TensorFlow (Keras 3 may not)."""

    @classmethod
    def _is_model(cls, model):
        return isinstance(model, cls._DEFAULT_MODEL)

    @classmethod
    def _is_loss_scale(cls, optimizer):
        return isinstance(optimizer, cls._LOSS_SCALE)

    @classmethod
    def _preserves_zeros(cls, optimizer):
        """Whether ``optimizer``'s own update leaves an entry with a zero
        gradient and zero slots at zero: tf_gradkit's optimizers say so
        (``PRESERVES_ZEROS``), Keras's are listed above (exactly those
        classes); anything else is assumed not to."""
        declared = getattr(type(optimizer), "PRESERVES_ZEROS", None)
        if declared is not None:
            return declared
        return type(optimizer) in cls._ZERO_PRESERVING  # a subclass may update otherwise

    @classmethod
    def _unpack(cls, data):
        return cls.KERAS.utils.unpack_x_y_sample_weight(data)

    @classmethod
    def _path_below_model(cls, variable):
        return cls._path(variable)

    # ------------------------------------------------------- a model's loss
    @classmethod
    def _overrides_compute_loss(cls, model):
        """Whether ``model``'s class replaced the flavour's ``compute_loss``."""
        return type(model).compute_loss is not cls._DEFAULT_MODEL.compute_loss

    @classmethod
    def _term(cls, name, loss, y_true, y_pred, reduction, mask, sample_weight=None):
        """A `LossTerm` for a Keras ``Loss`` object called as the flavour's
        ``Loss.__call__`` calls it, or an unknown one when it reduces its own
        way (its ``__call__`` overridden, a reduction that keeps every value,
        or one value for the whole batch). ``mask``: the prediction's Keras
        mask; a mask the loss's values carry (``ignore_class``) is merged in
        as Keras merges it."""
        import tensorflow as tf  # noqa: PLC0415

        if type(loss).__call__ is not cls.KERAS.losses.Loss.__call__:
            return LossTerm(name, None, unknown=(
                f"the loss of output {name!r} ({type(loss).__name__}) overrides "
                "`__call__`, so how it reduces is its own"))
        if reduction is None:
            return LossTerm(name, None, unknown=(
                f"the loss of output {name!r} has reduction "
                f"{getattr(loss, 'reduction', None)!r}"))
        y_true, y_pred = cls._loss_inputs(loss, y_true, y_pred)
        rank, masked = traced_values(loss.call, y_true, y_pred) or (None, False)
        if rank == 0:
            return LossTerm(name, None, unknown=(
                f"the loss of output {name!r} returns one value for the whole batch, "
                "so what it averages over is its own"))
        if masked:  # only its mask is used: the values' ops are pruned in a graph
            own = loss.call(y_true, y_pred)._keras_mask  # pylint: disable=protected-access
            mask = own if mask is None else tf.logical_and(tf.cast(mask, tf.bool),
                                                           tf.cast(own, tf.bool))
        if reduction == "weighted_mean":
            return LossTerm(name, reduction,
                            weights=cls._divisor_weights(loss, sample_weight, mask))
        return LossTerm(name, reduction, mask=mask if reduction == "mean" else None)

    @staticmethod
    def _loss_inputs(loss, y_true, y_pred):
        """What the flavour's ``Loss.__call__`` hands ``loss.call``."""
        del loss
        return y_true, y_pred

    @staticmethod
    def _divisor_weights(loss, sample_weight, mask):
        """The sample weights a ``"weighted_mean"`` loss divides by; only a
        host whose `_loss_terms` gives that reduction (Keras 3) has them."""
        raise NotImplementedError

    # -------------------------------------------------------- serialisation
    @classmethod
    def _serialize(cls, obj):
        return cls.KERAS.saving.serialize_keras_object(obj)

    @classmethod
    def _deserialize_optimizer(cls, config, custom_objects=None):
        # Legacy deserialisation (tf_keras's HDF5 and SavedModel loaders)
        # looks a nested optimizer up by its bare class name: give it ours.
        registered = config.get("registered_name") if isinstance(config, dict) else None
        found = cls._registered(registered) if registered else None
        if found is not None:
            custom_objects = {config["class_name"]: found, **(custom_objects or {})}
        return cls.KERAS.optimizers.deserialize(config, custom_objects=custom_objects)

    @classmethod
    def _deserialize_constraint(cls, config, custom_objects=None):
        return cls.KERAS.constraints.deserialize(config, custom_objects=custom_objects)

    @classmethod
    def _deserialize_function(cls, config, custom_objects=None):
        return cls.KERAS.saving.deserialize_keras_object(config,
                                                         custom_objects=custom_objects)

    @classmethod
    def _registered(cls, name):
        return cls.KERAS.saving.get_registered_object(name)

    def _saved_function(self, fn):
        """``{"fn": ...}`` for a function that can be saved by name, ``{}``
        for a lambda or an unregistered closure or local function (or one its
        module does not hold under its name).

        A registered function (``keras.saving.register_keras_serializable``,
        wherever it is defined) is saved as Keras saves it, under
        ``package>name`` on every Keras version (tf_keras <= 2.18 and Keras
        <= 3.6 write the bare name there, which another package may share). For any other function defined at a module's top
        level (or in a class body) Keras would write only its bare name (under
        the module ``"builtins"`` or, in tf_keras's HDF5 and SavedModel
        files, alone); we write its module and qualified name, so that it
        loads back (`_load_function`)."""
        if not inspect.isfunction(fn) or fn.__name__ == "<lambda>":
            return {}
        registered = self.KERAS.saving.get_registered_name(fn)
        if ">" in registered:
            saved = self._serialize(fn)
            if isinstance(saved, dict):  # tf_keras <= 2.18, Keras <= 3.6: bare name
                saved = dict(saved, config=registered, registered_name=registered)
            return {"fn": saved}
        qualname = fn.__qualname__
        if ("<" in qualname or fn.__closure__ is not None
                or _imported_function(fn.__module__, qualname) is not fn):
            return {}
        return {"fn": {"module": fn.__module__, "class_name": "function",
                       "config": qualname, "registered_name": None}}

    @classmethod
    def _load_function(cls, saved, custom_objects):
        """The function `_saved_function` saved, looked up in
        ``custom_objects``, then among the registered functions (as
        ``package>name``, under ``config`` or, beside the bare name that
        tf_keras <= 2.18 and Keras <= 3.6 wrote there, ``registered_name``;
        then by that bare name alone), then as its module's
        top-level function when that module is imported; else Keras's own
        lookup (its built-in functions; tf_keras also imports the module a
        file names, Keras 3 does not).

        We never import a module a saved file names (a file could name any
        module): a function saved by module comes back when its module has
        been imported, as Keras needs a registered class's module imported."""
        if isinstance(saved, str):  # tf_keras's legacy form (HDF5, SavedModel)
            name, module = saved, None
        elif (isinstance(saved, dict) and saved.get("class_name") == "function"
              and isinstance(saved.get("config"), str)):
            name, module = saved["config"], saved.get("module")
        else:
            return cls._deserialize_function(saved, custom_objects=custom_objects)
        fn = (custom_objects or {}).get(name) or cls._registered(name)
        registered = saved.get("registered_name") if isinstance(saved, dict) else None
        if fn is None and isinstance(registered, str) and ">" in registered:
            fn = cls._registered(registered)  # a bare "config" beside it (tf_keras <= 2.18)
        if fn is None and module and module != "builtins":
            fn = _imported_function(module, name)
        if fn is None and ">" not in name:
            fn = cls._registered_bare_name(name, custom_objects)
        if fn is not None:
            return fn
        try:
            return cls._deserialize_function(saved, custom_objects=custom_objects)
        except (TypeError, ValueError, AttributeError) as error:
            raise ValueError(_missing_function(name, module)) from error

    @classmethod
    def _registered_bare_name(cls, name, custom_objects):
        """The function registered as ``<package>>name`` (what a bare name
        saved by tf_keras <= 2.18 or Keras <= 3.6 means), if only one is."""
        known = dict(cls.KERAS.saving.get_custom_objects(), **(custom_objects or {}))
        found = {key: obj for key, obj in known.items()
                 if key.endswith(">" + name) and callable(obj)}
        if len(found) > 1:
            raise ValueError(
                f"A function saved by its bare name {name!r} (how tf_keras <= 2.18 "
                f"and Keras <= 3.6 save a registered function) matches several "
                f"registered functions: {sorted(found)}. Pass the one it is as "
                f"custom_objects={{{name!r}: fn}}.")
        return next(iter(found.values()), None)

    # ------------------------------------------------------ other optimizers
    @classmethod
    def _ema_average(cls, owner, variable):
        """``owner``'s moving average of ``variable`` (``use_ema``), or None."""
        averages = getattr(owner, "_model_variables_moving_average", None)
        if not averages:
            return None
        return averages[cls._index_in(owner, variable)]

    @staticmethod
    def _update_happened(optimizer):
        """Whether the call just made to ``optimizer`` updated, when it may
        not have (Keras 3's ``gradient_accumulation_steps``); else None."""
        del optimizer


class WrapperHost(OptimizerHost):
    """The flavour-free part of a wrapper's host."""

    @property
    def iterations(self):
        """The inner optimizer's updates (schedules and logs see those)."""
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, variable):  # tf_keras assigns it
        self.inner_optimizer.iterations = variable

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def finalize_variable_values(self, var_list):
        self._finalize(var_list)

    def _inner_apply(self, grads, variables, aggregated=False):
        """Hands ``grads`` to the inner optimizer once (``aggregated``: already
        summed over replicas)."""
        raise NotImplementedError

    def _inner_loss_scale(self):
        """What the inner chain multiplies the loss by (1.0 without a scale)."""
        raise NotImplementedError

    def _is_built(self):
        """Whether this wrapper has built its state."""
        raise NotImplementedError

    def _note_loss_scale_outside(self):
        """Called when a loss-scale optimizer is put around this wrapper
        (tf_keras tells the optimizer it wraps); nothing to do by default."""


class StateHost(OptimizerHost):
    """The flavour-free part of the host of an optimizer with its own state
    (the flavour's ``build`` calls the algorithm's ``_build_own``)."""


class SlotHost(OptimizerHost):
    """The flavour-free part of the host of a per-variable optimizer (the
    flavour's ``build`` calls ``_prepare`` and ``_build_slots``, its
    ``update_step`` ``_update_one``)."""

    def _new_slot(self, reference, shape, initial, name):
        """A slot variable of ``reference`` (saved with the optimizer)."""
        raise NotImplementedError

    def _assign(self, variable, value):
        """Assigns ``value`` to a slot the way the flavour's update does."""
        raise NotImplementedError

    @staticmethod
    def _read(slot):
        """A slot's ``tf.Variable`` (or value) for the core."""
        raise NotImplementedError

    def _learning_rate_config(self):
        """The learning rate's entry of ``get_config`` ({} where Keras saves it)."""
        raise NotImplementedError


def _imported_function(module_name, qualname):
    """The plain function ``module_name.qualname`` if that module is
    imported, else None."""
    obj = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if (inspect.isfunction(obj) and obj.__module__ == module_name
            and obj.__qualname__ == qualname):
        return obj
    return None


def _missing_function(name, module):
    """What to do when a saved function is not found here."""
    if module and module != "builtins":
        where = (f"define `{name}` again in the script (module __main__) that loads"
                 if module == "__main__" else f"`import {module}` before loading")
        return (
            f"This optimizer was saved with the function `{module}.{name}`, which "
            f"is not here: {where} (tf_gradkit never imports a module a saved "
            "file names), or register the function with "
            "`keras.saving.register_keras_serializable()` before saving, or pass "
            f"custom_objects={{{name!r}: fn}} to load_model (or from_config).")
    return (
        f"This optimizer was saved with the function {name!r}, which is not "
        "registered here: register it with `keras.saving.register_keras_serializable()` "
        "(import the module that does) before loading, or pass "
        f"custom_objects={{{name!r}: fn}} to load_model (or from_config).")


def constraint_class(set_class, keras, module_name, check_backend):
    """A flavour's Keras constraint made from a `core.sets` set class,
    registered as ``tf_gradkit>Name``; ``check_backend(owner)`` runs when one
    is constructed."""

    def __new__(cls, *args, **kwargs):
        del args, kwargs
        check_backend(cls.__name__)
        return object.__new__(cls)

    cls = type(set_class.__name__, (set_class, keras.constraints.Constraint), {
        "__new__": __new__,
        "__call__": lambda self, w: self.project(w),
        "__doc__": set_class.__doc__,
        "__module__": module_name,
        "get_config": set_class.get_config,
        "from_config": classmethod(lambda cls, config: cls(**config)),
    })
    return keras.saving.register_keras_serializable(package="tf_gradkit")(cls)


def layer_kinds(layers):
    """kind -> classes of a flavour's ``layers`` module that
    `tf_gradkit.gradients` has a per-example rule for (or refuses).
    "excluded" are subclasses of those classes whose math differs
    (transposed, depthwise and separable convolutions). "depthwise": the
    layers whose kernels pruning leaves alone (tfmot's registry prunes none
    of their weights; Keras 3 names such a kernel ``kernel``)."""
    return {
        "depthwise": tuple(getattr(layers, name) for name in
                           ("DepthwiseConv1D", "DepthwiseConv2D") if hasattr(layers, name)),
        "dense": (layers.Dense,),
        "conv": (layers.Conv1D, layers.Conv2D),
        "excluded": (layers.Conv1DTranspose, layers.Conv2DTranspose,
                     layers.DepthwiseConv2D, layers.SeparableConv1D,
                     layers.SeparableConv2D),
        "embedding": (layers.Embedding,),
        "layer_norm": (layers.LayerNormalization,),
        "batch_norm": (layers.BatchNormalization,),
        # Layers without weights whose output for an example depends on that
        # example alone (LM's tapped Jacobian needs every layer so).
        "per_example": tuple(getattr(layers, name) for name in PER_EXAMPLE_LAYERS
                             if hasattr(layers, name)),
    }


# ------------------------------------------------------- host module names
# A host module's attributes: its name, its Keras's Optimizer base, how a
# class registers with its Keras, the members its Keras sets only on
# optimizer instances (which the host classes may override).
HOST_ATTRIBUTES = ("FLAVOUR", "Optimizer", "register", "KERAS_INSTANCE_ATTRIBUTES")

# ------------------------------------------------------------ host functions
# What a host module gives the tools that hold a model, a layer or an
# optimizer rather than being one, each with its contract. A host module
# defines every one of them (`tests/test_host_contract.py`); the functions
# below are the same for both flavours (Keras names those members alike)
# and hosts take them from here.
HOST_FUNCTIONS = {
    "serves": "serves(obj) -> bool: whether obj (model, layer, optimizer, "
              "variable, loss, callback) belongs to this flavour's Keras",
    "check_backend": "check_backend(owner): raises unless this Keras runs on TensorFlow",
    "constraint_class": "constraint_class(set_class): the Keras constraint of a core.sets set",
    "layer_kinds": "layer_kinds(): kind -> this flavour's layer classes the gradient tools know",
    "pruning_layers": "pruning_layers(model) -> list: model's layers that keep pruning masks "
                      "of their own (tfmot's PruneLowMagnitude), in order; [] where none can",
    "pruning_masks": "pruning_masks(layers) -> [(weight, mask)]: the masks those layers hold "
                     "now (none before a layer is built)",
    "watch_applied_gradients": "watch_applied_gradients(optimizer, record) -> unwatch: "
                               "record(grads, variables) sees every gradient it applies",
    "resume_fit_at": "resume_fit_at(model, epoch, step) -> bool: the next fit starts "
                     "there (True: at that epoch's first step)",
    "forget_resume": "forget_resume(model): a later fit starts where it is told",
    "steps_per_execution": "steps_per_execution(model) -> int",
    "optimizer_map": "optimizer_map(optimizer): a dispatcher's (MultiOptimizer's) "
                     "map of variable groups to optimizers, or None",
    "built_variables": "built_variables(optimizer): the variables it was built with",
    "is_built": "is_built(optimizer) -> bool",
    "compiled_loss_weights": "compiled_loss_weights(model): compile's loss_weights or None",
    "loss_fn_kwargs": "loss_fn_kwargs(loss) -> dict: the keyword arguments a "
                      "function-wrapping Keras loss passes its function",
    "is_variable": "is_variable(obj) -> bool: a model variable (or tf.Variable)",
    "dataset_graph": "dataset_graph(dataset) -> GraphDef bytes tensor of a tf.data pipeline",
    "layer_call_kwargs": "layer_call_kwargs(layer) -> [dict]: the keyword arguments "
                         "(e.g. training=True) of each call of layer in a functional model",
}


def optimizer_map(optimizer):
    """See `HOST_FUNCTIONS` (Keras 3.15's ``MultiOptimizer`` keeps it privately)."""
    return getattr(optimizer, "_optimizer_map", None)


def built_variables(optimizer):
    """See `HOST_FUNCTIONS`."""
    return list(getattr(optimizer, "_trainable_variables", None) or [])


def is_built(optimizer):
    """See `HOST_FUNCTIONS` (tf_keras keeps ``_built``, Keras 3 ``built``)."""
    return bool(getattr(optimizer, "built", False) or getattr(optimizer, "_built", False))


def compiled_loss_weights(model):
    """See `HOST_FUNCTIONS` (both flavours keep it in ``_compile_config``)."""
    config = getattr(getattr(model, "_compile_config", None), "config", None) or {}
    return config.get("loss_weights")


def loss_fn_kwargs(loss):
    """See `HOST_FUNCTIONS` (``LossFunctionWrapper._fn_kwargs`` in both)."""
    return getattr(loss, "_fn_kwargs", None) or getattr(loss, "fn_kwargs", None) or {}


def is_variable(obj):
    """See `HOST_FUNCTIONS`: anything with TensorFlow's variable identity."""
    return hasattr(obj, "_unique_id") and hasattr(obj, "assign")


def dataset_graph(dataset):
    """See `HOST_FUNCTIONS` (tf.data keeps the serialised graph privately)."""
    return dataset._as_serialized_graph()  # pylint: disable=protected-access

PER_EXAMPLE_LAYERS = (
    "InputLayer", "Activation", "Dropout", "AlphaDropout", "GaussianDropout",
    "GaussianNoise", "SpatialDropout1D", "SpatialDropout2D", "Flatten", "Reshape",
    "Permute", "RepeatVector", "Identity", "ReLU", "LeakyReLU", "ELU", "Softmax",
    "Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum", "Concatenate",
    "ZeroPadding1D", "ZeroPadding2D", "Cropping1D", "Cropping2D", "UpSampling1D",
    "UpSampling2D", "MaxPooling1D", "MaxPooling2D", "AveragePooling1D",
    "AveragePooling2D", "GlobalAveragePooling1D", "GlobalAveragePooling2D",
    "GlobalMaxPooling1D", "GlobalMaxPooling2D", "Rescaling")
