"""What a rank hands the `simtrain` backend's calls, checked before anything is posted (process_group.py).

torch.distributed passes a backend what the rank gave, unchecked for the most
part: a root or peer outside the group, a list of tensors that does not hold
one per rank, an output that is not the group's inputs laid end to end. Each is
one line here, naming the call, on the rank that made it (and so, from
`spawn`, `RankFailed: rank 2 raised SimtrainError: recv: source rank 7 is not
a rank of the group (0 to 3)`), instead of an IndexError deep in a program, a
transfer to the wrong rank or a run that ends as if nothing were wrong.

    tensor = one_tensor(tensors, "broadcast")
    root = group_rank(opts.rootRank, 4, "broadcast", "root")
    one_per_rank(outputs, 4, "all_gather", "output")
    laid_end_to_end(output, input, 4, "all_gather_into_tensor", "output", "inputs")
    rows = split_rows(input, input_split_sizes, 4, "input_split_sizes")
"""
from ..errors import SimtrainError


def one_tensor(tensors: list, name: str):
    """The one tensor (or list) of a call: torch hands the backend a list of one per rank."""
    if len(tensors) != 1:
        raise SimtrainError(f"{name}: the simtrain backend takes one tensor (or list) per rank, got {len(tensors)}")
    return tensors[0]


def group_rank(rank: int, world: int, name: str, role: str) -> int:
    """`rank` (a root, a destination, a source) if it is a rank of a group of `world` ranks."""
    if not 0 <= rank < world:
        raise SimtrainError(f"{name}: {role} rank {rank} is not a rank of the group (0 to {world - 1})")
    return rank


def one_per_rank(tensors: list, world: int, name: str, what: str) -> list:
    """`tensors` if the list holds one tensor per rank of a group of `world` ranks."""
    if len(tensors) != world:
        raise SimtrainError(f"{name}: {len(tensors)} {what} tensors for a group of {world} ranks (one per rank)")
    return tensors


def laid_end_to_end(whole, part, world: int, name: str, whole_is: str, parts_are: str) -> None:
    """`whole` holds the `world` ranks' `part`s end to end (all-gather's output, reduce-scatter's input)."""
    if whole.numel() != world * part.numel():
        raise SimtrainError(f"{name}: an {whole_is} of {whole.numel()} elements for {world} ranks' {parts_are} of "
                            f"{part.numel()}")


def split_rows(tensor, sizes, world: int, field: str) -> list:
    """`tensor` cut into one block of rows per rank: by `sizes` (any sequence of integers, as a real backend's
    binding takes: a list, a numpy array), or evenly where none are given."""
    sizes = [int(size) for size in sizes] if sizes is not None else []
    if not sizes:
        if tensor.shape[0] % world:
            raise SimtrainError(f"{field}: {tensor.shape[0]} rows do not split evenly over {world} ranks")
        sizes = [tensor.shape[0] // world] * world
    if len(sizes) != world or sum(sizes) != tensor.shape[0]:
        raise SimtrainError(f"{field}: {list(sizes)} does not split {tensor.shape[0]} rows over {world} ranks")
    return list(tensor.split(list(sizes)))
