"""Communication: every collective and P2P of the house, what it records, and the network it may be held to.

    collectives.py  the one thin layer for every collective and P2P (calls, bytes and wait per axis: COMM)
    stall.py        stall records: when a job hangs, which rank stopped and where every other rank waits
    emulate.py      network emulation: each call held to a modelled link's time (docs/emulate.md)
    fault.py        a planted fault (one element of one collective made wrong), for `nanotitan verify`'s own check
"""
