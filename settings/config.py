"""Typed run configuration: YAML file + named config + command-line overrides, validated in one place.

A YAML file holds named configs built from each other with anchors and merge keys
(``short: {<<: *base, num_iters: 128}``). The chosen config is checked against the dataclass of its
model family (``ViTConfig`` or ``UNetConfig``): unknown keys are refused with the nearest valid name,
values are coerced to the type the field is annotated with (``int``, ``Optional[float]``,
``list[int]``, ``Literal["none", "fp16", "bf16"]`` for a choice) or refused, and cross-field rules
are checked. Values may name environment variables: ``$VAR``, ``${VAR}`` or ``${VAR:-default}``.

Every field below has a one-line description in its ``help`` metadata; ``python train.py --help``
prints them.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml

from settings.errors import ConfigError
from settings.signals import STOPPED_EXIT_CODE, signal_number


def _f(default, help, compare=True, **checks):
    """A setting: its default, a one-line description and bounds on its value (``min``/``max``
    inclusive, ``above``/``below`` exclusive; on every entry of a list) or, for a list, its
    ``length``. Its type and any choices come from the annotation (``Literal[...]``).
    ``identity=True`` marks the fields that say where a config came from, not how to train;
    ``path="dir"`` a directory (never a file), ``path="out"`` a directory the run writes into
    (``validate`` checks both, when set); ``size=True`` a setting that decides the size of the
    model, of its activations or of a sample (named when memory runs out)."""
    meta = {"help": help, **checks}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), compare=compare, metadata=meta)
    return field(default=default, compare=compare, metadata=meta)


@dataclass
class Config:
    """Settings shared by both model families."""

    # -- where the config came from: set by build_config from --config and --yaml_config, never
    # given as settings
    name: str = _f("", "name of the config in its YAML file (--config)", identity=True)
    yaml_path: str = _f("", "YAML file the config was read from (--yaml_config); two configs "
                        "with the same settings are equal wherever they were read",
                        compare=False, identity=True)
    model: Literal["vit", "unet"] = _f("vit", "model family: vit (ERA5) or unet (cosmology)")
    # -- run directory and reproducibility
    expdir: str = _f("./logs", "root of run directories: <expdir>/<config>/<world size>/<run_num>/",
                     path="out")
    run_num: str = _f("auto", "name of this run beside other runs of the same config; auto: "
                      "the next free number (with --resume: the run of the newest checkpoint)")
    seed: int = _f(0, "seed for weights, data order and augmentation", min=0, max=2**32 - 1)
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "auto (cuda when present, else cpu), cpu "
                                                "or cuda")
    cudnn_benchmark: bool = _f(True, "CUDA: time cuDNN's convolution algorithms on the first "
                               "steps and keep the fastest (false: deterministic algorithms, "
                               "bitwise-reproducible runs, slower)")
    # -- data
    data_root: str = _f("./data", "directory holding the data set", path="dir")
    data_loader_config: Literal["lowmem", "inmem", "synthetic", "dali-lowmem", "dali-inmem",
                                "device"] = _f(
        "lowmem", "lowmem: read each sample from disk; inmem: hold the data in memory; synthetic: "
        "one batch made in memory and served every step, for compute-only timing (needs no "
        "data); dali-lowmem / dali-inmem: the same samples through an NVIDIA DALI pipeline "
        "(pip install -r requirements-dali.txt); device (U-Net): hold the volumes in the "
        "training device's memory (GPU memory on a GPU) and cut and rotate each batch's crops "
        "there, the lowmem samples without workers or copies (see device_volume_dtype)")
    num_data_workers: int = _f(0, "data loader worker processes per rank (0: load in the main "
                               "process); with DALI, its reader threads", min=0)
    prefetch_depth: int = _f(2, "batches each loader prepares ahead (per worker for the PyTorch "
                             "loader, the queue depth of a DALI pipeline)", min=1)
    synthesize_if_missing: bool = _f(False, "generate small synthetic data under data_root when "
                                     "it holds none")
    # -- optimisation
    global_batch_size: int = _f(16, "samples per optimizer step, summed over data-parallel ranks",
                                min=1)
    local_batch_size: Optional[int] = _f(None, "samples per rank per step; when set, "
                                         "global_batch_size = local_batch_size x data-parallel "
                                         "ranks", min=1)
    base_batch_size: int = _f(16, "batch size at which lr is the learning rate (lr_scaling)",
                              min=1)
    num_epochs: Optional[int] = _f(None, "epochs to train (give this or num_iters)", min=1)
    num_iters: Optional[int] = _f(None, "optimizer steps to train (give this or num_epochs)",
                                  min=1)
    lr: float = _f(5e-4, "peak learning rate at base_batch_size", min=0.0)
    end_lr: float = _f(0.0, "learning rate at the end of the cosine decay", min=0.0)
    warmup_steps: int = _f(0, "steps of linear warm-up from 0 to the peak learning rate", min=0)
    lr_scaling: Literal["none", "linear", "sqrt"] = _f(
        "none", "peak lr = lr x (global/base batch size)^{0, 1, 1/2} for none, linear, sqrt")
    adam_betas: list[float] = _f([0.9, 0.999], "Adam's decay rates (beta1, beta2) of the moving "
                                 "averages of the gradient and of its square", length=2, min=0.0,
                                 below=1.0)
    amp_mode: Literal["none", "fp16", "bf16"] = _f("none", "automatic mixed precision: none, fp16 "
                                                   "(GPU, with a gradient scaler) or bf16")
    enable_jit: bool = _f(False, "compile the model with torch.compile")
    enable_fused: bool = _f(False, "use the fused Adam kernel where the device supports it")
    graph_warmup_steps: int = _f(3, "train_graph.py: eager steps on a side stream before the step "
                                 "is captured as a CUDA graph (at least 11 under DDP)", min=1)
    grad_accum_steps: int = _f(1, "micro-batches per optimizer step: each rank's share of the "
                               "global batch is taken in this many forward/backward passes "
                               "(less activation memory, the same step)", min=1)
    max_grad_norm: float = _f(0.0, "clip the gradient to this 2-norm before each step (0: no "
                              "clipping; the norm is logged either way)", min=0.0)
    # -- logging and checkpoints
    log_every: int = _f(10, "optimizer steps between training-loss log points (a host sync)",
                        min=1)
    checkpoint_every: int = _f(0, "optimizer steps between checkpoints (0: only at the end)",
                               min=0)
    checkpoint_keep: int = _f(3, "number of newest checkpoints kept", min=1)
    resume: Literal[False, True, "auto"] = _f(
        False, "continue from the newest valid checkpoint of this run directory; auto: continue "
        "when it holds checkpoints, start fresh otherwise (a requeued job)")
    stop_signals: list[str] = _f(
        ["SIGTERM", "SIGUSR1"], "signals that stop the run cleanly at the next log point: "
        f"checkpoint, then exit code {STOPPED_EXIT_CODE} (resumable)")
    resume_from: str = _f("", "continue from this checkpoint file, or the newest in this run "
                          "directory (e.g. one written with another number of ranks)")
    init_from: str = _f("", "start from the weights of a model of the tutorial's own code, saved "
                        "with torch.save(model.state_dict()) (empty: fresh weights)")
    throughput_report: bool = _f(False, "after training, time the loader alone (IO), the model on "
                                 "a cached batch (SYNTHETIC) and both (FULL) and report samples/s")
    profile_trace: str = _f("", "write a torch.profiler trace (Chrome/Perfetto JSON and a "
                            "TensorBoard profile) of a few steps of the second epoch to this "
                            "directory (empty: none)", path="out")
    enable_manual_profiling: bool = _f(False, "bracket 30 steps of the second epoch with the CUDA "
                                       "profiler API (for nsys -c cudaProfilerApi)")
    # -- data parallelism
    noddp: bool = _f(False, "skip the gradient all-reduce (compute-only scaling measurements; "
                     "the replicas drift apart)")
    disable_broadcast_buffers: bool = _f(False, "do not broadcast module buffers every step")
    bucket_cap_mb: float = _f(25.0, "DistributedDataParallel gradient bucket size in MB", min=0.0)
    dist_timeout_s: int = _f(600, "seconds a collective waits for a missing rank before failing",
                             min=1)

    @property
    def data_is_generated(self) -> bool:
        """Batches are made in memory (data_loader_config synthetic): nothing under data_root is
        read, and nothing is written there."""
        return self.data_loader_config == "synthetic"

    def check(self):
        """The rules between a family's own settings (its class says them)."""



