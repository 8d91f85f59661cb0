"""Vision Transformer that maps an atmospheric state (C, H, W) to the state dt steps later.

Patch embedding -> learned position embedding -> pre-norm transformer blocks -> a linear head
that turns every token back into its (C_out, p, p) patch. The module is serial; the tensor and
context parallel forms are made from it by ``distributed.parallelize``.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def patch_grid(img_size, patch_size: int) -> tuple[int, int]:
    """(rows, columns) of p x p patches of an image: ValueError unless p divides both sides."""
    h, w = img_size
    if h % patch_size or w % patch_size:
        raise ValueError(f"img_size={list(img_size)} is not divisible by patch_size={patch_size}: "
                         f"choose a patch_size that divides both {h} and {w}")
    return h // patch_size, w // patch_size


def tokens_to_image(x: torch.Tensor, grid, out_chans: int, p: int) -> torch.Tensor:
    """(B, gh*gw, C_out*p*p) -> (B, C_out, gh*p, gw*p), undoing the row-major patch order."""
    B, (gh, gw) = x.shape[0], grid
    x = x.reshape(B, gh, gw, out_chans, p, p).permute(0, 3, 1, 4, 2, 5)  # (B, C, gh, p, gw, p)
    return x.reshape(B, out_chans, gh * p, gw * p)


class PatchEmbed(nn.Module):
    """Non-overlapping p x p patches, each projected to ``embed_dim`` by a strided convolution."""

    def __init__(self, img_size, patch_size, in_chans, embed_dim):
        super().__init__()
        self.grid = patch_grid(img_size, patch_size)
        self.num_patches = self.grid[0] * self.grid[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        x = self.proj(x)  # (B, C, H, W) -> (B, E, H/p, W/p)
        return x.flatten(2).transpose(1, 2)  # -> (B, N, E), tokens in row-major patch order


class Attention(nn.Module):
    """Multi-head self-attention. ``qkv`` output is laid out as [q | k | v], each (heads, head_dim)."""

    def __init__(self, dim, num_heads, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim={dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = attn_drop
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, _ = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim)
        # strided views split on qkv's own dim 2: one copy of its gradient (docs/performance.md,
        # "The attention kernel")
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        x = x.transpose(1, 2).reshape(B, N, -1)  # (B, heads, N, hd) -> (B, N, E)
        return self.proj_drop(self.proj(x))


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim, drop=0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim, num_heads, mlp_ratio=4.0, drop=0.0, eps=1e-6):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads, attn_drop=drop, proj_drop=drop)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, int(dim * mlp_ratio), drop=drop)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """The defaults are the tutorial's model (23.8 M parameters); the other options are the
    settings of the same names (docs/training.md). ``activation_checkpointing`` recomputes blocks
    only while gradients are recorded: evaluation under ``torch.no_grad`` runs them plainly."""

    def __init__(self, img_size=(360, 720), patch_size=8, in_chans=20, out_chans=20, embed_dim=384,
                 depth=12, num_heads=8, mlp_ratio=4.0, dropout=0.0, layer_norm_eps=1e-6,
                 head_bias=False, activation_checkpointing=False):
        super().__init__()
        self.img_size = tuple(img_size)
        self.patch_size = patch_size
        self.out_chans = out_chans
        self.activation_checkpointing = activation_checkpointing
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, embed_dim))
        self.pos_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, dropout, layer_norm_eps)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        self.head = nn.Linear(embed_dim, out_chans * patch_size * patch_size, bias=head_bias)
        self.reset_parameters()

    def reset_parameters(self):
        """Truncated-normal weights (std 0.02), zero biases; LayerNorms keep torch's ones and zeros."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def tokens_to_image(self, x):
        """(B, N, C_out*p*p) -> (B, C_out, H, W)."""
        return tokens_to_image(x, self.patch_embed.grid, self.out_chans, self.patch_size)

    def forward(self, x):
        x = self.patch_embed(x) + self.pos_embed  # (B, C, H, W) -> (B, N, E)
        x = self.pos_drop(x)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for blk in self.blocks:  # (B, N, E) -> (B, N, E)
            x = checkpoint(blk, x, use_reentrant=False) if recompute else blk(x)
        x = self.head(self.norm(x))  # (B, N, E) -> (B, N, C_out*p*p)
        return self.tokens_to_image(x)
