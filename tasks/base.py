"""What a task answers where its problem has nothing of its own to say: the defaults every task
inherits (``class MyTask(Task)``), so that a new problem writes only what differs."""
from __future__ import annotations

import contextlib

import torch

from observe.flops import training_flops
from settings.errors import ConfigError


class Task:
    loss_name = ""  # the loss in words, for the start-up's Loss: line ("": its class's name)

    def sample_shape(self) -> tuple | None:
        """One input sample's shape, for the memory estimate before the first step (None: no
        estimate)."""
        return None

    def forward_kernels(self, device: torch.device, dtype: torch.dtype):
        """A factory of the context the forward pass runs under: torch's own kernel choices."""
        return contextlib.nullcontext

    def memory_format(self, device: torch.device) -> tuple[torch.memory_format, str]:
        """The layout of the model's weights, its batches and the loss, and why (for the log;
        empty: nothing to say): the default layout."""
        return torch.contiguous_format, ""

    def compile_options(self, memory_format: torch.memory_format) -> dict:
        """Options for torch.compile of the model in ``memory_format``: torch's defaults."""
        return {}

    def flops_per_sample(self, epoch: int = 0) -> int:
        """FLOPs of one sample's forward and backward pass, from ``forward_flops()``; a task whose
        training passes a sample through the model more than once counts each, in ``epoch``."""
        return training_flops(*self.forward_flops())

    def blocks(self, model) -> list:
        """The model's blocks, the units it is built of: FSDP gathers each one's weights together
        (``fsdp``), fp8 computes their linear layers (``fp8_linears``), and ``compile_blocks``
        compiles each on its own. None by default: the whole model is one unit."""
        return []

    def training_loss(self, model, x, y, loss, epoch: int) -> torch.Tensor:
        """The per-sample training loss of batch ``x``, ``y`` in epoch ``epoch`` (0-based):
        ``loss`` (the parallel model's: of this rank's part) of one forward pass of ``model``."""
        return loss(model(x), y)

    def forecast(self, model, x, whole) -> torch.Tensor:
        """Validation's prediction from ``x``: one forward pass of ``model``, made the whole
        output by ``whole`` (the sharding's gather of the ranks' parts)."""
        return whole(model(x))

    def skill(self, model, device: torch.device, forward, epoch: int, rank: int, world: int):
        """During training, after epoch ``epoch`` (0-based): the model's skill as its science
        scores it, briefly, as ({TensorBoard tag: value}, lines for the log), or None when the
        task has none to give after this epoch (the default: none). Collective over the
        ``world`` data-parallel ranks when it gives one; ``forward``: a factory of the forward
        pass's context (autocast, kernels)."""
        return None

    def score(self, model, device: torch.device, autocast, opts):
        """The trained ``model`` scored as its science judges it (``score.py``): an
        ``observe.score_report.Report``. A problem without such scores says so."""
        raise ConfigError(f"{type(self).__name__} has no scoring: score.py scores the ViT on "
                          f"ERA5 and the U-Net on cosmology volumes")
