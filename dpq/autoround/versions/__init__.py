"""One module per auto-round series dpq covers: everything dpq expects of that series, checked at install.

Each series module (``v0_16``, ``v0_17``) holds, for its checked release (``RELEASE``):

* ``SIGNATURES``: every upstream symbol the patch table (:data:`dpq.autoround.patches.TABLE`) replaces in
  this series, with its expected parameters (a symbol missing here is not patched in this series);
* ``NOT_PATCHED``: what this series does not patch that another does, and why;
* ``LOOP_REPRODUCED``: the sources dpq's lane loop reproduces op for op (``dpq/autoround/tune.py``), by
  digest: a change refuses the install by name;
* ``REPRODUCED``: the sources dpq's runtime reproduces with a fallback (the SignSGD step,
  ``dpq.engine.sign_step``), by digest: a change makes every lane run auto-round's own code;
* ``CALLED``: auto-round's private callables dpq calls, each of which must exist.

Covering a new series is one new module here and one line in :data:`SERIES`. The modules import
nothing of auto-round (the package's ``compat`` reads :data:`SERIES` before auto-round loads).
"""

from __future__ import annotations

from types import MappingProxyType, ModuleType

from . import v0_16, v0_17

__all__ = ["SERIES"]

SERIES: MappingProxyType[str, ModuleType] = MappingProxyType({"0.16": v0_16, "0.17": v0_17})
