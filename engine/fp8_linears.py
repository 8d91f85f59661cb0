"""fp8 linear layers (the ViT setting ``fp8_linears``): the transformer blocks' matmuls in
float8, with torchao's float8 training (``pip install -r requirements-fp8.txt``).

Which layers: the linear layers inside the task's blocks (``task.blocks``: the ViT's
qkv, proj, fc1 and fc2; at the ``mp`` size 99% of its linear layers' FLOPs and 69% of all its
FLOPs, most of the rest attention's) whose two dimensions on this rank are multiples of 16, as
fp8 matmul kernels need (``ViTConfig.check`` refuses a model whose block linears are not, so in
a run all of them are). The patch embedding (a convolution) and the head (it makes the
forecast itself) keep the autocast precision.

How: every matmul of the forward and backward pass (the output, the input's gradient, the
weight's gradient) casts its two operands to float8 with dynamic scales, the absolute maximum
mapped to float8's largest value: one scale per tensor (``tensorwise``: inputs and weights in
e4m3, output gradients in e5m2) or one per row (``rowwise``: all in e4m3, the scales powers of
2), multiplies on the fp8 tensor cores with fp32 accumulation and returns the result in the
autocast dtype (bf16). Weights, gradients and Adam's state stay fp32: checkpoints are the same
tensors as without fp8.

Where (``engine.parallelism.apply_parallelism``): after the tp/cp split, before FSDP and
torch.compile. A serial model's (or an FSDP model's) ``nn.Linear`` become torchao's
``Float8Linear`` (``convert_to_float8_training``). A tp/cp model's parallel linears
(``distributed.layers``) keep their collectives and compute the matmul of their slices with the
same fp8 matmul (``local_linear``): each rank scales its own weight slice by the slice's
maximum, not the whole weight's, so a tp run rounds a little differently from the serial one.
Under FSDP the gathered weights arrive in bf16 (the mixed-precision policy) and are cast to fp8
after the all-gather; torchao's fp8 all-gather (``enable_fsdp_float8_all_gather``) is off, so
the all-gather and the checkpoints are those of a bf16 run.

Devices: a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); an older one is
refused at the start. On a CPU the casts are emulated: the operands rounded to fp8 with the
same scales, multiplied in fp32 (slower than without fp8: for checking a config and for the
tests, not for speed).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
import torch.nn as nn

from settings.errors import ConfigError

log = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # the first GPUs with fp8 tensor cores (Ada); Hopper is 9.0
DIM_MULTIPLE = 16  # fp8 matmul kernels need both dimensions of each operand to be multiples


@contextlib.contextmanager
def _quiet(*names: str):
    """Loggers ``names`` at ERROR inside: importing torchao reports, as warnings, compiled
    extensions of other features that do not load here (its CUDA kernels for MX formats and
    CUTLASS; float8 training uses torch's own scaled matmul)."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def load_torchao(recipe: str):
    """``torchao.float8``, imported on first use (about 2 s); ConfigError (one line) when
    torchao is not installed or does not import with this torch."""
    try:
        with _quiet("torchao", "torch.utils._pytree"):
            import torchao.float8 as float8
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"fp8_linears={recipe} needs torchao's float8 training ({e}): pip "
                          f"install -r requirements-fp8.txt, or train without fp8 "
                          f"(--fp8_linears none)") from None
    return float8


def fits(out_features: int, in_features: int) -> bool:
    """Whether a linear's weight of (out, in) can be an fp8 matmul operand."""
    return out_features % DIM_MULTIPLE == 0 and in_features % DIM_MULTIPLE == 0


def float8_config(recipe: str, device: torch.device):
    """torchao's ``Float8LinearConfig`` of ``recipe``, emulated off a CUDA GPU."""
    float8 = load_torchao(recipe)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=device.type != "cuda")


def check(recipe: str, device: torch.device):
    """Refuse, before anything is written, a run with fp8 linears that cannot have them: torchao
    missing, a GPU without fp8 tensor cores, or a matmul that fails on the device (one
    forward and backward of a 16 x 16 fp8 linear in bf16, a few milliseconds)."""
    if recipe == "none":
        return
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if tuple(cap) < MIN_CAPABILITY:
            raise ConfigError(
                f"fp8_linears={recipe} needs a GPU with fp8 tensor cores (compute capability "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer: L40S, H100, H200, B200); "
                f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}: use --fp8_linears "
                f"none (bf16 matmuls)")
    float8, config = load_torchao(recipe), float8_config(recipe, device)
    gpus = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=gpus):  # the run's random streams left as they were
            layer = nn.Linear(DIM_MULTIPLE, DIM_MULTIPLE, device=device)
            layer = float8.convert_to_float8_training(nn.Sequential(layer), config=config)
            x = torch.randn(DIM_MULTIPLE, DIM_MULTIPLE, device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                y = layer(x)
            y.float().sum().backward()
    except (RuntimeError, NotImplementedError, AssertionError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"fp8_linears={recipe} fails on {device.type} ({reason[:160]}): use "
                          f"--fp8_linears none" + (" or tensorwise" if recipe != "tensorwise"
                                                   else "")) from None


def fp8_linear(config):
    """``(x, weight, bias) -> y``, ``F.linear``'s contract, with torchao's float8 matmul (the
    one ``Float8Linear`` calls) and its rule for autocast: on a GPU under autocast the input
    is first cast to the autocast dtype, and the result comes in the input's dtype."""
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    with torch.device("meta"):  # only for the matmul settings torchao derives from the config
        mm_config = Float8Linear(DIM_MULTIPLE, DIM_MULTIPLE, bias=False,
                                 config=config).linear_mm_config

    def linear(x, weight, bias=None):
        if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            x = x.to(torch.get_autocast_dtype("cuda"))
        y = matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)
        return y if bias is None else y + bias.to(y.dtype)
    return linear


def convert(blocks: list[nn.Module], recipe: str, device: torch.device) -> int:
    """Make the linear layers of ``blocks`` compute in fp8 (in place); the number converted.
    Serial linears become ``Float8Linear`` (same parameters, same names); tp/cp linears keep
    their collectives and take the fp8 matmul for their slice."""
    from distributed.layers import _ParallelLinear
    float8 = load_torchao(recipe)
    from torchao.float8.float8_linear import Float8Linear
    config = float8_config(recipe, device)
    local = None
    n = 0
    for block in blocks:
        for m in block.modules():
            if isinstance(m, _ParallelLinear) and fits(*m.weight.shape):
                local = local or fp8_linear(config)
                m.local_linear = local
                n += 1
        float8.convert_to_float8_training(
            block, config=config,
            module_filter_fn=lambda m, fqn: fits(m.out_features, m.in_features))
        n += sum(isinstance(m, Float8Linear) for m in block.modules())
    where = ("emulated on the CPU: operands rounded to fp8, multiplied in fp32, for checking a "
             "run, not for speed" if device.type != "cuda" else "on the fp8 tensor cores")
    log.info(f"fp8 linears ({recipe} scaling, torchao's float8 training): {n} linear layers in "
             f"{len(blocks)} block{'s' if len(blocks) != 1 else ''}, {where}")
    return n
