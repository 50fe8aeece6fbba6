"""The limits of what simtrain accepts, decided once and documented here.

A scenario, a topology file or a command line is checked against these
bounds before anything runs, so that an absurd input ends in one line naming
its field instead of a MemoryError, an OverflowError or a host that runs out of
memory. The bounds are far above any study simtrain is meant for and below
what would take the host down; README's "Limits and hostile input" lists them.

    from simtrain.limits import MAX_DEVICES
    Field(ge=1, le=MAX_DEVICES)

Memory the host really has is checked separately, per run (host_memory.py).
"""

# Files a user names (user_files.py): scenarios and topology files.
MAX_FILE_BYTES = 512 << 10  # 512 KiB: a file is read up to this size and refused past it (parsing it takes ~3 s)
MAX_YAML_DEPTH = 32  # nested mappings and lists; a scenario uses 5
MAX_INTEGER_DIGITS = 64  # an integer literal with more digits is refused before Python converts it
MAX_NAME_BYTES = 128  # `name`, in UTF-8: the default output folder runs/<name>/ takes it

# Counts.
MAX_DEVICES = 131_072  # simulated devices of one cluster (cluster.devices, a topology file's gpus, --devices)
MAX_PROCESSES = 4096  # real processes of one simtrain launch or calibrate on this host (--nproc)
MAX_LINKS = 500_000  # links of one topology (about 1.4 KiB of host memory each): fully_connected up to 1,000 GPUs
MAX_SWEEP_RUNS = 10_000  # runs of one simtrain sweep (the product of its grids)
MAX_STEPS = 1_000_000  # train.steps, and any count of steps (intervals, annealing)
MAX_MH_STEPS = 1_000  # data.mh.steps: proposals per batch slot per batch, each a host draw
MAX_SCHEDULE_ENTRIES = 1_000  # train.schedule entries (each validated, ~0.4 ms); values of one pbt mutation list
MAX_SAMPLES = 100_000_000  # data.samples of a synthetic data set
MAX_FEATURES = 1_000_000  # data.features, data.classes
MAX_WIDTH = 1_000_000  # one hidden layer's width or one convolution's channels
MAX_LAYERS = 1_000  # entries of model.hidden or model.channels, model.layers of a gpt
MAX_SEQ_LEN = 65_536  # data.seq_len of token data (a gpt's attention holds seq_len^2 scores per head)
MAX_HEADS = 4_096  # model.heads of a gpt
MAX_CAPACITY_FACTOR = float(MAX_HEADS)  # model.moe.capacity_factor: at experts / top_k (at most 4,096) an
#   expert keeps every assignment, so a larger factor changes nothing
MAX_MICROBATCHES = 4_096  # parallel.pipeline.microbatches
MAX_BATCH_SIZE = 1_000_000  # data.batch_size, per device
MAX_CHANNELS = 64  # parallel.channels, --channels: all-reduce channels (NCCL's own limit is 32 or 64 by version)
MAX_SEED = 2**32 - 1  # seed: every derived torch and numpy seed stays in range
MAX_FAULTS = 1_000  # cluster.faults entries, fleet.failures entries
MAX_FLEET_EVENTS = 2_000_000  # failures, slowdowns and checkpoints a fleet run expects (about 10 us of host time each)

# Quantities, in SI units (units.parse_quantity); zero passes to the field's own check.
QUANTITY_RANGES = {
    "bytes": (1.0, 2.0**60),  # 1 B to 1 EiB
    "bandwidth": (1.0, 1e18),  # 1 B/s to 1 EB/s
    "time": (0.0, 1e6),  # up to about 11.6 days per hop or per access
    "flops": (1.0, 1e21),  # 1 FLOP/s to 1 ZFLOP/s
    "long_time": (0.0, 1e11),  # a fleet's horizon, one component's mean time between failures: up to ~3,000 years
}
MAX_LEARNING_RATE = 1e6  # past this, every update overflows fp32 parameters
MAX_SLOWDOWN = 1e6  # cluster.overrides.<rank>.slowdown
MIN_EFFICIENCY = 1e-6  # a device's efficiency (fraction of peak): with MAX_SLOWDOWN, every span stays finite
MAX_COMPUTE_JITTER = 2.0  # std of log(factor): a span stays within e^(+-8) of its mean at 4 sigma
MAX_COMPUTE_JITTER_FIXED = 1.0  # s: far past any host's scheduling noise (a time slice is milliseconds)
MAX_COLLECTIVE_BYTES = 1 << 40  # simtrain collective --sizes: 1 TiB per rank

# Chakra execution traces given to `simtrain replay` (replay/trace_file.py): each file's size is checked before it
# is read, and the nodes are counted as they are decoded (a replay holds about 2 KiB of host memory per node).
MAX_CHAKRA_FILE_BYTES = 256 << 20  # 256 MiB per file: about two million nodes of simtrain's own traces
MAX_CHAKRA_NODES = 1_000_000  # nodes of all the ranks' traces together

# A ring all-reduce whose positions differ (chunks of two sizes: a buffer that does not split evenly over the ring)
# is timed position by position (hw/ring_timing.py): N positions x 2(N - 1) steps, about 22 ns each on the 2-core
# machine (a 10,000-position ring in 4.5 s, 2026-12-07). Past this many, the ring is refused in one line at its
# first collective (about 45 s of timing): a 100,000-rank flat ring would take some 7 minutes a ring.
MAX_RING_POSITION_STEPS = 2_000_000_000
