"""Per-rank memory and communication of the tensor / context / data parallel ViT, from its shapes.

    python -m benchmarks.memory_model --config mp --tensor_parallel 4     # 45 patch rows: padded sequence parallelism
    python -m benchmarks.memory_model --config mp --amp_mode bf16 --data_parallel 8 --fsdp

Any config key can be overridden (``--key value``, as for train.py); the model's own options are
in ``--help``; more examples: docs/parallelism.md ("Memory per rank"). World = tp x cp x dp; the
local batch is ``global_batch_size / dp`` unless ``--local_batch_size`` is given; the layout is
the engine's (``distributed.parallelize.token_layout``). What is counted, and every assumption:
benchmarks/memory_model.md. Tested against the CPU byte count in tests/test_mp_training.py.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import List, Tuple

from distributed.groups import ParallelGroups
from distributed.parallelize import sequence_parallel_summary, validate_vit_layout
from settings.parse import build_config, parse_overrides
from settings.errors import ConfigError, OneLineParser, at_least, refuse
from engine.runtime import batch_sizes

ATTENTION = ("flash", "efficient", "math")
MEASURE = ("cuda", "cpu")
GiB = 1024**3


@dataclass
class Shape:
    """The ViT and one rank's share of a step (everything the model needs from a config)."""

    batch: int
    img: Tuple[int, int]
    patch: int
    cin: int
    cout: int
    embed: int
    depth: int
    heads: int
    hidden: int
    dropout: float = 0.0
    head_bias: bool = False

    @classmethod
    def from_config(cls, cfg, local_batch: int) -> "Shape":
        return cls(local_batch, tuple(cfg.img_size), cfg.patch_size, cfg.n_in_channels, cfg.n_out_channels,
                   cfg.embed_dim, cfg.depth, cfg.num_heads, int(cfg.embed_dim * cfg.mlp_ratio), cfg.dropout,
                   cfg.head_bias)

    @property
    def tokens(self) -> int:
        return (self.img[0] // self.patch) * (self.img[1] // self.patch)

    def split(self, tp: int, cp: int, lay) -> Tuple[int, int, int]:
        """(n, nc, band rows) for a ``distributed.parallelize.TokenLayout``: tokens of a rank between
        the linears, tokens of its cp rank inside attention/MLP (padding included), image rows of
        its band; for band 0, a longest one (cp bands may differ by one patch row)."""
        start, stop = lay.band_rows(0)
        band_rows = (stop - start) * self.patch
        if lay.sequence_parallel:  # row bands: local_tokens * tp = N / cp; padded: the padded cp band
            return lay.local_tokens, lay.local_tokens * tp, band_rows
        return lay.band_tokens, lay.band_tokens, band_rows


@dataclass
class Prediction:
    tp: int
    cp: int
    dp: int
    local_batch: int
    params: int
    grads: int
    adam: int
    activations: int
    extra: dict = field(default_factory=dict)  # allocator-only terms (--measure cuda)
    transient: int = 0
    sequence_parallel: bool = True
    padding: int = 0  # tokens appended to each cp band (padded sequence parallelism)
    after_forward: int = 0
    peak: int = 0
    activation_items: List[Tuple[str, int]] = field(default_factory=list)
    collectives: List[dict] = field(default_factory=list)
    fsdp: bool = False
    gathered: int = 0  # FSDP: the root's and the largest block's gathered weights
    unsharded_grads: int = 0  # FSDP without a reduce-scatter per micro-batch: the whole gradient


def fsdp_shard(name: str, numel: int, s: Shape, dp: int) -> int:
    """Elements of one rank's FSDP shard of a parameter: FSDP splits dim 0, padded to a multiple
    of dp (``pos_embed``, of shape (1, N, E), is whole on every rank, padding on all but one)."""
    if name == "pos_embed":
        dim0 = 1
    elif name.endswith(".weight") and not name.split(".")[-2].startswith("norm"):
        dim0 = {"qkv": 3 * s.embed, "fc1": s.hidden, "head": s.cout * s.patch * s.patch}.get(
            name.split(".")[-2], s.embed)  # out features (channels of the patch embedding)
    else:
        dim0 = numel  # biases and LayerNorm weights
    return math.ceil(dim0 / dp) * (numel // dim0)


def fsdp_gathered(rows, amp: bool) -> Tuple[int, int]:
    """(root weights, largest block's weights) in bytes of FSDP's compute dtype."""
    a = 2 if amp else 4
    blocks = {}
    root = 0
    for name, numel, _ in rows:
        if name.startswith("blocks."):
            key = name.split(".")[1]
            blocks[key] = blocks.get(key, 0) + numel
        else:
            root += numel
    return a * root, a * max(blocks.values(), default=0)


def parameters(s: Shape, tp: int, cp: int, lay) -> List[Tuple[str, int, Tuple[str, ...]]]:
    """(name, elements on this rank, axes its gradient is summed over) for every parameter."""
    E, F, pp = s.embed, s.hidden // tp, s.patch * s.patch
    mp = ("cp", "tp") if lay.sequence_parallel else ("cp",)  # the axes whose ranks hold other tokens
    pos = (lay.band_tokens * E, ("tp",) if lay.padded else ())  # the slice of the rank's image band
    out = [("patch_embed.proj.weight", E * s.cin * pp, mp), ("patch_embed.proj.bias", E, mp), ("pos_embed", *pos)]
    for i in range(s.depth):
        b = f"blocks.{i}."
        out += [(b + "norm1.weight", E, mp), (b + "norm1.bias", E, mp),
                (b + "attn.qkv.weight", 3 * E // tp * E, ("cp",)), (b + "attn.qkv.bias", 3 * E // tp, ("cp",)),
                (b + "attn.proj.weight", E * E // tp, ("cp",)), (b + "attn.proj.bias", E, mp),
                (b + "norm2.weight", E, mp), (b + "norm2.bias", E, mp),
                (b + "mlp.fc1.weight", F * E, ("cp",)), (b + "mlp.fc1.bias", F, ("cp",)),
                (b + "mlp.fc2.weight", E * F, ("cp",)), (b + "mlp.fc2.bias", E, mp)]
    out += [("norm.weight", E, mp), ("norm.bias", E, mp),
            ("head.weight", s.cout * pp * E, mp)] + ([("head.bias", s.cout * pp, mp)] if s.head_bias else [])
    return out


def activations(s: Shape, tp: int, cp: int, amp: bool, attention: str, checkpointing: bool, device: str,
                lay) -> List[Tuple[str, int]]:
    """(what, bytes) of every tensor kept for backward on one rank, in forward order."""
    f, a = 4, 2 if amp else 4
    B, E, N = s.batch, s.embed, s.tokens
    sequence_parallel = lay.sequence_parallel
    n, nc, rows = s.split(tp, cp, lay)
    h, F = s.heads // tp, s.hidden // tp
    drop = s.dropout > 0
    band = B * rows * s.img[1]  # pixels of a rank's image band (per channel)
    pp = s.patch * s.patch
    items = []
    if amp:
        items += [("patch_embed input (cast)", a * s.cin * band), ("patch_embed weight (cast)", a * E * s.cin * pp)]
    else:
        items += [("patch_embed input", f * s.cin * band)]
    if drop:
        items.append(("pos_drop mask", B * n * E))

    def norm(name):
        return [(f"{name} input", f * B * n * E), (f"{name} mean/rstd", 2 * f * B * n)]

    def column(name, out_features):  # out_features: this rank's
        if tp > 1 and sequence_parallel:
            return [(f"{name} input (LayerNorm output, local tokens)", a * B * n * E)]
        rows = [(f"{name} input", (a if amp else f) * B * n * E)]
        return rows + ([(f"{name} weight (cast)", a * out_features * E)] if amp else [])

    block = norm("norm1") + column("qkv", 3 * E // tp)
    if attention == "math":
        c = f if (device == "cpu" and amp) else a  # the CPU math kernel computes reduced precision in fp32
        block += [("attention q (scaled)", c * B * nc * E // tp), ("attention k (scaled)", c * B * N * E // tp),
                  ("attention probabilities", c * B * h * nc * N)]
        if h == 1 and c == a:  # one local head: the batched matmul takes v as a view, keeping its storage
            block += [("attention v (qkv output)", a * B * nc * 3 * E // tp) if cp == 1
                      else ("attention v (k/v all-gathered over cp)", a * B * N * 2 * E // tp)]
        else:
            block += [("attention v (contiguous)", c * B * N * E // tp)]
        block += [("proj input (attention output)", a * B * nc * E // tp)]
    else:
        rows = nc if attention == "flash" else 32 * math.ceil(nc / 32)
        block += [("qkv output (q, and k/v when cp = 1)", a * B * nc * 3 * E // tp)]
        if cp > 1:
            block += [("k/v all-gathered over cp", a * B * N * 2 * E // tp)]
        block += [("attention output = proj input", a * B * nc * E // tp), ("attention logsumexp", f * B * h * rows)]
    if amp:
        block.append(("proj weight (cast)", a * E * E // tp))
    if drop:
        block.append(("proj_drop mask", B * n * E))
    block += norm("norm2") + column("fc1", F)
    block += [("GELU input (fc1 output)", a * B * nc * F), ("fc2 input (GELU output)", a * B * nc * F)]
    if amp:
        block.append(("fc2 weight (cast)", a * E * F))
    if drop:
        block += [("mlp dropout masks", B * nc * F + B * n * E)]
    for i in range(s.depth):
        if checkpointing:
            items.append((f"blocks.{i} input (checkpointed)", f * B * n * E))
        else:
            items += [(f"blocks.{i} {what}", v) for what, v in block]
    items += norm("norm")
    if amp:
        items += [("head input (cast)", a * B * n * E), ("head weight (cast)", a * s.cout * pp * E)]
    else:
        items += [("head input", f * B * n * E)]
    items += [("loss difference", f * s.cout * band), ("loss per-sample norms", 2 * f * B)]
    return items


def collectives(s: Shape, tp: int, cp: int, dp: int, amp: bool, checkpointing: bool, param_rows,
                bucket_cap_mb: float, lay) -> List[dict]:
    """Collectives of one training step on one rank (the byte counts: benchmarks/memory_model.md)."""
    f, a = 4, 2 if amp else 4
    B, E, N = s.batch, s.embed, s.tokens
    sequence_parallel = lay.sequence_parallel
    nc, D = s.split(tp, cp, lay)[1], s.depth
    fwd = D * (2 if checkpointing else 1)  # checkpointing re-runs the blocks' forward in backward
    rows = []

    def add(what, kind, group, g, calls, nbytes):
        if g > 1 and calls:
            share = 1 if kind == "broadcast" else (2 if kind == "all-reduce" else 1) * (g - 1) / g
            wire = share * nbytes * calls
            rows.append(dict(what=what, kind=kind, group=group, size=g, calls=calls, bytes_per_call=int(nbytes),
                             bytes_per_step=int(round(wire))))

    if sequence_parallel:
        add("qkv/fc1 input gather (forward)", "all-gather", "tp", tp, 2 * fwd, a * B * nc * E)
        add("proj/fc2 partial sums (forward)", "reduce-scatter", "tp", tp, 2 * fwd, a * B * nc * E)
        add("qkv/fc1 input gradient (backward)", "reduce-scatter", "tp", tp, 2 * D, a * B * nc * E)
        add("qkv/fc1 input re-gather for the weight gradient (backward)", "all-gather", "tp", tp, 2 * D,
            a * B * nc * E)
        add("proj/fc2 output gradient (backward)", "all-gather", "tp", tp, 2 * D, a * B * nc * E)
    else:
        add("proj/fc2 partial sums (forward)", "all-reduce", "tp", tp, 2 * fwd, a * B * nc * E)
        add("qkv/fc1 input gradient (backward, fp32 LayerNorm output)", "all-reduce", "tp", tp, 2 * D,
            f * B * nc * E)
        if s.dropout > 0:
            add("dropout masks of tp-replicated activations (forward)", "broadcast", "tp", tp, 2 * fwd + 1,
                B * nc * E)
    add("K/V gather (forward)", "all-gather", "cp", cp, fwd, a * B * N * 2 * E // tp)
    add("K/V gradient (backward)", "reduce-scatter", "cp", cp, D, a * B * N * 2 * E // tp)
    if lay.padded:
        add("head output gather (forward; padding dropped after it)", "all-gather", "tp", tp, 1,
            a * B * nc * s.cout * s.patch * s.patch)
    if lay.row_bands:
        add("loss sums (forward)", "all-reduce", "tp x cp", tp * cp, 1, 2 * f * B)
    else:
        add("loss sums (forward)", "all-reduce", "cp", cp, 1, 2 * f * B)
    sizes = {"tp": tp, "cp": cp}
    by_key = {}
    for _, numel, axes in param_rows:
        live = [x for x in axes if sizes[x] > 1]
        if live:
            key = "tp x cp" if len(live) == 2 else live[0]
            by_key[key] = by_key.get(key, 0) + f * numel
    total = f * sum(numel for _, numel, _ in param_rows)
    buckets = max(1, math.ceil(total / (bucket_cap_mb * 2**20))) if bucket_cap_mb else len(param_rows)
    for key in ("tp", "cp", "tp x cp"):
        if key in by_key:  # one coalesced all-reduce per DDP bucket holding such gradients
            g = {"tp": tp, "cp": cp, "tp x cp": tp * cp}[key]
            add(f"replicated-parameter gradients (sum over {key})", "all-reduce", key, g, 1, by_key[key])
    add("gradient average over dp (DDP buckets)", "all-reduce", "dp", dp, 1, total)
    for r in rows:
        if r["what"].startswith(("replicated", "gradient average")):
            r["calls"] = f"~{buckets} buckets"
    return rows


def predict(s: Shape, tp: int, cp: int, dp: int = 1, amp: bool = False, attention: str = "flash",
            checkpointing: bool = False, measure: str = "cuda", bucket_cap_mb: float = 25.0,
            sequence_parallel: bool = True, fsdp: bool = False, accum_steps: int = 1,
            reduce_each_microbatch: bool = True) -> Prediction:
    """``sequence_parallel``: as the engine's config key (False: off); ``fsdp``: parameters,
    gradients and Adam state sharded over the ``dp`` ranks (tp = cp = 1); ``accum_steps``,
    ``reduce_each_microbatch``: the ``grad_accum_steps`` and ``fsdp_reduce_each_microbatch``
    settings (FSDP's reduce-scatters and, when it is off, the unsharded gradient it holds)."""
    if fsdp and tp * cp > 1:
        raise ValueError(f"fsdp with tensor_parallel={tp} x context_parallel={cp}: this model "
                         f"counts FSDP alone (tp = cp = 1); for the combination, divide the tp/cp "
                         f"layout's parameters, gradients and Adam state by data_parallel")
    lay = validate_vit_layout(s.img, s.patch, s.embed, s.heads, s.hidden,  # the engine's token layout
                              ParallelGroups(tensor_parallel=tp, context_parallel=cp), sequence_parallel)
    sp = lay.sequence_parallel
    f, a = 4, 2 if amp else 4
    rows = parameters(s, tp, cp, lay)
    params = f * sum(numel for _, numel, _ in rows)
    if fsdp:  # every rank keeps 1/dp of each parameter, gradient and moment
        params = f * sum(fsdp_shard(name, numel, s, dp) for name, numel, _ in rows)
    adam = 2 * params + 4 * len(rows)
    items = activations(s, tp, cp, amp, attention, checkpointing, measure, lay)
    acts = sum(v for _, v in items)
    p = Prediction(tp, cp, dp, s.batch, params, params, adam, acts, activation_items=items, sequence_parallel=sp,
                   padding=lay.pad, fsdp=fsdp)
    if fsdp and dp > 1:
        root, block = fsdp_gathered(rows, amp)
        p.gathered = root + block
        p.extra["FSDP gathered weights (root + one block)"] = p.gathered
        p.transient += f * block // (2 if amp else 4)  # the block's whole gradient before its reduce-scatter
        if accum_steps > 1 and not reduce_each_microbatch:  # every rank: the whole fp32 gradient
            p.unsharded_grads = f * sum(numel for _, numel, _ in rows)
    if measure == "cuda":
        _, nc, band_rows = s.split(tp, cp, lay)
        F = s.hidden // tp
        if tp * cp * dp > 1 and not fsdp:  # DDP wraps every other model-parallel or multi-rank run
            p.extra["DDP gradient buckets"] = params
        batch_bytes = f * s.batch * (s.cin + s.cout) * band_rows * s.img[1]
        p.extra["batch on the device (x and y, the rank's rows)"] = batch_bytes
        p.transient += 2 * a * s.batch * nc * F + (a * s.batch * nc * s.embed if tp > 1 and sp else 0)
        if checkpointing:  # the activations of the block a checkpointed block recomputes in backward
            one = Shape(**{**asdict(s), "depth": 1})
            p.transient += sum(v for k, v in activations(one, tp, cp, amp, attention, False, measure, lay)
                               if k.startswith("blocks.0 "))
    p.after_forward = params + adam + acts + sum(p.extra.values())
    # the gradients: this rank's shards, or (FSDP accumulating unsharded) the whole gradient, which
    # the last micro-batch's backward turns into the shards block by block
    p.peak = p.after_forward + max(p.grads, p.unsharded_grads) + p.transient
    p.collectives = collectives(s, tp, cp, dp, amp, checkpointing, rows, bucket_cap_mb, lay)
    if fsdp:
        p.collectives = [r for r in p.collectives if r["group"] != "dp"] + fsdp_collectives(
            rows, dp, amp, checkpointing, accum_steps, reduce_each_microbatch)
    return p


def fsdp_collectives(rows, dp: int, amp: bool, checkpointing: bool, accum_steps: int = 1,
                     reduce_each_microbatch: bool = True) -> List[dict]:
    """FSDP's per-step collectives over dp: in every micro-batch each block's weights all-gathered
    in the forward and again in the backward, the root's gathered once; the gradients
    reduce-scattered in fp32 in every micro-batch's backward, or once per step in the last one's
    when ``reduce_each_microbatch`` is off."""
    if dp < 2:
        return []
    root, block = fsdp_gathered(rows, amp)
    depth = len({name.split(".")[1] for name, _, _ in rows if name.startswith("blocks.")})
    share = (dp - 1) / dp
    a = 2 if amp else 4
    k = accum_steps
    r = k if reduce_each_microbatch else 1
    return [dict(what=what, kind=kind, group="dp", size=dp, calls=calls, bytes_per_call=int(nbytes),
                 bytes_per_step=int(round(share * nbytes * calls))) for what, kind, calls, nbytes in (
        ("block weights (forward, again in backward)", "all-gather", 2 * depth * k, block),
        ("root weights (forward)", "all-gather", k, root),
        ("block gradients (fp32)", "reduce-scatter", depth * r, 4 * block // a),
        ("root gradients (fp32)", "reduce-scatter", r, 4 * root // a))]


def predict_config(cfg, data_parallel: int = 1, attention: str = "flash", measure: str = "cuda") -> Prediction:
    """The prediction for a ``settings.config`` ViT config (its tp, cp, sequence parallelism, AMP,
    checkpointing, batch), as the engine runs it."""
    tp, cp = cfg.tensor_parallel, cfg.context_parallel
    local, _ = batch_sizes(cfg, data_parallel)
    return predict(Shape.from_config(cfg, local), tp, cp, data_parallel, cfg.amp_mode != "none", attention,
                   cfg.activation_checkpointing, measure, cfg.bucket_cap_mb, cfg.sequence_parallel, cfg.fsdp,
                   cfg.grad_accum_steps, cfg.fsdp_reduce_each_microbatch)


# ---- command line ---------------------------------------------------------------------------------

def report(p: Prediction, cfg=None, gpu_gb: float = 80.0, measure: str = "cuda", attention: str = "flash") -> str:
    lines = []
    unit, name = (GiB, "GiB") if p.peak >= GiB else (2**20, "MiB")

    def _gb(x):
        return f"{x / unit:10.3f}"

    if cfg is not None:
        lines.append(f"config {cfg.name}: img {cfg.img_size}, patch {cfg.patch_size}, embed {cfg.embed_dim}, depth "
                     f"{cfg.depth}, heads {cfg.num_heads}, amp {cfg.amp_mode}, activation_checkpointing "
                     f"{cfg.activation_checkpointing}")
    lines.append(f"layout tp={p.tp} x cp={p.cp} x dp={p.dp}{' (FSDP)' if p.fsdp else ''} "
                 f"(world {p.tp * p.cp * p.dp}), local batch "
                 f"{p.local_batch}, attention {attention}, measured as {measure}")
    if cfg is not None and p.tp > 1:
        lines.append(sequence_parallel_summary(cfg.img_size, cfg.patch_size, p.tp, p.cp, p.sequence_parallel))
    lines += ["", f"{'per rank':<59}{name}"]
    rows = [("parameters (fp32)", p.params), ("gradients (fp32)", p.grads), ("Adam state (2 moments + step)", p.adam),
            ("activations saved for backward", p.activations)]
    rows += list(p.extra.items())
    if p.unsharded_grads:
        rows.append(("FSDP unsharded gradients between micro-batches", p.unsharded_grads))
    for k, v in rows:
        lines.append(f"  {k:<52}{_gb(v)}")
    lines.append(f"  {'after forward (params + Adam + activations' + (' + extra)' if p.extra else ')'):<52}"
                 f"{_gb(p.after_forward)}")
    if p.transient:
        lines.append(f"  {'backward transients (estimate)':<52}{_gb(p.transient)}")
    verdict = "fits" if p.peak <= gpu_gb * GiB else "does not fit"
    share = (f"   ({p.peak / GiB / gpu_gb:.0%} of {gpu_gb:g} GiB: {verdict})"
             if measure == "cuda" else "")
    grads = "unsharded grads" if p.unsharded_grads else "gradients"
    lines.append(f"  {'peak (after forward + ' + grads + (' + transients)' if p.transient else ')'):<52}"
                 f"{_gb(p.peak)}{share}")
    lines += ["", "activations by kind (all blocks together)"]
    agg = {}
    for k, v in p.activation_items:
        key = k.split(" ", 1)[1] if k.startswith("blocks.") else k
        agg[key] = agg.get(key, 0) + v
    for k, v in sorted(agg.items(), key=lambda kv: -kv[1]):
        if v:
            lines.append(f"  {k:<52}{v / 2**20:12.2f} MiB")
    lines += ["", "collectives per training step (ring: bytes each rank sends)"]
    lines.append(f"  {'what':<60}{'kind':<16}{'group':<14}{'calls':>12}{'MiB/call':>12}{'MiB/step':>12}")
    for r in p.collectives:
        lines.append(f"  {r['what']:<60}{r['kind']:<16}{r['group'] + ' (' + str(r['size']) + ')':<14}"
                     f"{str(r['calls']):>12}{r['bytes_per_call'] / 2**20:12.2f}{r['bytes_per_step'] / 2**20:12.2f}")
    if not p.collectives:
        lines.append("  none (one rank)")
    else:
        lines.append(f"  {'total':<60}{'':<16}{'':<14}{'':>12}{'':>12}"
                     f"{sum(r['bytes_per_step'] for r in p.collectives) / 2**20:12.2f}")
    return "\n".join(lines)


def main(argv=None):
    ap = OneLineParser(prog="python -m benchmarks.memory_model", add_help=True,
                       description="Per-rank memory and communication of the parallel ViT; any "
                                   "other --key value overrides the config")
    ap.add_argument("--yaml_config", default="config/ViT.yaml", help="YAML file of configs")
    ap.add_argument("--config", default="mp", help="config to model (default: %(default)s)")
    ap.add_argument("--data_parallel", type=at_least(1), default=1,
                    help="data-parallel ranks beside tp x cp (default: %(default)s)")
    ap.add_argument("--attention", choices=ATTENTION, default="flash",
                    help="flash: CPU flash kernel or CUDA flash; efficient: CUDA memory-efficient; math")
    ap.add_argument("--measure", choices=MEASURE, default="cuda",
                    help="cuda: what the allocator holds; cpu: the engine's CPU byte count")
    ap.add_argument("--gpu_memory_gb", type=at_least(0.1, float), default=80.0,
                    help="memory of one GPU in GiB (2^30 bytes), for the fits / does not fit "
                         "verdict of --measure cuda (default: %(default)g)")
    ap.add_argument("--json", action="store_true", help="print the prediction as JSON")
    own, rest = ap.parse_known_args(argv)
    try:
        _, overrides = parse_overrides(rest)  # a bare --fsdp: True, as for train.py
        cfg = build_config(own.yaml_config, own.config, overrides)
        if cfg.model != "vit":
            raise ConfigError(f"config '{cfg.name}' is a {cfg.model} config: the model covers the ViT")
        p = predict_config(cfg, own.data_parallel, own.attention, own.measure)
    except (ConfigError, ValueError) as e:
        refuse(str(e))
    if own.json:
        print(json.dumps(asdict(p), indent=1))
    else:
        print(report(p, cfg, own.gpu_memory_gb, own.measure, own.attention))
    return p


if __name__ == "__main__":
    main()
