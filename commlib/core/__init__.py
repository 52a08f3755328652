"""The bottom layer: element types, the one bounded wait, the fingerprints of calls, the caches of lists seen before, and which GPU libraries are usable."""
