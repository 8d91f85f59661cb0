"""Does torch.compile train a channels-last 3-D U-Net? A reproduction with torch alone (no
project imports), to run with whatever torch a machine has::

    python benchmarks/cl_compile_repro.py                        # a GPU: the U-Net's widths
    python benchmarks/cl_compile_repro.py --width 4 --max-width 16 --side 32    # small, CPU too

The model, the phases (eager, then compiled, each with its own limit), the comparison, the
verdict lines and this script's earlier options: docs/performance.md ("channels-last"). Exit
status 0 when the compiled step gave the eager numbers, else 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time


def build_model(width: int, max_width: int, levels: int):
    import torch
    import torch.nn as nn

    widths = [min(width * 2**i, max_width) for i in range(levels)]

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.down, self.up = nn.ModuleList(), nn.ModuleList()
            cin = 4
            for w in widths:  # (B, cin, s) -> (B, w, s / 2)
                self.down.append(nn.Sequential(nn.Conv3d(cin, w, 4, stride=2, padding=1),
                                               nn.LeakyReLU(0.01, inplace=True)))
                cin = w
            for i in reversed(range(1, levels)):  # the bottom level has no skip
                cin = widths[i] if i == levels - 1 else 2 * widths[i]
                self.up.append(nn.Sequential(nn.ConvTranspose3d(cin, widths[i - 1], 4, stride=2,
                                                                padding=1), nn.ReLU(inplace=True)))
            self.last = nn.ConvTranspose3d(2 * widths[0], 5, 4, stride=2, padding=1)

        def forward(self, x):
            skips = []
            for blk in self.down:
                x = blk(x)
                skips.append(x)
            x = skips.pop()
            for i, blk in enumerate(self.up):
                x = blk(x if i == 0 else torch.cat([x, skips.pop()], dim=1))
            return torch.tanh(self.last(torch.cat([x, skips.pop()], dim=1)))

    model = UNet()
    for m in model.modules():
        if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d)):
            nn.init.normal_(m.weight, 0.0, 0.02)
            nn.init.zeros_(m.bias)
    return model


def first_line(e: BaseException) -> str:
    """The root cause of a (chained) exception: its type and first non-empty line."""
    root = e
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    lines = [ln.strip() for ln in str(root).splitlines() if ln.strip()]
    text = f"{type(root).__name__}: {lines[0] if lines else ''}"
    if root is not e:
        text += f" (raised as {type(e).__name__})"
    return text[:400]


def make_step(a, device):
    """The model (channels-last) and a function of one forward + backward of it (or of its
    compiled form) on a fixed random batch: (loss, the gradient as one fp64 vector)."""
    import torch

    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = True  # as in the project's runs
    fmt = torch.channels_last_3d
    torch.manual_seed(0)
    model = build_model(a.width, a.max_width, a.side.bit_length() - 1)  # down to 1^3
    model = model.to(device, memory_format=fmt)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(a.batch, 4, a.side, a.side, a.side, device=device, generator=g)
    y = torch.rand(a.batch, 5, a.side, a.side, a.side, device=device, generator=g) * 1.8 - 0.9
    x, y = x.contiguous(memory_format=fmt), y.contiguous(memory_format=fmt)

    def step(run):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = (run(x) - y).abs().mean()
        loss.backward()
        # the gradient in the parameters' logical order, whatever their layout
        grad = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        for p in model.parameters():
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
        return float(loss), grad
    return model, step


def timed(phase: str, limit: float, report, fn):
    """``fn()`` and its seconds, within ``limit``; None (reported) when it raised. Past
    ``limit`` it reports and exits at once (status 1): a compile that hangs cannot be
    interrupted from Python (its compile workers end with this process)."""
    def expire():
        report(f"{phase}: no result within {limit:g} s")
        os._exit(1)
    timer = threading.Timer(limit, expire)
    timer.daemon = True
    timer.start()
    t0 = time.perf_counter()
    try:
        return fn(), time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 (the failure is the finding)
        report(f"{phase}: FAILED: {first_line(e)}")
        return None
    finally:
        timer.cancel()


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2: no usage block
        sys.stderr.write(f"error: {message} ({self.prog} --help lists the options)\n")
        raise SystemExit(2)


def main(argv=None) -> int:
    p = _Parser(prog="python benchmarks/cl_compile_repro.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=64, help="channels of the first level")
    p.add_argument("--max-width", type=int, default=512, help="widths double up to this")
    p.add_argument("--side", type=int, default=64,
                   help="crop side, a power of 2: log2(side) levels, down to 1^3")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--backend", default="inductor", help="torch.compile's backend")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds for the compiled phase (compile + forward + backward)")
    p.add_argument("--eager-timeout", type=float, default=None,
                   help="seconds for the eager phase (default: --timeout)")
    p.add_argument("--json", default="", help="also write the verdicts to this JSON file")
    a = p.parse_args(argv)
    if a.side < 2 or a.side & (a.side - 1):
        p.error(f"--side {a.side}: must be a power of 2")
    if min(a.width, a.max_width, a.batch) < 1 or a.timeout <= 0:
        p.error("--width, --max-width and --batch must be 1 or more, --timeout above 0")
    if a.json and os.path.lexists(a.json):
        p.error(f"--json {a.json} exists: choose another name, or remove it")
    import torch
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = torch.version.cuda or "none"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "none"
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    levels = a.side.bit_length() - 1
    widths = [min(a.width * 2**i, a.max_width) for i in range(levels)]
    amp = ("bf16 autocast, cuDNN autotuning on" if device.type == "cuda"
           else "fp32 (no autocast on a CPU)")
    head = [f"torch {torch.__version__}, CUDA {cuda}, cuDNN {cudnn}; Python "
            f"{sys.version.split()[0]}; {gpu}",
            f"model: {levels} levels, widths {widths[0]}..{widths[-1]}, input {a.batch} x 4 "
            f"x {a.side}^3, channels_last_3d, {amp}; torch.compile(backend={a.backend!r})"]
    print("\n".join(head), flush=True)
    lines = []

    def report(line: str, works: bool = False):
        """Print a verdict line and write --json with the lines so far."""
        lines.append(line)
        print(line, flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"works": works, "lines": lines,
                           "markdown": "```\n" + "\n".join(head + lines) + "\n```"}, f, indent=1)

    model, step = make_step(a, device)
    eager = timed("eager", a.eager_timeout or a.timeout, report, lambda: step(model))
    if eager is None:
        return 1
    (ref_loss, ref_grad), seconds = eager
    report(f"eager: forward + backward in {seconds:.1f} s (loss {ref_loss:.6f})")
    compiled = timed("compiled", a.timeout, report,
                     lambda: step(torch.compile(model, backend=a.backend)))
    if compiled is None:
        return 1
    (loss, grad), seconds = compiled
    cos = float(grad @ ref_grad / (grad.norm() * ref_grad.norm()))
    diff = float((grad - ref_grad).abs().max() / ref_grad.abs().max())
    tol = 2e-2 if device.type == "cuda" else 1e-4
    same = abs(loss - ref_loss) <= tol * abs(ref_loss) and cos > 0.99
    report(f"compiled: compiled and ran in {seconds:.1f} s; loss {loss:.6f} vs eager "
           f"{ref_loss:.6f}, gradient cosine {cos:.6f}, max |difference| / max |gradient| "
           f"{diff:.1e}: " + ("same numbers" if same else "DIFFERENT numbers"), works=same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
