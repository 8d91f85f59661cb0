"""The settings of a run: one dataclass per model family (``ViTConfig``, ``UNetConfig``, on the
shared ``Config``), each setting declared once by ``_f``. The rules between settings of one family
are its class's ``check()``; ``validate`` checks the rest; ``settings.parse`` reads them."""
from __future__ import annotations

import dataclasses
import functools
import os
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

from settings.errors import ConfigError
from settings.signals import STOPPED_EXIT_CODE, signal_number


_current_group = [None]  # the group the settings declared next belong to (``_group``)


def _group(name: str | None):
    """In a config class body: the settings declared after it are listed under ``name`` by
    ``--help`` (until ``config_class`` ends the class; the others under their class's name)."""
    _current_group[0] = name


def config_class(cls):
    """A config class: a dataclass whose settings' groups end with it."""
    cls = dataclass(cls)
    _group(None)
    return cls


def _f(default, help, compare=True, **checks):
    """A setting: its default, a one-line description, bounds on its value (``min``/``max``
    inclusive, ``above``/``below`` exclusive; on every entry of a list) or a list's ``length``;
    type and choices come from the annotation. ``identity``: where a config came from, not how
    to train; ``path``: "dir" a directory, "out" one the run writes into (``validate`` checks
    both); ``size``: decides the size of the model, its activations or a sample (named when
    memory runs out); ``resume``: a resumed run may change it (how long and how it runs, not
    what it learns; another value of any other setting is refused). Its ``--help`` group is the
    ``_group`` it is declared under."""
    meta = {"help": help, "group": _current_group[0], **checks}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), compare=compare, metadata=meta)
    return field(default=default, compare=compare, metadata=meta)


