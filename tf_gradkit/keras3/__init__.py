"""tf_gradkit for Keras 3 (``keras``); importing it imports Keras 3 only.

Every public class is made here from its algorithm and this flavour's host
(`tf_gradkit._hosts`) and registered as ``tf_gradkit>Name``, so that
``load_model`` finds them; so is the ``constraints`` submodule, from
`tf_gradkit.core.sets`.
"""

from tf_gradkit import _hosts
from tf_gradkit._hosts import keras3 as _host
from tf_gradkit.keras3 import layers
from tf_gradkit.keras3 import callbacks  # noqa: F401  (gk.callbacks)

__all__ = _hosts.publish(globals(), _host, __name__, layers)