@dataclass
class ViTConfig(Config):
    """Vision Transformer on ERA5 fields: predict the state dt steps after the input."""

    img_size: list[int] = _f([360, 720], "image height and width the fields are cropped to",
                             length=2, min=1, size=True)
    patch_size: int = _f(8, "side of the square patches", min=1, size=True)
    embed_dim: int = _f(384, "token width", min=1, size=True)
    depth: int = _f(12, "number of transformer blocks", min=1, size=True)
    num_heads: int = _f(8, "attention heads", min=1)
    mlp_ratio: float = _f(4.0, "MLP hidden width / embed_dim", min=0.0, size=True)
    dropout: float = _f(0.0, "dropout probability", min=0.0, max=1.0)
    layer_norm_eps: float = _f(1e-6, "epsilon added to the variance in every LayerNorm", above=0.0)
    head_bias: bool = _f(False, "give the output head (token -> patch) a bias")
    n_in_channels: int = _f(20, "input channels (the first n of the 20 ERA5 variables)", min=1,
                            max=20, size=True)
    n_out_channels: int = _f(20, "output channels", min=1, max=20)
    dt: int = _f(1, "forecast lead in 6-hour steps", min=1)
    limit_nsamples: Optional[int] = _f(None, "use this many training pairs, spread evenly over "
                                       "the years", min=1)
    limit_nsamples_val: Optional[int] = _f(None, "use this many validation pairs", min=1)
    synthetic_steps_per_year: int = _f(240, "time steps per year when synthesizing data", min=2)
    # -- model parallelism
    tensor_parallel: int = _f(1, "ranks that split each layer's weights (heads, MLP width)", min=1)
    context_parallel: int = _f(1, "ranks that split the token sequence (image rows)", min=1)
    parallel_order: str = _f("tp-cp-dp", "which group's ranks are adjacent (first) to last, "
                             "e.g. tp-cp-dp keeps tensor-parallel ranks on one node")
    activation_checkpointing: bool = _f(False, "recompute each block's activations in the "
                                        "backward pass instead of storing them")
    sequence_parallel: bool = _f(True, "split the LayerNorm/residual activations over the "
                                 "tensor-parallel ranks too (false: whole on each of them)")

    def check(self):
        """The rules between this family's settings (``validate`` calls it last)."""
        if self.data_loader_config == "device":
            raise ConfigError("data_loader_config=device holds the U-Net's cosmology volumes on "
                              "the training device; the ViT's ERA5 data has no such loader: use "
                              "--data_loader_config lowmem or inmem")
        h, w = self.img_size
        p = self.patch_size
        if h % p or w % p:
            raise ConfigError(f"img_size={self.img_size} is not divisible by patch_size={p}: "
                              f"choose a patch_size that divides {h} and {w}")
        if self.data_is_generated and (h < 2 or w < 4):
            raise ConfigError(f"img_size={self.img_size} is too small for generated ERA5 fields "
                              f"(the rows run from pole to pole): use at least 2 rows and 4 "
                              f"columns")
        if self.embed_dim % self.num_heads:
            ok = [n for n in range(1, self.embed_dim + 1) if self.embed_dim % n == 0 and n <= 64]
            raise ConfigError(f"num_heads={self.num_heads} does not divide embed_dim="
                              f"{self.embed_dim}: choose one of {ok}")


