"""What a micro-batch's loss divides by, read from the model under ``fit``.

A loss that averages divides a sum by a count: Keras divides by the
examples (or elements) of the batch, by the unmasked tokens under a Keras
mask, by the sum of the sample weights (Keras 3's
``"mean_with_sample_weight"``), or by nothing (``reduction="sum"``). With
micro-batch t's sum ``S_t`` and count ``D_t``, its gradient is
``g_t = grad S_t / D_t + grad R`` (``R``: weight regularizers, the same in
every micro-batch of a window), and the big batch's is
``grad (S_1 + ... + S_k) / (D_1 + ... + D_k) + grad R``. So a window equals
the big batch exactly when each micro-batch is weighted by its own count:

    sum_t D_t g_t / sum_t D_t.

Averaging the micro-batches' own means instead (weights 1, or the examples
when the loss averages over tokens) is the 2024 gradient-accumulation bug:
a short-sequence micro-batch's tokens then count for more than a long one's.
A ``"sum"`` loss needs ``sum_t g_t``: weight 1 per micro-batch and a
window count of 1.

`denominator` reads this from the flavour's compiled losses (the host's
``_loss_terms``); it returns the count, refuses what no single weight per
micro-batch can make exact, and says when the count cannot be known.
"""

from typing import NamedTuple

import tensorflow as tf


class Denominator(NamedTuple):
    """``count``: what this micro-batch's loss divides by (a float32
    scalar, up to a factor that is the same for every micro-batch); ``summed``:
    the loss divides by nothing, so the window sums its micro-batches."""

    count: tf.Tensor
    summed: bool


class UnknownDenominator(Exception):
    """The loss's denominator cannot be read; ``str(error)`` says why."""


def _source(term):
    """What a term's count is: ``("examples",)``, ``("mask", m)``,
    ``("weights", w)`` or ``("sum",)`` (tensors compared by identity)."""
    if term.reduction == "sum":
        return ("sum",)
    if term.reduction == "mean" and term.mask is not None:
        return ("mask", term.mask)
    if term.reduction == "weighted_mean" and term.weights is not None:
        return ("weights", term.weights)
    # Divided by its elements: the batch times the output's other
    # dimensions, which every micro-batch shares (fixed-length outputs).
    return ("examples",)


def _describe(source):
    return {"examples": "its examples (or elements)", "mask": "its unmasked tokens",
            "weights": "the sum of its sample weights",
            "sum": "nothing (reduction='sum')"}[source[0]]


def _same(a, b):
    return a[0] == b[0] and (len(a) == 1 or a[1] is b[1])


def denominator(terms, batch_size, extra_losses, owner):
    """The `Denominator` of this micro-batch's loss.

    Args:
      terms: the host's ``_loss_terms`` (one `LossTerm` per compiled loss).
      batch_size: the micro-batch's examples (a scalar tensor).
      extra_losses: the host's ``_extra_losses(model)``: ``(all,
        data_dependent)`` losses the model adds to the compiled ones.
      owner: the optimizer's name, for messages.

    Raises:
      UnknownDenominator: a loss's count cannot be read.
      ValueError: the counts are known, but no weight per micro-batch makes
        the window exact (outputs dividing by different counts; a summed
        loss beside added losses; a count other than the examples beside
        losses that average over examples).
    """
    unknown = [t.unknown for t in terms if t.reduction is None]
    if unknown:
        raise UnknownDenominator("; ".join(unknown))
    if not terms:
        raise UnknownDenominator("no compiled loss reached this batch")
    sources = [_source(t) for t in terms]
    first = sources[0]
    for term, source in zip(terms[1:], sources[1:]):
        if not _same(first, source):
            raise ValueError(
                f"{owner}: the losses of outputs {terms[0].name!r} and {term.name!r} "
                f"divide by different counts ({_describe(first)}; {_describe(source)}), "
                "so no one weight per micro-batch makes a window equal the big batch. "
                "Give every output's loss the same denominator (the same mask, or "
                "reduction='sum' for all, scaled with loss_weights), or pass "
                "sample_count=fn (fn(x, y, sample_weight) -> the count to weigh each "
                "micro-batch by), or reduction='microbatch' to weigh micro-batches "
                "equally (not the big batch).")
    total, data_dependent = extra_losses
    if first[0] == "sum":
        if total:
            raise ValueError(
                f"{owner}: the compiled loss is a sum (reduction='sum'), which a window "
                f"sums over its micro-batches, but the model adds {total} more loss(es) "
                "(regularizers, add_loss) that the big batch counts once, not once per "
                "micro-batch. Use an averaging loss (the default reduction), or "
                "reduction='sum' on this optimizer in a custom loop that adds the "
                "regularizers once per window.")
        return Denominator(tf.constant(1.0, tf.float32), True)
    if first[0] != "examples" and data_dependent:
        raise ValueError(
            f"{owner}: the compiled loss divides by {_describe(first)}, but the model "
            f"adds {data_dependent} loss(es) that depend on the batch (add_loss, "
            "activity regularizers) and average over examples: no one weight per "
            "micro-batch makes both equal the big batch. Fold them into the compiled "
            "loss, or pass sample_count=fn to choose the weight yourself.")
    if first[0] == "mask":
        count = tf.reduce_sum(tf.cast(first[1], tf.float32))
    elif first[0] == "weights":
        count = tf.reduce_sum(tf.cast(first[1], tf.float32))
    else:
        count = tf.cast(batch_size, tf.float32)
    return Denominator(count, False)
