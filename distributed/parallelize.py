"""Turn the serial ViT into its tensor / context / sequence parallel form (``parallelize_vit``),
with the serial parameter names: docs/parallelism.md ("How model parallelism works") tells the
layout and which parameters are split or replicated over which axes. Dropout on sharded
activations needs a random stream per rank: seed each rank differently *after*
``parallelize_vit``.
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
                                mark_module_replicated, sharded_parameter, split_bounds)
from distributed.mappings import all_gather_fwd_split_bwd, all_reduce_fwd_identity_bwd
from networks.vit import patch_grid, tokens_to_image


@dataclass(frozen=True)
class TokenLayout:
    """How the tokens of one model replica are laid out over its tp x cp ranks (``rows`` x
    ``cols`` patches): ``row_bands``, ``tp * cp`` image bands of whole patch rows, else ``cp``
    bands; ``padded`` (sequence parallel without row bands): each cp band's tokens, padded with
    ``pad_of(c)`` zero tokens to a multiple of tp, cut into tp equal chunks."""

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

    def local_tokens_of(self, cp_rank: int) -> int:
        """Tokens a rank of cp rank ``cp_rank`` holds between the linears (padding included)."""
        n = self.cp_band_tokens()[cp_rank]
        if self.padded:
            return -(-n // self.tp)
        return n // self.tp if self.row_bands else n  # row bands: tp divides the cp band's rows

    def pad_of(self, cp_rank: int) -> int:
        """Zero tokens appended to cp rank ``cp_rank``'s band (padded layout; else 0)."""
        return self.local_tokens_of(cp_rank) * self.tp - self.cp_band_tokens()[cp_rank] if self.padded else 0