@dataclass
class UNetConfig(Config):
    """3D U-Net on cosmology volumes: N-body fields in, hydrodynamic fields out."""

    base_width: int = _f(64, "channels of the first encoder level; doubled per level", min=1, size=True)
    max_width: int = _f(512, "cap on the channels of any level", min=1, size=True)
    full_scale: bool = _f(True, "six levels (true) or five", size=True)
    conv_init_std: float = _f(0.02, "std of the normal initialisation of conv weights", min=0.0)
    leaky_relu_slope: float = _f(0.01, "negative slope of the encoder's LeakyReLUs", min=0.0)
    n_in_channels: int = _f(4, "N-body input channels", min=1, size=True)
    n_out_channels: int = _f(5, "hydro output channels", min=1)
    lambda_rho: float = _f(0.0, "weight of the L1 term on exp(14 x) of output channel 0", min=0.0)
    data_size: int = _f(64, "side of the cubic crops", min=2, size=True)
    Nsamples: int = _f(65536, "training crops per epoch", min=1)
    Nsamples_val: int = _f(8192, "validation crops per validation", min=1)
    train_file: str = _f("train.h5", "training volume file under data_root")
    val_file: str = _f("valid.h5", "validation volume file under data_root")
    device_volume_dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32", "data_loader_config device: the type the volumes are held in; bfloat16 or "
        "float16 halves the memory they take (values rounded to that type once, at load; "
        "batches stay float32)")
    nbody_vector_channels: list[int] = _f([1, 2, 3], "input channels that are the x, y, z "
                                          "components of a vector (empty: none)")
    hydro_vector_channels: list[int] = _f([2, 3, 4], "output channels that are the x, y, z "
                                          "components of a vector")
    synthetic_size: list[int] = _f([64, 64], "train and validation box sides when synthesizing "
                                   "data", length=2, min=1)

    def check(self):
        """The rules between this family's settings (``validate`` calls it last)."""
        levels = 6 if self.full_scale else 5
        if self.data_size % 2**levels:
            raise ConfigError(f"data_size={self.data_size} must be divisible by 2^{levels}="
                              f"{2**levels} for a U-Net with full_scale={self.full_scale}")
        for key, n in (("nbody_vector_channels", self.n_in_channels),
                       ("hydro_vector_channels", self.n_out_channels)):
            chans = getattr(self, key)
            if chans and (len(chans) != 3 or any(not 0 <= c < n for c in chans)):
                raise ConfigError(f"{key}={chans} must list 3 channel indices below {n}, or be []")


