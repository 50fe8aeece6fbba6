"""Where sharded data parallelism puts each parameter: units, padded flat buffers, chunks and owners (pure logic).

The model's trainable parameters, in `model.parameters()` order, are laid
end to end in one flat buffer (the parameters', the gradients', as DDP's
gradient bucket). They are grouped into **units**, the granularity at which
FSDP gathers parameters and reduce-scatters gradients: an entry of the
model's nn.Sequential with parameters starts a unit, and the parameterless
entries after it join it (train/partition.py's `model_units`: for a gpt the
embedding, each transformer block and the head; for an mlp each Linear with
its ReLU); a model that is not an nn.Sequential is one unit.

Each unit's region is padded with zeros to a multiple of the shard degree N
and cut into N equal chunks, as FSDP pads a flat parameter. The rank at
position p of a shard group owns chunk (p + 1) mod N of every unit: the chunk
a ring reduce-scatter leaves at position p, and the one a ring all-gather
starts from there (comm/ring.py). A rank's shard is its chunk of every unit,
end to end: `shard_numel` elements, Psi / N when each unit's size divides
by N, else sum over units of ceil(Psi_u / N).

    layout = ShardLayout([p.numel() for p in params], units=[[0, 1], [2, 3]], shards=4)
    layout.padded_numel, layout.shard_numel, layout.owned(position=1)
    chunks = layout.chunks(flat_buffer, unit=0)        # N views of unit 0's region
    owned = layout.chunk(flat_buffer, unit=0, index=layout.owned(position=1))
    flat_buffer[layout.param_slice(2)]                 # parameter 2's elements
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardLayout:
    """Units of parameters in a padded flat buffer, each cut into `shards` chunks."""

    numels: tuple[int, ...]  # each trainable parameter's elements, in model.parameters() order
    units: tuple[tuple[int, ...], ...]  # each unit's parameter indices, contiguous, in order
    shards: int  # N: the shard group's ranks

    def __init__(self, numels, units, shards: int):
        object.__setattr__(self, "numels", tuple(numels))
        object.__setattr__(self, "units", tuple(tuple(unit) for unit in units))
        object.__setattr__(self, "shards", shards)
        flat = [index for unit in self.units for index in unit]
        if flat != list(range(len(self.numels))):
            raise ValueError(f"units must cover parameters 0..{len(self.numels) - 1} in order, got {self.units}")
        # each unit's chunk size and where its padded region starts: read per unit and rank every step
        sizes = tuple(-(-self.unit_numel(unit) // shards) for unit in range(len(self.units)))
        starts = tuple(sum(size * shards for size in sizes[:unit]) for unit in range(len(sizes)))
        object.__setattr__(self, "_chunk_numels", sizes)
        object.__setattr__(self, "_unit_starts", starts)

    def unit_numel(self, unit: int) -> int:
        """Elements of unit `unit`'s parameters, unpadded."""
        return sum(self.numels[index] for index in self.units[unit])

    def chunk_numel(self, unit: int) -> int:
        """Elements of one chunk of unit `unit`: ceil(unit numel / N)."""
        return self._chunk_numels[unit]

    def unit_start(self, unit: int) -> int:
        """Where unit `unit`'s padded region starts in the flat buffer."""
        return self._unit_starts[unit]

    def unit_slice(self, unit: int) -> slice:
        start = self.unit_start(unit)
        return slice(start, start + self.chunk_numel(unit) * self.shards)

    @property
    def padded_numel(self) -> int:
        """Elements of the padded flat buffer: every unit's padded region."""
        return self.shard_numel * self.shards

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard: one chunk of every unit."""
        return sum(self.chunk_numel(unit) for unit in range(len(self.units)))

    def param_slice(self, index: int) -> slice:
        """Parameter `index`'s elements in the flat buffer (its unit's padding comes after the unit's last)."""
        unit = next(u for u, members in enumerate(self.units) if index in members)
        start = self.unit_start(unit) + sum(self.numels[i] for i in self.units[unit] if i < index)
        return slice(start, start + self.numels[index])

    def owned(self, position: int) -> int:
        """The chunk of every unit that the rank at ring position `position` of its shard group owns."""
        return (position + 1) % self.shards

    def chunks(self, buffer, unit: int) -> list:
        """Unit `unit`'s region of a flat `buffer`, as its N chunks (views)."""
        return [self.chunk(buffer, unit, index) for index in range(self.shards)]

    def chunk(self, buffer, unit: int, index: int):
        """Chunk `index` of unit `unit`'s region of a flat `buffer` (a view): `chunks(buffer, unit)[index]`."""
        size = self.chunk_numel(unit)
        start = self.unit_start(unit) + index * size
        return buffer[start:start + size]

    def shard_slice(self, unit: int) -> slice:
        """Where unit `unit`'s chunk sits in a rank's shard: a chunk of each unit before it."""
        start = self.unit_start(unit) // self.shards
        return slice(start, start + self.chunk_numel(unit))
