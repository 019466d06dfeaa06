"""DeepSpeed's `deepspeed.runtime.zero.partition_parameters` import path: `Init`, `GatheredParameters` and the
`ZeroParamStatus` enum with DeepSpeed's members and values.

Difference: DeepSpeed marks each ZeRO-3 parameter with `ds_status` (one of these); shardwise's ZeRO-3 parameters
carry no such attribute (whether a unit is gathered is the runtime's, not the parameter's), so the enum serves
imports and comparisons a script makes, not a reading of shardwise's parameters.
"""

import enum

from shardwise.zero import GatheredParameters, Init


class ZeroParamStatus(enum.Enum):
    """Where a ZeRO-3 parameter's full value is, in DeepSpeed's terms."""

    AVAILABLE = 1
    """Gathered whole on this rank."""
    NOT_AVAILABLE = 2
    """Only this rank's shard is held."""
    INFLIGHT = 3
    """A gather has been issued and has not completed."""


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]
