"""Faces shaped like other libraries, over numbaccum's core transformations.

* `numbaccum.compat.torchzero`: torchzero's clipping modules (``ClipNorm``, ``ClipNormByEMA``,
  ...), each a GradientTransformation and a stateful object with ``step``/``state_dict``.
* `numbaccum.compat.declearn`: declearn's OptiModules (``L2Clipping``, ``EWMAModule``, ...) with
  their registry names, ``run`` on a dict of arrays and the config/state round trips.

Import the submodule you need; ``import numbaccum`` imports neither.
"""
