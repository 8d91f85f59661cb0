"""Model parallelism (tensor, context/sequence and data parallel) for the ViT.

``groups``      process groups for the tp x cp x dp rank grid (``ParallelGroups``)
``mappings``    differentiable collectives (copy_to, reduce_from, scatter_to, gather_from,
                all_gather, reduce_scatter)
``layers``      sharded layers and gradient reduction for replicated parameters
``parallelize`` serial ViT -> sharded ViT, image sharding, distributed loss, serial checkpoints
"""
from distributed.groups import ParallelGroups, build_groups, group_ranks, validate_parallel_config

__all__ = ["ParallelGroups", "build_groups", "group_ranks", "validate_parallel_config"]
