"""Turn the serial ViT into its tensor / context / sequence parallel form.

Data layout
-----------
Let ``T = tp * cp`` (the ranks of one model replica) and ``gh = H / patch_size`` the number of
patch rows. With sequence parallelism (``sequence_parallel=True``, chosen automatically when
``T`` divides ``gh``) the image is cut into ``T`` horizontal bands of ``gh / T`` whole patch
rows (full width); the replica rank with chunk index ``c = cp_rank * tp + tp_rank`` gets band
``c``:

* input: ``shard_image(x)`` -> ``x[:, :, c*H/T:(c+1)*H/T, :]`` (every channel, full width);
* tokens: the band's patches are, in the serial row-major order, tokens
  ``[c*N/T, (c+1)*N/T)``; the embedding, position embedding, LayerNorms, residuals and head
  work on these only. Attention/MLP gather the tokens of the cp rank over tp (heads / hidden
  units split over tp), and K/V over cp (see ``distributed.layers``);
* output: the model returns the same band of the output image, ``(B, C_out, H/T, W)``;
  ``gather_image`` reassembles ``(B, C_out, H, W)`` on every rank of the replica;
* loss: ``relative_l2_loss(pred_band, tar_band)`` sums per-sample squares over the replica
  (differentiable all-reduce) and equals the serial relative L2 loss.

Without sequence parallelism (``sequence_parallel=False``: the fallback when ``T`` does not
divide ``gh`` but ``cp`` does, e.g. the 45 patch rows of a 360 x 720 image at tp = 2 or 4) the
image is cut into ``cp`` bands of ``gh / cp`` rows and ``c = cp_rank``: every tp rank of a cp
rank holds the same band, its tokens, LayerNorm and residual activations (plain Megatron tensor
parallelism; tp still splits heads and MLP width). ``pos_embed`` is split over cp only; patch
embedding, LayerNorms, head and row-parallel biases are summed over cp only (the tp ranks
compute identical gradients for them); ``gather_image`` gathers over cp and the loss sums over
cp. ``choose_sequence_parallel`` says which mode a layout gets.

Data parallel ranks (same tp/cp coordinates, other dp coordinate) take different samples; with
``reduce_replicated_grads`` (or DDP over ``groups.dp_group`` with
``replicated_grads_comm_hook``) the gradients equal the serial gradients of the combined batch.

The sharded model's parameters have the serial names; ``serial_state_dict`` gathers them into
the serial layout (save checkpoints like that) and ``load_serial_state_dict`` slices a serial
state dict for any tp/cp layout; ``tensors_to_serial`` / ``tensors_from_serial`` do the same for
other per-parameter tensors such as optimizer moments (``optimizer.state[param]["exp_avg"]``).

Dropout: sharded activations on different ranks need different random streams; seed each rank
differently *after* ``parallelize_vit`` (weights come from the serial model, not from the RNG).
Activations replicated over tp (no sequence parallelism) get the same mask on every tp rank
(``distributed.layers.ReplicatedDropout``: tp rank 0 draws it and broadcasts it).
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from distributed.groups import ParallelGroups
from distributed.layers import (ParallelBlock, ParallelPatchEmbed, ReplicatedDropout, SequenceParallelLayerNorm,
                                ShardSpec, mark_module_replicated, sharded_parameter, check_divisible, divisor_choices,
                                load_serial_state_dict, serial_state_dict, tensors_from_serial,
                                tensors_to_serial)
from distributed.mappings import gather_from, reduce_from

__all__ = ["ParallelViT", "parallelize_vit", "validate_vit_layout", "choose_sequence_parallel",
           "sequence_parallel_summary", "image_rows", "shard_image", "gather_image", "relative_l2_loss",
           "serial_state_dict", "load_serial_state_dict", "tensors_to_serial", "tensors_from_serial"]


def _patch_rows(img_size, patch_size: int) -> int:
    if img_size[0] % patch_size or img_size[1] % patch_size:
        raise ValueError(f"img_size={list(img_size)} is not divisible by patch_size={patch_size}")
    return img_size[0] // patch_size


def choose_sequence_parallel(img_size, patch_size: int, tp: int, cp: int) -> bool:
    """Whether the ViT runs with sequence parallelism at ``tp`` x ``cp``.

    ``True`` when ``tp * cp`` divides the patch rows (tokens sharded over cp and tp), ``False``
    when only ``cp`` does (tokens sharded over cp, replicated over tp). ``ValueError`` when
    ``cp`` does not divide them: tokens are always sharded over cp in whole patch rows.
    """
    rows = _patch_rows(img_size, patch_size)
    if rows % cp:
        raise ValueError(
            f"context_parallel={cp} does not divide the {rows} patch rows (img height {img_size[0]} / patch_size "
            f"{patch_size}): tokens are sharded over cp in whole patch rows (and over tp as well, sequence "
            f"parallelism, when tensor_parallel x context_parallel divides them); choose context_parallel in "
            f"{divisor_choices(rows)}, or an img_size whose patch rows divide by {cp}, e.g. "
            f"{_fitting_img_size(img_size, patch_size, cp)}")
    return rows % (tp * cp) == 0


def _fitting_img_size(img_size, patch_size: int, chunks: int) -> list:
    """The largest img_size not above ``img_size`` (else the smallest) whose patch rows divide by ``chunks``."""
    rows = img_size[0] // patch_size
    return [max(rows // chunks, 1) * chunks * patch_size, img_size[1]]


def sequence_parallel_summary(img_size, patch_size: int, tp: int, cp: int, sequence_parallel: bool) -> str:
    """One line saying which mode a layout runs in and why (the engine logs it)."""
    rows = _patch_rows(img_size, patch_size)
    t = tp * cp
    if tp == 1:
        return "Sequence parallelism not needed at tensor_parallel=1" + (
            f": the {rows} patch rows are split over context_parallel={cp} ({rows // cp} per rank)" if cp > 1 else "")
    if sequence_parallel:
        return (f"Sequence parallelism on: the {rows} patch rows divide by tensor_parallel x context_parallel = "
                f"{t}; LayerNorm/residual activations are split over the tensor-parallel ranks "
                f"({rows // t} patch rows per rank)")
    if rows % t == 0:
        return (f"Sequence parallelism off (sequence_parallel=False): LayerNorm/residual activations are whole "
                f"on each tensor-parallel rank ({rows // cp} patch rows per context-parallel rank)")
    fit = _fitting_img_size(img_size, patch_size, t)
    return (f"Sequence parallelism off: the {rows} patch rows do not divide by tensor_parallel x "
            f"context_parallel = {t}; LayerNorm/residual activations are whole on each tensor-parallel rank "
            f"(an img_size whose patch rows divide by {t}, e.g. [{fit[0]}, {fit[1]}], turns it on)")


def validate_vit_layout(img_size, patch_size: int, embed_dim: int, num_heads: int, mlp_hidden_dim: int,
                        groups: ParallelGroups, sequence_parallel: Optional[bool] = None) -> bool:
    """Raise ``ValueError`` unless the ViT can be sharded over ``groups``' tp and cp; return
    whether it runs with sequence parallelism.

    ``sequence_parallel=None`` chooses (:func:`choose_sequence_parallel`); ``True`` requires
    tp x cp to divide the patch rows, ``False`` only cp.
    """
    tp, cp = groups.tp_size, groups.cp_size
    check_divisible("num_heads", num_heads, "tensor_parallel", tp)
    check_divisible("embed_dim", embed_dim, "tensor_parallel", tp)
    check_divisible("mlp hidden dim", mlp_hidden_dim, "tensor_parallel", tp)
    fits = choose_sequence_parallel(img_size, patch_size, tp, cp)
    if sequence_parallel and not fits:
        rows = img_size[0] // patch_size
        raise ValueError(
            f"context_parallel={cp} x tensor_parallel={tp} = {cp * tp} does not divide the {rows} patch rows "
            f"(img height {img_size[0]} / patch_size {patch_size}): with sequence parallelism tokens are "
            f"sharded over cp and tp in whole patch rows; choose context_parallel x tensor_parallel in "
            f"{divisor_choices(rows)}, or sequence_parallel=None/False (tokens sharded over cp only)")
    return fits if sequence_parallel is None else bool(sequence_parallel)


class ParallelViT(nn.Module):
    """The ViT sharded over tp and cp; build it with :func:`parallelize_vit`.

    ``forward(x_band) -> y_band``: ``x_band`` is ``shard_image(x)``, (B, C_in, H/T, W);
    the result is the same band of the serial output, (B, C_out, H/T, W), ``T = tp * cp`` with
    sequence parallelism, ``T = cp`` without (``sequence_parallel``; ``None`` chooses, see
    :func:`choose_sequence_parallel`).

    Parameters (names as in the serial ViT):

    * ``patch_embed.proj``, ``norm``, ``head``: whole on every rank; each rank applies them to
      its own tokens, so their gradients are summed over the ranks holding other tokens:
      ``reduce_over=("cp", "tp")`` with sequence parallelism, ``("cp",)`` without;
    * ``pos_embed``: split along tokens over (cp, tp) (or cp only), (1, N/T, E), no reduction;
    * blocks: see :class:`distributed.layers.ParallelBlock`.
    """

    def __init__(self, img_size, patch_size: int, in_chans: int, out_chans: int, embed_dim: int, depth: int,
                 num_heads: int, mlp_hidden_dim: int, groups: ParallelGroups, dropout: float = 0.0,
                 eps: float = 1e-5, activation_checkpointing: bool = False, sequence_parallel: Optional[bool] = True,
                 dtype=None, device=None):
        super().__init__()
        sp = validate_vit_layout(img_size, patch_size, embed_dim, num_heads, mlp_hidden_dim, groups,
                                 sequence_parallel)
        self.groups, self.sequence_parallel = groups, sp
        self.img_size, self.patch_size, self.out_chans = tuple(img_size), patch_size, out_chans
        self.activation_checkpointing = activation_checkpointing
        axes = ("cp", "tp") if sp else ("cp",)  # the axes the tokens are split over
        kw = dict(sequence_parallel=sp, dtype=dtype, device=device)
        self.patch_embed = ParallelPatchEmbed(img_size, patch_size, in_chans, embed_dim, groups, **kw)
        n, n_local = self.patch_embed.num_patches, self.patch_embed.local_num_patches
        self.pos_embed = sharded_parameter((1, n_local, embed_dim), ShardSpec((1, n, embed_dim), axes, 1),
                                           (), dtype, device)
        self.pos_drop = ReplicatedDropout(dropout, groups, sp)
        self.blocks = nn.ModuleList(
            ParallelBlock(embed_dim, num_heads, mlp_hidden_dim, groups, drop=dropout, eps=eps, **kw)
            for _ in range(depth))
        self.norm = SequenceParallelLayerNorm(embed_dim, groups, eps=eps, **kw)
        self.head = nn.Linear(embed_dim, out_chans * patch_size * patch_size, dtype=dtype, device=device)
        mark_module_replicated(self.head, axes)

    def sequence_parallel_summary(self) -> str:
        """One line: sequence parallelism on or off for this layout, and why."""
        return sequence_parallel_summary(self.img_size, self.patch_size, self.groups.tp_size, self.groups.cp_size,
                                         self.sequence_parallel)

    # ---- data in / out ----------------------------------------------------------------------
    def image_rows(self) -> Tuple[int, int]:
        """``(start, stop)`` image rows of this rank's band (to read only those from disk)."""
        return image_rows(self.groups, self.img_size[0], self.patch_size, self.sequence_parallel)

    def shard_image(self, x: torch.Tensor) -> torch.Tensor:
        return shard_image(x, self.groups, self.patch_size, self.sequence_parallel)

    def gather_image(self, y: torch.Tensor) -> torch.Tensor:
        return gather_image(y, self.groups, self.sequence_parallel)

    def loss(self, pred: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return relative_l2_loss(pred, target, self.groups, reduction, self.sequence_parallel)

    # ---- model --------------------------------------------------------------------------------
    def tokens_to_image(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N/T, C_out*p*p) -> (B, C_out, H/T, W): the rank's band of patch rows."""
        B, p = x.shape[0], self.patch_size
        gh, gw = self.patch_embed.local_grid
        x = x.reshape(B, gh, gw, self.out_chans, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(B, self.out_chans, gh * p, gw * p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pos_drop(self.patch_embed(x) + self.pos_embed)  # (B, N/T, E)
        for blk in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.tokens_to_image(self.head(self.norm(x)))


def parallelize_vit(model: nn.Module, groups: ParallelGroups, activation_checkpointing: bool = False,
                    sequence_parallel: Optional[bool] = True) -> ParallelViT:
    """Shard a serial ``networks.vit.ViT`` over ``groups`` (tp and cp), starting from its weights.

    Every rank of a replica must pass the same serial model (same config, seed and weights);
    each keeps only its slices. No communication. ``activation_checkpointing`` recomputes each
    block in backward (``torch.utils.checkpoint``, ``use_reentrant=False``).
    ``sequence_parallel``: ``True`` shards the tokens over cp and tp (tp x cp must divide the
    patch rows), ``False`` over cp only, ``None`` chooses (:func:`choose_sequence_parallel`:
    on when tp x cp divides the patch rows, otherwise off); ``pm.sequence_parallel`` says which.
    """
    ref = model.pos_embed
    blk = model.blocks[0] if len(model.blocks) else None
    embed_dim = ref.shape[-1]
    num_heads = blk.attn.num_heads if blk is not None else 1
    mlp_hidden = blk.mlp.fc1.out_features if blk is not None else embed_dim
    pm = ParallelViT(model.img_size, model.patch_size, model.patch_embed.proj.in_channels, model.out_chans,
                     embed_dim, len(model.blocks), num_heads, mlp_hidden, groups, dropout=model.pos_drop.p,
                     eps=model.norm.eps, activation_checkpointing=activation_checkpointing,
                     sequence_parallel=sequence_parallel, dtype=ref.dtype, device=ref.device)
    load_serial_state_dict(pm, model.state_dict(), groups)
    pm.train(model.training)
    return pm


# ---- image partition, gather and loss -----------------------------------------------------------

def _band(groups: ParallelGroups, sequence_parallel: bool) -> Tuple[int, int]:
    """(number of bands, this rank's band): tp x cp bands with sequence parallelism, cp without."""
    if sequence_parallel:
        return groups.mp_size, groups.mp_rank
    return groups.cp_size, groups.cp_rank


def image_rows(groups: ParallelGroups, height: int, patch_size: int,
               sequence_parallel: bool = True) -> Tuple[int, int]:
    """``(start, stop)`` rows of an image of ``height`` rows that this rank's band covers."""
    chunks, index = _band(groups, sequence_parallel)
    rows = height // patch_size
    if height % patch_size or rows % chunks:
        what = (f"context_parallel={groups.cp_size} x tensor_parallel={groups.tp_size} = {chunks}"
                if sequence_parallel else f"context_parallel={chunks}")
        raise ValueError(f"{what} does not divide the {rows} patch rows of height {height} / patch_size {patch_size}")
    band = height // chunks
    return index * band, (index + 1) * band


def shard_image(x: torch.Tensor, groups: ParallelGroups, patch_size: int,
                sequence_parallel: bool = True) -> torch.Tensor:
    """This rank's band of a full ``(..., H, W)`` image: rows ``image_rows(groups, H, patch_size)``."""
    start, stop = image_rows(groups, x.shape[-2], patch_size, sequence_parallel)
    if stop - start == x.shape[-2]:
        return x
    return x[..., start:stop, :].contiguous()  # a copy, so the full image can be freed


def gather_image(y: torch.Tensor, groups: ParallelGroups, sequence_parallel: bool = True) -> torch.Tensor:
    """Full ``(B, C, H, W)`` from every replica rank's band (collective over tp and cp; over cp
    only without sequence parallelism, where the tp ranks hold the same band).

    Differentiable (``gather_from``: the backward keeps this rank's band), for use on results that
    are then computed identically on every rank of the replica.
    """
    dim = y.dim() - 2
    if sequence_parallel:
        y = gather_from(y, groups.tp_group, dim)  # tp bands are adjacent inside a cp band
    return gather_from(y, groups.cp_group, dim)


def relative_l2_loss(pred: torch.Tensor, target: torch.Tensor, groups: Optional[ParallelGroups] = None,
                     reduction: str = "mean", sequence_parallel: bool = True) -> torch.Tensor:
    """``||pred - target||_2 / ||target||_2`` per sample, over all its (C, H, W) values.

    ``pred`` and ``target`` are this rank's bands; the per-sample sums of squares are added over
    the ranks holding different bands, with ``reduce_from`` (forward all-reduce, backward
    identity): the replica (tp x cp) with sequence parallelism, cp only without (the tp ranks
    hold the same band; summing over them would count it tp times). The value equals the serial
    loss on every rank and each rank's gradient is that of its band.
    ``reduction="mean"``: batch mean (the training loss); ``"none"``: the (B,) per-sample values.
    Sums are taken in at least float32 (bf16/fp16 outputs under autocast).
    """
    dtype = torch.promote_types(pred.dtype, torch.float32)
    diff = (pred.to(dtype) - target.to(dtype)).flatten(1).pow(2).sum(1)
    ref = target.to(dtype).flatten(1).pow(2).sum(1)
    sums = torch.stack([diff, ref])
    if groups is not None:
        sums = reduce_from(sums, groups.mp_group if sequence_parallel else groups.cp_group)
    per_sample = sums[0].sqrt() / sums[1].sqrt()
    if reduction == "none":
        return per_sample
    if reduction != "mean":
        raise ValueError(f"reduction={reduction!r}: expected 'mean' or 'none'")
    return per_sample.mean()
