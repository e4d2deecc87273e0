"""``phalanx bench host``: where the host (Python) time of one eager decode step goes.

Eager decode at small batch is bound by the host: the GPU finishes each kernel before Python has
launched the next, so the step time is the time Python takes to issue it. This bench times one
step without synchronising (the host's share) and with it, then wraps every ``kernels.ops`` entry
point in a wall-clock timer for a few more steps and prints each op's calls and microseconds per
step; what is left is the model's own Python and torch glue (views, splits, allocations).

Host speed differs from machine to machine (about 2x between hosts of the same GPU kind), so
compare rows of one run, and give the machine with any figure: the output names it
(``tools/host_info.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from phalanx.kernels import bound, ops
from phalanx.tools.bench.args import at_least
from phalanx.tools.bench.measure import PAGE_SIZE
from phalanx.tools.bench.random_model import build_random_model
from phalanx.tools.geometries import GEOMETRIES
from phalanx.tools.host_info import host_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--geometry", choices=sorted(GEOMETRIES), default="4b", help="model shape (random weights)"
    )
    parser.add_argument("--batch", type=at_least(1), default=1, help="decode rows")
    parser.add_argument("--steps", type=at_least(1), default=20, help="steps per measurement")
    parser.add_argument(
        "--context", type=at_least(0), default=512, help="tokens already in each row's KV cache"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the benchmark runs")


@contextmanager
def timed_ops() -> Iterator[tuple[dict[str, float], Counter[str]]]:
    """Every callable in ``kernels.ops.__all__``, and every bound op of ``kernels.bound`` (under
    the name of the op it stands for), wrapped in a timer while the block runs. A timed call
    inside another (the general op a bound op falls back to) counts in the outer one only."""
    seconds: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    originals = {name: getattr(ops, name) for name in ops.__all__ if name != "rope_cache"}
    bound_calls = {cls: cls.__call__ for cls in bound.BOUND_OPS}
    depth = 0

    def timer(name_of: Callable[[tuple], str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            nonlocal depth
            if depth:
                return fn(*args, **kwargs)
            depth += 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth -= 1
                name = name_of(args)
                seconds[name] += time.perf_counter() - started
                calls[name] += 1

        return timed

    for name, fn in originals.items():
        setattr(ops, name, timer(lambda args, name=name: name, fn))
    for cls, call in bound_calls.items():
        cls.__call__ = timer(lambda args: args[0].op, call)
    try:
        yield seconds, calls
    finally:
        for name, fn in originals.items():
            setattr(ops, name, fn)
        for cls, call in bound_calls.items():
            cls.__call__ = call


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> int:
    from phalanx.models.qwen35 import DecodeBatch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("phalanx bench host: needs a CUDA GPU (or --device cpu)")
        return 2
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_random_model(args.geometry, device, dtype)
    pages_per_row = -(-(args.context + 2 * args.steps + 8) // PAGE_SIZE)
    model.allocate_cache(args.batch * pages_per_row + 1, PAGE_SIZE, args.batch)
    step = DecodeBatch(
        tokens=torch.randint(0, model.config.vocab_size, (args.batch,), device=device),
        positions=torch.full((args.batch,), args.context, dtype=torch.int64, device=device),
        state_slots=torch.arange(args.batch, device=device),
        page_table=torch.arange(args.batch * pages_per_row, dtype=torch.int32, device=device).view(
            args.batch, -1
        ),
    )
    for _ in range(3):  # compile, tune
        model.decode(step)
    _sync(device)

    issue, whole = [], []
    for _ in range(args.steps):
        _sync(device)
        started = time.perf_counter()
        model.decode(step)
        issued = time.perf_counter()
        _sync(device)
        issue.append(issued - started)
        whole.append(time.perf_counter() - started)
    with timed_ops() as (seconds, calls):
        started = time.perf_counter()
        for _ in range(args.steps):
            model.decode(step)
        instrumented = (time.perf_counter() - started) / args.steps
        _sync(device)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"phalanx {args.geometry}, eager decode, batch {args.batch}, {name}, median of {args.steps} steps")
    print(host_line(device))
    print(f"host time to issue a step: {statistics.median(issue) * 1e3:.2f} ms")
    print(f"step time, synchronised:   {statistics.median(whole) * 1e3:.2f} ms")
    print(f"with every op timed:       {instrumented * 1e3:.2f} ms a step")
    print("| op | calls a step | µs a call | ms a step |")
    print("|---|---|---|---|")
    for op, total in sorted(seconds.items(), key=lambda item: -item[1]):
        per_step = total / args.steps
        print(f"| {op} | {calls[op] // args.steps} | {total / calls[op] * 1e6:.1f} | {per_step * 1e3:.2f} |")
    glue = instrumented - sum(seconds.values()) / args.steps
    print(f"| (model glue: views, splits, allocations) | | | {glue * 1e3:.2f} |")
    return 0
