"""Faults: the status board ranks share (who entered what, who left and why, whom uneven steps blame) and its exchange across nodes."""
