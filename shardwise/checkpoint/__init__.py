"""Checkpoints: DeepSpeed's file layout written atomically (`files.py`), the layout-independent index of a tag
(`index.py`), save and load of an engine's training state (`save_load.py`), loading at another layout
(`reshard.py`), any layout turned into one state dict on one process (`consolidate.py`), and DeepSpeed's own
format both ways (`deepspeed_layout.py`, `deepspeed_read.py`, `deepspeed_write.py`)."""