CONFIG_CLASSES = {"vit": ViTConfig, "unet": UNetConfig}


def register_config(model: str, config_class: type):
    """A config class for ``model: <model>`` in a YAML config (a new problem registers its own,
    beside its task and data set)."""
    CONFIG_CLASSES[model] = config_class

# Keys the reference tutorials used that mean something here under another name.
RENAMED = {
    "lr_schedule": "lr, end_lr, warmup_steps and lr_scaling",
    "start_lr": "lr",
    "warmup": "warmup_steps",
    "N_out_channels": "n_out_channels",
    "ngf": "base_width",
}
# Command-line flags kept from the tutorials, as (key, value) they set.
FLAG_ALIASES = {
    "enable_amp": ("amp_mode", "fp16"),
    "enable_apex": ("enable_fused", True),
    "enable_benchy": ("throughput_report", True),
}
# Settings and values kept from the tutorials under their names there.
SETTING_ALIASES = {"row_parallel_size": "tensor_parallel"}
VALUE_ALIASES = {("data_loader_config", "dali"): "dali-lowmem"}
ENTRY_ARGS = ("yaml_config", "config")


# ----------------------------------------------------------------------------- YAML loading


_ENV = re.compile(r"\$\{(\w+)(:-([^}]*))?\}|\$(\w+)")


def expand_env(value: str) -> str:
    """Expand $VAR, ${VAR} and ${VAR:-default}; an unset variable without default is an error."""

    def sub(m):
        name = m.group(1) or m.group(4)
        if name in os.environ and (os.environ[name] or m.group(2) is None):
            return os.environ[name]
        if m.group(2) is not None:
            return m.group(3)
        raise ConfigError(f"environment variable ${name} is not set (used in '{value}'): "
                          f"export it, or override the value on the command line")

    return _ENV.sub(sub, value)


def load_yaml_configs(path: str) -> dict:
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"--yaml_config {path}: no such file; the configs live in config/ViT.yaml "
                          f"and config/UNet.yaml") from None
    except IsADirectoryError:
        raise ConfigError(f"--yaml_config {path} is a directory: name a YAML file in it, e.g. "
                          f"config/ViT.yaml") from None
    except (OSError, UnicodeDecodeError) as e:  # unreadable: permissions, a binary file, ...
        raise ConfigError(f"--yaml_config {path} cannot be read ({e}): name a readable YAML "
                          f"file, e.g. config/ViT.yaml") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--yaml_config {path} is not valid YAML: {yaml_problem(e)}") from None
    example = "e.g. 'quickstart:' and below it, indented, 'lr: 1e-3'"
    if doc is None:
        raise ConfigError(f"--yaml_config {path} is empty: it must map config names to their "
                          f"settings, {example}")
    if not isinstance(doc, dict):
        raise ConfigError(f"--yaml_config {path} holds a {_yaml_kind(doc)}, not a mapping of "
                          f"config names to their settings: {example}")
    for name, settings in doc.items():
        if not isinstance(settings, dict):
            raise ConfigError(f"--yaml_config {path}: config '{name}' holds a "
                              f"{_yaml_kind(settings)}, not a mapping of settings: {example}")
    return doc


