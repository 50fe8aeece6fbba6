"""torchtitan's Trainer on the ranks of a real gloo group, the reference `simtrain torchtitan` is compared with, and
the small job both run: a tokenizer and a dataset made here, seeded, in torchtitan's formats (no download).

`titan_assets(folder)` writes a word-level tokenizer (tokenizer.json, tokenizer_config.json: 500 words, [UNK],
bos and eos) and a dataset of 400 documents of 40 to 300 words drawn with a seeded generator, as one JSON-lines
file that torchtitan's `c4_test` loader reads (`datasets.load_dataset(folder, split="train")`); `job(assets, ...)`
is torchtitan's command line for its Llama 3 debug model on them; `gloo_rank` runs it in a gloo process and gives
rank 0's losses and every parameter in full.
"""
import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

WORDS = [f"w{i}" for i in range(500)]


def titan_assets(folder: Path) -> Path:
    """A tokenizer and a dataset in `folder` (see above); `folder`."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    vocab = {"[UNK]": 0, "<|bos|>": 1, "<|eos|>": 2, **{word: 3 + i for i, word in enumerate(WORDS)}}
    (folder / "tokenizer").mkdir(parents=True)
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer" / "tokenizer.json"))
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}))
    (folder / "data").mkdir()
    draw = random.Random(0)
    with open(folder / "data" / "train.json", "w") as documents:
        for _ in range(400):
            text = " ".join(draw.choice(WORDS) for _ in range(draw.randint(40, 300)))
            documents.write(json.dumps({"text": text}) + "\n")
    return folder


def job(assets: Path, *extra: str) -> list[str]:
    """torchtitan's arguments: its Llama 3 debug model on `assets`, sequences of 128 tokens, 3 steps, every step
    logged, no validation, DTensor for the model-parallel dimensions (see the guide), its outputs in `assets`;
    then `extra`."""
    return ["--module", "llama3", "--config", "llama3_debugmodel", "--hf_assets_path", str(assets / "tokenizer"),
            "--dataloader.dataset_path", str(assets / "data"), "--training.seq_len", "128",
            "--training.local_batch_size", "2", "--training.steps", "3", "--metrics.log_freq", "1",
            "--validator.no-enable", "--parallelism.spmd_backend", "partial_dtensor",
            "--dump_folder", str(assets / "outputs"), "--debug.seed", "0", *extra]


class HostDevice(SimpleNamespace):
    """torchtitan's device module for a real run on the CPU: one device, no memory statistics."""

    def __init__(self):
        super().__init__(get_device_name=lambda device=None: "cpu", current_device=lambda: 0,
                         device_count=lambda: 1, set_device=lambda device: None, synchronize=lambda device=None: None,
                         get_device_properties=lambda device=None: SimpleNamespace(name="cpu", total_memory=1 << 40),
                         memory_stats=lambda device=None: {}, reset_peak_memory_stats=lambda device=None: None,
                         empty_cache=lambda: None)


def full_parameters(trainer) -> dict:
    """Every parameter of the trained model, whole (a DTensor's shards gathered), by name."""
    from torch.distributed.tensor import DTensor
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for part in trainer.model_parts for name, p in part.named_parameters()}


def premul_sum_on_gloo() -> None:
    """Gloo has no `ReduceOp.PREMUL_SUM(factor)`, NCCL's op that FSDP2 reduce-scatters gradients with when
    torchtitan sets its divide factor: in this process, each input times the factor, then summed, as NCCL
    computes it."""
    import torch.distributed as dist
    reduce_scatter = dist.reduce_scatter_single

    def premul_then_sum(output, input, group=None, op=dist.ReduceOp.SUM, async_op=False):
        if isinstance(op, dist.ReduceOp) and op.op == dist.ReduceOp.PREMUL_SUM:
            input, op = input * op.factor, dist.ReduceOp.SUM
        return reduce_scatter(output=output, input=input, group=group, op=op, async_op=async_op)

    dist.reduce_scatter_single = premul_then_sum


def gloo_rank(rank: int, world: int, arguments: list[str]) -> tuple[list[float], dict]:
    """In a process of a gloo group: torchtitan's training of `arguments`; its losses and full parameters."""
    from simtrain.frameworks.torchtitan import cpu_machine, train
    os.environ["LOCAL_RANK"] = "0"
    premul_sum_on_gloo()
    with cpu_machine(HostDevice()):
        run = train(arguments, numerics=True)
        return run.losses, full_parameters(run.trainer)
