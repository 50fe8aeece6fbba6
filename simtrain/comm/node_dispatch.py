"""A token dispatch over two hops, the network first: each token crosses to a host once (DeepEP's internode path).

DeepSeek-V3 (arXiv 2412.19437, 3.2.2) sends a token to at most 4 nodes and
dispatches it as DeepEP does: over InfiniBand once to each destination node,
to the GPU with the same index there (the relay), which forwards it over
NVLink to the GPUs that hold its experts. `node_dispatch` is that path as a
per-rank program, for an all-to-all whose `counts[src][dst]` rows are in
rank src's `send` block by block (destination order, as comm/all_to_all.py's
programs take them) and land in rank dst's `recv` block by block (source
order), exactly where `pairwise_all_to_all` puts them:

1. over the network: rank (h, i) (host h, position i) sends relay (h', i)
   of every other host its blocks for that host's ranks; with `token_ids`
   (the token each sent row is: a token sent to several experts is several
   rows) only each token's first row, once, with each row's place among them
   (int32, 4 bytes a row: what the relay needs to make the rows again, as
   DeepEP sends each token's top-k indices). `node_rows[src][h']` is how many
   tokens rank src sends host h', which every rank knows beforehand (the
   counts exchange), so each receive is sized;
2. inside each host: relay (h', i) gives each host peer (h', j) the rows of
   every source on its rail (i) bound for (h', j), rows again, in one message;
   the blocks of its own host's sources take this hop alone.

Without `token_ids` every row crosses (it is the reverse of
comm/all_to_all.py's hierarchical order, PXN's). Between hosts a rank sends
one message to each of n-1 relays. With `token_ids` what crosses from host to
host is (tokens x hosts each reaches, other than its own) rows and 4 bytes a
row of the blocks; the second hop moves rows, not tokens (DeepEP's forwards a
token once to each GPU). Needs hosts of equal size.

    program = node_dispatch(rank, 4, send, recv, counts, hosts=[[0, 1], [2, 3]],
                            node_rows=[[3, 2], [4, 1], [2, 2], [0, 3]], token_ids=ids)
"""
import torch

from .ops import Recv, Send

ROW_INDEX = torch.int32  # the dtype of a row's place among its host's tokens


def node_dispatch(rank: int, world: int, send: torch.Tensor, recv: torch.Tensor, counts, *, hosts,
                  node_rows=None, token_ids: torch.Tensor | None = None, tag: int = 0):
    """Per-rank program: `recv` gets block (src, rank) of every rank's `send` (source order), through the relay on
    the sender's rail of each host; with `token_ids` each token crosses to a host once (the module's docstring)."""
    host = next(index for index, ranks in enumerate(hosts) if rank in ranks)
    position = hosts[host].index(rank)
    rails = [list(ranks) for ranks in zip(*hosts)]
    if len(rails) * len(hosts) != world or any(len(ranks) != len(hosts[host]) for ranks in hosts):
        raise ValueError(f"node dispatch needs hosts of equal size covering {world} ranks, got {hosts}")
    rows = lambda src, ranks: sum(int(counts[src][dst]) for dst in ranks)  # noqa: E731
    ids = None if token_ids is None else token_ids.split([rows(rank, ranks) for ranks in hosts])
    sends = send.split([int(counts[rank][dst]) for dst in range(world)])

    # 1. Over the network: to the relay at this rank's position on every host, what is bound for that host.
    staged, ops = {}, []  # staged[src]: (the tokens src sent this host, each row's place among them or None)
    for h, ranks in enumerate(hosts):
        if not rows(rank, ranks):
            continue
        block = torch.cat([sends[dst] for dst in ranks])
        payload, where = block, None
        if ids is not None:
            payload, where = _tokens_once(block, ids[h], node_rows[rank][h])
        if h == host:
            staged[rank] = payload, where
            continue
        ops += [Send(hosts[h][position], payload, tag)] + ([] if where is None else [Send(hosts[h][position], where,
                                                                                         tag)])
    for src in rails[position]:
        if src == rank or not rows(src, hosts[host]):
            continue
        sent = rows(src, hosts[host])
        payload = send.new_empty((sent if ids is None else node_rows[src][host], *send.shape[1:]))
        ops.append(Recv(src, payload, tag=tag))
        where = None
        if ids is not None:
            where = send.new_empty(sent, dtype=ROW_INDEX)
            ops.append(Recv(src, where, tag=tag))
        staged[src] = payload, where
    if ops:
        yield ops

    # 2. Inside the host: to each host peer, the rows of every source on this rail bound for it (rail order).
    recvs = recv.split([int(counts[src][rank]) for src in range(world)])
    ops, landed = [], []
    for j, dst in enumerate(hosts[host]):
        parts = []
        for src in rails[position]:
            if src in staged:
                payload, where = staged[src]
                start = rows(src, hosts[host][:j])
                span = slice(start, start + int(counts[src][dst]))
                parts.append((src, payload[span] if where is None else payload[where[span]]))
        if dst == rank:
            for src, part in parts:
                recvs[src].copy_(part)
        elif sum(int(counts[src][dst]) for src, _ in parts):
            ops.append(Send(dst, torch.cat([part for _, part in parts]), tag))
    for j, relay in enumerate(hosts[host]):
        sizes = [int(counts[src][rank]) for src in rails[j]]
        if relay != rank and sum(sizes):
            buffer = recv.new_empty((sum(sizes), *recv.shape[1:]))
            ops.append(Recv(relay, buffer, tag=tag))
            landed.append((rails[j], buffer.split(sizes)))
    if ops:
        yield ops
    for sources, blocks in landed:
        for src, block in zip(sources, blocks):
            recvs[src].copy_(block)
    return recv


def _tokens_once(block: torch.Tensor, ids: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each of `block`'s `tokens` tokens once, token order; each row's place among them) of rows whose tokens are
    `ids` (meta tensors: shapes alone)."""
    if block.is_meta or ids.is_meta:
        return block.new_empty((tokens, *block.shape[1:])), block.new_empty(len(ids), dtype=ROW_INDEX)
    unique, where = torch.unique(ids, return_inverse=True)
    if len(unique) != tokens:
        raise ValueError(f"node dispatch: {len(unique)} tokens in the rows for a host, the counts said {tokens}")
    first = torch.full((tokens,), len(ids), dtype=torch.long).scatter_reduce(
        0, where, torch.arange(len(ids)), "amin")
    return block[first], where.to(ROW_INDEX)
