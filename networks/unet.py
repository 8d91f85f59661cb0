"""3D U-Net mapping N-body fields (4 channels) to hydrodynamic fields (5 channels).

Strided 4^3 convolutions halve the volume at each level (LeakyReLU), transposed convolutions
double it back (ReLU) with the matching encoder level concatenated as a skip connection, and a
tanh bounds the output to the [-1, 1] range of the transformed targets. ``full_scale`` uses six
levels (a 64^3 crop reaches 1^3 at the bottom); otherwise five.
"""
import torch
import torch.nn as nn


def down_block(cin, cout, slope):
    return nn.Sequential(nn.Conv3d(cin, cout, 4, stride=2, padding=1),
                         nn.LeakyReLU(slope, inplace=True))


def up_block(cin, cout):
    return nn.Sequential(nn.ConvTranspose3d(cin, cout, 4, stride=2, padding=1), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, in_chans=4, out_chans=5, base_width=64, max_width=512, full_scale=True,
                 conv_init_std=0.02, conv_init_bias=0.0, leaky_relu_slope=0.01):
        super().__init__()
        levels = 6 if full_scale else 5
        widths = [min(base_width * 2**i, max_width) for i in range(levels)]
        self.levels = levels
        self.down = nn.ModuleList()
        cin = in_chans
        for w in widths:
            self.down.append(down_block(cin, w, leaky_relu_slope))
            cin = w
        # Decoder: the deepest level has no skip; every other level concatenates its encoder twin.
        self.up = nn.ModuleList()
        for i in reversed(range(1, levels)):
            cin = widths[i] if i == levels - 1 else 2 * widths[i]
            self.up.append(up_block(cin, widths[i - 1]))
        self.last = nn.ConvTranspose3d(2 * widths[0], out_chans, 4, stride=2, padding=1)
        self.conv_init_std = conv_init_std
        self.conv_init_bias = conv_init_bias
        self.reset_parameters()

    def reset_parameters(self):
        for m in self.modules():
            if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d)):
                nn.init.normal_(m.weight, 0.0, self.conv_init_std)
                nn.init.constant_(m.bias, self.conv_init_bias)

    def forward(self, x):
        if any(s % 2**self.levels for s in x.shape[2:]):
            raise ValueError(f"crop size {tuple(x.shape[2:])} must be divisible by 2^{self.levels}")
        skips = []
        for blk in self.down:  # (B, C, L) -> (B, w_i, L / 2^(i+1))
            x = blk(x)
            skips.append(x)
        x = skips.pop()
        for i, blk in enumerate(self.up):
            x = blk(x if i == 0 else torch.cat([x, skips.pop()], dim=1))
        x = self.last(torch.cat([x, skips.pop()], dim=1))  # -> (B, out, L)
        return torch.tanh(x)