def _yaml_kind(value) -> str:
    kinds = {list: "list", str: "string", int: "number", float: "number", bool: "boolean",
             type(None): "null value"}
    return kinds.get(type(value), type(value).__name__)


def yaml_problem(e: yaml.YAMLError) -> str:
    """The parser's reason on one line, with the line and column where it found it (and where
    the construct it was reading began): e.g. ``line 3, column 1: found character '\\t' that
    cannot start any token (indent with spaces, not tabs)``."""
    if isinstance(e, yaml.MarkedYAMLError):
        text = e.problem or e.context or "unreadable"
        if "'\\t'" in text:
            text += " (indent with spaces, not tabs)"
        if isinstance(e, yaml.constructor.ConstructorError) and "tag" in text:
            text += (" (tags such as !!python/object are not read: write plain values, lists "
                     "and mappings)")
        if e.context and e.problem and e.context_mark is not None:
            text += (f" ({e.context} that starts at line {e.context_mark.line + 1}, column "
                     f"{e.context_mark.column + 1})")
        if e.problem_mark is not None:
            text = f"line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}: {text}"
    elif isinstance(e, yaml.reader.ReaderError):
        text = (f"character {e.position + 1}: unacceptable character #x{e.character:04x} "
                f"({e.reason}): save it as UTF-8 text")
    else:
        text = str(e)
    return " ".join(text.split())


def nearest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else f"valid: {', '.join(sorted(choices))}"


# ----------------------------------------------------------------------------- coercion


@functools.lru_cache(maxsize=None)
def field_types(cls) -> dict:
    """Each field's annotation of a config class, evaluated (``list[int]``, ``Literal[...]``)."""
    return typing.get_type_hints(cls)


def _coerce_scalar(key, value, tp):
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
            return False
        raise ConfigError(f"{key}={value!r} is not a boolean: use true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r} is not an integer: give a whole number, e.g. {key}=4")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not a number")
        number = None
        if isinstance(value, (int, float)):
            try:
                number = float(value)
            except OverflowError:  # an integer beyond any float
                number = math.inf
        elif isinstance(value, str):  # YAML 1.1 reads 5E-4 as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}={value!r} is not a number: give e.g. {key}=1e-3")
        if not math.isfinite(number):  # nan and inf parse as floats but are never a setting
            raise ConfigError(f"{key}={value!r} is not a finite number: give e.g. {key}=1e-3")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return expand_env(str(value))
        raise ConfigError(f"{key}={value!r} is not a string")
    raise TypeError(f"unsupported config type {tp} for {key}")


def _check_bounds(key, v, meta):
    if "min" in meta and v < meta["min"]:
        raise ConfigError(f"{key}={v} must be >= {meta['min']}")
    if "max" in meta and v > meta["max"]:
        raise ConfigError(f"{key}={v} must be <= {meta['max']}")
    if "above" in meta and v <= meta["above"]:
        raise ConfigError(f"{key}={v} must be > {meta['above']}")
    if "below" in meta and v >= meta["below"]:
        raise ConfigError(f"{key}={v} must be < {meta['below']}")


def _coerce_mixed_choice(key, value, choices):
    """``value`` as the first of ``choices``' types that reads it as a choice (e.g. ``resume``:
    false, true or "auto"; "yes" reads as true, "auto" as the string)."""
    for tp in dict.fromkeys(type(c) for c in choices):
        try:
            v = _coerce_scalar(key, value, tp)
        except ConfigError:
            continue
        if v in choices:
            return v
    return value


def _coerce_item(key, value, tp, meta):
    """One value of type ``tp`` (a scalar type or ``Literal[...]``), checked against ``meta``."""
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        v = _coerce_mixed_choice(key, value, choices) if len({type(c) for c in choices}) > 1 \
            else _coerce_scalar(key, value, type(choices[0]))
        if v not in choices:
            raise ConfigError(f"{key}={v!r} is not one of {', '.join(map(str, choices))}: "
                              f"{nearest(str(v), [str(c) for c in choices])}")
        return v
    v = _coerce_scalar(key, value, tp)
    _check_bounds(key, v, meta)
    return v


