"""torch.compile of the channels-last U-Net on a GPU: which variant compiles, trains the same
numbers as the eager step, and how fast its step is. One line per variant::

    python -m benchmarks.channels_last_compile                  # every variant, 3 at a time
    python -m benchmarks.channels_last_compile --only cl-compile cl-eager --batch 32

The step is the notes' compute-only step (docs/performance.md, "Memory format"): the project's
UNet at the tutorial's sizes, a batch of 64 crops of 64^3 on the GPU, bf16 autocast, L1 loss,
torch's fused Adam, cuDNN autotuning on. Each variant runs in its own process (a failed compile
leaves no state behind): one eager step and one step of the variant from the same weights and
batch (their losses must agree to bf16 rounding and their gradients point the same way, cosine
above 0.99: "works", else "WRONG"), then ``--steps`` timed steps. Compiles run side by side
(``--jobs``); the timed steps of one variant at a time (a file lock), so the step times are those
of a GPU to itself.

On torch 2.11 the compiled backward of the channels-last model failed with
``AssertionError: expected size 512==512, stride 64==1 at dim=1`` in
``aten.convolution_backward``: the output strides torch's fake kernel predicted for a
convolution's gradient were not those cuDNN returned. The variants tell where it comes from
(autocast's weight copies, the 1^3 bottom level whose channels-last and contiguous strides
coincide, the input's layout) and which way round it: a variant that "works" at the speed of
``cl-eager`` or better is the one to take (tasks/cosmo.py, ``CHANNELS_LAST_COMPILE_OPTIONS``).
The first suspect is the bottom level: a channels-last (B, 512, 1, 1, 1) tensor has the strides
of a contiguous one, (512, 1, 1, 1, 1), and inductor lays out a 3D convolution's input and
weight in the stride order of its output, so the convolution into the 1^3 level gets its input
and weight in the default layout while the traced graph has them channels-last (seen with
torch 2.11's fake tensors on a CPU; the CPU's own convolutions take another path and compile).
"""
from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from elsewhere
    sys.path.insert(0, ROOT)

# name: (memory format, compile, what else, what it tells)
VARIANTS = {
    "default-eager": ("contiguous", False, "", "the default layout, eager (H200: 39.4 ms)"),
    "cl-eager": ("channels_last", False, "", "channels-last, eager (H200: 32.5 ms)"),
    "default-compile": ("contiguous", True, "", "the default layout, compiled"),
    "cl-compile": ("channels_last", True, "", "channels-last, compiled as the project would"),
    "cl-compile-fp32": ("channels_last", True, "fp32", "no autocast: are bf16 weight copies "
                        "involved?"),
    "cl-compile-5levels": ("channels_last", True, "five_levels", "full_scale false (bottom "
                           "2^3, no 1^3 level; another model): is the 1^3 level involved?"),
    "cl-compile-input-contiguous": ("channels_last", True, "input_contiguous", "weights "
                                    "channels-last, batch not"),
    "cl-compile-bottom-eager": ("channels_last", True, "bottom_eager", "the 1^3 level's two "
                                "convolutions left out of the compiled graphs"),
    "cl-compile-no-size-asserts": ("channels_last", True, "no_size_asserts", "inductor's "
                                   "stride checks off (only of use if the numbers agree)"),
    "cl-compile-no-layout-opt": ("channels_last", True, "no_layout_opt", "inductor's "
                                 "layout_optimization off"),
    "cl-compile-aot-eager": ("channels_last", True, "aot_eager", "backend aot_eager: the same "
                             "traced graphs without inductor (fake kernels or inductor?)"),
}


