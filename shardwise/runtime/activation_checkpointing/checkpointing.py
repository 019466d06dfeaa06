"""DeepSpeed's `deepspeed.runtime.activation_checkpointing.checkpointing` import path: the same names as
`shardwise.checkpointing` (`deepspeed.checkpointing`), which is where DeepSpeed's come from too."""

from shardwise.checkpointing import *  # noqa: F401,F403
from shardwise.checkpointing import __all__  # noqa: F401
