"""The SparseLift compiler session (see :mod:`~lightning_sparselift.session.driver`), in its phases:
``lifting`` (the ranks agree on one lifted graph), ``plan_store`` (a saved plan reused when every
rank can use it), ``verify`` (the installed plan against the identity plan), ``drift`` (the
workload against what the plan was decided on) and ``compiler_time`` (what the compiler cost)."""

from lightning_sparselift.session.driver import Phase, SparseLiftSession
from lightning_sparselift.session.lifting import mark_generated

__all__ = ["Phase", "SparseLiftSession", "mark_generated"]
