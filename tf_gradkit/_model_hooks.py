"""One installer for every optimizer that needs its model's training methods.

Three optimizers reach into the model they are handed (``model=`` or
``attach(model)``): `LevenbergMarquardt` takes over ``train_step`` (it needs
residuals, not gradients), `GradientAccumulator` reads each batch's size in
``train_step`` and ends windows at epoch end through ``fit``, and
`AugmentedLagrangian` adds output-constraint terms in ``compute_loss`` and its
metrics to the logs. All of them go through one `ModelBinding` per model
instance (never its class), which keeps these promises:

- **One owner at a time.** The methods act for the optimizers that are in
  the model's *current* optimizer chain (``model.optimizer`` and its
  ``inner_optimizer``s), decided each time a step is traced. Constructing
  another optimizer with the same model, or binding one that is not
  compiled, changes nothing for the one that trains.
- **Removed on recompile.** ``model.compile`` is wrapped too: when the new
  optimizer chain holds none of the bound optimizers, the model's own
  ``train_step``, ``compute_loss`` and ``fit`` are put back (compiling with a
  bound optimizer again puts the hooks back). Between binding and the next
  compile the hooks are in place but act for no one unless a bound
  optimizer is the model's.
- **A model's own train_step is never skipped silently.** An optimizer that
  replaces the step (LM) refuses, at binding, a model whose class overrides
  ``train_step``; optimizers that only wrap it (accumulation, Lagrangian)
  call it.

Each bound optimizer provides what it needs, all optional:
``_wrap_train_step(step, model) -> step`` (``step(data) -> logs``),
``_wrap_loss(loss, arguments) -> loss`` (the bound arguments of
``compute_loss``, called while its train step runs), ``_on_fit_start(model)``
(eagerly, before ``fit`` starts) and ``_on_epoch_end()``.
"""

import functools
import inspect
import weakref

from tf_gradkit._optimizer_tree import _groups_unknown, check_groups, optimizer_chain

_HOOKED = ("train_step", "compute_loss", "fit")


