"""Seeded request workloads: the request record, synthetic generators, block chains and hit ceilings."""
