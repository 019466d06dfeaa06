"""No pipeline (pipeline.stages = 1): the `interfaces.Pipeline` of a model held whole on every rank.

A global batch is DeepSpeed's plain loop, gradient_accumulation_steps times forward, backward and step through
the step driver; module states keep their own names; there are no other stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Iterator

import torch

from shardwise.comm.collectives import Comm
from shardwise.errors import UserError
from shardwise.parallel.tied import TiedParams
from shardwise.parallel.outputs import loss_of

if TYPE_CHECKING:
    from shardwise.parallel.interfaces import StepDriver
    from shardwise.parallel.zero.build import ShardingUnits


class SingleStage:
    reads_in_order: ClassVar[bool] = False    # DeepSpeed's plain engine shuffles its training data
    fixed_micro_batches: ClassVar[bool] = False

    def __init__(self, metrics_comm: Comm):
        self.metrics_comm = metrics_comm
        """The dp group, for the loss average ("dp:metrics")."""

    def owned(self, model_parameters: Iterable[Any]) -> list[Any]:
        return list(model_parameters)

    def blocks(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """The children of the model's largest ModuleList: the transformer blocks of the built-in GPT and of
        Hugging Face models, the same modules ZeRO-3 makes its units."""
        from shardwise.parallel.zero.params import default_unit_modules
        return [m for _, m in default_unit_modules(module)]

    def sharding_units(self) -> ShardingUnits | None:
        return None

    def tied_params(self) -> TiedParams:
        """One stage holds every use of a shared module: autograd sums its gradient."""
        return TiedParams()

    def train_batch(self, driver: StepDriver, data_iter: Iterator[Any] | None) -> float:
        if data_iter is None:
            raise UserError("engine.train_batch(data_iter) needs an iterator of micro-batches: pass one, or give "
                            "shardwise.initialize(training_data=...) or engine.set_dataiterator(...)")
        count = driver.micro_batches
        total: torch.Tensor | None = None        # [] float32 on the compute device: no host read per micro-batch
        for i in range(count):
            loss = loss_of(driver.forward(next(data_iter)))
            driver.backward(loss)
            part = loss.detach().float()
            total = part if total is None else total + part
            if i + 1 < count:
                driver.step()
        assert total is not None
        return driver.step_agreeing_loss(total / count)

    def eval_batch(self, driver: StepDriver, data_iter: Iterator[Any] | None, count: int) -> float:
        if data_iter is None:
            raise UserError("engine.eval_batch(data_iter) needs an iterator of micro-batches")
        total: torch.Tensor | None = None        # on the compute device until the one read below
        for _ in range(count):
            loss = loss_of(driver.forward(next(data_iter)))
            if not torch.is_tensor(loss) or loss.dim() != 0:
                raise UserError("engine.eval_batch needs the model to return a scalar loss tensor (or an output "
                                "with .loss, as Hugging Face models return when given labels)")
            total = loss.float() if total is None else total + loss.float()
        assert total is not None
        return self._dp_mean(total, count)

    def _dp_mean(self, total: torch.Tensor, count: int) -> float:
        """``total`` (the sum of this rank's ``count`` micro-batch losses) as the mean over micro-batches and
        data-parallel ranks: one all-reduce, one host read; the same value on every rank."""
        mean = (total / count).to(torch.float64).reshape(1)
        self.metrics_comm.all_reduce(mean)
        return mean.tolist()[0] / self.metrics_comm.size

    def refuse_manual_step(self, what: str) -> None:
        """Every call is allowed without a pipeline."""

    def module_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return module.state_dict()

    def load_module_state(self, module: torch.nn.Module, full: dict[str, Any], strict: bool) -> None:
        module.load_state_dict(full, strict=strict)

    def full_names(self, module: torch.nn.Module) -> dict[str, str]:
        return {k: k for k in module.state_dict(keep_vars=True)}

    def gather_stages(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        return local

    def close(self) -> None:
        """Nothing to release."""
