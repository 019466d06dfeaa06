"""torch's fused Adam/AdamW kernel for the shard masters, when the user left the implementation to torch.

On CPU, torch picks its single-tensor loop for Adam/AdamW when neither `foreach` nor `fused` is given: five
passes over each tensor per step. ZeRO masters are one flat fp32 shard per bucket, the case the fused kernel
(one pass, vectorized) serves best: measured on 951,360 elements, one core, 2.7 ms per step single-tensor,
2.5 ms foreach, 0.85 ms fused. The update is the same formula; the fused kernel rounds differently in the last
bit (max |difference| 2.4e-7 on O(1) values after 20 steps), well inside the parity tests' rtol 1e-5.

An explicit choice (`"foreach"` or `"fused"` in the optimizer params, or on a client optimizer's groups) is
left as it is.
"""

from __future__ import annotations

import torch

from shardwise.ops.adam import DeepSpeedCPUAdam, FusedAdam

_FUSED_DEVICES = ("cpu", "cuda")
# Exactly these classes (a user's subclass may step otherwise): torch's, and DeepSpeed's that are torch's update
# (`shardwise.ops.adam`; a config's "Adam" / "AdamW" builds FusedAdam)
_TORCH_UPDATE = (torch.optim.Adam, torch.optim.AdamW, FusedAdam, DeepSpeedCPUAdam)


def prefer_fused_adam(optimizer: torch.optim.Optimizer) -> int:
    """Switch the groups of a torch Adam/AdamW (or DeepSpeed's FusedAdam / DeepSpeedCPUAdam) whose implementation is unspecified to `fused=True`, where the
    kernel supports their tensors (fp32 on CPU or CUDA, not differentiable). Returns the groups switched.

    Safe after construction: Adam reads `group["fused"]` at every step and creates the per-parameter state on
    first use (`step` then lives on the parameter's device, as the fused kernel wants); no state exists yet."""
    if type(optimizer) not in _TORCH_UPDATE or optimizer.state:
        return 0
    switched = 0
    for group in optimizer.param_groups:
        unspecified = group.get("fused") is None and group.get("foreach") is None
        plain = not group.get("differentiable", False) and not group.get("capturable", False)
        supported = all(p.dtype == torch.float32 and p.device.type in _FUSED_DEVICES for p in group["params"])
        if unspecified and plain and supported and group["params"]:
            group["fused"] = True
            switched += 1
    return switched
