"""Model parallelism (tensor, context/sequence and data parallel) for the ViT.

``groups``      process groups for the tp x cp x dp rank grid (``ParallelGroups``; ``SINGLE_PROCESS``
                without torch.distributed)
``mappings``    differentiable collectives named for their forward and backward
                (``identity_fwd_all_reduce_bwd``, ``all_gather_fwd_split_bwd``, ...)
``layers``      sharded layers and gradient reduction for replicated parameters
``parallelize`` serial ViT -> sharded ViT, image bands, the task's loss over bands, serial checkpoints
"""
