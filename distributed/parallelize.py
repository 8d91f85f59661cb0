"""Turn the serial ViT into its tensor / context / sequence parallel form.

Data layout
-----------
Let ``T = tp * cp`` (the ranks of one model replica) and ``gh = H / patch_size`` the number of
patch rows; :func:`token_layout` picks one of three layouts (the engine logs which).

Row bands (sequence parallelism, ``T`` divides ``gh``): the image is cut into ``T`` horizontal
bands of ``gh / T`` whole patch rows (full width); the replica rank with chunk index
``c = cp_rank * tp + tp_rank`` gets band ``c``:

* input: ``shard_image(x)`` -> ``x[:, :, c*H/T:(c+1)*H/T, :]`` (every channel, full width);
* tokens: the band's patches are, in the serial row-major order, tokens
  ``[c*N/T, (c+1)*N/T)``; the embedding, position embedding, LayerNorms, residuals and head
  work on these only. Attention/MLP gather the tokens of the cp rank over tp (heads / hidden
  units split over tp), and K/V over cp (see ``distributed.layers``);
* output: the model returns the same band of the output image, ``(B, C_out, H/T, W)``;
  ``gather_image`` reassembles ``(B, C_out, H, W)`` on every rank of the replica;
* loss: ``relative_l2_loss(pred_band, tar_band)`` sums per-sample squares over the replica
  (differentiable all-reduce) and equals the serial relative L2 loss.

Padded sequence parallelism (``T`` does not divide ``gh`` but ``cp`` does, e.g. the 45 patch
rows of a 360 x 720 image at tp = 2 or 4): the image is cut into ``cp`` bands (``c = cp_rank``,
every tp rank of a cp rank gets the same band and embeds it, a cheap convolution); the band's
``n`` tokens, padded with zeros to ``tp * ceil(n / tp)``, are split into tp equal chunks and
each rank keeps its own from there to the head, so the LayerNorm/residual activations are still
split over tp. Padding tokens never reach a real one: attention drops them from the keys and
values (``ParallelAttention(seq_pad=...)``), every other op is per token, so their gradients
are zero and the result equals the serial model. After the head the chunks are gathered over
tp and the padding dropped: the output is the cp band, ``gather_image`` gathers over cp and the
loss sums over cp only. ``pos_embed`` holds the cp band's slice, used chunk by chunk, so its
gradient is summed over tp.

No sequence parallelism (``sequence_parallel=False``): ``cp`` bands as above, and every tp
rank of a cp rank holds the band's tokens, LayerNorm and residual activations whole (plain
Megatron tensor parallelism; tp still splits heads and MLP width). ``pos_embed`` is split over
cp only; patch embedding, LayerNorms, head and row-parallel biases are summed over cp only (the
tp ranks compute identical gradients for them).

Data parallel ranks (same tp/cp coordinates, other dp coordinate) take different samples; with
``reduce_replicated_grads`` (or DDP over ``groups.dp_group`` with
``replicated_grads_comm_hook``) the gradients equal the serial gradients of the combined batch.

The sharded model's parameters have the serial names; ``serial_state_dict`` gathers them into
the serial layout (save checkpoints like that) and ``load_serial_state_dict`` slices a serial
state dict for any tp/cp layout; ``tensors_to_serial`` / ``tensors_from_serial`` do the same for
other per-parameter tensors such as optimizer moments (``optimizer.state[param]["exp_avg"]``).

Dropout: sharded activations on different ranks need different random streams; seed each rank
differently *after* ``parallelize_vit`` (weights come from the serial model, not from the RNG).
Activations replicated over tp (sequence parallelism off) get the same mask on every tp rank
(``distributed.layers.ReplicatedDropout``: tp rank 0 draws it and broadcasts it).
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from distributed.groups import ParallelGroups
from distributed.layers import (ParallelBlock, ParallelPatchEmbed, ReplicatedDropout, SequenceParallelLayerNorm,
                                ShardSpec, mark_module_replicated, sharded_parameter, check_divisible, divisor_choices,
                                load_serial_state_dict, serial_state_dict, tensors_from_serial,
                                tensors_to_serial)
from distributed.mappings import gather_from, reduce_from

__all__ = ["ParallelViT", "parallelize_vit", "validate_vit_layout", "TokenLayout", "token_layout",
           "sequence_parallel_summary", "image_rows", "shard_image", "gather_image", "relative_l2_loss",
           "serial_state_dict", "load_serial_state_dict", "tensors_to_serial", "tensors_from_serial"]


def _patch_rows(img_size, patch_size: int) -> int:
    if img_size[0] % patch_size or img_size[1] % patch_size:
        raise ValueError(f"img_size={list(img_size)} is not divisible by patch_size={patch_size}")
    return img_size[0] // patch_size


@dataclass(frozen=True)
class TokenLayout:
    """How the tokens of one model replica are laid out over its tp x cp ranks.

    * ``sequence_parallel``: the activations outside the linears (LayerNorm, residual, dropout)
      are split over tp (at tp = 1 there is nothing to split);
    * ``row_bands``: the image is cut into ``tp * cp`` bands of whole patch rows (tp x cp
      divides the rows); otherwise into ``cp`` bands, every tp rank of a cp rank embedding the
      same band (``bands``);
    * ``band_tokens``: tokens of one band; ``local_tokens``: tokens a rank holds between the
      linears; ``pad``: zero tokens appended to each cp band so that tp divides it.
    * ``padded`` (sequence parallel without row bands): the cp band's tokens, padded to
      ``local_tokens * tp``, are split into tp equal chunks, which need not be whole rows.
    """

    sequence_parallel: bool
    row_bands: bool
    bands: int
    band_tokens: int
    local_tokens: int
    pad: int = 0

    @property
    def padded(self) -> bool:
        return self.sequence_parallel and not self.row_bands


def token_layout(img_size, patch_size: int, tp: int, cp: int, sequence_parallel: bool = True) -> TokenLayout:
    """The :class:`TokenLayout` of a ViT image at ``tp`` x ``cp``.

    Tokens are always split over cp in whole patch rows (``ValueError`` naming the choices when
    cp does not divide them). With ``sequence_parallel`` and tp > 1 they are further split over
    tp: in whole patch rows when tp x cp divides the rows, else in equal chunks of the cp band's
    tokens padded with ``(-tokens) % tp`` zero tokens (e.g. 360 x 720 at patch 8, tp = 4: 45
    rows, 4050 tokens, 2 pad tokens, 1013 per rank). ``sequence_parallel=False``: split over cp
    only, every tp rank of a cp rank holds the same tokens (plain Megatron tensor parallelism).
    """
    rows = _patch_rows(img_size, patch_size)
    cols = img_size[1] // patch_size
    if rows % cp:
        raise ValueError(
            f"context_parallel={cp} does not divide the {rows} patch rows (img height {img_size[0]} / patch_size "
            f"{patch_size}): tokens are sharded over cp in whole patch rows; choose context_parallel in "
            f"{divisor_choices(rows)}, or an img_size whose patch rows divide by {cp}, e.g. "
            f"{_fitting_img_size(img_size, patch_size, cp)}")
    n_band = rows // cp * cols
    if tp == 1 or (sequence_parallel and rows % (tp * cp) == 0):
        n = rows // (tp * cp) * cols
        return TokenLayout(True, True, tp * cp, n, n)
    if not sequence_parallel:
        return TokenLayout(False, False, cp, n_band, n_band)
    local = -(-n_band // tp)
    return TokenLayout(True, False, cp, n_band, local, local * tp - n_band)


def _fitting_img_size(img_size, patch_size: int, chunks: int) -> list:
    """The largest img_size not above ``img_size`` (else the smallest) whose patch rows divide by ``chunks``."""
    rows = img_size[0] // patch_size
    return [max(rows // chunks, 1) * chunks * patch_size, img_size[1]]


def sequence_parallel_summary(img_size, patch_size: int, tp: int, cp: int, sequence_parallel: bool = True) -> str:
    """One line saying how a layout splits the tokens and why (the engine logs it)."""
    lay = token_layout(img_size, patch_size, tp, cp, sequence_parallel)
    rows = _patch_rows(img_size, patch_size)
    if tp == 1:
        return "Sequence parallelism not needed at tensor_parallel=1" + (
            f": the {rows} patch rows are split over context_parallel={cp} ({rows // cp} per rank)" if cp > 1 else "")
    if not lay.sequence_parallel:
        return (f"Sequence parallelism off (sequence_parallel=False): LayerNorm/residual activations are whole "
                f"on each tensor-parallel rank ({lay.band_tokens} tokens per context-parallel rank)")
    if lay.row_bands:
        return (f"Sequence parallelism on: the {rows} patch rows divide by tensor_parallel x context_parallel = "
                f"{tp * cp}; LayerNorm/residual activations are split over the tensor-parallel ranks "
                f"({rows // (tp * cp)} patch rows per rank)")
    fit = _fitting_img_size(img_size, patch_size, tp * cp)
    pad = f", {lay.pad} padding token{'s' if lay.pad != 1 else ''} per band" if lay.pad else ""
    return (f"Sequence parallelism on, padded: the {rows} patch rows do not divide by tensor_parallel x "
            f"context_parallel = {tp * cp}, so the {lay.band_tokens} tokens of each context-parallel band are "
            f"split into {tp} chunks of {lay.local_tokens}{pad} (an img_size whose patch rows divide by {tp * cp}, "
            f"e.g. [{fit[0]}, {fit[1]}], also splits the image bands over tensor_parallel)")


def validate_vit_layout(img_size, patch_size: int, embed_dim: int, num_heads: int, mlp_hidden_dim: int,
                        groups: ParallelGroups, sequence_parallel: bool = True) -> TokenLayout:
    """Raise ``ValueError`` unless the ViT can be sharded over ``groups``' tp and cp; return
    its :class:`TokenLayout`."""
    tp, cp = groups.tp_size, groups.cp_size
    check_divisible("num_heads", num_heads, "tensor_parallel", tp)
    check_divisible("embed_dim", embed_dim, "tensor_parallel", tp)
    check_divisible("mlp hidden dim", mlp_hidden_dim, "tensor_parallel", tp)
    return token_layout(img_size, patch_size, tp, cp, sequence_parallel)


class ParallelViT(nn.Module):
    """The ViT sharded over tp and cp; build it with :func:`parallelize_vit`.

    ``forward(x_band) -> y_band``: ``x_band`` is ``shard_image(x)``, (B, C_in, H/T, W); the
    result is the same band of the serial output, (B, C_out, H/T, W), with ``T = tp * cp`` row
    bands (``layout.row_bands``) or ``T = cp`` (padded sequence parallelism, or none).

    Parameters (names as in the serial ViT):

    * ``patch_embed.proj``, ``norm``, ``head``: whole on every rank; each rank applies them to
      its own tokens (padded mode: the patch embedding to its cp band, of which it keeps its tp
      chunk), so their gradients are summed over the ranks holding other tokens:
      ``reduce_over=("cp", "tp")`` with sequence parallelism, ``("cp",)`` without;
    * ``pos_embed``: split along tokens over the image bands, (1, N/T, E); in padded mode the
      tp ranks hold the cp band's whole slice and use their chunk of it: summed over tp;
    * blocks: see :class:`distributed.layers.ParallelBlock`.
    """

    def __init__(self, img_size, patch_size: int, in_chans: int, out_chans: int, embed_dim: int, depth: int,
                 num_heads: int, mlp_hidden_dim: int, groups: ParallelGroups, dropout: float = 0.0,
                 eps: float = 1e-5, activation_checkpointing: bool = False, sequence_parallel: bool = True,
                 dtype=None, device=None):
        super().__init__()
        lay = validate_vit_layout(img_size, patch_size, embed_dim, num_heads, mlp_hidden_dim, groups,
                                  sequence_parallel)
        self.groups, self.layout = groups, lay
        self.img_size, self.patch_size, self.out_chans = tuple(img_size), patch_size, out_chans
        self.activation_checkpointing = activation_checkpointing
        sp = lay.sequence_parallel
        token_axes = ("cp", "tp") if sp else ("cp",)  # the axes whose ranks hold other tokens
        band_axes = ("cp", "tp") if lay.row_bands else ("cp",)  # the axes the image bands are cut over
        kw = dict(sequence_parallel=sp, dtype=dtype, device=device)
        self.patch_embed = ParallelPatchEmbed(img_size, patch_size, in_chans, embed_dim, groups, dtype=dtype,
                                              device=device, sequence_parallel=lay.row_bands,
                                              reduce_over=token_axes)
        n = self.patch_embed.num_patches
        self.pos_embed = sharded_parameter((1, lay.band_tokens, embed_dim), ShardSpec((1, n, embed_dim), band_axes, 1),
                                           ("tp",) if lay.padded else (), dtype, device)
        self.pos_drop = ReplicatedDropout(dropout, groups, sp)
        self.blocks = nn.ModuleList(
            ParallelBlock(embed_dim, num_heads, mlp_hidden_dim, groups, drop=dropout, eps=eps,
                          seq_pad=lay.pad if lay.padded else 0, **kw)
            for _ in range(depth))
        self.norm = SequenceParallelLayerNorm(embed_dim, groups, eps=eps, **kw)
        self.head = nn.Linear(embed_dim, out_chans * patch_size * patch_size, dtype=dtype, device=device)
        mark_module_replicated(self.head, token_axes)

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sequence_parallel

    def sequence_parallel_summary(self) -> str:
        """One line: how the tokens are split for this layout, and why."""
        return sequence_parallel_summary(self.img_size, self.patch_size, self.groups.tp_size, self.groups.cp_size,
                                         self.sequence_parallel)

    # ---- data in / out ----------------------------------------------------------------------
    def image_rows(self) -> Tuple[int, int]:
        """``(start, stop)`` image rows of this rank's band (to read only those from disk)."""
        return image_rows(self.groups, self.img_size[0], self.patch_size, self.layout.row_bands)

    def shard_image(self, x: torch.Tensor) -> torch.Tensor:
        return shard_image(x, self.groups, self.patch_size, self.layout.row_bands)

    def gather_image(self, y: torch.Tensor) -> torch.Tensor:
        return gather_image(y, self.groups, self.layout.row_bands)

    def loss(self, pred: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return relative_l2_loss(pred, target, self.groups, reduction, self.layout.row_bands)

    # ---- model --------------------------------------------------------------------------------
    def tokens_to_image(self, x: torch.Tensor) -> torch.Tensor:
        """(B, tokens of the band, C_out*p*p) -> (B, C_out, band rows, W): the rank's image band."""
        B, p = x.shape[0], self.patch_size
        gh, gw = self.patch_embed.local_grid
        x = x.reshape(B, gh, gw, self.out_chans, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(B, self.out_chans, gh * p, gw * p)

    def _tp_chunk(self, x: torch.Tensor) -> torch.Tensor:
        """Padded mode: this tp rank's chunk of the cp band's tokens, padded with zeros to tp chunks.

        A copy (not a view), so the band's whole token tensor is freed."""
        lay, r = self.layout, self.groups.tp_rank
        n = lay.local_tokens
        if (r + 1) * n > lay.band_tokens:  # the last chunk(s) hold the padding
            x = F.pad(x, (0, 0, 0, lay.pad))
        return x.narrow(1, r * n, n).clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x) + self.pos_embed  # (B, tokens of the rank's image band, E)
        if self.layout.padded:
            x = self._tp_chunk(x)
        x = self.pos_drop(x)  # (B, local_tokens, E)
        for blk in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        x = self.head(self.norm(x))
        if self.layout.padded:  # the cp band's tokens again: gather the tp chunks, drop the padding
            x = gather_from(x, self.groups.tp_group, 1).narrow(1, 0, self.layout.band_tokens)
        return self.tokens_to_image(x)


def parallelize_vit(model: nn.Module, groups: ParallelGroups, activation_checkpointing: bool = False,
                    sequence_parallel: bool = True) -> ParallelViT:
    """Shard a serial ``networks.vit.ViT`` over ``groups`` (tp and cp), starting from its weights.

    Every rank of a replica must pass the same serial model (same config, seed and weights);
    each keeps only its slices. No communication. ``activation_checkpointing`` recomputes each
    block in backward (``torch.utils.checkpoint``, ``use_reentrant=False``).
    ``sequence_parallel``: ``True`` splits the tokens over cp and tp (:func:`token_layout`: in
    whole patch rows when tp x cp divides them, else in padded chunks of each cp band),
    ``False`` over cp only; ``pm.layout`` says how.
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
# ``row_bands``: the image is cut into tp x cp bands (True) or into cp bands, the tp ranks of a
# cp rank holding the same one (False: padded sequence parallelism, or none).

def _band(groups: ParallelGroups, row_bands: bool) -> Tuple[int, int]:
    """(number of bands, this rank's band)."""
    if row_bands:
        return groups.mp_size, groups.mp_rank
    return groups.cp_size, groups.cp_rank


def image_rows(groups: ParallelGroups, height: int, patch_size: int, row_bands: bool = True) -> Tuple[int, int]:
    """``(start, stop)`` rows of an image of ``height`` rows that this rank's band covers."""
    chunks, index = _band(groups, row_bands)
    rows = height // patch_size
    if height % patch_size or rows % chunks:
        what = (f"context_parallel={groups.cp_size} x tensor_parallel={groups.tp_size} = {chunks}"
                if row_bands else f"context_parallel={chunks}")
        raise ValueError(f"{what} does not divide the {rows} patch rows of height {height} / patch_size {patch_size}")
    band = height // chunks
    return index * band, (index + 1) * band


def shard_image(x: torch.Tensor, groups: ParallelGroups, patch_size: int, row_bands: bool = True) -> torch.Tensor:
    """This rank's band of a full ``(..., H, W)`` image: rows ``image_rows(groups, H, patch_size)``."""
    start, stop = image_rows(groups, x.shape[-2], patch_size, row_bands)
    if stop - start == x.shape[-2]:
        return x
    return x[..., start:stop, :].contiguous()  # a copy, so the full image can be freed


def gather_image(y: torch.Tensor, groups: ParallelGroups, row_bands: bool = True) -> torch.Tensor:
    """Full ``(B, C, H, W)`` from every replica rank's band (collective over tp and cp with row
    bands; over cp only otherwise, where the tp ranks hold the same band).

    Differentiable (``gather_from``: the backward keeps this rank's band), for use on results that
    are then computed identically on every rank of the replica.
    """
    dim = y.dim() - 2
    if row_bands:
        y = gather_from(y, groups.tp_group, dim)  # tp bands are adjacent inside a cp band
    return gather_from(y, groups.cp_group, dim)


def relative_l2_loss(pred: torch.Tensor, target: torch.Tensor, groups: Optional[ParallelGroups] = None,
                     reduction: str = "mean", row_bands: bool = True) -> torch.Tensor:
    """``||pred - target||_2 / ||target||_2`` per sample, over all its (C, H, W) values.

    ``pred`` and ``target`` are this rank's bands; the per-sample sums of squares are added over
    the ranks holding different bands, with ``reduce_from`` (forward all-reduce, backward
    identity): the replica (tp x cp) with row bands, cp only otherwise (the tp ranks hold the
    same band; summing over them would count it tp times). The value equals the serial loss on
    every rank and each rank's gradient is that of its band.
    ``reduction="mean"``: batch mean (the training loss); ``"none"``: the (B,) per-sample values.
    Sums are taken in at least float32 (bf16/fp16 outputs under autocast).
    """
    dtype = torch.promote_types(pred.dtype, torch.float32)
    diff = (pred.to(dtype) - target.to(dtype)).flatten(1).pow(2).sum(1)
    ref = target.to(dtype).flatten(1).pow(2).sum(1)
    sums = torch.stack([diff, ref])
    if groups is not None:
        sums = reduce_from(sums, groups.mp_group if row_bands else groups.cp_group)
    per_sample = sums[0].sqrt() / sums[1].sqrt()
    if reduction == "none":
        return per_sample
    if reduction != "mean":
        raise ValueError(f"reduction={reduction!r}: expected 'mean' or 'none'")
    return per_sample.mean()