@config_class
class Config:
    """Settings shared by both model families."""

    _group("where the config came from")  # set by build_config from --config and
    # --yaml_config, never given as settings
    name: str = _f("", "name of the config in its YAML file (--config)", identity=True, resume=True)
    yaml_path: str = _f("", "YAML file the config was read from (--yaml_config); two configs "
                        "with the same settings are equal wherever they were read",
                        compare=False, identity=True, resume=True)
    model: Literal["vit", "unet"] = _f("vit", "model family: vit (ERA5) or unet (cosmology)")
    _group("run directory and reproducibility")
    expdir: str = _f("./logs", "root of run directories: <expdir>/<config>/<world size>/<run_num>/",
                     path="out", resume=True)
    run_num: str = _f("auto", "name of this run beside other runs of the same config; auto: "
                      "the next free number (with --resume: the run of the newest checkpoint)",
                      resume=True)
    seed: int = _f(0, "seed for weights, data order and augmentation", min=0, max=2**32 - 1)
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "auto (cuda when present, else cpu), cpu "
                                                "or cuda", resume=True)
    cudnn_benchmark: bool = _f(True, "CUDA: time cuDNN's convolution algorithms on the first "
                               "steps and keep the fastest (false: deterministic algorithms, "
                               "bitwise-reproducible runs, slower)", resume=True)
    allow_tf32: bool = _f(True, "CUDA: fp32 matmuls and convolutions on tensor cores in TF32 "
                          "(a 10-bit mantissa), as in NVIDIA's containers and the tutorial's "
                          "runs; false: full fp32 (so does NVIDIA_TF32_OVERRIDE=0)", resume=True)
    _group("data")
    data_root: str = _f("./data", "directory holding the data set", path="dir")
    data_loader_config: Literal["lowmem", "inmem", "synthetic", "dali-lowmem", "dali-inmem",
                                "device"] = _f(
        "lowmem", "lowmem: read each sample from disk; inmem: hold the data in memory; synthetic: "
        "one batch made in memory and served every step, for compute-only timing (needs no "
        "data); dali-lowmem / dali-inmem: the same samples through an NVIDIA DALI pipeline "
        "(pip install -r requirements-dali.txt); device (U-Net): hold the volumes in the "
        "training device's memory (GPU memory on a GPU) and cut and rotate each batch's crops "
        "there, the lowmem samples without workers or copies (see device_volume_dtype)",
        resume=True)
    num_data_workers: int = _f(0, "data loader worker processes per rank (0: load in the main "
                               "process); with DALI, its reader threads", min=0, resume=True)
    prefetch_depth: int = _f(2, "batches each loader prepares ahead (per worker for the PyTorch "
                             "loader, the queue depth of a DALI pipeline)", min=1, resume=True)
    loader_timeout_s: int = _f(600, "seconds a rank waits for its next batch before the run "
                               "stops with one line saying what the loader is stuck on (exit 1, "
                               "checkpoints kept; 0: wait forever)", min=0, resume=True)
    synthesize_if_missing: bool = _f(False, "generate small synthetic data under data_root when "
                                     "it holds none", resume=True)
    _group("optimisation")
    global_batch_size: int = _f(16, "samples per optimizer step, summed over data-parallel ranks",
                                min=1, resume=True)
    local_batch_size: Optional[int] = _f(None, "samples per rank per step; when set, "
                                         "global_batch_size = local_batch_size x data-parallel "
                                         "ranks", min=1, resume=True)
    base_batch_size: int = _f(16, "batch size at which lr is the learning rate (lr_scaling)", min=1)
    num_epochs: Optional[int] = _f(None, "epochs to train (give this or num_iters)", min=1,
    resume=True)
    num_iters: Optional[int] = _f(None, "optimizer steps to train (give this or num_epochs)",
                                  min=1, resume=True)
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
    enable_jit: bool = _f(False, "compile the model with torch.compile", resume=True)
    compile_blocks: bool = _f(False, "with enable_jit: compile each of the model's blocks on its "
                              "own (the ViT's transformer blocks, the U-Net's stages) instead of "
                              "the whole model; a block's compiled code serves every block like "
                              "it, so the first step comes sooner, and the parts between the "
                              "blocks run eagerly (docs/performance.md)", resume=True)
    compile_cache_dir: str = _f("", "where torch.compile keeps its caches, for later runs to "
                                "reuse (empty: $TORCHINDUCTOR_CACHE_DIR, else torch's "
                                "/tmp/torchinductor_<user>); on $SCRATCH shared by every rank "
                                "and job", path="out", resume=True)
    enable_fused: bool = _f(False, "use the fused Adam kernel where the device supports it",
    resume=True)
    graph_warmup_steps: int = _f(3, "train_graph.py: eager steps on a side stream before the step "
                                 "is captured as a CUDA graph (at least 11 under DDP)", min=1,
                                 resume=True)
    grad_accum_steps: int = _f(1, "micro-batches per optimizer step: each rank's share of the "
                               "global batch is taken in this many forward/backward passes "
                               "(less activation memory, the same step)", min=1, resume=True)
    max_grad_norm: float = _f(0.0, "clip the gradient to this 2-norm before each step (0: no "
                              "clipping; the norm is logged either way)", min=0.0)
    _group("logging and checkpoints")
    log_every: int = _f(10, "optimizer steps between training-loss log points (a host sync)",
                        min=1, resume=True)
    checkpoint_every: int = _f(0, "optimizer steps between checkpoints (0: only at the end)",
                               min=0, resume=True)
    checkpoint_keep: int = _f(3, "number of newest checkpoints kept", min=1, resume=True)
    resume: Literal[False, True, "auto"] = _f(
        False, "continue from the newest valid checkpoint of this run directory; auto: continue "
        "when it holds checkpoints, start fresh otherwise (a requeued job)", resume=True)
    stop_signals: list[str] = _f(
        ["SIGTERM", "SIGUSR1", "SIGINT"], "signals that stop the run cleanly at the next log point "
        "(or, when a rank waits for data, within a few seconds at the last finished step): "
        f"checkpoint, then exit code {STOPPED_EXIT_CODE} (resumable); a second SIGINT (Ctrl-C) "
        "ends the run at once (exit code 130)", resume=True)
    resume_from: str = _f("", "continue from this checkpoint (a ckpt_<step>.pt file or an FSDP "
                          "run's ckpt_<step>.dcp directory), or the newest in this run directory "
                          "(e.g. one written with another number of ranks)", resume=True)
    init_from: str = _f("", "start a new run (step 0, a new optimizer and schedule) from saved "
                        "weights: a checkpoint of this project (ckpt_<step>.pt or .dcp; not a "
                        "state dict taken out of one, which is read as the tutorial's) or a model "
                        "of the tutorial's own code saved with torch.save(model.state_dict()) "
                        "(empty: fresh weights)", resume=True)
    throughput_report: bool = _f(False, "after training, time the loader alone (IO), the model on "
                                 "a cached batch (SYNTHETIC) and both (FULL) and report samples/s",
                                 resume=True)
    profile_trace: str = _f("", "write a torch.profiler trace (Chrome/Perfetto JSON and a "
                            "TensorBoard profile) of a few steps of the second epoch to this "
                            "directory (empty: none)", path="out", resume=True)
    enable_manual_profiling: bool = _f(False, "bracket 30 steps of the second epoch with the CUDA "
                                       "profiler API, for nsys -c cudaProfilerApi (a run under "
                                       "nsys does so without it)", resume=True)
    _group("data parallelism")
    noddp: bool = _f(False, "skip the gradient all-reduce (compute-only scaling measurements; "
                     "the replicas drift apart)")
    disable_broadcast_buffers: bool = _f(False, "do not broadcast module buffers every step",
    resume=True)
    fsdp: bool = _f(False, "shard the parameters, gradients and Adam state over the "
                    "data-parallel ranks (FSDP2, torch's fully_shard) instead of replicating them "
                    "(DDP): each rank keeps 1/N (of its tensor/context-parallel slices, with "
                    "those) and gathers a block's weights just before using it; checkpoints load "
                    "either way", resume=True)
    fsdp_reduce_each_microbatch: bool = _f(
        True, "with --fsdp and --grad_accum_steps > 1: reduce-scatter the gradients in every "
        "micro-batch's backward, so a rank never holds the whole gradient (false: accumulate the "
        "whole unsharded fp32 gradient on every rank and reduce-scatter once per step: fewer "
        "collectives, one whole gradient more memory per rank)", resume=True)
    bucket_cap_mb: float = _f(25.0, "DistributedDataParallel gradient bucket size in MB", min=0.0,
    resume=True)
    dist_timeout_s: int = _f(600, "seconds a collective waits for a missing rank before failing",
                             min=1, resume=True)

    @property
    def data_is_generated(self) -> bool:
        """Batches are made in memory: nothing under data_root is read or written."""
        return self.data_loader_config == "synthetic"

    def check(self):
        """The rules between a family's own settings (``validate`` calls it last)."""


