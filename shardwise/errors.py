"""Exceptions that mean "the user asked for something wrong", as opposed to a bug in shardwise.

The CLI catches :class:`UserError` and prints one line ``shardwise: error: ...`` with exit code 2,
never a traceback. Everything raised because of a bad config file, a bad flag or a bad input file
should subclass it; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """An error in what the user gave us (config, flags, files). The message names the fix."""


class CheckpointError(UserError):
    """A checkpoint that cannot be read into this run (missing, damaged, or written for another layout)."""


class ArgumentError(UserError, ValueError):
    """A call's argument that cannot work (an empty save_dir, ...); a ValueError too, as DeepSpeed raises there."""


class TagValidationError(CheckpointError, AssertionError):
    """The ranks save under different tags and checkpoint.tag_validation is "Fail". An AssertionError too: that is
    what DeepSpeed raises there, and scripts written for it catch that."""


class NoSyncError(UserError, AssertionError):
    """engine.no_sync() misused (nested, stepped inside, or at a ZeRO stage that partitions gradients as they are
    produced). An AssertionError too: that is what DeepSpeed raises there."""


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than communication.timeout_minutes; the message names the ranks that did not
    arrive and what every rank waited on (`shardwise.comm.watchdog`). Not a `UserError`: a stalled node or a bug,
    reported by the CLI as a rank's failure, with this line."""


class DesyncError(UserError):
    """The ranks ran different sequences of collectives (`shardwise.comm.sequence`); the message names the first
    operation that differs and the ranks on each side."""


class NonFiniteError(UserError):
    """Too many optimizer steps in a row were skipped for inf/nan loss or gradients
    (nonfinite.max_consecutive_skips)."""
