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

`Journal` rolls back what a worker that died inside the block left half
written. TensorFlow cancels a dead worker's work on the parameter server
wherever it stands, so a block's writes to several variables are not atomic;
one op writing one variable is. The journal is one int64 vector, written by
single ops: the block's phase (0 when no block is under way) and the values
of the counters it guards as they were when the block began. The next block
to take the mutex finds the phase set, restores every counter from the
journal and lets its owner discard what the counters do not describe (an
accumulator drops the open window: its sums may hold part of a micro-batch).
A rollback that dies too is redone the same way by the block after it.

`after_writes` orders a write after every stateful op a block created, so
that a value published by it (an update count) is never seen before the
updates it counts: a worker that reads the count, then the weights, never
labels old weights with a new count.
"""

import functools

import tensorflow as tf

__all__ = ["new_mutex", "run_exclusive", "after_writes", "Journal"]


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


def run_exclusive(mutex, fn, after=(), journal=None):
    """Runs ``fn()`` holding ``mutex`` (see the module doc) and returns its
    result. ``after``: tensors (``IndexedSlices``, None allowed) computed
    before the lock is taken. ``journal``: a `Journal` that rolls back a block
    a dying worker left half written, and guards this one."""
    if mutex is None:
        return fn()
    if tf.executing_eagerly():  # the lock ops need a graph: one for this call
        return tf.function(lambda: run_exclusive(mutex, fn, after, journal),
                           autograph=False)()
    if journal is not None:
        fn = functools.partial(journal.run, fn)
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


class Journal:
    """Counters that a block holding a mutex changes together, kept whole
    when a worker dies inside the block (module doc).

    Args:
      variable: int64 vector of ``1 + len(counters)`` zeros, on the device of
        the counters (a checkpoint without it restores zeros: no block under
        way).
      counters: int64 scalar variables the blocks write.
      on_torn: ``on_torn(phase)`` runs after the counters are restored from a
        block that did not finish (``phase``: int64 scalar, the last `mark`
        that block made, 1 when none); it writes what must follow (drop a
        window, count it).
    """

    WRITING = 1

    def __init__(self, variable, counters, on_torn):
        self.variable = variable
        self.counters = list(counters)
        self.on_torn = on_torn

    def run(self, fn):
        """Rolls back a torn block, then runs ``fn()`` as a block: the phase
        is set before any of its writes and cleared after all of them."""
        entry = self.variable.read_value()

        def roll_back():
            for index, counter in enumerate(self.counters):
                counter.assign(entry[1 + index])
            self.on_torn(entry[0])
            return tf.constant(True)

        rolled = tf.cond(entry[0] > 0, roll_back, lambda: tf.constant(False))
        with tf.control_dependencies([rolled]):
            begin = self.variable.assign(tf.stack(
                [tf.constant(self.WRITING, tf.int64)] +
                [tf.cast(c.read_value(), tf.int64) for c in self.counters]))
        with tf.control_dependencies([begin]):
            result, created = _stateful_ops_of(fn)
        with tf.control_dependencies(created):
            self.mark(0)
        return result

    def mark(self, phase):
        """Records how far the block has come (an int; 0: done), in one write."""
        return self.variable.scatter_nd_update(
            [[0]], tf.constant([phase], tf.int64))

    def snapshot(self, counter):
        """``counter``'s value as a reader should see it: the journal's while
        a block is under way or torn, else the variable's."""
        index = next(i for i, c in enumerate(self.counters) if c is counter)
        entry = self.variable.read_value()
        return tf.where(entry[0] > 0, entry[1 + index], counter.read_value())
