"""A Megatron-Core training script as its users launch it with torchrun (`torchrun --nproc-per-node 4
megatron_script.py --tp 2`): rank and world from torchrun's environment, the GPU's backend (nccl) named, the device
set from LOCAL_RANK, then the job of tests/megatron_ranks.py with the layout its arguments give. With
`--print-losses` (a run with values), each rank holding losses (a last pipeline stage's) prints them. `simtrain megatron` runs it unchanged
(tests/test_megatron.py)."""
import argparse
import os

import torch
import torch.distributed as dist

from megatron_ranks import Layout, train


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("tp", "pp", "vpp", "steps", "micro-batches"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--print-losses", action="store_true")
    arguments = vars(parser.parse_args())
    printed = arguments.pop("print_losses")
    given = {name: value for name, value in arguments.items() if value is not None}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend="nccl")
    losses, _ = train(rank, world, Layout(**given))
    for step, loss in enumerate(losses.tolist() if printed else []):
        print(f"rank {rank} step {step + 1} loss {loss:.6f}")


if __name__ == "__main__":
    main()
