"""Faults and waiting: the status board ranks share, its exchange across nodes, and the one bounded way a collective waits."""