def token_layout(img_size, patch_size: int, tp: int, cp: int, sequence_parallel: bool = True) -> TokenLayout:
    """The :class:`TokenLayout` of a ViT image at ``tp`` x ``cp``: tokens split over cp in bands
    of whole patch rows (``ValueError`` when cp exceeds the patch rows) and, with
    ``sequence_parallel`` and tp > 1, over tp: in whole rows when tp x cp divides the rows, else
    padded (360 x 720 at patch 8, tp = 4: 45 rows, 4050 tokens, 2 pad tokens, 1013 per rank).
    Without, every tp rank of a cp rank holds the same tokens (plain Megatron)."""
    rows = patch_grid(img_size, patch_size)[0]
    if cp > rows:
        raise ValueError(
            f"context_parallel={cp} exceeds the {rows} patch rows (img height {img_size[0]} / patch_size "
            f"{patch_size}): tokens are sharded over cp in whole patch rows, at least one per rank; choose "
            f"context_parallel <= {rows}")
    row_bands = tp == 1 or (sequence_parallel and rows % (tp * cp) == 0)
    return TokenLayout(sequence_parallel or tp == 1, row_bands, rows, img_size[1] // patch_size, tp, cp)


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
    # the largest image height not above img_size's (else the smallest) whose rows divide by tp x cp
    fit = max(rows // (tp * cp), 1) * tp * cp * patch_size
    pads = [lay.pad_of(c) for c in range(cp)]
    pad = (f", {'up to ' if min(pads) != max(pads) else ''}{max(pads)} padding token{'s' if max(pads) != 1 else ''} "
           f"per band") if any(pads) else ""
    return (f"Sequence parallelism on, padded: the {rows} patch rows do not divide by tensor_parallel x "
            f"context_parallel = {tp * cp}, so the {tokens} tokens of each context-parallel band are "
            f"split into {tp} chunks of {_either(lay.local_tokens_of(c) for c in range(cp))}{pad} (an img_size "
            f"whose patch rows divide by {tp * cp}, e.g. [{fit}, {img_size[1]}], also splits the image bands over "
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
    """The ViT sharded over tp and cp (:func:`parallelize_vit`). ``forward(x_band) -> y_band``:
    ``x_band`` is ``shard_image(x)``, (B, C_in, band rows, W); the result is the same band of the
    serial output, (B, C_out, band rows, W): a ``layout.band_axes`` band."""

    def __init__(self, model: nn.Module, groups: ParallelGroups, activation_checkpointing: bool,
                 sequence_parallel: bool):
        super().__init__()
        ref, blocks = model.pos_embed, model.blocks
        embed_dim, p = ref.shape[-1], model.patch_size
        num_heads = blocks[0].attn.num_heads if len(blocks) else 1
        hidden = blocks[0].mlp.fc1.out_features if len(blocks) else embed_dim
        lay = validate_vit_layout(model.img_size, p, embed_dim, num_heads, hidden, groups, sequence_parallel)
        self.groups, self.layout = groups, lay
        self.img_size, self.patch_size, self.out_chans = model.img_size, p, model.out_chans
        self.activation_checkpointing = activation_checkpointing
        sp, dropout, eps = lay.sequence_parallel, model.pos_drop.p, model.norm.eps
        token_axes = ("cp", "tp") if sp else ("cp",)  # the axes whose ranks hold other tokens
        kw = dict(sequence_parallel=sp, dtype=ref.dtype, device=ref.device)
        self.patch_embed = ParallelPatchEmbed(model.img_size, p, model.patch_embed.proj.in_channels, embed_dim,
                                              groups, band_axes=lay.band_axes, reduce_over=token_axes,
                                              dtype=ref.dtype, device=ref.device)
        self.pos_embed = sharded_parameter((1, self.patch_embed.local_num_patches, embed_dim),
                                           ShardSpec(tuple(ref.shape), lay.band_axes, 1, unit=lay.cols),
                                           ("tp",) if lay.padded else (), ref.dtype, ref.device)
        self.pos_drop = ReplicatedDropout(dropout, groups, sp)
        self.blocks = nn.ModuleList(
            ParallelBlock(embed_dim, num_heads, hidden, groups, drop=dropout, eps=eps,
                          band_tokens=lay.cp_band_tokens(), **kw)
            for _ in blocks)
        self.norm = TokenShardedLayerNorm(embed_dim, eps=eps, **kw)
        self.head = nn.Linear(embed_dim, model.head.out_features, bias=model.head.bias is not None,
                              dtype=ref.dtype, device=ref.device)
        mark_module_replicated(self.head, token_axes)
        load_serial_state_dict(self, model.state_dict(), groups)
        self.train(model.training)

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
        with row bands, else over cp). Differentiable (the backward keeps this rank's band), for
        results then computed identically on every rank of the replica."""
        dim = y.dim() - 2
        if self.layout.row_bands:
            y = all_gather_fwd_split_bwd(y, self.groups.tp_group, dim)  # tp bands are adjacent inside a cp band
        sizes = [r * self.patch_size for r in self.layout.cp_band_rows()]  # may differ by one patch row
        return all_gather_fwd_split_bwd(y, self.groups.cp_group, dim, sizes=sizes)

    # ---- model --------------------------------------------------------------------------------
    def _tp_chunk(self, x: torch.Tensor) -> torch.Tensor:
        """Padded mode: this tp rank's chunk of the cp band's tokens, padded with zeros to tp
        chunks; a copy, so the band's whole token tensor is freed."""
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
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if recompute else blk(x)
        x = self.head(self.norm(x))  # (B, local tokens, C_out*p*p)
        if self.layout.padded:  # the cp band's tokens again: gather the tp chunks, drop the padding
            band = self.layout.cp_band_tokens()[self.groups.cp_rank]
            x = all_gather_fwd_split_bwd(x, self.groups.tp_group, 1).narrow(1, 0, band)
        return tokens_to_image(x, self.patch_embed.local_grid, self.out_chans, self.patch_size)  # the band


def parallelize_vit(model: nn.Module, groups: ParallelGroups, activation_checkpointing: Optional[bool] = None,
                    sequence_parallel: bool = True) -> ParallelViT:
    """Shard a serial ``networks.vit.ViT`` over ``groups`` (tp and cp), each rank keeping its
    slices of its weights (every rank of a replica passes the same model; no communication), its
    dropout, ``eps``, head bias and ``activation_checkpointing`` (unless given here).
    ``sequence_parallel``: split the tokens over cp and tp (:func:`token_layout`), or cp only."""
    if activation_checkpointing is None:
        activation_checkpointing = bool(getattr(model, "activation_checkpointing", False))
    return ParallelViT(model, groups, activation_checkpointing, sequence_parallel)


def sharded_loss(loss_fn, pred: torch.Tensor, target: torch.Tensor, groups: ParallelGroups,
                 layout: TokenLayout, rows=None) -> torch.Tensor:
    """The per-sample (B,) loss ``loss_fn`` (``tasks.losses.PartialSumLoss``) of whole images,
    from this rank's bands of them (image ``rows``, for a loss that weights rows): the partial
    sums added over the ranks holding other bands (the replica with row bands, else cp), then
    finished: the serial loss on every rank, each rank's gradient that of its band."""
    sums = loss_fn.partial_sums(pred, target, rows)  # (B, K): this band's share of each sample's sums
    sums = all_reduce_fwd_identity_bwd(sums, groups.mp_group if layout.row_bands else groups.cp_group)
    return loss_fn.finish(sums)
