"""What every tf_gradkit optimizer wrapper shares, written once.

`GradientAccumulator`, `Projected`, `AugmentedLagrangian` and
`pruning.MaskAware` take an optimizer and return one (STYLE.md, point 3). The
flavour's host (`tf_gradkit._hosts`) gives them ``iterations``, ``variables``,
the build order and the ``apply`` entry points; this base gives them the
inner optimizer, its serialisation, the errors for bad arguments, and the
composition rule: each wrapper says which inner optimizers it can wrap
exactly (the ability flags below and its ``REFUSALS``), and `check_inner`
refuses the others at construction, naming both classes and what to write
instead, so no composition runs silently wrong.
"""

from tf_gradkit import _hosts
from tf_gradkit._model_hooks import check_model
from tf_gradkit._optimizer_tree import optimizer_chain


WRAPPER_ADVICE = ("Set learning rate, clipping, weight decay and EMA on the inner "
                  "optimizer.")


def unexpected_arguments(owner, kwargs, accepted, advice=WRAPPER_ADVICE):
    """The one wording of every tf_gradkit class's unknown-argument error."""
    return TypeError(f"{owner}: unexpected arguments {sorted(kwargs)}; accepted are "
                     f"{accepted}. {advice}".strip())


def no_gradients_error(variables):
    """Keras's error for an update with no gradient at all (both flavours
    raise ``ValueError("No gradients provided for any variable...")``)."""
    names = [getattr(v, "path", None) or v.name for v in variables]
    return ValueError(f"No gradients provided for any variable: {names}.")


def _forwarded(attribute):
    """A setting of Keras's base optimizer that a wrapper's own step never
    reads (clipping): read from and written to the inner optimizer, which
    applies it, so ``wrapper.clipnorm = 1.0`` is not silently ignored."""

    def get(self):
        inner = vars(self).get("inner_optimizer")
        return None if inner is None else getattr(inner, attribute)

    def set_(self, value):
        inner = vars(self).get("inner_optimizer")
        if inner is not None:
            setattr(inner, attribute, value)
        elif value is not None:  # Keras's base __init__ sets None, before the inner exists
            raise unexpected_arguments(type(self).__name__, {attribute: value},
                                       self.ACCEPTED)

    return property(get, set_, doc=f"The inner optimizer's ``{attribute}``.")


