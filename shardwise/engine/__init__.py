"""The training engine: `initialize` builds it (`initialize.py`, in its order of construction), `Engine` runs
it (`engine.py`, DeepSpeed's members in `deepspeed_api.py`), the step driver counts micro-batches and steps for
the engine and for pipeline schedules (`step.py`). Strategies stay under `shardwise.parallel`; the engine calls
them through `shardwise.parallel.interfaces`."""
