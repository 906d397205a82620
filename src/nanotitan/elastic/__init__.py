"""Elastic jobs: nodes join and leave a running job, which re-plans its layout and goes on (docs/elastic.md).

    coordinator.py  node 0's store and the generations: who is a member, which layout each generation runs
    agent.py        one per node: registers, starts its node's ranks for each generation, serves its snapshot files
    rank.py         one rank of a generation: the Trainer, plus what the agents need to know
    snapshot.py     every K steps each rank's state in memory on its node, copied to a peer node
    replicas.py     which snapshot units each node keeps (per origin node), and a whole step assembled on node 0
    tempdirs.py     each agent's temp dir, marked with its owner; the dirs of agents provably gone, swept
    transport.py    the file transport between nodes (TCP, the job's members only)
    liveness.py     each agent's signed connection to node 0: a dead node noticed at once, a silent one in 4 s
    auth.py         the job secret and the MACs the members put on what they tell each other (docs/security.md)
"""
