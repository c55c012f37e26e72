"""``--transport redis-sortedset``: a sorted set per queue, scored by deadline, with leased
claims (``transport`` is the seam's implementation; the other modules are its parts)."""