def run_variant(name: str, batch: int, steps: int, lock_path: str, device: str = "cuda") -> str:
    import torch

    from networks.unet import UNet

    fmt_name, compiled, extra, _ = VARIANTS[name]
    fmt = torch.channels_last_3d if fmt_name == "channels_last" else torch.contiguous_format
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.backends.cudnn.benchmark = True
    amp = extra != "fp32"
    import torch._inductor.config  # noqa: F401  (the settings two variants change)
    if extra == "no_size_asserts":
        torch._inductor.config.size_asserts = False
    if extra == "no_layout_opt":
        torch._inductor.config.layout_optimization = False

    def build():
        torch.manual_seed(0)
        m = UNet(full_scale=extra != "five_levels").to(dev, memory_format=fmt)
        return m, torch.optim.Adam(m.parameters(), lr=1e-4, fused=True)

    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(batch, 4, 64, 64, 64, device=dev, generator=g)
    y = torch.rand(batch, 5, 64, 64, 64, device=dev, generator=g) * 1.8 - 0.9
    if extra != "input_contiguous":
        x = x.contiguous(memory_format=fmt)
    y = y.contiguous(memory_format=fmt)

    def step(model, opt, grads=False):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss = (model(x) - y).abs().mean()
        loss.backward()
        # the gradient in the parameters' logical order, whatever their layout
        g = torch.cat([p.grad.float().flatten() for p in model.parameters()]) if grads else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), g

    ref_model, ref_opt = build()
    ref_loss, ref_grad = step(ref_model, ref_opt, grads=True)
    del ref_model, ref_opt
    model, opt = build()
    run = model
    if compiled:
        if extra == "bottom_eager":
            for blk in (model.down[-1], model.up[0]):
                blk.forward = torch.compiler.disable(blk.forward)
        run = torch.compile(model, backend="aot_eager" if extra == "aot_eager" else "inductor")
    t0 = time.perf_counter()
    try:
        loss, grad = step(run, opt, grads=True)
        sync()
    except Exception as e:  # noqa: BLE001 (the failure is the finding)
        msg = " ".join(str(e).split())[:240]
        return f"{name:30s} fails  {type(e).__name__}: {msg}"
    first_s = time.perf_counter() - t0
    # the same step: the loss to bf16 rounding, the gradient pointing the same way (a gradient
    # laid out in memory other than the compiled code reads it would be scrambled: cosine ~ 0)
    grad, ref_grad = grad.double(), ref_grad.double()  # (a float32 sum of 10^7 terms drifts)
    cos = float(grad @ ref_grad / (grad.norm() * ref_grad.norm()))
    same = abs(float(loss) - float(ref_loss)) <= 2e-2 * abs(float(ref_loss)) and cos > 0.99
    del grad, ref_grad
    for _ in range(3):
        step(run, opt)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one variant's timed steps at a time
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(run, opt)
        sync()
        ms = 1e3 * (time.perf_counter() - t0) / steps
    verdict = "works" if same else "WRONG"
    return (f"{name:30s} {verdict:5s}  {ms:7.2f} ms/step  (first step {first_s:.1f} s; loss "
            f"{float(loss):.5f} vs eager {float(ref_loss):.5f}; gradient cosine {cos:.4f})")


def main(argv=None):
    from settings.errors import OneLineParser, at_least, refuse

    p = OneLineParser(prog="python -m benchmarks.channels_last_compile",
                      description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=list(VARIANTS), help="these variants alone")
    p.add_argument("--batch", type=at_least(1), default=64)
    p.add_argument("--steps", type=at_least(1), default=20, help="timed steps per variant")
    p.add_argument("--jobs", type=at_least(1), default=3, help="variants compiled side by side")
    p.add_argument("--timeout", type=at_least(1.0, float), default=300, help="seconds per variant")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in a child process
    p.add_argument("--lock", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a smoke test
    a = p.parse_args(argv)
    if a.variant:
        print(run_variant(a.variant, a.batch, a.steps, a.lock, a.device), flush=True)
        return
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        refuse("no CUDA GPU here: this times compiled and eager layouts of the U-Net on a GPU "
               "(python -m benchmarks.cl_compile_repro --device cpu runs the compile check on a "
               "CPU)")
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}; "
          f"batch {a.batch} x 4 x 64^3, bf16 autocast, fused Adam, {a.steps} timed steps",
          flush=True)
    names = a.only or list(VARIANTS)
    lock = os.path.join(tempfile.mkdtemp(), "timing.lock")
    running = []  # (name, process, start)
    pending = list(names)
    while pending or running:
        while pending and len(running) < a.jobs:
            name = pending.pop(0)
            cmd = [sys.executable, "-m", "benchmarks.channels_last_compile", "--variant", name,
                   "--batch", str(a.batch), "--steps", str(a.steps), "--lock", lock,
                   "--device", a.device]
            running.append((name, subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True),
                            time.monotonic()))
        time.sleep(0.5)
        for item in list(running):
            name, proc, t0 = item
            if proc.poll() is None and time.monotonic() - t0 < a.timeout:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                print(f"{name:30s} fails  (no result in {a.timeout:.0f} s)", flush=True)
            else:
                out, err = proc.communicate()
                lines = [ln for ln in out.splitlines() if ln.startswith(name)]
                tail = " ".join(err.strip().splitlines()[-1:])[:240]
                print(lines[-1] if lines else f"{name:30s} fails  (exit {proc.returncode}: "
                      f"{tail})", flush=True)
            running.remove(item)
    for name in names:
        print(f"  {name}: {VARIANTS[name][3]}")


if __name__ == "__main__":
    main()
