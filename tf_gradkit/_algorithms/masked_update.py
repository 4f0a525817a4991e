"""What every wrapper that updates through pruning masks shares, written once.

`MaskAware` (explicit masks, or tfmot's in tf_keras) and `MagnitudePruning`
(its own masks), both flavours, make every update go through the current mask
``M`` of each pruned weight ``w``::

    g <- g * M;  inner update;  w <- w * M;  s <- s * M

for each per-entry slot ``s`` of ``w`` in the inner optimizers (Adam's
moments, momentum, EMA averages: the host's ``_slots_of`` finds them), only
when the inner optimizer really updated (its ``iterations`` moved), so after
every step the pruned entries of the weights and of their optimizer state
are exactly zero. Under ``tf.distribute`` the writes go through one
``merge_call``. A subclass says where the masks come from (``_table``) and
may change them after an update (``_after_update``).
"""

import tensorflow as tf

from tf_gradkit._algorithms.wrapper import Wrapper, no_gradients_error


def mask_gradient(grad, mask):
    """``grad * mask`` for a dense gradient or ``tf.IndexedSlices``."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        rows = tf.gather(tf.cast(mask, grad.values.dtype), grad.indices)
        return tf.IndexedSlices(grad.values * rows, grad.indices, grad.dense_shape)
    return grad * tf.cast(mask, grad.dtype)


def _multiply_in_place(variable, mask):
    value = variable.read_value()
    return variable.assign(value * tf.cast(mask, value.dtype), read_value=False)


class MaskedUpdate(Wrapper):
    """The flavour-free masked update (see the module doc)."""

    # Masks go around any update, LM's (over the support) and windows' too.
    WRAPS_RESIDUAL_OPTIMIZERS = True
    WRAPS_ACCUMULATORS = True
    # Masks gradients every call and weights when an update happened.
    WRAPS_KERAS_ACCUMULATION = True
    provides_masks = True
    _targets = ()
    # Whether weights and slots must be masked after every update: the masks
    # can change under this optimizer (tfmot's layers change them). A
    # subclass that changes them itself (`_after_update`, masking everything
    # then) may skip the other updates when `_only_at_changes()`.
    MASK_SLOTS_EVERY_UPDATE = True

    def _only_at_changes(self):
        """Masking only when the masks change is exact when every optimizer
        below keeps an entry with a zero gradient and zero state at zero:
        the masked gradients then keep pruned weights and slots at zero."""
        from tf_gradkit._optimizer_tree import optimizer_chain  # noqa: PLC0415
        return not self.MASK_SLOTS_EVERY_UPDATE and all(
            self._preserves_zeros(o) for o in optimizer_chain(self.inner_optimizer))

    def _table(self):
        """``{var_key: (variable, mask)}`` of the masked weights."""
        raise NotImplementedError

    def _after_update(self, distribution, updated):
        """Called in cross-replica context before the weights are masked;
        ``updated``: whether a real update just happened (a boolean tensor
        or Python bool). A schedule recomputes its masks here (and masks the
        slots, `_mask_slots`, when they change)."""
        del distribution, updated

    def _mask_slots(self, distribution):
        """``s <- s * M`` for every slot of every masked weight."""
        for _, mask, slots in self._targets:
            for slot in slots:
                distribution.extended.update(slot, _multiply_in_place, args=(mask,),
                                             group=False)

    def _build_targets(self, var_list):
        """``(variable, mask, slots)`` of each masked weight of ``var_list``."""
        table = self._table()
        slots = self._slots_of(self.inner_optimizer, var_list)
        self._targets = self._untracked([
            (self._tf_variable(table[key][0]), table[key][1], slots[key])
            for key in (self._variable_key(v) for v in var_list) if key in table])

    def _finalize(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)
        self.mask_state()

    # ----------------------------------------------------------------- update
    def _apply_grads(self, grads, variables, aggregated=False):
        if all(grad is None for grad in grads):
            raise no_gradients_error(variables)
        table = self._table()
        masked = []
        for grad, variable in zip(grads, variables):
            entry = table.get(self._variable_key(variable))
            masked.append(grad if entry is None else mask_gradient(grad, entry[1]))
        before = tf.identity(self.iterations)
        self._inner_apply(masked, variables, aggregated)
        self._mask_state_if(tf.not_equal(self.iterations, before))

    def _mask_state_if(self, updated):
        """Masks weights and slots, if the inner optimizer really updated."""
        if tf.distribute.has_strategy() or self._only_at_changes():
            # Only at changes: `_after_update`'s one conditional decides (no
            # nested conditional: one slows a compiled step, as measured in
            # docs/gradient_accumulation.md).
            # merge calls cannot sit in a tf.cond branch; masking again is
            # idempotent, and `_after_update` gates itself on `updated`.
            self.mask_state(updated)
        elif tf.executing_eagerly():
            if bool(updated):
                self.mask_state(True)
        else:
            def apply():
                self.mask_state(True)
                return tf.constant(True)
            tf.cond(updated, apply, lambda: tf.constant(False))

    def mask_state(self, updated=False):
        """``w <- w * M`` and ``s <- s * M`` for every masked weight and slot.

        Done by ``apply_gradients`` after each real update; call it yourself
        after changing masks outside training, or after ``minimize`` of an
        optimizer that bypasses ``apply_gradients`` (everything is masked
        then). ``updated``: whether a real update just happened (masks due
        then are recomputed first).
        """
        if not self._targets:
            return

        def mask_all(distribution, updated):
            if isinstance(updated, tf.distribute.DistributedValues):  # the same on all
                updated = distribution.experimental_local_results(updated)[0]
            self._after_update(distribution, updated)
            if updated is False or not self._only_at_changes():  # or called by hand
                for variable, mask, _ in self._targets:
                    distribution.extended.update(variable, _multiply_in_place,
                                                 args=(mask,), group=False)
                self._mask_slots(distribution)

        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            tf.distribute.get_replica_context().merge_call(mask_all, args=(updated,))
        elif tf.distribute.has_strategy():
            mask_all(tf.distribute.get_strategy(), updated)
        else:
            # e.g. `finalize_variable_values` at the end of `fit`, outside the
            # scope of the strategy the optimizer was created under.
            with self._strategy().scope():
                mask_all(self._strategy(), updated)

    def minimize(self, loss, var_list, tape=None):
        """As the inner optimizer's; for optimizers that need residuals (like
        LevenbergMarquardt), calls the inner ``minimize`` then masks."""
        if not getattr(self.inner_optimizer, "needs_residuals", False):
            return super().minimize(loss, var_list, tape=tape)
        var_list = list(var_list() if callable(var_list) else var_list)
        with tf.init_scope():
            self.build(var_list)
        result = self.inner_optimizer.minimize(loss, var_list)
        self.mask_state(True)
        return result

    @property
    def needs_residuals(self):
        return getattr(self.inner_optimizer, "needs_residuals", False)
