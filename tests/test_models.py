import pytest
import torch

from networks.unet import UNet
from networks.vit import ViT


@pytest.mark.parametrize("img,patch,embed,depth,heads,cin,cout", [
    ((16, 32), 4, 32, 1, 2, 20, 20),
    ((32, 64), 8, 64, 2, 4, 5, 3),
    ((24, 48), 6, 48, 3, 3, 20, 20),
])
def test_vit_shapes(img, patch, embed, depth, heads, cin, cout):
    m = ViT(img_size=img, patch_size=patch, in_chans=cin, out_chans=cout, embed_dim=embed,
            depth=depth, num_heads=heads)
    x = torch.randn(2, cin, *img)
    assert m(x).shape == (2, cout, *img)
    assert m.pos_embed.shape == (1, (img[0] // patch) * (img[1] // patch), embed)


def test_vit_head_undoes_patch_order():
    """A head that copies each token's own patch back must reproduce the input exactly."""
    p, c = 4, 3
    m = ViT(img_size=(8, 12), patch_size=p, in_chans=c, out_chans=c, embed_dim=c * p * p,
            depth=0, num_heads=1)
    x = torch.randn(2, c, 8, 12)
    tokens = x.reshape(2, c, 2, p, 3, p).permute(0, 2, 4, 1, 3, 5).reshape(2, 6, c * p * p)
    assert torch.equal(m.tokens_to_image(tokens), x)


def test_vit_reference_size():
    m = ViT()  # the tutorial's base config: 360x720, patch 8, embed 384, depth 12
    assert abs(sum(p.numel() for p in m.parameters()) / 1e6 - 23.8) < 0.1


@pytest.mark.parametrize("full_scale,size,width", [(True, 64, 4), (False, 32, 8), (False, 64, 4)])
def test_unet_shapes_and_range(full_scale, size, width):
    m = UNet(base_width=width, max_width=8 * width, full_scale=full_scale)
    y = m(torch.randn(1, 4, size, size, size))
    assert y.shape == (1, 5, size, size, size)
    assert y.abs().max() < 1


def test_unet_reference_size_and_bad_crop():
    m = UNet()
    assert abs(sum(p.numel() for p in m.parameters()) / 1e6 - 117.0) < 0.1
    with pytest.raises(ValueError, match="divisible by 2\\^6"):
        m(torch.randn(1, 4, 32, 32, 32))


def test_vit_head_without_bias_and_norm_epsilon():
    kw = dict(img_size=(16, 32), patch_size=4, in_chans=3, out_chans=2, embed_dim=32, depth=1,
              num_heads=2)
    with_bias, without = ViT(**kw, head_bias=True), ViT(**kw, layer_norm_eps=1e-3)
    def n(m):
        return sum(p.numel() for p in m.parameters())

    assert n(with_bias) - n(without) == 2 * 4 * 4 and without.head.bias is None
    assert {m.eps for m in without.modules() if isinstance(m, torch.nn.LayerNorm)} == {1e-3}
    assert without(torch.randn(1, 3, 16, 32)).shape == (1, 2, 16, 32)


def test_unet_leaky_relu_slope():
    m = UNet(base_width=2, max_width=8, full_scale=False, leaky_relu_slope=0.3)
    assert {a.negative_slope for a in m.modules() if isinstance(a, torch.nn.LeakyReLU)} == {0.3}
    assert UNet(base_width=2, max_width=8, full_scale=False).down[0][1].negative_slope == 0.01
