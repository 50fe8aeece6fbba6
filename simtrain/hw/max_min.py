"""Max-min fair sharing of directed links by flows: the rates progressive filling gives.

A flow crosses directed links, each with a bandwidth (bytes/s). Max-min
fairness gives every flow the largest rate such that no flow's rate could grow
without lowering a smaller one's; progressive filling finds it by repeatedly
saturating the link whose fair share (its unallocated bandwidth over its flows
not yet fixed) is smallest, and fixing the rates of that link's flows at that
share. Only the flows connected to the ones that changed need new rates: the
component reached from them through shared links (hw/network.py reshares
when a flow starts, ends or its links change).

    for flow, rate in max_min_rates(seeds):   # every flow of the seeds' components, in discovery order
        ...

A link here is anything with `bandwidth` and `flows` (the flows on it, in
arrival order); a flow anything with `links`. The computation writes its
working figures `cap` and `unfixed` on the links.
"""
from heapq import heappop, heappush


def max_min_rates(seeds) -> list[tuple]:
    """(flow, rate) for every flow of the components of `seeds`, in breadth-first order from the seeds."""
    # Components: breadth-first over flows and the directed links they share.
    members = dict.fromkeys(seeds)
    links = {}
    queue = list(members)
    for flow in queue:
        for link in flow.links:
            if link not in links:
                links[link] = None
                for other in link.flows:
                    if other not in members:
                        members[other] = None
                        queue.append(other)
    # Progressive filling: repeatedly saturate the link with the smallest fair share. Shares only grow as
    # flows get fixed, so a heap with lazy re-insertion finds the bottleneck; the index breaks ties in order.
    heap = []
    for index, link in enumerate(links):
        link.cap = link.bandwidth
        link.unfixed = len(link.flows)
        heap.append((link.bandwidth / link.unfixed, index, link))
    heap.sort()
    rates = {}
    while heap:
        share, index, link = heappop(heap)
        if not link.unfixed:
            continue
        current = link.cap / link.unfixed
        if current != share:
            heappush(heap, (current, index, link))
            continue
        for flow in link.flows:
            if flow in rates:
                continue
            rates[flow] = share
            for other in flow.links:
                other.cap -= share
                other.unfixed -= 1
    return [(flow, rates[flow]) for flow in queue]