def coerce(cls, key: str, value: Any):
    """``value`` (from YAML or the command line) as the type of ``cls``'s field ``key``, checked."""
    tp = field_types(cls)[key]
    meta = {f.name: f for f in dataclasses.fields(cls)}[key].metadata
    if typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp):  # Optional
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~")):
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value if value.strip().startswith("[") else f"[{value}]")
            except yaml.YAMLError:
                pass
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} is not a list: give e.g. {key}=[1,2]")
        (item,) = typing.get_args(tp)
        out = [_coerce_item(f"{key}[{i}]", v, item, meta) for i, v in enumerate(value)]
        if "length" in meta and len(out) != meta["length"]:
            raise ConfigError(f"{key}={out} must have {meta['length']} entries, e.g. "
                              f"{key}={default_value(cls, key)}")
        return out
    return _coerce_item(key, value, tp, meta)


def default_value(cls, key):
    f = {f.name: f for f in dataclasses.fields(cls)}[key]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


# ----------------------------------------------------------------------------- command line


def parse_overrides(argv: list[str]) -> tuple[dict, dict]:
    """Split ``--key value``, ``--key=value`` and bare ``--flag`` arguments.

    Returns (entry arguments, overrides) in command-line order; values stay strings (or True
    for a bare flag) and are typed later against the config class.
    """
    entry, overrides = {}, {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument '{arg}': settings are given as --key value")
        key, eq, val = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                val = argv[i + 1]
                i += 1
            else:
                val = True
        key = key.replace("-", "_") if key.replace("-", "_") in ENTRY_ARGS else key
        if key in ENTRY_ARGS and val is True:
            example = "config/ViT.yaml" if key == "yaml_config" else "quickstart"
            raise ConfigError(f"--{key} needs a value: e.g. --{key} {example}")
        (entry if key in ENTRY_ARGS else overrides)[key] = val
        i += 1
    return entry, overrides


def identity_fields(cls) -> tuple:
    """The fields that say where a config came from (its name and file), not how to train."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("identity"))


def _apply(cls, values: dict, source: str) -> dict:
    fields = {f.name for f in dataclasses.fields(cls)}
    out = {}
    aliased = {}  # setting -> the flag alias that set it
    for key, val in values.items():
        key = SETTING_ALIASES.get(key, key)
        if isinstance(val, str):
            val = VALUE_ALIASES.get((key, val), val)
        if key in FLAG_ALIASES:
            target, alias_val = FLAG_ALIASES[key]
            if _coerce_scalar(key, val, bool):
                out[target] = coerce(cls, target, alias_val)
                aliased[target] = key
            continue
        if key in identity_fields(cls):
            raise ConfigError(f"'{key}' is not a setting ({source}): the config's name and file are "
                              f"chosen with --config and --yaml_config; remove '{key}'")
        if key not in fields:
            if key in RENAMED and RENAMED[key]:
                hint = f"use {RENAMED[key]}"
            else:
                hint = nearest(key, fields - set(identity_fields(cls)))
            raise ConfigError(f"unknown setting '{key}' ({source}): {hint}")
        out[key] = _coerce_given(cls, key, val, source)
    for target, alias in aliased.items():
        _check_alias(cls, alias, target, values.get(target), source)
    return out


def _coerce_given(cls, key, val, source):
    """``coerce``, saying so when a command-line setting was given without its value (a bare
    ``--lr`` reads as true)."""
    try:
        return coerce(cls, key, val)
    except ConfigError:
        if val is True and source == "command line":
            raise ConfigError(f"--{key} needs a value: e.g. --{key} {default_value(cls, key)}") from None
        raise


def _check_alias(cls, alias, target, given, source):
    """A flag alias (``--enable_amp``) and its setting (``--amp_mode bf16``) given together must
    agree: which one should win is not for the program to guess."""
    if given is not None and coerce(cls, target, given) != coerce(cls, target,
                                                                  FLAG_ALIASES[alias][1]):
        raise ConfigError(f"--{alias} means {target}={FLAG_ALIASES[alias][1]} but {target}="
                          f"{given} is also given ({source}): keep one of them")


def build_config(yaml_path: str, name: str, overrides: Optional[dict] = None) -> Config:
    """The named config of the YAML file with overrides applied, typed and validated."""
    configs = load_yaml_configs(yaml_path)
    if name not in configs:
        raise ConfigError(f"--config {name}: no such config in {yaml_path}: {nearest(name, configs)} "
                          f"(available: {', '.join(configs)})")
    raw = dict(configs[name])
    model = str(raw.get("model", "vit")).lower()
    if isinstance(overrides, dict) and "model" in overrides:
        if overrides["model"] is True:  # a bare --model
            raise ConfigError("--model needs a value: e.g. --model unet")
        model = str(overrides["model"]).lower()
    if model not in CONFIG_CLASSES:
        raise ConfigError(f"model={model!r} in config '{name}' is not one of "
                          f"{', '.join(CONFIG_CLASSES)}")
    cls = CONFIG_CLASSES[model]
    values = _apply(cls, raw, f"config '{name}' in {yaml_path}")
    cli = _apply(cls, overrides or {}, "command line")
    # num_epochs and num_iters are alternatives: the one given on the command line wins.
    if "num_epochs" in cli and "num_iters" not in cli:
        values.pop("num_iters", None)
    if "num_iters" in cli and "num_epochs" not in cli:
        values.pop("num_epochs", None)
    _choose_batch_setting(values, cli)
    values.update(cli)
    cfg = cls(name=name, yaml_path=yaml_path, **values)
    validate(cfg)
    return cfg


def _choose_batch_setting(values: dict, cli: dict):
    """global_batch_size and local_batch_size are alternatives: the one given on the command line
    wins over the config's; both on the command line are refused (local_batch_size, when set,
    decides the global batch: local x data-parallel ranks)."""
    if "global_batch_size" in cli and cli.get("local_batch_size") is not None:
        raise ConfigError(f"both --global_batch_size {cli['global_batch_size']} and "
                          f"--local_batch_size {cli['local_batch_size']} are given: keep one "
                          f"(local_batch_size sets the global batch to local x data-parallel "
                          f"ranks); for larger steps than fit in memory use --grad_accum_steps")
    if "global_batch_size" in cli and "local_batch_size" not in cli:
        values["local_batch_size"] = None


def check_dir(key: str, path: str, fix: str = "give a directory") -> str:
    """``path`` is a directory, or can be made as one: its nearest existing ancestor is a
    directory (returned)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"{key}={path}: {probe} is a file, not a directory: {fix}")
    return probe


