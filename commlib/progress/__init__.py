"""Asynchronous work and overlap: issuing a collective inline or on the progress queue, Work handles, all-reduces in flight, the backward-order reducer."""