# ERA5 channels of `fields` (T, C, H, W), in file order (docs/data.md).
ERA5_CHANNELS = ("u10m", "v10m", "t2m", "sp", "msl", "t850", "u1000", "v1000", "z1000", "u850",
                 "v850", "z850", "u500", "v500", "z500", "t500", "z50", "r500", "r850", "tcwv")


@config_class
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
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = _f(
        "auto", "kernel of the attention (torch's scaled_dot_product_attention): auto takes "
        "cuDNN's first on Hopper GPUs in bf16/fp16 (the fastest measured there, "
        "docs/performance.md), torch's own choice elsewhere; a named one is refused where it has "
        "no kernel", resume=True)
    fp8_linears: Literal["none", "tensorwise", "rowwise"] = _f(
        "none", "compute the transformer blocks' linear layers (qkv, proj, fc1, fc2) in fp8 with "
        "torchao's float8 training (pip install -r requirements-fp8.txt), scaled per tensor "
        "(tensorwise) or per row (rowwise); needs amp_mode bf16, block dims that are multiples "
        "of 16 and a GPU of compute capability 8.9 or newer (H100, H200, L40S), emulated on a "
        "CPU (docs/performance.md)")
    skill_every: int = _f(0, "every this many epochs, after the validation: the forecast skill "
                          "of a short rollout (skill_lead_steps steps from 8 initial conditions "
                          "spread through the validation years; RMSE in physical units and ACC "
                          "of every variable) in TensorBoard (Skill/...) and the log; 0: never "
                          "(score.py scores a trained run in full)", min=0, resume=True)
    skill_lead_steps: int = _f(4, "forecast steps of skill_every's rollouts (4 steps of dt x 6 h: "
                               "a day at dt 1)", min=1, resume=True)
    n_in_channels: int = _f(20, "input channels (the first n of the 20 ERA5 variables)", min=1,
                            max=20, size=True)
    n_out_channels: int = _f(20, "output channels", min=1, max=20)
    dt: int = _f(1, "forecast lead in 6-hour steps", min=1)
    limit_nsamples: Optional[int] = _f(None, "use this many training pairs, spread evenly over "
                                       "the years", min=1)
    limit_nsamples_val: Optional[int] = _f(None, "use this many validation pairs, spread evenly "
                                           "over the years", min=1)
    synthetic_steps_per_year: int = _f(240, "time steps per year when synthesizing data", min=2)
    loss_latitude_weights: bool = _f(False, "weight the training loss of each grid row by the "
                                     "area of its cells (cos latitude, mean 1), as WeatherBench "
                                     "2 scores; false: the tutorial's unweighted loss")
    loss_level_weights: bool = _f(False, "weight each pressure-level variable (z500, t850...) "
                                  "by its level over their mean level, as GraphCast; surface "
                                  "variables 1")
    loss_variable_weights: list[str] = _f([], "NAME=WEIGHT for variables whose loss weighs other "
                                          "than 1 (e.g. t2m=2,z50=0.5); names as in the log's "
                                          "RMSE lines")
    _group("rollout training")
    rollout_steps: int = _f(1, "autoregressive steps of each training sample: the loss is the "
                            "mean over N steps, each fed the model's previous output "
                            "(docs/training.md)", min=1)
    rollout_schedule: str = _f("", "rollout steps by epoch, EPOCH:STEPS entries from epoch 0, e.g. "
                               "0:1,20:2,40:4, in place of rollout_steps (empty: none)")
    rollout_checkpointing: bool = _f(False, "recompute each rollout step's activations in the "
                                     "backward pass: memory grows far less than the steps",
                                     resume=True)
    _group("model parallelism")
    tensor_parallel: int = _f(1, "ranks that split each layer's weights (heads, MLP width)", min=1,
    resume=True)
    context_parallel: int = _f(1, "ranks that split the token sequence (image rows)", min=1,
    resume=True)
    parallel_order: Literal["tp-cp-dp", "tp-dp-cp", "cp-tp-dp", "cp-dp-tp", "dp-tp-cp",
                            "dp-cp-tp"] = _f(
        "tp-cp-dp", "which group's ranks are adjacent (first) to last, e.g. tp-cp-dp keeps "
        "tensor-parallel ranks on one node", resume=True)
    activation_checkpointing: bool = _f(False, "recompute each block's activations in the "
                                        "backward pass instead of storing them", resume=True)
    sequence_parallel: bool = _f(True, "split the LayerNorm/residual activations over the "
                                 "tensor-parallel ranks too (false: whole on each of them)",
                                 resume=True)

    def variable_weights(self) -> dict:
        """``loss_variable_weights`` as {name: weight}; a ConfigError naming a wrong entry."""
        names, weights = ERA5_CHANNELS[: self.n_out_channels], {}
        for entry in self.loss_variable_weights:
            name, _, value = entry.partition("=")
            try:
                weights[name] = float(value)
            except ValueError:
                weights[name] = -1.0
            if name not in names or not weights[name] >= 0:
                raise ConfigError(f"loss_variable_weights: {entry!r} is not NAME=WEIGHT with a "
                                  f"weight >= 0 and NAME one of {', '.join(names)}")
        return weights

    def check(self):
        self.variable_weights()
        if self.data_loader_config == "device":
            raise ConfigError("data_loader_config=device holds the U-Net's cosmology volumes on "
                              "the training device; the ViT's ERA5 data has no such loader: use "
                              "--data_loader_config lowmem or inmem")
        h, w = self.img_size
        p = self.patch_size
        if h % p or w % p:
            near = [max(p, round(n / p) * p) for n in (h, w)]
            other = next((d for d in range(p - 1, 1, -1) if h % d == w % d == 0), None)
            raise ConfigError(f"img_size={self.img_size} is not divisible by patch_size={p}: "
                              f"change img_size to multiples of {p}, e.g. --img_size {near[0]} "
                              f"{near[1]}" + (f", or --patch_size {other}" if other else ""))
        if self.data_is_generated and (h < 2 or w < 4):
            raise ConfigError(f"img_size={self.img_size} is too small for generated ERA5 fields "
                              f"(the rows run from pole to pole): use at least 2 rows and 4 "
                              f"columns")
        if self.embed_dim % self.num_heads:
            ok = [n for n in range(1, self.embed_dim + 1) if self.embed_dim % n == 0 and n <= 64]
            raise ConfigError(f"num_heads={self.num_heads} does not divide embed_dim="
                              f"{self.embed_dim}: choose one of {ok}")
        rollout = self.rollout_max  # (a malformed schedule: refused)
        if rollout > 1 and self.n_in_channels != self.n_out_channels:
            raise ConfigError(f"rollout of {rollout} steps feeds the model's output back as its "
                              f"input, and n_in_channels={self.n_in_channels} != n_out_channels="
                              f"{self.n_out_channels}: give both the same number of channels")
        if rollout > 1 and self.data_loader_config not in ("lowmem", "inmem"):
            raise ConfigError(f"rollout of {rollout} steps needs windows of {rollout + 1} states, "
                              f"which data_loader_config={self.data_loader_config} cannot give: "
                              f"use --data_loader_config lowmem or inmem")
        # skill_every: each rank rolls the whole model out from stored states by itself
        if self.skill_every and (self.fsdp or self.tensor_parallel * self.context_parallel > 1):
            raise ConfigError(f"skill_every={self.skill_every} rolls the model out on each rank by "
                              f"itself, which a model sharded over ranks (fsdp, tensor_parallel, "
                              f"context_parallel) cannot do: score the run's checkpoints with "
                              f"score.py instead (--skill_every 0)")
        if self.skill_every and self.data_is_generated:
            raise ConfigError(f"skill_every={self.skill_every} rolls the model out through stored "
                              f"ERA5 years, and data_loader_config synthetic has none: train on "
                              f"ERA5 files, or --skill_every 0")
        # fp8 linears: bf16 around the fp8 matmuls, and each block linear's dims on a rank
        # multiples of 16 (the fp8 kernels'). The device is checked when it is known.
        if self.fp8_linears != "none" and self.amp_mode != "bf16":
            raise ConfigError(f"fp8_linears={self.fp8_linears} runs with amp_mode bf16 (the rest "
                              f"of the model in bf16 around the fp8 matmuls), not "
                              f"amp_mode={self.amp_mode}: add --amp_mode bf16")
        tp = self.tensor_parallel
        for what, n in (("embed_dim", self.embed_dim),
                        ("the MLP's hidden width (embed_dim x mlp_ratio)",
                         int(self.embed_dim * self.mlp_ratio))):
            if self.fp8_linears != "none" and n % (16 * tp):
                per = f" / tensor_parallel={tp} = {n / tp:g}" if tp > 1 else ""
                raise ConfigError(f"fp8_linears={self.fp8_linears} needs the blocks' linear "
                                  f"dims on each rank to be multiples of 16: {what}={n}{per} "
                                  f"is not; choose an embed_dim and mlp_ratio that make it a "
                                  f"multiple of {16 * tp}, or --fp8_linears none")

    def rollout_plan(self) -> list[tuple[int, int]]:
        """(first epoch, rollout steps) of each part of the run; a malformed schedule refused."""
        if not self.rollout_schedule:
            return [(0, self.rollout_steps)]
        example = "e.g. --rollout_schedule 0:1,20:2,40:4"
        try:
            plan = [tuple(int(v) for v in entry.split(":"))
                    for entry in self.rollout_schedule.split(",")]
        except ValueError:
            plan = []
        if not plan or any(len(p) != 2 or p[1] < 1 for p in plan):
            raise ConfigError(f"rollout_schedule={self.rollout_schedule} is not a list of "
                              f"EPOCH:STEPS entries with STEPS >= 1: {example}")
        epochs = [e for e, _ in plan]
        if epochs[0] != 0 or any(b <= a for a, b in zip(epochs, epochs[1:])):
            raise ConfigError(f"rollout_schedule={self.rollout_schedule} must start at epoch 0 "
                              f"and its epochs increase: {example}")
        return plan

    @property
    def rollout_max(self) -> int:
        """The most rollout steps of the run: its samples hold this many targets."""
        return max(n for _, n in self.rollout_plan())

    def rollout_at(self, epoch: int) -> int:
        """The rollout steps of ``epoch`` (0-based) under ``rollout_plan``."""
        return [n for e, n in self.rollout_plan() if e <= epoch][-1]


