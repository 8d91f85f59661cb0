"""The roofline of a training step: FLOPs and bytes of each layer (U-Net) or op group (ViT),
computed from the config, and each one's floor at a device's matmul rate and memory bandwidth.

How a step is modelled, and every assumption: benchmarks/roofline.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# ATen op names (without "aten::" and the overload) that classify an op whatever its module.
CASTS = frozenset({"to", "_to_copy"})
LAYOUT = frozenset({"view", "reshape", "permute", "transpose", "unbind", "clone", "contiguous",
                    "flatten", "_unsafe_view", "stack", "t", "expand", "select", "slice",
                    "detach", "dropout", "alias", "unsqueeze", "squeeze", "as_strided", "split",
                    "chunk", "copy_", "_reshape_alias"})
F32 = 4  # bytes of an fp32 value: master weights, their gradients, Adam's moments, norms, losses


@dataclass(frozen=True)
class Op:
    """One ATen op of the step: its group, pass ("fwd" or "bwd"), bytes read and written, FLOPs
    its kernel executes and FLOPs as the task counts them."""
    group: str
    phase: str
    name: str
    read: int
    written: int
    flops: int = 0
    model_flops: int = 0

    @property
    def bytes(self) -> int:
        return self.read + self.written


@dataclass
class StepModel:
    """The ops of one training step of a model at a batch size and precision, and how an op of
    the real model is assigned to one of its groups (``classify``)."""
    model: str  # "vit" or "unet"
    batch: int
    amp: bool  # autocast to a 2-byte dtype
    ops: list[Op]
    groups: tuple[str, ...]  # the table's rows, in order
    params: list[tuple[str, int]]  # (name, numel) of every parameter, as model.named_parameters()
    classify: Callable[..., str]  # (module path or None, op name, cat_index) -> group
    cast_group: str  # where every dtype cast goes
    accumulation_group: str  # where autograd's sums of the gradients of a tensor used twice go

    def totals(self, group: str | None = None, phase: str | None = None) -> dict:
        ops = [o for o in self.ops if (group is None or o.group == group)
               and (phase is None or o.phase == phase)]
        return {"flops": sum(o.flops for o in ops), "model_flops": sum(o.model_flops for o in ops),
                "bytes": sum(o.bytes for o in ops), "read": sum(o.read for o in ops),
                "written": sum(o.written for o in ops)}

    def rows(self, matmul_flops_per_s: float, bytes_per_s: float) -> list[dict]:
        """One row per group: FLOPs, bytes and the floor in ms at the given rates."""
        out = []
        for g in self.groups:
            t = self.totals(g)
            out.append({"group": g, **t, **floor(t["flops"], t["bytes"], matmul_flops_per_s,
                                                 bytes_per_s)})
        return out


def floor(flops: float, nbytes: float, matmul_flops_per_s: float, bytes_per_s: float) -> dict:
    """The time bounds of work of ``flops`` and ``nbytes``: compute, memory and their max (ms),
    and which of the two bounds it."""
    compute_ms = 1e3 * flops / matmul_flops_per_s
    memory_ms = 1e3 * nbytes / bytes_per_s
    return {"compute_ms": compute_ms, "memory_ms": memory_ms,
            "floor_ms": max(compute_ms, memory_ms),
            "bound": "compute" if compute_ms > memory_ms else "memory"}


def model_params(cfg) -> list[tuple[str, int]]:
    """(name, numel) of every parameter of the model of ``cfg``, built on the meta device."""
    import torch

    from tasks import make_task
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = make_task(cfg).build_model()
    return [(name, p.numel()) for name, p in model.named_parameters()]


def op_name(name: str) -> str:
    """'aten::addmm' (profiler) or 'aten.addmm.default' (dispatch) -> 'addmm'."""
    if name.startswith("aten::"):
        return name[6:]
    if name.startswith("aten."):
        return name.split(".")[1]
    return name


# ----------------------------------------------------------------------------- building blocks

class _Ops(list):
    """The op list under construction, with the helpers that append the ops of one layer."""

    def __init__(self, amp: bool, cast_group: str):
        super().__init__()
        self.amp = amp
        self.act = 2 if amp else F32  # bytes of an activation
        self.cast_group = cast_group

    def add(self, group, phase, name, read, written, flops=0, model_flops=None):
        self.append(Op(group, phase, name, int(read), int(written), int(flops),
                       int(flops if model_flops is None else model_flops)))

    def cast(self, phase, name, n, to_half: bool):
        """An autocast cast of n values between fp32 and the 2-byte dtype (none without amp)."""
        if self.amp:
            self.add(self.cast_group, phase, name, n * (F32 if to_half else 2),
                     n * (2 if to_half else F32))

    def linear(self, group, name, rows, fin, fout, bias=True, cast_input=False,
               input_grad=True):
        """nn.Linear on (rows, fin): forward addmm (mm without bias) and its backward: the
        input gradient (mm), the weight gradient (mm), the bias gradient (a sum over rows);
        under autocast the casts of weight, bias (and the fp32 input) and of their gradients."""
        a, w = self.act, fin * fout
        self.cast("fwd", f"{name} weight cast", w, True)
        if bias:
            self.cast("fwd", f"{name} bias cast", fout, True)
        if cast_input:
            self.cast("fwd", f"{name} input cast", rows * fin, True)
        mm = 2 * rows * fin * fout
        self.add(group, "fwd", f"{name} {'addmm' if bias else 'mm'}",
                 a * (rows * fin + w + (fout if bias else 0)), a * rows * fout, mm)
        if input_grad:
            self.add(group, "bwd", f"{name} input gradient mm", a * (rows * fout + w),
                     a * rows * fin, mm)
        self.add(group, "bwd", f"{name} weight gradient mm", a * (rows * fout + rows * fin),
                 a * w, mm)
        if bias:
            self.add(group, "bwd", f"{name} bias gradient sum", a * rows * fout, a * fout)
        self.cast("bwd", f"{name} weight gradient cast", w, False)
        if bias:
            self.cast("bwd", f"{name} bias gradient cast", fout, False)
        if cast_input and input_grad:
            self.cast("bwd", f"{name} input gradient cast", rows * fin, False)

    def conv(self, group, name, batch, cin, cout, kernel, vox_in, vox_out, mac_vox,
             cast_input=False, input_grad=True):
        """A convolution (or transposed convolution) with bias: ``kernel`` weights per
        (cin, cout) pair, ``mac_vox`` voxels at which every weight multiplies-adds once (the
        output's for a convolution, the input's for a transposed one); one backward op, without
        the input gradient when ``input_grad`` is False (the first layer)."""
        a, w = self.act, cin * cout * kernel
        self.cast("fwd", f"{name} weight cast", w, True)
        self.cast("fwd", f"{name} bias cast", cout, True)
        if cast_input:
            self.cast("fwd", f"{name} input cast", batch * cin * vox_in, True)
        fl = 2 * batch * cin * cout * kernel * mac_vox
        x, y = batch * cin * vox_in, batch * cout * vox_out
        self.add(group, "fwd", f"{name} convolution", a * (x + w + cout), a * y, fl)
        self.add(group, "bwd", f"{name} convolution backward", a * (y + x + w),
                 a * ((x if input_grad else 0) + w + cout), fl * (2 if input_grad else 1))
        self.cast("bwd", f"{name} weight gradient cast", w, False)
        self.cast("bwd", f"{name} bias gradient cast", cout, False)

    def elementwise(self, group, name, n, backward=True):
        """A unary elementwise op on n activations (ReLU, LeakyReLU, GELU, tanh): reads and
        writes them (the same bytes whether in place or not); its backward reads the
        output gradient and the saved input (or output) and writes the input gradient."""
        a = self.act
        self.add(group, "fwd", name, a * n, a * n)
        if backward:
            self.add(group, "bwd", f"{name} backward", 2 * a * n, a * n)

    def adam(self, params: list[tuple[str, int]]):
        """torch's fused Adam: the step counts' _foreach_add_ and _fused_adam_ (benchmarks/roofline.md)."""
        n = sum(numel for _, numel in params)
        t = len(params)
        self.add("optimizer", "opt", "step counts +1 (_foreach_add_)", F32 * t, F32 * t)
        self.add("optimizer", "opt", "_fused_adam_", F32 * (4 * n + t), F32 * 3 * n)


# ----------------------------------------------------------------------------------- the ViT

VIT_GROUPS = ("attention", "projections", "mlp", "norms", "adds", "copies", "loss", "optimizer")


def vit_group(module: str | None, op: str, cat_index: int | None = None) -> str:
    """The group of an op of ``networks/vit.py``'s ViT run in ``module`` (its path below the
    model, "" for the model itself, None outside it: the loss)."""
    if op in CASTS:
        return "copies"
    if module is None:
        return "loss"
    if "attention" in op:
        return "attention"
    leaf = module.rsplit(".", 1)[-1]
    if leaf == "attn":  # the Attention module's own ops: SDPA (or its math form) and layouts
        return "copies" if op in LAYOUT else "attention"
    if op in LAYOUT:
        return "copies"
    if leaf in ("qkv", "proj", "head") or module.startswith("patch_embed"):
        return "projections"
    if leaf in ("fc1", "fc2", "act"):
        return "mlp"
    if leaf.startswith("norm"):
        return "norms"
    if op in ("add", "add_"):
        return "adds"
    return "other"


def vit_model(cfg, batch: int, amp: bool) -> StepModel:
    """The ops of a training step of the ViT of ``cfg`` (a ViTConfig) on ``batch`` samples."""
    h, w = cfg.img_size
    p, e, heads = cfg.patch_size, cfg.embed_dim, cfg.num_heads
    n = (h // p) * (w // p)  # tokens per sample
    t = batch * n  # tokens per batch
    hidden = int(e * cfg.mlp_ratio)
    cin, cout = cfg.n_in_channels, cfg.n_out_channels
    ops = _Ops(amp, "copies")
    a, r = ops.act, F32  # activation bytes; the residual stream is fp32

    # patch embedding: a p x p convolution of stride p, one (cin p p -> e) product per token
    ops.conv("projections", "patch_embed", batch, cin, e, p * p, h * w, n, n,
             cast_input=True, input_grad=False)
    ops.add("adds", "fwd", "position embedding add", a * t * e + r * n * e, r * t * e)
    ops.cast("bwd", "position embedding add: gradient to the patches' dtype", t * e, True)
    if batch > 1:
        ops.add("adds", "bwd", "position embedding gradient (sum over the batch)", r * t * e,
                r * n * e)

    def layer_norm(name):
        ops.add("norms", "fwd", name, r * (t * e + 2 * e), r * (t * e + 2 * t))
        ops.add("norms", "bwd", f"{name} backward", r * (2 * t * e + 2 * t + 2 * e),
                r * (t * e + 2 * e))

    def residual(name):
        ops.add("adds", "fwd", f"{name} residual add", (r + a) * t * e, r * t * e)
        ops.cast("bwd", f"{name} residual add: gradient to the branch's dtype", t * e, True)
        # x feeds both the norm and the add: autograd sums its two gradients
        ops.add("adds", "bwd", f"{name} gradient sum of the residual stream", 2 * r * t * e,
                r * t * e)

    attn_fwd = 4 * batch * n * n * e  # q k^T and P V, all heads: 2 x 2 N^2 head_dim per head
    for i in range(cfg.depth):
        b = f"block {i}"
        layer_norm(f"{b} norm1")
        ops.linear("projections", f"{b} qkv", t, e, 3 * e, cast_input=True)
        ops.add("attention", "fwd", f"{b} SDPA", 3 * a * t * e,
                a * t * e + F32 * batch * heads * n, attn_fwd)
        ops.add("attention", "bwd", f"{b} SDPA backward",
                5 * a * t * e + F32 * batch * heads * n, 3 * a * t * e,
                flops=5 * attn_fwd // 2, model_flops=2 * attn_fwd)
        # the gradients of q, k, v stacked (unbind's backward) straight into qkv's (B, N, 3E)
        ops.add("copies", "bwd", f"{b} q/k/v gradients stacked", 3 * a * t * e, 3 * a * t * e)
        ops.linear("projections", f"{b} proj", t, e, e)
        residual(f"{b} attention")
        layer_norm(f"{b} norm2")
        ops.linear("mlp", f"{b} fc1", t, e, hidden, cast_input=True)
        ops.elementwise("mlp", f"{b} GELU", t * hidden)
        ops.linear("mlp", f"{b} fc2", t, hidden, e)
        residual(f"{b} MLP")
    layer_norm("final norm")
    q = cout * p * p
    ops.linear("projections", "head", t, e, q, bias=cfg.head_bias, cast_input=True)
    ops.add("copies", "fwd", "tokens to image (permute copy)", a * t * q, a * t * q)
    ops.add("copies", "bwd", "tokens to image backward (permute copy)", a * t * q, a * t * q)
    _relative_l2(ops, batch, t * q)
    params = model_params(cfg)
    ops.adam(params)
    return StepModel("vit", batch, amp, list(ops), VIT_GROUPS, params, vit_group, "copies",
                     "adds")


def _relative_l2(ops: _Ops, batch: int, v: int):
    """tasks.era5.RelativeL2 on v values (prediction in the activations' dtype, target
    fp32): sum (pred - y)^2 and sum y^2 per sample."""
    ops.cast("fwd", "loss: prediction to fp32", v, False)
    ops.add("loss", "fwd", "pred - y", 2 * F32 * v, F32 * v)
    for name in ("(pred - y)^2", "y^2"):
        ops.add("loss", "fwd", name, F32 * v, F32 * v)
        ops.add("loss", "fwd", f"sum of {name}", F32 * v, F32 * batch)
    ops.add("loss", "bwd", "pow backward: (pred - y)^1", F32 * v, F32 * v)
    ops.add("loss", "bwd", "pow backward: x 2", F32 * v, F32 * v)
    ops.add("loss", "bwd", "pow backward: x gradient", F32 * (v + batch), F32 * v)
    ops.cast("bwd", "loss: gradient to the prediction's dtype", v, True)


def _l1(ops: _Ops, batch: int, v: int):
    """tasks.cosmo.L1Rho without the density term on v values: sum |pred - y| per sample (in
    the prediction's layout, channels-last or not)."""
    ops.cast("fwd", "loss: prediction to fp32", v, False)
    ops.add("loss", "fwd", "pred - y", 2 * F32 * v, F32 * v)
    ops.add("loss", "fwd", "|pred - y|", F32 * v, F32 * v)
    ops.add("loss", "fwd", "sum of |pred - y|", F32 * v, F32 * batch)
    ops.add("loss", "bwd", "abs backward: sign", F32 * v, F32 * v)
    ops.add("loss", "bwd", "abs backward: x gradient", F32 * (v + batch), F32 * v)
    ops.cast("bwd", "loss: gradient to the prediction's dtype", v, True)


# ---------------------------------------------------------------------------------- the U-Net

def unet_widths(cfg) -> list[int]:
    levels = 6 if cfg.full_scale else 5
    return [min(cfg.base_width * 2**i, cfg.max_width) for i in range(levels)]


def unet_cat_name(index: int, levels: int) -> str:
    """The row of the index-th concatenation of a forward pass (it feeds up.{index + 1}, the
    last one the last layer)."""
    return "last cat" if index == levels - 2 else f"up.{index + 1} cat"


def unet_groups(levels: int) -> tuple[str, ...]:
    rows = []
    for i in range(levels):
        rows += [f"down.{i} conv", f"down.{i} leaky_relu"]
    for j in range(levels - 1):
        if j:
            rows.append(f"up.{j} cat")
        rows += [f"up.{j} convT", f"up.{j} relu"]
    return tuple(rows + ["last cat", "last convT", "tanh", "loss", "casts", "skip grad sums",
                         "optimizer"])


def unet_group(module: str | None, op: str, cat_index: int | None = None,
               levels: int = 6) -> str:
    """The row of an op of ``networks/unet.py``'s UNet run in ``module`` (its path below the
    model, "" for the model itself, None outside it: the loss); a concatenation's row comes from
    its place in the forward pass (``cat_index``)."""
    if op in CASTS:
        return "casts"
    if module is None:
        return "loss"
    parts = module.split(".")
    if parts[0] in ("down", "up") and len(parts) == 3:
        if parts[0] == "down":
            return f"down.{parts[1]} " + ("conv" if parts[2] == "0" else "leaky_relu")
        return f"up.{parts[1]} " + ("convT" if parts[2] == "0" else "relu")
    if module == "last":
        return "last convT"
    if module == "":
        if op == "cat" and cat_index is not None:
            return unet_cat_name(cat_index, levels)
        if op == "tanh":
            return "tanh"
    return "other"


def unet_model(cfg, batch: int, amp: bool) -> StepModel:
    """The ops of a training step of the U-Net of ``cfg`` (a UNetConfig) on ``batch`` crops, in
    either memory format (channels-last has the same ops)."""
    if cfg.lambda_rho:
        raise ValueError(f"lambda_rho={cfg.lambda_rho}: the roofline models the L1 loss "
                         f"without the density term; use lambda_rho 0")
    widths = unet_widths(cfg)
    levels = len(widths)
    side = [cfg.data_size // 2**(i + 1) for i in range(levels)]  # side after down block i
    vox = [s**3 for s in side]
    ops = _Ops(amp, "casts")
    a, k = ops.act, 64  # 4^3 kernels
    cin = cfg.n_in_channels
    for i, w in enumerate(widths):
        vin = cfg.data_size**3 if i == 0 else vox[i - 1]
        ops.conv(f"down.{i} conv", f"down.{i}", batch, cin, w, k, vin, vox[i], vox[i],
                 cast_input=i == 0, input_grad=i > 0)
        ops.elementwise(f"down.{i} leaky_relu", f"down.{i} LeakyReLU (in place)",
                        batch * w * vox[i])
        cin = w
    for j, i in enumerate(reversed(range(1, levels))):
        c = widths[i]
        if j:  # x (the level below, upsampled) and the skip of level i, side by side
            ops.add(f"up.{j} cat", "fwd", f"up.{j} cat", 2 * a * batch * c * vox[i],
                    2 * a * batch * c * vox[i])
            c *= 2
        ops.conv(f"up.{j} convT", f"up.{j}", batch, c, widths[i - 1], k, vox[i], vox[i - 1],
                 vox[i])
        ops.elementwise(f"up.{j} relu", f"up.{j} ReLU (in place)", batch * widths[i - 1] * vox[i - 1])
    ops.add("last cat", "fwd", "last cat", 2 * a * batch * widths[0] * vox[0],
            2 * a * batch * widths[0] * vox[0])
    v = batch * cfg.n_out_channels * cfg.data_size**3
    ops.conv("last convT", "last", batch, 2 * widths[0], cfg.n_out_channels, k, vox[0],
             cfg.data_size**3, vox[0])
    ops.elementwise("tanh", "tanh", v)
    _l1(ops, batch, v)
    # each skip (not the bottom level's) feeds the next down block and a cat: autograd sums the
    # two gradients (the cat's backward itself is slices: views)
    for i in range(levels - 1):
        n = batch * widths[i] * vox[i]
        ops.add("skip grad sums", "bwd", f"skip {i} gradient sum", 2 * a * n, a * n)
    params = model_params(cfg)
    ops.adam(params)

    def classify(module, op, cat_index=None):
        return unet_group(module, op, cat_index, levels)
    return StepModel("unet", batch, amp, list(ops), unet_groups(levels), params, classify,
                     "casts", "skip grad sums")


def step_model(task, batch: int, amp: bool) -> StepModel:
    """The step model of a task's model (tasks/era5.py's ViT or tasks/cosmo.py's U-Net)."""
    if hasattr(task.cfg, "img_size"):
        return vit_model(task.cfg, batch, amp)
    return unet_model(task.cfg, batch, amp)
