"""Turn the serial ViT into its tensor / context / sequence parallel form.

Data layout
-----------
The image has ``gh = H / patch_size`` patch rows of ``gw`` patches and is always cut in whole
patch rows. Over cp it is cut into ``cp`` bands whose lengths differ by at most one patch row,
the longer ones first (``distributed.layers.split_bounds``: the 45 patch rows of a 360 x 720
image at patch 8 and cp = 4 are bands of 12, 11, 11 and 11 rows), so any cp from 1 to ``gh``
works. Bands of different lengths carry no padding: each cp rank holds only its real tokens. The
one collective over cp that needs equal chunks, the all-gather of keys and values, pads every
band's K/V to the longest band's, gathers and drops the padding again, so no query attends to
it and each band gets the gradient of its real K/V back; ``gather_image`` drops it the same
way. Everything else over cp is a sum (the loss, replicated-parameter gradients).
:func:`token_layout` then picks how each cp band is split over tp (the engine logs which):

Row bands (tp = 1, or sequence parallelism with tp x cp dividing ``gh``): the image is cut into
``T = tp * cp`` bands (all equal when tp > 1); the replica rank with chunk index
``c = cp_rank * tp + tp_rank`` gets band ``c``:

* input: ``shard_image(x)`` -> ``x[..., start:stop, :]`` with ``(start, stop) = image_rows()``
  (every channel, full width);
* tokens: the band's patches are, in the serial row-major order, a contiguous range of tokens;
  the embedding, position embedding, LayerNorms, residuals and head work on these only.
  Attention/MLP gather the tokens of the cp band over tp (heads / hidden units split over tp),
  and K/V over cp (see ``distributed.layers``);
* output: the model returns the same band of the output image, ``(B, C_out, band rows, W)``;
  ``gather_image`` reassembles ``(B, C_out, H, W)`` on every rank of the replica;
* loss: :func:`sharded_loss` adds the task loss's per-sample partial sums of every band over
  the replica (forward all-reduce, backward identity) and finishes them: the serial loss.

Padded sequence parallelism (tp > 1 and tp x cp does not divide ``gh``, e.g. 45 patch rows at
tp = 2 or 4): the image is cut into the ``cp`` bands only (every tp rank of a cp rank gets the
same band and embeds it, a cheap convolution); the band's ``n`` tokens, padded with zeros to
``tp * ceil(n / tp)``, are split into tp equal chunks and each rank keeps its own from there to
the head, so the LayerNorm/residual activations are still split over tp. Padding tokens never
reach a real one: attention drops them from the keys and values
(``ParallelAttention(band_tokens=...)``), every other op is per token, so their gradients are
zero and the result equals the serial model. After the head the chunks are gathered over tp
and the padding dropped: the output is the cp band, ``gather_image`` gathers over cp and the
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
from typing import Iterable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from distributed.groups import ParallelGroups
from distributed.layers import (ParallelBlock, ParallelPatchEmbed, ReplicatedDropout, ShardSpec,
                                TokenShardedLayerNorm, check_divisible, load_serial_state_dict,
                                mark_module_replicated, serial_state_dict, sharded_parameter,
                                split_bounds, tensors_from_serial, tensors_to_serial)
from distributed.mappings import all_gather_fwd_split_bwd, all_reduce_fwd_identity_bwd
from networks.vit import patch_grid

__all__ = ["ParallelViT", "parallelize_vit", "validate_vit_layout", "TokenLayout", "token_layout",
           "sequence_parallel_summary", "sharded_loss", "serial_state_dict", "load_serial_state_dict",
           "tensors_to_serial", "tensors_from_serial"]


@dataclass(frozen=True)
class TokenLayout:
    """How the tokens of one model replica are laid out over its tp x cp ranks.

    * ``rows`` x ``cols``: the image's patch rows and columns;
    * ``sequence_parallel``: the activations outside the linears (LayerNorm, residual, dropout)
      are split over tp (at tp = 1 there is nothing to split);
    * ``row_bands``: the image is cut into ``tp * cp`` bands of whole patch rows
      (``band_axes == ("cp", "tp")``); otherwise into ``cp`` bands (``("cp",)``), every tp rank
      of a cp rank embedding the same band;
    * ``padded`` (sequence parallel without row bands): each cp band's tokens, padded with
      ``pad_of(c)`` zero tokens to a multiple of tp, are split into tp equal chunks, which need
      not be whole rows.

    Bands come from ``distributed.layers.split_bounds``: over cp their lengths may differ by one
    patch row, longer bands first. ``band_tokens``, ``local_tokens`` and ``pad`` are those of band
    0, a longest one (its ranks hold the most tokens); the ``*_of`` methods give every band's.
    """

    sequence_parallel: bool
    row_bands: bool
    rows: int
    cols: int
    tp: int
    cp: int

    @property
    def padded(self) -> bool:
        return self.sequence_parallel and not self.row_bands

    @property
    def band_axes(self) -> Tuple[str, ...]:
        """The axes the image bands are cut over, outer to inner."""
        return ("cp", "tp") if self.row_bands else ("cp",)

    @property
    def bands(self) -> int:
        return self.tp * self.cp if self.row_bands else self.cp

    def band_index(self, cp_rank: int, tp_rank: int) -> int:
        """The band of the rank with these coordinates."""
        return cp_rank * self.tp + tp_rank if self.row_bands else cp_rank

    def band_rows(self, band: int) -> Tuple[int, int]:
        """``(start, stop)`` patch rows of ``band``."""
        return split_bounds(self.rows, self.bands, band)

    def cp_band_rows(self) -> Tuple[int, ...]:
        """Patch rows of each cp rank's band, in cp-rank order (the tp row bands of a cp band
        together, with row bands)."""
        return tuple(stop - start for start, stop in (split_bounds(self.rows, self.cp, c) for c in range(self.cp)))

    def cp_band_tokens(self) -> Tuple[int, ...]:
        """Real tokens of each cp rank's band, in cp-rank order."""
        return tuple(r * self.cols for r in self.cp_band_rows())

    def tokens_of(self, band: int) -> int:
        start, stop = self.band_rows(band)
        return (stop - start) * self.cols

    def local_tokens_of(self, cp_rank: int) -> int:
        """Tokens a rank of cp rank ``cp_rank`` holds between the linears (padding included)."""
        n = self.cp_band_tokens()[cp_rank]
        if self.padded:
            return -(-n // self.tp)
        return n // self.tp if self.row_bands else n  # row bands: tp divides the cp band's rows

    def pad_of(self, cp_rank: int) -> int:
        """Zero tokens appended to cp rank ``cp_rank``'s band (padded layout; else 0)."""
        return self.local_tokens_of(cp_rank) * self.tp - self.cp_band_tokens()[cp_rank] if self.padded else 0

    @property
    def band_tokens(self) -> int:
        return self.tokens_of(0)

    @property
    def local_tokens(self) -> int:
        return self.local_tokens_of(0)

    @property
    def pad(self) -> int:
        return self.pad_of(0)


def token_layout(img_size, patch_size: int, tp: int, cp: int, sequence_parallel: bool = True) -> TokenLayout:
    """The :class:`TokenLayout` of a ViT image at ``tp`` x ``cp``.

    Tokens are always split over cp in whole patch rows, in bands that differ by at most one row
    (``ValueError`` when cp exceeds the patch rows). With ``sequence_parallel`` and tp > 1 they
    are further split over tp: in whole patch rows when tp x cp divides the rows, else in equal
    chunks of each cp band's tokens padded with zero tokens to a multiple of tp (e.g. 360 x 720
    at patch 8, tp = 4: 45 rows, 4050 tokens, 2 pad tokens, 1013 per rank).
    ``sequence_parallel=False``: split over cp only, every tp rank of a cp rank holds the same
    tokens (plain Megatron tensor parallelism).
    """
    rows = patch_grid(img_size, patch_size)[0]
    if cp > rows:
        raise ValueError(
            f"context_parallel={cp} exceeds the {rows} patch rows (img height {img_size[0]} / patch_size "
            f"{patch_size}): tokens are sharded over cp in whole patch rows, at least one per rank; choose "
            f"context_parallel <= {rows}")
    row_bands = tp == 1 or (sequence_parallel and rows % (tp * cp) == 0)
    return TokenLayout(sequence_parallel or tp == 1, row_bands, rows, img_size[1] // patch_size, tp, cp)


def _fitting_img_size(img_size, patch_size: int, chunks: int) -> list:
    """The largest img_size not above ``img_size`` (else the smallest) whose patch rows divide by ``chunks``."""
    rows = img_size[0] // patch_size
    return [max(rows // chunks, 1) * chunks * patch_size, img_size[1]]


def _either(values: Iterable[int]) -> str:
    """``[12, 11, 11, 11] -> "12 or 11"``: the distinct values, largest first."""
    return " or ".join(str(v) for v in sorted(set(values), reverse=True))


def sequence_parallel_summary(img_size, patch_size: int, tp: int, cp: int, sequence_parallel: bool = True) -> str:
    """One line saying how a layout splits the tokens and why (the engine logs it)."""
    lay = token_layout(img_size, patch_size, tp, cp, sequence_parallel)
    rows = lay.rows
    if tp == 1:
        return "Sequence parallelism not needed at tensor_parallel=1" + (
            f": the {rows} patch rows are split over context_parallel={cp} ({_either(lay.cp_band_rows())} per rank)"
            if cp > 1 else "")
    tokens = _either(lay.cp_band_tokens())
    if not lay.sequence_parallel:
        return (f"Sequence parallelism off (sequence_parallel=False): LayerNorm/residual activations are whole "
                f"on each tensor-parallel rank ({tokens} tokens per context-parallel rank)")
    if lay.row_bands:
        return (f"Sequence parallelism on: the {rows} patch rows divide by tensor_parallel x context_parallel = "
                f"{tp * cp}; LayerNorm/residual activations are split over the tensor-parallel ranks "
                f"({rows // (tp * cp)} patch row{'s' if rows // (tp * cp) != 1 else ''} per rank)")
    fit = _fitting_img_size(img_size, patch_size, tp * cp)
    pads = [lay.pad_of(c) for c in range(cp)]
    pad = (f", {'up to ' if min(pads) != max(pads) else ''}{max(pads)} padding token{'s' if max(pads) != 1 else ''} "
           f"per band") if any(pads) else ""
    return (f"Sequence parallelism on, padded: the {rows} patch rows do not divide by tensor_parallel x "
            f"context_parallel = {tp * cp}, so the {tokens} tokens of each context-parallel band are "
            f"split into {tp} chunks of {_either(lay.local_tokens_of(c) for c in range(cp))}{pad} (an img_size "
            f"whose patch rows divide by {tp * cp}, e.g. [{fit[0]}, {fit[1]}], also splits the image bands over "
            f"tensor_parallel)")


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

    ``forward(x_band) -> y_band``: ``x_band`` is ``shard_image(x)``, (B, C_in, band rows, W);
    the result is the same band of the serial output, (B, C_out, band rows, W). The bands are
    the ``T = tp * cp`` row bands (``layout.row_bands``) or the ``cp`` bands (padded sequence
    parallelism, or none); see the module docstring.

    Parameters (names as in the serial ViT):

    * ``patch_embed.proj``, ``norm``, ``head``: whole on every rank; each rank applies them to
      its own tokens (padded mode: the patch embedding to its cp band, of which it keeps its tp
      chunk), so their gradients are summed over the ranks holding other tokens:
      ``reduce_over=("cp", "tp")`` with sequence parallelism, ``("cp",)`` without. The head has
      a bias only if the serial one has;
    * ``pos_embed``: split along tokens over the image bands, (1, band tokens, E); in padded
      mode the tp ranks hold the cp band's whole slice and use their chunk of it: summed over tp;
    * blocks: see :class:`distributed.layers.ParallelBlock`.
    """

    def __init__(self, img_size, patch_size: int, in_chans: int, out_chans: int, embed_dim: int, depth: int,
                 num_heads: int, mlp_hidden_dim: int, groups: ParallelGroups, dropout: float = 0.0,
                 eps: float = 1e-5, head_bias: bool = True, activation_checkpointing: bool = False,
                 sequence_parallel: bool = True, dtype=None, device=None):
        super().__init__()
        lay = validate_vit_layout(img_size, patch_size, embed_dim, num_heads, mlp_hidden_dim, groups,
                                  sequence_parallel)
        self.groups, self.layout = groups, lay
        self.img_size, self.patch_size, self.out_chans = tuple(img_size), patch_size, out_chans
        self.activation_checkpointing = activation_checkpointing
        self.band = lay.band_index(groups.cp_rank, groups.tp_rank)
        sp = lay.sequence_parallel
        token_axes = ("cp", "tp") if sp else ("cp",)  # the axes whose ranks hold other tokens
        kw = dict(sequence_parallel=sp, dtype=dtype, device=device)
        self.patch_embed = ParallelPatchEmbed(img_size, patch_size, in_chans, embed_dim, groups, dtype=dtype,
                                              device=device, band_axes=lay.band_axes, reduce_over=token_axes)
        assert self.patch_embed.rows == lay.band_rows(self.band), "patch embedding and layout disagree on the band"
        n = self.patch_embed.num_patches
        self.pos_embed = sharded_parameter((1, self.patch_embed.local_num_patches, embed_dim),
                                           ShardSpec((1, n, embed_dim), lay.band_axes, 1, unit=lay.cols),
                                           ("tp",) if lay.padded else (), dtype, device)
        self.pos_drop = ReplicatedDropout(dropout, groups, sp)
        self.blocks = nn.ModuleList(
            ParallelBlock(embed_dim, num_heads, mlp_hidden_dim, groups, drop=dropout, eps=eps,
                          band_tokens=lay.cp_band_tokens(), **kw)
            for _ in range(depth))
        self.norm = TokenShardedLayerNorm(embed_dim, groups, eps=eps, **kw)
        self.head = nn.Linear(embed_dim, out_chans * patch_size * patch_size, bias=head_bias, dtype=dtype,
                              device=device)
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
        """``(start, stop)``: the real image rows of this rank's band (to read only those from disk)."""
        start, stop = self.patch_embed.rows
        return start * self.patch_size, stop * self.patch_size

    def shard_image(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's band ``x[..., start:stop, :]`` of a whole ``(..., H, W)`` image."""
        if x.shape[-2] != self.img_size[0]:
            raise ValueError(f"shard_image takes whole images of {self.img_size[0]} rows, got {x.shape[-2]}: "
                             f"pass the full image (a band of image_rows() is already this rank's input)")
        start, stop = self.image_rows()
        if stop - start == x.shape[-2]:
            return x
        return x[..., start:stop, :].contiguous()  # a copy, so the full image can be freed

    def gather_image(self, y: torch.Tensor) -> torch.Tensor:
        """The whole ``(B, C, H, W)`` from every replica rank's band (collective over tp and cp
        with row bands; over cp only otherwise, where the tp ranks hold the same band).

        Differentiable (the backward keeps this rank's band), for results that are then
        computed identically on every rank of the replica.
        """
        dim = y.dim() - 2
        if self.layout.row_bands:
            y = all_gather_fwd_split_bwd(y, self.groups.tp_group, dim)  # tp bands are adjacent inside a cp band
        sizes = [r * self.patch_size for r in self.layout.cp_band_rows()]  # may differ by one patch row
        return all_gather_fwd_split_bwd(y, self.groups.cp_group, dim, sizes=sizes)

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
        lay, r, c = self.layout, self.groups.tp_rank, self.groups.cp_rank
        n = lay.local_tokens_of(c)
        if (r + 1) * n > x.shape[1]:  # the last chunk(s) hold the padding
            x = F.pad(x, (0, 0, 0, lay.pad_of(c)))
        return x.narrow(1, r * n, n).clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x) + self.pos_embed  # (B, tokens of the rank's image band, E)
        if self.layout.padded:
            x = self._tp_chunk(x)
        x = self.pos_drop(x)  # (B, local tokens, E)
        for blk in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        x = self.head(self.norm(x))  # (B, local tokens, C_out*p*p)
        if self.layout.padded:  # the cp band's tokens again: gather the tp chunks, drop the padding
            band = self.layout.cp_band_tokens()[self.groups.cp_rank]
            x = all_gather_fwd_split_bwd(x, self.groups.tp_group, 1).narrow(1, 0, band)
        return self.tokens_to_image(x)


def parallelize_vit(model: nn.Module, groups: ParallelGroups, activation_checkpointing: Optional[bool] = None,
                    sequence_parallel: bool = True) -> ParallelViT:
    """Shard a serial ``networks.vit.ViT`` over ``groups`` (tp and cp), starting from its weights.

    Every rank of a replica must pass the same serial model (same config, seed and weights);
    each keeps only its slices. No communication. The sharded model mirrors the serial one's
    options: dropout, every LayerNorm's ``eps``, whether the head has a bias, and
    ``model.activation_checkpointing`` (recompute each block in backward,
    ``torch.utils.checkpoint`` with ``use_reentrant=False``); ``activation_checkpointing`` given
    here overrides the model's. ``sequence_parallel``: ``True`` splits the tokens over cp and tp
    (:func:`token_layout`: in whole patch rows when tp x cp divides them, else in padded chunks
    of each cp band), ``False`` over cp only; ``pm.layout`` says how.
    """
    if activation_checkpointing is None:
        activation_checkpointing = bool(getattr(model, "activation_checkpointing", False))
    ref = model.pos_embed
    blk = model.blocks[0] if len(model.blocks) else None
    embed_dim = ref.shape[-1]
    num_heads = blk.attn.num_heads if blk is not None else 1
    mlp_hidden = blk.mlp.fc1.out_features if blk is not None else embed_dim
    pm = ParallelViT(model.img_size, model.patch_size, model.patch_embed.proj.in_channels, model.out_chans,
                     embed_dim, len(model.blocks), num_heads, mlp_hidden, groups, dropout=model.pos_drop.p,
                     eps=model.norm.eps, head_bias=model.head.bias is not None,
                     activation_checkpointing=activation_checkpointing, sequence_parallel=sequence_parallel,
                     dtype=ref.dtype, device=ref.device)
    for name, norm in model.named_modules():  # same names in the sharded model
        if isinstance(norm, nn.LayerNorm):
            pm.get_submodule(name).eps = norm.eps
    load_serial_state_dict(pm, model.state_dict(), groups)
    pm.train(model.training)
    return pm


def sharded_loss(loss_fn, pred: torch.Tensor, target: torch.Tensor, groups: ParallelGroups,
                 layout: TokenLayout) -> torch.Tensor:
    """The per-sample (B,) loss ``loss_fn`` of whole images, from this rank's bands of them.

    ``loss_fn`` is the task's loss (``tasks.losses.PartialSumLoss``: ``partial_sums`` then
    ``finish``); ``pred`` and ``target`` are this rank's bands. Each rank's per-sample partial
    sums are added over the ranks holding other bands with ``all_reduce_fwd_identity_bwd``
    (forward all-reduce, backward identity): the replica (tp x cp) with row bands, cp only
    otherwise (the tp ranks hold the same band; summing over them would count it tp times).
    ``finish`` then gives the serial loss on every rank, and each rank's gradient is that of its
    band.
    """
    sums = loss_fn.partial_sums(pred, target)  # (B, K): this band's share of each sample's sums
    sums = all_reduce_fwd_identity_bwd(sums, groups.mp_group if layout.row_bands else groups.cp_group)
    return loss_fn.finish(sums)
