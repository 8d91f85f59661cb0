"""fp8 linear layers (``fp8_linears``): the transformer blocks' linears compute in float8 with
torchao (docs/performance.md, "fp8 linear layers"); tp/cp linears keep their collectives, their
slice's matmul in fp8 (``local_linear``). Emulated on a CPU, for checks, not speed."""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn as nn

from settings.errors import ConfigError

log = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # the first GPUs with fp8 tensor cores (Ada); Hopper is 9.0
DIM_MULTIPLE = 16  # fp8 matmul kernels need both dimensions of each operand to be multiples


def load_torchao(recipe: str, device: torch.device):
    """``torchao.float8`` (imported on first use: about 2 s) and its ``Float8LinearConfig`` of
    ``recipe``, emulated off a CUDA GPU; ConfigError when torchao does not import."""
    # Importing torchao warns of compiled extensions of other features that do not load here
    # (its MX and CUTLASS kernels; float8 training uses torch's own scaled matmul).
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        import torchao.float8 as float8
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"fp8_linears={recipe} needs torchao's float8 training ({e}): pip "
                          f"install -r requirements-fp8.txt, or train without fp8 "
                          f"(--fp8_linears none)") from None
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return float8, dataclasses.replace(config, emulate=device.type != "cuda")


def fits(out_features: int, in_features: int) -> bool:
    """Whether a linear's weight of (out, in) can be an fp8 matmul operand."""
    return out_features % DIM_MULTIPLE == 0 and in_features % DIM_MULTIPLE == 0


def check(recipe: str, device: torch.device):
    """Refuse, before anything is written, fp8 linears that cannot run: torchao missing, a GPU
    without fp8 tensor cores, or a 16 x 16 fp8 linear's forward and backward failing."""
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
    float8, config = load_torchao(recipe, device)
    try:  # (fork_rng: the run's random streams left as they were)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
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
    """``F.linear`` with torchao's float8 matmul (``Float8Linear``'s) and its autocast rule: on a
    GPU under autocast the input is cast to the autocast dtype first."""
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
    """Make the linear layers of ``blocks`` compute in fp8, in place (serial ones become
    ``Float8Linear``, the same parameters); the number converted."""
    from distributed.layers import _ParallelLinear
    float8, config = load_torchao(recipe, device)
    from torchao.float8.float8_linear import Float8Linear
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
