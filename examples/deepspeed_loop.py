"""A DeepSpeed-style training loop with `import shardwise` in place of `deepspeed`: `initialize` returns
(engine, optimizer, dataloader, lr_scheduler), and each batch goes through engine(batch), engine.backward(loss)
and engine.step(), which also handles gradient accumulation and the learning-rate schedule.

    python examples/deepspeed_loop.py                                   # one process
    torchrun --nproc-per-node 2 examples/deepspeed_loop.py              # two gloo (or NCCL) ranks
"""

import argparse
import json

import torch

import shardwise
from shardwise.data import load_corpus
from shardwise.models import GPT, gpt_config


class Windows(torch.utils.data.Dataset):
    """Fixed, non-overlapping windows of a token array: item i -> (input_ids [seq], labels [seq])."""

    def __init__(self, tokens, seq_len: int, count: int):
        self.tokens, self.seq_len, self.count = tokens, seq_len, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        start = i * (self.seq_len + 1)
        window = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype("int64"))
        return window[:-1], window[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="examples/ds_config.json")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--summary", default=None, help="write a JSON summary here (rank 0)")
    args = parser.parse_args()

    shardwise.init_distributed()
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_layer=2, d_model=64, n_head=4, seq_len=32))
    dataset = Windows(load_corpus("stdlib", max_bytes=1 << 20), seq_len=32, count=args.samples)

    engine, optimizer, dataloader, lr_scheduler = shardwise.initialize(
        model=model, model_parameters=model.parameters(), config=args.config, training_data=dataset)

    losses = []
    for batch in dataloader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))

    if engine.dp_rank == 0:
        print(f"global steps {engine.global_steps}, lr {engine.get_lr()[0]:.2e}, "
              f"first loss {losses[0]:.3f}, last loss {losses[-1]:.3f}")
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump({"global_steps": engine.global_steps, "losses": losses, "dp_size": engine.dp_size,
                           "lr": engine.get_lr()}, f)


if __name__ == "__main__":
    main()
    # torch asks every process to destroy its groups before exiting: gloo's worker threads may otherwise still
    # hold finished work when the interpreter shuts down, which aborts the process
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
