"""Where sharded data parallelism puts each parameter: units, padded flat buffers, chunks and owners (pure logic).

The model's trainable parameters, in `model.parameters()` order, are laid
end to end in one flat buffer (the parameters', the gradients', as DDP's
gradient bucket). They are grouped into **units**, the granularity at which
FSDP gathers parameters and reduce-scatters gradients: an entry of the
model's nn.Sequential with parameters starts a unit, and the parameterless
entries after it join it (train/partition.py's `model_units`: for a gpt the
embedding, each transformer block and the head; for an mlp each Linear with
its ReLU); a model that is not an nn.Sequential is one unit.

Each unit's region is padded with zeros to a multiple of its shard group's
size N and cut into N equal chunks, as FSDP pads a flat parameter. The rank at
position p of a shard group owns chunk (p + 1) mod N of every unit: the chunk
a ring reduce-scatter leaves at position p, and the one a ring all-gather
starts from there (comm/ring.py). A rank's shard is its chunk of every unit,
end to end: `shard_numel` elements, Psi / N when each unit's size divides
by N, else sum over units of ceil(Psi_u / N). Units may be sharded over
groups of different sizes: `shards` is one N for every unit, or one per unit
(Megatron-Core's distributed optimizer shards the dense parameters over the
data-parallel group and an MoE's experts over the experts' own, smaller one).

    layout = ShardLayout([p.numel() for p in params], units=[[0, 1], [2, 3]], shards=4)
    layout.padded_numel, layout.shard_numel, layout.owned(unit=0, position=1)
    chunks = layout.chunks(flat_buffer, unit=0)        # N views of unit 0's region
    owned = layout.chunk(flat_buffer, unit=0, index=layout.owned(0, position=1))
    flat_buffer[layout.param_slice(2)]                 # parameter 2's elements
    ShardLayout(numels, units=[dense, experts], shards=(8, 2))   # each unit over its own group
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardLayout:
    """Units of parameters in a padded flat buffer, each cut into as many chunks as its shard group has ranks."""

    numels: tuple[int, ...]  # each trainable parameter's elements, in model.parameters() order
    units: tuple[tuple[int, ...], ...]  # each unit's parameter indices, contiguous, in order
    unit_shards: tuple[int, ...]  # each unit's N: its shard group's ranks

    def __init__(self, numels, units, shards: int | tuple[int, ...]):
        object.__setattr__(self, "numels", tuple(numels))
        object.__setattr__(self, "units", tuple(tuple(unit) for unit in units))
        unit_shards = (shards,) * len(self.units) if isinstance(shards, int) else tuple(shards)
        if len(unit_shards) != len(self.units):
            raise ValueError(f"one shard count per unit: {len(self.units)} units, got {unit_shards}")
        object.__setattr__(self, "unit_shards", unit_shards)
        flat = [index for unit in self.units for index in unit]
        if flat != list(range(len(self.numels))):
            raise ValueError(f"units must cover parameters 0..{len(self.numels) - 1} in order, got {self.units}")
        # each unit's chunk size, where its padded region starts and where its chunk sits in a shard: read per unit
        # and rank every step
        sizes = tuple(-(-self.unit_numel(unit) // n) for unit, n in enumerate(unit_shards))
        regions = [size * n for size, n in zip(sizes, unit_shards)]
        object.__setattr__(self, "_chunk_numels", sizes)
        object.__setattr__(self, "_unit_starts", tuple(sum(regions[:unit]) for unit in range(len(sizes))))
        object.__setattr__(self, "_shard_starts", tuple(sum(sizes[:unit]) for unit in range(len(sizes))))

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
        return slice(start, start + self.chunk_numel(unit) * self.unit_shards[unit])

    @property
    def padded_numel(self) -> int:
        """Elements of the padded flat buffer: every unit's padded region."""
        return sum(self.chunk_numel(unit) * n for unit, n in enumerate(self.unit_shards))

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard: one chunk of every unit."""
        return sum(self._chunk_numels)

    def param_slice(self, index: int) -> slice:
        """Parameter `index`'s elements in the flat buffer (its unit's padding comes after the unit's last)."""
        unit = next(u for u, members in enumerate(self.units) if index in members)
        start = self.unit_start(unit) + sum(self.numels[i] for i in self.units[unit] if i < index)
        return slice(start, start + self.numels[index])

    def owned(self, unit: int, position: int) -> int:
        """The chunk of unit `unit` that the rank at ring position `position` of the unit's shard group owns."""
        return (position + 1) % self.unit_shards[unit]

    def chunks(self, buffer, unit: int) -> list:
        """Unit `unit`'s region of a flat `buffer`, as its N chunks (views)."""
        return [self.chunk(buffer, unit, index) for index in range(self.unit_shards[unit])]

    def chunk(self, buffer, unit: int, index: int):
        """Chunk `index` of unit `unit`'s region of a flat `buffer` (a view): `chunks(buffer, unit)[index]`."""
        size = self.chunk_numel(unit)
        start = self.unit_start(unit) + index * size
        return buffer[start:start + size]

    def shard_slice(self, unit: int) -> slice:
        """Where unit `unit`'s chunk sits in a rank's shard: a chunk of each unit before it."""
        start = self._shard_starts[unit]
        return slice(start, start + self.chunk_numel(unit))