class ModelBinding:
    """The hooks of one model instance; see the module docstring."""

    _ATTR = "_tf_gradkit_binding"

    def __init__(self, model, callback_base):
        self._model_ref = weakref.ref(model)
        self._bound = []            # weak references to bound optimizers
        self._callback_base = callback_base
        self._hooked = False
        self._step_wrappers = []    # wrap(step, model) -> step, not optimizers'
        # Per replica, what the train step being traced knows (its batch, the
        # batch size, values bound optimizers record while its loss is
        # computed): keyed by replica id, not thread, because a
        # LossScaleOptimizer outside runs the inner update through
        # `call_for_each_replica` from a merge_call, on threads other than
        # the train step's.
        self._steps = {}

    # ------------------------------------------------------------ binding
    @classmethod
    def bind(cls, model, optimizer, callback_base):
        """Binds ``optimizer`` to ``model`` (installing the binding once)."""
        binding = model.__dict__.get(cls._ATTR)
        if binding is None:
            binding = cls(model, callback_base)
            object.__setattr__(model, cls._ATTR, binding)
            binding._wrap_compile(model)
        if all(ref() is not optimizer for ref in binding._bound):
            binding._bound.append(weakref.ref(optimizer))
        # Installed now, not at the next compile: in
        # `model.compile(optimizer=LevenbergMarquardt(model))` Python looks up
        # `model.compile` before the optimizer binds. The hooks act only for
        # optimizers in the model's chain when a step is traced.
        if not binding._hooked:
            binding._install(model)
        return binding

    @classmethod
    def of(cls, model):
        return model.__dict__.get(cls._ATTR)

    @classmethod
    def wrap_step(cls, model, wrap, callback_base):
        """Puts ``wrap(step, model) -> step`` around ``model``'s train step
        (outermost) until the returned function is called; the next train
        function is traced with it (and, once removed, without it)."""
        binding = model.__dict__.get(cls._ATTR)
        if binding is None:
            binding = cls(model, callback_base)
            object.__setattr__(model, cls._ATTR, binding)
            binding._wrap_compile(model)
        binding._step_wrappers.append(wrap)
        if binding._hooked:
            _forget_train_function(model)
        else:
            binding._install(model)

        def remove():
            if any(w is wrap for w in binding._step_wrappers):
                binding._step_wrappers = [w for w in binding._step_wrappers
                                          if w is not wrap]
                binding.refresh()
                _forget_train_function(model)

        return remove

    def active(self):
        """Bound optimizers in the model's current chain, outermost first."""
        model = self._model_ref()
        if model is None:
            return []
        bound = [ref() for ref in self._bound]
        return [opt for opt in optimizer_chain(getattr(model, "optimizer", None))
                if any(opt is b for b in bound if b is not None)]

    def refresh(self):
        """After a compile: keeps the hooks while a bound optimizer is the
        model's (or in its chain), removes them otherwise."""
        model = self._model_ref()
        if model is None:
            return
        # A MultiOptimizer given a function knows its optimizers only once
        # it is built (the first fit): until then it may hold a bound one.
        pending = any(_groups_unknown(o) for o in
                      optimizer_chain(getattr(model, "optimizer", None)))
        keep = pending or bool(self.active()) or bool(self._step_wrappers)
        if keep and not self._hooked:
            self._install(model)
        elif not keep and self._hooked:
            for name in _HOOKED:
                model.__dict__.pop(name, None)
            self._hooked = False
            _forget_train_function(model)

    @property
    def model(self):
        return self._model_ref()

    def step_value(self, name):
        """What the train step being traced on this replica recorded under
        ``name`` (None outside a train step, or when nothing was recorded):
        ``"batch_size"`` and ``"data"`` always, ``"loss_arguments"`` (the
        bound arguments of ``compute_loss``) once the loss is computed."""
        return (self._steps.get(_replica_key()) or {}).get(name)

    def record(self, name, value):
        """Records ``value`` for the rest of this replica's train step."""
        step = self._steps.get(_replica_key())
        if step is not None:
            step[name] = value

    @property
    def batch_size(self):
        """The batch size of the train step being traced on this replica."""
        return self.step_value("batch_size")

    # -------------------------------------------------------------- hooks
    def _wrap_compile(self, model):
        original = model.compile
        binding = self

        @functools.wraps(original)
        def compile(*args, **kwargs):  # noqa: A001 - the method it wraps
            result = original(*args, **kwargs)
            binding.refresh()
            return result

        object.__setattr__(model, "compile", compile)

    def _install(self, model):
        binding = self
        # The class's methods (or whatever the instance held before us).
        train_step, compute_loss, fit = (getattr(model, n) for n in _HOOKED)
        loss_signature = inspect.signature(compute_loss)

        @functools.wraps(train_step)
        def hooked_train_step(data):
            _build_dispatchers(model)
            step = train_step
            for optimizer in reversed(binding.active()):
                wrap = getattr(optimizer, "_wrap_train_step", None)
                if wrap is not None:
                    step = wrap(step, model)
            for wrap in binding._step_wrappers:
                step = wrap(step, model)
            key = _replica_key()
            previous = binding._steps.get(key)
            binding._steps[key] = {"batch_size": _batch_size(data), "data": data}
            try:
                return step(data)
            finally:
                binding._steps[key] = previous

        @functools.wraps(compute_loss)
        def hooked_compute_loss(*args, **kwargs):
            loss = compute_loss(*args, **kwargs)
            if binding.batch_size is None:  # not inside our train step
                return loss
            arguments = loss_signature.bind(*args, **kwargs).arguments
            binding.record("loss_arguments", arguments)
            for optimizer in binding.active():
                wrap = getattr(optimizer, "_wrap_loss", None)
                if wrap is not None:
                    loss = wrap(loss, arguments)
            return loss

        def end_epoch():
            for optimizer in binding.active():
                hook = getattr(optimizer, "_on_epoch_end", None)
                if hook is not None:
                    hook()

        class _EpochEnd(self._callback_base):
            """Tells the bound optimizers that an epoch's data has ended.
            Put first in ``fit``'s callbacks, so that every other callback's
            ``on_epoch_end`` (checkpoints, backups) sees the epoch's last
            update; its hooks run again harmlessly after validation did."""

            def on_epoch_end(self, epoch, logs=None):
                del epoch, logs
                end_epoch()

        def evaluate_in_fit(evaluate):
            """``fit`` validates after an epoch's data and before the
            callbacks' ``on_epoch_end``: the epoch ends first, so that the
            validation logs describe the weights the epoch ends with."""

            @functools.wraps(evaluate)
            def hooked_evaluate(*args, **kwargs):
                if kwargs.get("_use_cached_eval_dataset"):  # fit's own validation
                    end_epoch()
                return evaluate(*args, **kwargs)

            return hooked_evaluate

        @functools.wraps(fit)
        def hooked_fit(*args, **kwargs):
            _build_dispatchers(model)
            for optimizer in binding.active():
                start = getattr(optimizer, "_on_fit_start", None)
                if start is not None:
                    start(model)
            args = list(args)
            if len(args) > 5:  # fit(x, y, batch_size, epochs, verbose, callbacks)
                args[5] = [_EpochEnd()] + list(args[5] or [])
            else:
                kwargs["callbacks"] = [_EpochEnd()] + list(kwargs.get("callbacks") or [])
            own_evaluate = model.__dict__.get("evaluate")
            object.__setattr__(model, "evaluate", evaluate_in_fit(model.evaluate))
            try:
                return fit(*args, **kwargs)
            finally:
                if own_evaluate is None:
                    model.__dict__.pop("evaluate", None)
                else:
                    object.__setattr__(model, "evaluate", own_evaluate)

        hooked_train_step._tf_gradkit = True  # ours, not a user's override
        object.__setattr__(model, "train_step", hooked_train_step)
        object.__setattr__(model, "compute_loss", hooked_compute_loss)
        object.__setattr__(model, "fit", hooked_fit)
        self._hooked = True
        _forget_train_function(model)


