"""Collective planning and checks: the session every call goes through, each collective's steps, fusion into buckets, argument and consistency checks, counters."""
