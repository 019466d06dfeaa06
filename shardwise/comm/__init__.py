"""Communication: every collective goes through a `Comm` (a process group plus its `CommLedger`).

`ring_all_reduce` is our own bandwidth-optimal ring over point-to-point sends, an alternative to the
backend's `dist.all_reduce` (`Comm.ring_all_reduce` records it in the ledger).
"""

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.comm.ring import ring_all_reduce

__all__ = ["Comm", "CommLedger", "ring_all_reduce"]