def _build_dispatchers(model):
    """Builds the model's optimizer now, as its first update would, when a
    MultiOptimizer in it has not yet asked its function which optimizer
    takes each variable: the bound optimizers among them act from the start
    of the step (the loss they read, the step LM replaces)."""
    root = getattr(model, "optimizer", None)
    if any(_groups_unknown(o) for o in optimizer_chain(root)):
        import tensorflow as tf  # noqa: PLC0415

        with tf.init_scope():
            root.build(model.trainable_variables)
    check_groups(root)


def _forget_train_function(model):
    """Keras 3 binds ``train_step`` when it makes its train function (the
    first ``fit`` after a compile), so one made before the hooks changed is
    dropped; the next ``fit`` makes a new one."""
    if getattr(model, "train_function", None) is not None:
        model.train_function = None


def _replica_key():
    import tensorflow as tf  # noqa: PLC0415

    context = tf.distribute.get_replica_context()
    if context is None:
        return "cross-replica"
    return int(tf.get_static_value(context.replica_id_in_sync_group))


def _batch_size(data):
    import tensorflow as tf  # noqa: PLC0415 - keep this module import-light

    first = tf.nest.flatten(data)[0]
    return tf.shape(first)[0]


def bind_after_load(optimizer, bound):
    """Binds an optimizer made by ``from_config`` to the model its Keras is
    loading it for (the host's ``_note_loading``), when it was bound when
    saved: a loaded optimizer belongs to exactly that model, so ``fit``
    needs no ``tf_gradkit.attach(model)`` first. Returns whether it bound;
    where it cannot (``from_config`` called by hand, a model LM cannot take
    over), ``attach`` stays the way and the optimizer says so when it
    trains."""
    model = optimizer._model_loaded_for()  # pylint: disable=protected-access
    if model is None or not bound:
        return False
    try:
        optimizer.attach(model)
    except (TypeError, ValueError):
        return False
    return True


def check_model(optimizer, model):
    """Raises unless ``model`` is a model of ``optimizer``'s Keras flavour."""
    if not optimizer._is_model(model):  # pylint: disable=protected-access
        raise TypeError(f"{type(optimizer).__name__}: `model` must be a "
                        f"{optimizer.MODEL_KIND}. Received: "
                        f"model={type(model).__module__}.{type(model).__name__}")


def overrides_train_step(model, default_model_class):
    """True when ``model``'s class (or instance, by someone else) replaced the
    flavour's ``Model.train_step``."""
    own = model.__dict__.get("train_step")
    if own is not None and not getattr(own, "_tf_gradkit", False):
        return True
    return getattr(type(model), "train_step") is not getattr(default_model_class,
                                                             "train_step")
