"""Exclusive updates of shared state, for workers that update it at once.

Under ``tf.distribute.experimental.ParameterServerStrategy`` every worker runs
its steps against variables on the parameter servers, concurrently. A
gradient-accumulation micro-step reads the window's counter, adds into the
sums and, when the window is full, applies and resets it: two workers doing
that at once lose micro-steps or close a window twice (60 micro-steps of 2
made 15 to 37 updates instead of 30). TF1's ``ConditionalAccumulator`` did
its bookkeeping under a mutex in C++; TF2's resource accumulator ops cannot
be combined with a conditional update atomically, and ``tf.CriticalSection``
deadlocks while tracing a function that calls ``merge_call`` (every Keras
optimizer under a strategy does).

`run_exclusive` holds a mutex resource (`new_mutex`, created once on the
device of the state, i.e. the parameter server) around a block of graph
code: the lock is taken after the block's inputs are computed (so a worker
never holds it while computing gradients), every op the block creates
waits for the lock, and the lock is released only after every stateful op
the block created has run. Called eagerly it traces a function for the call
(the chief's own calls under ParameterServerStrategy); not under XLA (the mutex ops have no XLA kernel;
ParameterServerStrategy does not compile with XLA).

`after_writes` orders a write after every stateful op a block created, so
that a value published by it (an update count) is never seen before the
updates it counts: a worker that reads the count, then the weights, never
labels old weights with a new count.
"""

import tensorflow as tf

__all__ = ["new_mutex", "run_exclusive", "after_writes"]


def new_mutex(device):
    """A mutex resource on ``device``, created outside any function."""
    with tf.init_scope(), tf.device(device):
        return tf.raw_ops.MutexV2(shared_name="", container="")


def _stateful_ops_of(fn):
    """Runs ``fn()``; returns its result and the stateful ops it created."""
    graph = tf.compat.v1.get_default_graph()
    before = set(graph.get_operations())
    result = fn()
    created = [op for op in graph.get_operations()
               if op not in before and op._is_stateful]  # pylint: disable=protected-access
    return result, created


def run_exclusive(mutex, fn, after=()):
    """Runs ``fn()`` holding ``mutex`` (see the module doc) and returns its
    result. ``after``: tensors (``IndexedSlices``, None allowed) computed
    before the lock is taken."""
    if mutex is None:
        return fn()
    if tf.executing_eagerly():  # the lock ops need a graph: one for this call
        return tf.function(lambda: run_exclusive(mutex, fn, after), autograph=False)()
    after = [t.values if isinstance(t, tf.IndexedSlices) else t
             for t in tf.nest.flatten(after) if t is not None]
    with tf.control_dependencies(after), tf.device(mutex.device):
        lock = tf.raw_ops.MutexLock(mutex=mutex)
    with tf.control_dependencies([lock]):
        result, created = _stateful_ops_of(fn)
    with tf.control_dependencies(created), tf.device(mutex.device):
        tf.raw_ops.ConsumeMutexLock(mutex_lock=lock)
    return result


def after_writes(fn, then):
    """Runs ``fn()``, then ``then()`` once every stateful op ``fn`` created
    has run; returns ``then()``'s result."""
    if tf.executing_eagerly():
        fn()
        return then()
    _, created = _stateful_ops_of(fn)
    with tf.control_dependencies(created):
        return then()