def check_writable_dir(key: str, path: str):
    """``path`` is a directory this process can write into, or can be made as one: the nearest
    existing ancestor is a writable directory."""
    probe = check_dir(key, path, "give a directory (it is created when missing)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path}: {probe} is not writable by this user: choose a "
                          f"directory you can write to")


def validate(cfg: Config):
    """Rules that involve more than one field, and the places runs read from and write to."""
    for f in dataclasses.fields(cfg):
        path = getattr(cfg, f.name)
        if f.metadata.get("path") == "out" and path:
            check_writable_dir(f.name, path)
        elif f.metadata.get("path") == "dir" and path:
            check_dir(f.name, path)
    for name in cfg.stop_signals:
        signal_number(name)  # a ConfigError unless it names a signal the run can catch
    if cfg.num_epochs is None and cfg.num_iters is None:
        raise ConfigError("neither num_epochs nor num_iters is set: give one, e.g. --num_epochs 3")
    if cfg.num_epochs is not None and cfg.num_iters is not None:
        raise ConfigError(f"both num_epochs={cfg.num_epochs} and num_iters={cfg.num_iters} are set:"
                          f" keep one (set the other to null)")
    cfg.check()


def to_dict(cfg: Config, identity: bool = True) -> dict:
    """Every field of ``cfg``; without ``name`` and ``yaml_path`` when ``identity`` is false."""
    skip = () if identity else identity_fields(type(cfg))
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}


def dump(cfg: Config, derived: Optional[dict] = None) -> str:
    """The resolved config as YAML that ``--yaml_config`` reads back under the same name.

    The settings go under the config's name; the file it was read from and the ``derived``
    values (the per-rank batch, the peak lr, ...) are comment lines above them."""
    text = yaml.safe_dump({cfg.name: to_dict(cfg, identity=False)}, sort_keys=False,
                          default_flow_style=None)
    notes = {"read from": cfg.yaml_path} if cfg.yaml_path else {}
    notes.update(derived or {})
    return "".join(f"# {k}: {v}\n" for k, v in notes.items()) + text
