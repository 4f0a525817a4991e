"""tf_gradkit for tf_keras (the Keras 2 line tfmot needs); importing it imports
tf_keras only.

Every public class is made here from its algorithm and this flavour's host
(`tf_gradkit._hosts`) and registered as ``tf_gradkit>Name``, so that
``load_model`` finds them; so is the ``constraints`` submodule, from
`tf_gradkit.core.sets`.
"""

from tf_gradkit import _hosts
from tf_gradkit._hosts import tf_keras as _host
from tf_gradkit.tf_keras import layers
from tf_gradkit.tf_keras import callbacks  # noqa: F401  (gk.callbacks)

__all__ = _hosts.publish(globals(), _host, __name__, layers)