@config_class
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
    _group("memory layout")
    memory_format: Literal["auto", "channels_last", "contiguous"] = _f(
        "auto", "layout of the model's weights, its input batches and the loss in memory: "
        "channels_last (torch.channels_last_3d: the channels of a voxel side by side; 1.21x faster "
        "bf16 compute-only steps on an H200), contiguous (torch's default) or auto: channels_last "
        "on a GPU in bf16/fp16 unless with enable_jit (torch.compile's backward fails there on a "
        "channels-last U-Net, docs/performance.md), contiguous in fp32 and on a CPU. The same "
        "numbers either way; a checkpoint of either resumes in the other", resume=True)

    def check(self):
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


@functools.lru_cache(maxsize=None)
def field_types(cls) -> dict:
    """Each field's annotation of a config class, evaluated (``list[int]``, ``Literal[...]``)."""
    return typing.get_type_hints(cls)


def default_value(cls, key):
    f = {f.name: f for f in dataclasses.fields(cls)}[key]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def identity_fields(cls) -> tuple:
    """The fields that say where a config came from (its name and file), not how to train."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("identity"))


def check_dir(key: str, path: str, writable: bool = False):
    """``path`` is a directory (``writable``: one this process can write into), or can be made
    as one: its nearest existing ancestor is such a directory."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        fix = "give a directory (it is created when missing)" if writable else "give a directory"
        raise ConfigError(f"{key}={path}: {probe} is a file, not a directory: {fix}")
    if writable and not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path}: {probe} is not writable by this user: choose a "
                          f"directory you can write to")


