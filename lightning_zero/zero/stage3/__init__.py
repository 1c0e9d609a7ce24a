"""ZeRO stage 3: parameters sharded, gathered just in time per unit, freed right after.

- ``unit.py``: :class:`ShardedParam` and :class:`ShardedUnit`, a unit's buffers, gathers and
  gradients ([Note: stage-3 layout], [Note: a stage-3 parameter outside its gather]);
- ``partition.py``: which modules become units, and parameters built on the meta device
  ([Note: one unit per dtype]);
- ``hooks.py``: the forward/backward hooks and the engine's phase ([Note: stage-3 lifecycle]);
- ``engine.py``: :class:`Zero3Engine`, the stage-3 :class:`~lightning_zero.zero.engine.ZeroEngine`,
  and :class:`PiecesSource`, re-sharding a module another engine left in pieces;
- ``optimizer.py``: :class:`Zero3Optimizer` over the engine's pieces.
"""

from lightning_zero.zero.stage3.engine import PiecesSource, Zero3Engine
from lightning_zero.zero.stage3.hooks import Phase
from lightning_zero.zero.stage3.optimizer import Zero3Layout, Zero3Optimizer
from lightning_zero.zero.stage3.unit import ShardedParam, ShardedUnit, UnitState

__all__ = ["Phase", "PiecesSource", "ShardedParam", "ShardedUnit", "UnitState", "Zero3Engine", "Zero3Layout", "Zero3Optimizer"]
