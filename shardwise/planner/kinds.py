"""The planner's enums: precision, optimizer, offload, recomputation, ZeRO-3 gathering."""

from __future__ import annotations

import enum


class Precision(str, enum.Enum):
    """Dtype of weights, gradients and activations; bf16/fp16 also keep fp32 master weights."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def nbytes(self) -> int:
        """Bytes of one weight / gradient / activation element."""
        return 4 if self is Precision.FP32 else 2

    @property
    def mixed(self) -> bool:
        """Mixed precision: the optimizer steps fp32 master copies of the 16-bit weights."""
        return self is not Precision.FP32


class Optimizer(str, enum.Enum):
    """Optimizer family, which fixes the state bytes per parameter (`optimizer_state_bytes`)."""

    ADAM = "adam"                  # Adam and AdamW: momentum + variance in fp32
    SGD_MOMENTUM = "sgd-momentum"  # one fp32 momentum buffer
    SGD = "sgd"                    # no state

    def state_bytes(self, precision: Precision) -> int:
        """The ZeRO paper's K: fp32 optimizer bytes per parameter, the fp32 master copy included
        under mixed precision (Adam + bf16/fp16: 4 master + 4 momentum + 4 variance = 12)."""
        moments = {Optimizer.ADAM: 8, Optimizer.SGD_MOMENTUM: 4, Optimizer.SGD: 0}[self]
        return moments + (4 if precision.mixed else 0)


class Offload(str, enum.Enum):
    """ZeRO-Offload: what lives in CPU memory instead of GPU memory."""

    NONE = "none"
    OPTIMIZER = "optimizer"                   # optimizer states (+ fp32 grads), stepped on the CPU; stages 1-3
    OPTIMIZER_AND_PARAMS = "optimizer+params"  # also the 16-bit parameters; stage 3 only


class Recompute(str, enum.Enum):
    """Activation recomputation (Korthikanti et al. 2022)."""

    NONE = "none"
    SELECTIVE = "selective"   # recompute only the attention core (QK^T, softmax, dropout, AV)
    FULL = "full"             # keep each layer's input, recompute the layer in backward


class Zero3Gather(str, enum.Enum):
    """What ZeRO-3 gathers at once, which sets its buffers and how many collectives it launches."""

    BLOCK = "block"     # one transformer block per all-gather (our engine's units)
    MODULE = "module"   # each Linear / norm module separately (DeepSpeed's hooks)
