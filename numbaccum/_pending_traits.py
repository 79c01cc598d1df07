"""The `numbaccum.traits` of the stages whose modules were being edited elsewhere when the
traits came (issue 43): each line belongs on its class, where it is declared; this module goes
once they are there. Imported last by the package's ``__init__``."""

from __future__ import annotations

from .accumulation import MultiSteps, _ApplyEvery
from .base import Chain
from .inject import _InjectHyperparams
from .masking import _Conditionally, _Flatten, _Masked, _Partition
from .privacy import _AddNoise, _Aggregate
from .traits import ELEMENT, LEAF, TREE

for _cls, _scope, _children in (
    (Chain, ELEMENT, "stages"),
    (_ApplyEvery, ELEMENT, None),
    (_InjectHyperparams, ELEMENT, "probe"),  # probe: the inner stage at the initial values
    (_Conditionally, ELEMENT, "stage"),
    # a mask or a label tree has the params' structure: whole leaves of it
    (_Masked, LEAF, "inner"),
    (_Partition, LEAF, "chain"),
    (_Flatten, LEAF, "inner"),
    (_AddNoise, TREE, None),  # its noise is drawn by element position in the whole tree
    (_Aggregate, TREE, None),
):
    setattr(_cls, "scope", _scope)
    setattr(_cls, "children_at", _children)
setattr(_Flatten, "joins_leaves", True)
# A skip function of the user's sees a tree of the params' structure: whole leaves of it.
setattr(MultiSteps, "scope", property(lambda self: LEAF if self._skip is not None else ELEMENT))
setattr(MultiSteps, "children_at", "_inner")
