"""Does torch.compile train a channels-last 3-D U-Net? A reproduction with torch alone (no
project imports), to run with whatever torch a machine has::

    python benchmarks/cl_compile_repro.py                        # a GPU: the U-Net's widths
    python benchmarks/cl_compile_repro.py --width 4 --max-width 16 --side 32    # small, CPU too

The model, the phases (eager, then compiled, each with its own limit), the comparison and the
verdict lines are described in docs/performance.md ("channels-last"); ``--contiguous``,
``--options`` and ``--per-level`` were options of this script at commit 68986f8. Exit status 0
when the compiled step gave the eager numbers, else 1.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
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


def child(a) -> None:
    """One phase in this process: prints JSON lines {"phase", "event": start|done|failed}."""
    import torch

    def say(**kw):
        print(json.dumps(kw), flush=True)

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = True
    fmt = torch.channels_last_3d
    levels = a.side.bit_length() - 1  # down to 1^3
    torch.manual_seed(0)
    model = build_model(a.width, a.max_width, levels)
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

    say(phase="eager", event="start")
    t0 = time.perf_counter()
    ref_loss, ref_grad = step(model)
    say(phase="eager", event="done", seconds=time.perf_counter() - t0, loss=ref_loss)
    say(phase="compiled", event="start")
    t0 = time.perf_counter()
    try:
        loss, grad = step(torch.compile(model, backend=a.backend))
    except Exception as e:  # noqa: BLE001 (the failure is the finding)
        say(phase="compiled", event="failed", seconds=time.perf_counter() - t0,
            error=first_line(e))
        return
    seconds = time.perf_counter() - t0
    cos = float(grad @ ref_grad / (grad.norm() * ref_grad.norm()))
    diff = float((grad - ref_grad).abs().max() / ref_grad.abs().max())
    tol = 2e-2 if cuda else 1e-4
    same = abs(loss - ref_loss) <= tol * abs(ref_loss) and cos > 0.99
    say(phase="compiled", event="done", seconds=seconds, loss=loss, eager_loss=ref_loss,
        cosine=cos, max_rel_diff=diff, same=same)


def run_phases(argv: list[str], eager_timeout: float, timeout: float) -> dict:
    """Run the phases in a child; the parent enforces each phase's limit (killing the child).
    Returns {phase: the phase's last event (a dict)}."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *argv]
    # a session of its own: a child past its limit is killed with the compile workers it started
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    lines: queue.Queue = queue.Queue()

    def pump(stream):
        for ln in stream:
            lines.put(ln)
        lines.put(None)
    threading.Thread(target=pump, args=(proc.stdout,), daemon=True).start()
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    events, phase, deadline = {}, None, None
    start_deadline = time.monotonic() + max(eager_timeout, 60)  # imports before the first phase
    while True:
        limit = deadline if deadline is not None else start_deadline
        try:
            ln = lines.get(timeout=max(0.0, limit - time.monotonic()))
        except queue.Empty:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            events[phase or "eager"] = {"event": "timeout",
                                        "limit": timeout if phase == "compiled" else eager_timeout}
            return events
        if ln is None:
            break
        if not ln.startswith("{"):
            continue
        ev = json.loads(ln)
        events[ev["phase"]] = ev
        if ev["event"] == "start":
            phase = ev["phase"]
            deadline = time.monotonic() + (timeout if phase == "compiled" else eager_timeout)
        else:
            phase, deadline = None, None
    proc.wait()
    tail = [ln.strip() for ln in err if ln.strip()][-1:] or [f"exit {proc.returncode}"]
    died = {"event": "failed", "error": f"the process died: {tail[0][:300]}"}
    for name, ev in list(events.items()):
        if ev["event"] == "start":  # the child died in this phase
            events[name] = died
    return events or {"eager": died}


def verdict(ev: dict | None, phase: str) -> str:
    if ev is None:
        return "not run"
    if ev["event"] == "timeout":
        return f"no result within {ev['limit']:g} s"
    if ev["event"] == "failed":
        return f"FAILED: {ev['error']}"
    if phase == "eager":
        return f"forward + backward in {ev['seconds']:.1f} s (loss {ev['loss']:.6f})"
    return (f"compiled and ran in {ev['seconds']:.1f} s; loss {ev['loss']:.6f} vs eager "
            f"{ev['eager_loss']:.6f}, gradient cosine {ev['cosine']:.6f}, max |difference| / "
            f"max |gradient| {ev['max_rel_diff']:.1e}: "
            + ("same numbers" if ev["same"] else "DIFFERENT numbers"))


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
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.side < 2 or a.side & (a.side - 1):
        p.error(f"--side {a.side}: must be a power of 2")
    if min(a.width, a.max_width, a.batch) < 1 or a.timeout <= 0:
        p.error("--width, --max-width and --batch must be 1 or more, --timeout above 0")
    if a.json and os.path.lexists(a.json) and not a.child:
        p.error(f"--json {a.json} exists: choose another name, or remove it")
    import torch
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.child:
        child(a)
        return 0
    cuda = torch.version.cuda or "none"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "none"
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else "CPU"
    head = [f"torch {torch.__version__}, CUDA {cuda}, cuDNN {cudnn}; Python "
            f"{sys.version.split()[0]}; {gpu}"]
    print(head[0], flush=True)
    levels = a.side.bit_length() - 1
    widths = [min(a.width * 2**i, a.max_width) for i in range(levels)]
    amp = ("bf16 autocast, cuDNN autotuning on" if a.device.startswith("cuda")
           else "fp32 (no autocast on a CPU)")
    head.append(f"model: {levels} levels, widths {widths[0]}..{widths[-1]}, input {a.batch} x 4 "
                f"x {a.side}^3, channels_last_3d, {amp}; torch.compile(backend={a.backend!r})")
    print(head[1], flush=True)
    events = run_phases(list(argv if argv is not None else sys.argv[1:]),
                        a.eager_timeout or a.timeout, a.timeout)
    lines = [f"eager: {verdict(events.get('eager'), 'eager')}"]
    if events.get("eager", {}).get("event") == "done":
        lines.append(f"compiled: {verdict(events.get('compiled'), 'compiled')}")
    print("\n".join(lines), flush=True)
    ok = events.get("compiled", {}).get("same") is True
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"works": ok, "events": events, "lines": lines,
                       "markdown": "```\n" + "\n".join(head + lines) + "\n```"}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