def validate(cfg: Config):
    """Rules that involve more than one field, and the places runs read from and write to."""
    for f in dataclasses.fields(cfg):
        if f.metadata.get("path") and getattr(cfg, f.name):
            check_dir(f.name, getattr(cfg, f.name), writable=f.metadata["path"] == "out")
    if not cfg.expdir:
        raise ConfigError("expdir is empty: give the directory that holds the run directories, "
                          "e.g. --expdir ./logs")
    if cfg.run_num in ("", ".", "..") or "/" in cfg.run_num:
        raise ConfigError(f"run_num={cfg.run_num!r} is not the name of a run: give a name "
                          f"without '/' (e.g. --run_num baseline), or auto")
    for name in cfg.stop_signals:
        signal_number(name)  # a ConfigError unless it names a signal the run can catch
    if cfg.fsdp and cfg.noddp:
        raise ConfigError("fsdp shards the model over the data-parallel ranks and reduces the "
                          "gradients onto the shards; noddp turns that reduction off: drop one of "
                          "--fsdp and --noddp")
    if cfg.fsdp and cfg.amp_mode == "fp16":
        raise ConfigError("amp_mode=fp16 is not combined with fsdp (its gradient scaler would "
                          "skip steps on some ranks' shards only): use --amp_mode bf16, or DDP "
                          "(drop --fsdp) for fp16")
    if cfg.compile_blocks and not cfg.enable_jit:
        raise ConfigError("compile_blocks=true says what torch.compile compiles, and enable_jit is "
                          "false, so nothing would be: add --enable_jit true, or drop "
                          "--compile_blocks")
    if cfg.init_from and cfg.resume_from:
        raise ConfigError(f"init_from={cfg.init_from} starts a new run from those weights, and "
                          f"resume_from={cfg.resume_from} continues that run from its checkpoint: "
                          f"give one of --init_from and --resume_from")
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