class Wrapper:
    """The flavour-independent half of every wrapper (see the module doc)."""

    # The constructor argument of a wrapper that accumulates micro-batches
    # itself (GradientAccumulator's ``steps``), or None.
    accumulation_argument = None
    clipnorm = _forwarded("clipnorm")
    clipvalue = _forwarded("clipvalue")
    global_clipnorm = _forwarded("global_clipnorm")

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Excludes variables from the inner optimizer's weight decay (the
        wrapper decays nothing itself); before the first step, as Keras."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list,
                                                       var_names=var_names)

    def set_weights(self, weights):
        """Sets own and inner variables, in ``variables`` order (what HDF5
        loading calls; Keras's own sets only ``_variables``, which would
        leave the inner optimizer's state as it was)."""
        if not self._is_built():
            raise ValueError(
                f"You are calling `set_weights()` on {type(self).__name__} before it "
                "is built. Call `optimizer.build(trainable_variables)` first.")
        variables, weights = list(self.variables), list(weights)
        if len(weights) != len(variables) or any(
                tuple(v.shape) != tuple(w.shape) for v, w in zip(variables, weights)):
            raise ValueError(
                f"{type(self).__name__}.set_weights: got values of shapes "
                f"{[tuple(w.shape) for w in weights]} for optimizer variables of "
                f"shapes {[tuple(v.shape) for v in variables]}.")
        for variable, weight in zip(variables, weights):
            variable.assign(weight)

    def _warn_missing_gradients(self, grads, variables):
        """Keras's warning for the variables given a None gradient (the
        flavour's own wording), when some but not all are None."""
        if any(g is None for g in grads) and not all(g is None for g in grads):
            self._filter_empty(list(grads), list(variables))

    # Abilities, overridden per wrapper class:
    WRAPS_RESIDUAL_OPTIMIZERS = False  # LM: steps from residuals, not gradients
    WRAPS_ACCUMULATORS = False         # an inner GradientAccumulator
    WRAPS_KERAS_ACCUMULATION = False   # inner gradient_accumulation_steps
    REFUSALS = {}                      # reason -> advice
    ACCEPTED = "optimizer, name"       # the constructor's arguments, for errors
    # Whether this wrapper's own step leaves an entry with a zero gradient at
    # zero (masks between changes rely on it: `masked_update`); an
    # AugmentedLagrangian adds gradient terms of its own, so it does not.
    PRESERVES_ZEROS = True

    def _init_wrapper(self, optimizer, name, kwargs):
        """Checks the backend, the arguments and the inner optimizer, then
        initialises the host's base optimizer. Nothing is built yet."""
        owner = type(self).__name__
        self._check_backend()
        if kwargs:
            raise unexpected_arguments(owner, kwargs, self.ACCEPTED)
        if not isinstance(optimizer, (self._OPTIMIZER, self._LOSS_SCALE)):
            other = _hosts.host_of(optimizer)
            advice = ("" if other is None else f" For an optimizer of the other flavour use "
                      f"tf_gradkit.{other.FLAVOUR}.{owner}.")
            raise TypeError(
                f"{owner} (tf_gradkit.{self.FLAVOUR}) wraps a {self.OPTIMIZER_KIND} "
                f"optimizer. Received: optimizer={self._describe(optimizer)}.{advice}")
        self.check_inner(optimizer)
        self._init_base(name)
        self.inner_optimizer = optimizer

    def _check_model(self, model):
        check_model(self, model)

    def check_inner(self, optimizer):
        """Refuses an inner optimizer (chain) this wrapper cannot wrap exactly."""
        me = type(self).__name__
        for inner in optimizer_chain(optimizer):
            them = type(inner).__name__
            if type(inner) is type(self):
                reason = "same"
                why = f"{me} inside {me} applies the wrapper twice, one layer at a time"
            elif getattr(type(inner), "needs_residuals", False) is True and \
                    not self.WRAPS_RESIDUAL_OPTIMIZERS:
                reason = "residuals"
                why = (f"{them} takes its step from residuals and the Jacobian of the "
                       "whole batch (minimize(residual_fn, vars) or its own fit step), "
                       f"never from gradients, so what {me} does to gradients would be "
                       "ignored")
            elif getattr(type(inner), "accumulates_gradients", False) is True and \
                    not self.WRAPS_ACCUMULATORS:
                reason = "accumulator"
                why = (f"{them} updates only once per window, but {me} would act on "
                       "every micro-batch")
            elif (getattr(inner, "gradient_accumulation_steps", None) or 0) > 1 \
                    and not self.WRAPS_KERAS_ACCUMULATION:
                steps = inner.gradient_accumulation_steps
                reason = "keras_accumulation"
                why = (f"{them}(gradient_accumulation_steps={steps}) updates only every "
                       f"{steps} calls, but {me} would act on every call")
            elif getattr(type(inner), "provides_masks", False) and \
                    getattr(type(self), "provides_masks", False):
                reason = "masks"
                why = (f"both keep pruning masks, and {me} would mask with its own "
                       f"while {them} masks with others")
            elif self._is_loss_scale(inner) and not self._wraps_loss_scale():
                reason = "loss_scale"
                why = self._loss_scale_reason(them)
            else:
                continue
            advice = self.REFUSALS.get(reason, "")
            raise TypeError(f"{me} cannot wrap {them}: {why}. {advice}".strip())

    def _wraps_loss_scale(self):
        return self.WRAPS_LOSS_SCALE

    def _loss_scale_reason(self, them):
        return (f"under a mixed_float16 policy Keras 3's compile wraps this "
                f"{type(self).__name__} in another {them}, and the gradients would be "
                "unscaled twice (updates 1/scale too small)")

    def _build_own(self, var_list):
        """The wrapper's own state, after the inner optimizer is built."""
        del var_list

    def _finalize(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def _inner_config(self):
        return self._serialize(self.inner_optimizer)

    @classmethod
    def _inner_from_config(cls, config, custom_objects=None):
        """Pops and rebuilds the nested inner optimizer of ``config``."""
        return cls._deserialize_optimizer(config.pop("optimizer"),
                                          custom_objects=custom_objects)


def _refused_after_construction(attribute, advice):
    """A setting of Keras's base optimizer that the wrapper does not apply
    itself (weight decay, EMA: the inner optimizer applies them at the real
    update; Keras 3's ``gradient_accumulation_steps``: the wrapper's update
    does not accumulate). The wrapper keeps what Keras's base ``__init__``
    sets (its defaults); setting another value on the wrapper afterwards is
    refused, naming what to do instead (it used to be ignored without a
    word). ``advice(wrapper, value)`` is that sentence."""
    slot = f"_base_{attribute}"

    def get(self):
        return vars(self).get(slot)

    def set_(self, value):
        if vars(self).get("inner_optimizer") is None or value == vars(self).get(slot):
            vars(self)[slot] = value  # Keras's base __init__, or no change
            return
        raise ValueError(
            f"{type(self).__name__}: `{attribute}` set on the wrapper would change "
            f"nothing. Received: {attribute}={value!r}. "
            + advice(self, value))

    return property(get, set_, doc=f"Keras's default ``{attribute}`` (refused when "
                                   "set: see the error for where it belongs).")


def _inner_advice(attribute):
    def advice(wrapper, value):
        del wrapper
        return (f"It is applied by the inner optimizer at the real update: set it "
                f"there, `optimizer.inner_optimizer.{attribute} = {value!r}`, or pass "
                "it to the inner optimizer's constructor (EMA settings: before its "
                "first step).")
    return advice


def _accumulation_advice(wrapper, value):
    name = type(wrapper).__name__
    if wrapper.accumulation_argument:  # a wrapper that accumulates itself
        return f"Pass `{wrapper.accumulation_argument}={value!r}` to {name}'s constructor."
    return (f"The wrapper's update does not accumulate: wrap it, "
            f"`GradientAccumulator({name}(...), steps={value!r})`, or pass "
            "`gradient_accumulation_steps` to the inner optimizer's constructor "
            "(Keras 3).")


# Set on the class here, at the end of the module (they need the functions above).
for _attribute in ("weight_decay", "use_ema", "ema_momentum", "ema_overwrite_frequency"):
    setattr(Wrapper, _attribute,
            _refused_after_construction(_attribute, _inner_advice(_attribute)))
Wrapper.gradient_accumulation_steps = _refused_after_construction(
    "gradient_accumulation_steps", _accumulation_advice)
del _attribute
