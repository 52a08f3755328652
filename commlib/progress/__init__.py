"""Asynchronous work: the progress queue of a communicator's collectives, Work handles, GPU stream order, all-reduces left in flight."""
