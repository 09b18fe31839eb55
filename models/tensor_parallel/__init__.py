"""One model sharded over the ranks of a tensor-parallel group: what each rank holds (shard.py), what its
forward needs from the others (collectives.py)."""
