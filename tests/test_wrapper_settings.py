"""Inner-optimizer settings set on a wrapper after construction (weight decay,
EMA): the wrapper applies none of them itself, so setting one is refused,
naming the attribute and where to set it (it used to change nothing, without
a word). Set on the inner optimizer, they act exactly as on the optimizer
alone."""

import numpy as np
import pytest

SETTINGS = {"weight_decay": 0.5, "use_ema": True, "ema_momentum": 0.5,
            "ema_overwrite_frequency": 1}


def _wrappers(K, gk):
    return {
        "GradientAccumulator": lambda inner: gk.GradientAccumulator(
            inner, steps=1, reduction="microbatch"),
        "Projected": lambda inner: gk.Projected(inner, {".": gk.constraints.Box(-1e6, 1e6)}),
    }


@pytest.mark.parametrize("wrapper", ["GradientAccumulator", "Projected"])
@pytest.mark.parametrize("attribute", sorted(SETTINGS))
def test_setting_an_inner_setting_on_a_wrapper_is_refused(K, gk, wrapper, attribute):
    opt = _wrappers(K, gk)[wrapper](K.optimizers.SGD(0.1))
    default = getattr(opt, attribute)
    setattr(opt, attribute, default)  # no change: allowed
    with pytest.raises(ValueError, match=rf"{wrapper}: `{attribute}`.*Received: "
                       rf"{attribute}=.*optimizer\.inner_optimizer\.{attribute} ="):
        setattr(opt, attribute, SETTINGS[attribute])
    assert getattr(opt, attribute) == default
    assert getattr(opt.inner_optimizer, attribute) != SETTINGS[attribute]


@pytest.mark.parametrize("wrapper", ["GradientAccumulator", "Projected"])
def test_weight_decay_set_on_the_inner_optimizer_acts_as_alone(K, gk, wrapper):
    x = np.linspace(-1, 1, 24, dtype="float32").reshape(8, 3)
    y = x.sum(axis=1, keepdims=True)

    def fit(make):
        model = K.Sequential([K.Input((3,)), K.layers.Dense(1, kernel_initializer="ones")])
        model.compile(make(), "mse")
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    def wrapped():
        opt = _wrappers(K, gk)[wrapper](K.optimizers.SGD(0.1))
        opt.inner_optimizer.weight_decay = 0.5  # what the error says to write
        return opt

    alone = fit(lambda: K.optimizers.SGD(0.1, weight_decay=0.5))
    plain = fit(lambda: K.optimizers.SGD(0.1))
    for a, w, p in zip(alone, fit(wrapped), plain):
        np.testing.assert_allclose(w, a, rtol=1e-6, atol=1e-7)
    assert np.max(np.abs(alone[0] - plain[0])) > 1e-3  # the decay did act


@pytest.mark.parametrize("wrapper", ["GradientAccumulator", "Projected"])
def test_gradient_accumulation_steps_on_a_wrapper_is_refused(K, gk, wrapper):
    """Keras 3's ``gradient_accumulation_steps`` set on a wrapper after
    construction changed nothing: the wrapper's update applied every batch
    (Projected) or kept its own window (GradientAccumulator). Refused, with
    the argument that does accumulate; the optimizer still trains as built."""
    opt = _wrappers(K, gk)[wrapper](K.optimizers.SGD(0.1))
    default = opt.gradient_accumulation_steps
    opt.gradient_accumulation_steps = default  # no change: allowed
    advice = (r"Pass `steps=4` to GradientAccumulator's constructor"
              if wrapper == "GradientAccumulator"
              else r".*GradientAccumulator\(Projected\(\.\.\.\), steps=4\)")
    with pytest.raises(ValueError, match=rf"{wrapper}: `gradient_accumulation_steps`.*"
                       rf"Received: gradient_accumulation_steps=4\. {advice}"):
        opt.gradient_accumulation_steps = 4
    assert opt.gradient_accumulation_steps == default
    x = np.linspace(-1, 1, 24, dtype="float32").reshape(8, 3)
    model = K.Sequential([K.Input((3,)), K.layers.Dense(1)])
    model.compile(opt, "mse")
    model.fit(x, x.sum(axis=1, keepdims=True), batch_size=4, epochs=1, verbose=0)
    assert int(opt.iterations.numpy()) == 2  # one update per batch (steps=1)
