"""ConditionalGradient: the algorithm, written once for both Keras flavours
(the rule, its oracles and argument checks are `tf_gradkit.core.frank_wolfe`)."""

import tensorflow as tf

from tf_gradkit.core import frank_wolfe


class ConditionalGradient:
    """Frank-Wolfe (conditional gradient) optimizer.

    Keeps each variable inside a norm ball of radius ``lambda_`` without
    projections: each step takes the point ``s`` of the ball that minimises
    the linearised loss ``<g, s>`` (a linear minimisation oracle, LMO) and
    moves towards it,

        w <- (1 - learning_rate) * w + learning_rate * s.

    A convex combination of feasible points is feasible, so a variable that
    starts inside its ball (and ``0 <= learning_rate <= 1``) never leaves it.
    For ``ord="fro"``, ``s = -lambda_ * g / (|g|_F + epsilon)``; for
    ``ord="nuclear"``, ``s = -lambda_ * u1 v1^T`` with the top singular pair
    of ``g`` (low-rank updates, low-rank iterates).
    ``learning_rate = 2 / (t + 2)`` gives the classical ``O(1/t)``
    convergence for smooth convex losses (Jaggi 2013).

    Sets (``ord``), each a ball centred at 0 with radius ``r = lambda_``:
      - ``"fro"``: ``|w|_F <= r`` (default, as in tensorflow-addons).
      - ``"nuclear"``: sum of singular values ``<= r``. Tensors of rank > 2
        (conv kernels) are seen as ``(prod(leading dims), last dim)``
        matrices; rank < 2 (biases) use the ``"fro"`` oracle. The top singular
        pair comes from ``power_iterations`` rounds of power iteration per
        step, warm-started from the previous step's right singular vector (an
        optimizer variable, checkpointed), never from a full SVD.
      - ``"l1"``: ``sum |w_i| <= r`` (one nonzero per step: sparse iterates).
      - ``"linf"``: ``max |w_i| <= r``.
      - ``"k_sparse"``: ``|w|_inf <= r`` and ``|w|_1 <= k r`` (the hull of
        k-sparse vectors; the LMO takes the ``k`` largest ``|g_i|``).

    Sparse gradients (``tf.IndexedSlices``, from embeddings) are densified: the
    step moves every entry of the variable, and the oracle needs the whole
    gradient (duplicate indices summed).

    Args:
      learning_rate: the step size gamma in ``[0, 1]``: a float, or a
        learning-rate schedule of the same Keras flavour whose values lie in
        ``[0, 1]``.
      lambda_: the radius. A float for every variable, or a dict
        ``{regex: radius}`` matched (``re.search``, first matching entry in
        dict order) against each variable's path (Keras 3 ``variable.path``, e.g. ``dense/kernel``; tf_keras
        ``variable.name``, e.g. ``dense/kernel:0``); every pattern must
        match some variable and every variable some pattern (add
        ``".*": radius`` last as a default), else ``build`` raises ValueError.
      epsilon: added to ``|g|_F`` in the ``"fro"`` oracle so a zero gradient
        gives ``s = 0``.
      ord: ``"fro"``, ``"nuclear"``, ``"l1"``, ``"linf"`` or ``"k_sparse"``.
      k: entries per vertex for ``ord="k_sparse"`` (an integer >= 1);
        must be None otherwise.
      power_iterations: power-iteration rounds per step for ``"nuclear"``
        (each two matrix-vector products), an integer >= 1.
      name: optional name.
      **kwargs: the base optimizer's ``clipnorm``, ``clipvalue``,
        ``global_clipnorm``, ``use_ema``, ... .

    Migrating from ``tfa.optimizers.ConditionalGradient``: same arguments and
    the same radius; tensorflow-addons' ``learning_rate`` is the weight on the
    *old* iterate (``w <- lr * w - (1 - lr) * lambda_ * g / |g|``), so pass
    ``learning_rate = 1 - tfa_learning_rate`` to get identical updates.

    Example:

    >>> opt = ConditionalGradient(0.1, lambda_={"kernel": 5.0, ".*": 1.0},
    ...                           ord="nuclear")
    >>> model.compile(optimizer=opt, loss="mse")

    Reference: M. Jaggi, "Revisiting Frank-Wolfe: Projection-free sparse
    convex optimization", ICML 2013.
    
    """

    def __init__(self, learning_rate, lambda_=0.01, epsilon=1e-7, ord="fro",
                 k=None, power_iterations=2, name=None, **kwargs):
        # pylint: disable=redefined-builtin
        self._check_backend()
        frank_wolfe.validate_arguments(learning_rate, lambda_, epsilon, ord, k,
                                       power_iterations)
        self._init_base(name, learning_rate, **kwargs)
        self.lambda_ = dict(lambda_) if isinstance(lambda_, dict) else float(lambda_)
        self.epsilon = epsilon
        self.ord = ord
        self.k = k
        self.power_iterations = power_iterations
        self._oracle = frank_wolfe.make_oracle(ord, k, epsilon, power_iterations)

    def _prepare(self, var_list):
        """The radius of each variable (raises before anything is built)."""
        return frank_wolfe.resolve_radii(self.lambda_, [self._path(v) for v in var_list])

    def _build_slots(self, var_list, radii):
        self._radii = radii
        self._singular_vectors = []
        for var in var_list:
            shape = self._oracle.state_shape(var.shape)
            self._singular_vectors.append(None if shape is None else self._new_slot(
                var, shape, frank_wolfe.initial_singular_vector(shape[0], var.dtype),
                "singular_vector"))

    def _update_one(self, gradient, variable, learning_rate):
        index = self._variable_index(variable)
        vector = self._singular_vectors[index]
        w = tf.convert_to_tensor(variable)
        s, new_vector = self._oracle(gradient, self._radii[index],
                                     None if vector is None else self._read(vector))
        lr = tf.cast(learning_rate, w.dtype)
        self._assign(variable, frank_wolfe.frank_wolfe_update(w, s, lr))
        if vector is not None:
            self._assign(vector, new_vector)

    def get_config(self):
        config = super().get_config()
        config.update(self._learning_rate_config())
        config.update(lambda_=self.lambda_, epsilon=self.epsilon, ord=self.ord,
                      k=self.k, power_iterations=self.power_iterations)
        return config
