"""``phalanx serve``: the OpenAI-compatible server over one replica.

Without ``--model`` it serves the embedded tiny demo model (built on first use into the user's
cache directory) on CPU at TP 2 on 127.0.0.1:8000, and prints a curl line that works against it.
The replica is launched before the port is bound, so once the address is printed the server is
ready. ``--port 0`` picks a free port (the printed address names it).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import structlog

from executor.errors import ExecutorError
from server.body_limit import DEFAULT_MAX_BODY_BYTES
from tools.launch_options import add_launch_arguments, executor_options, model_dir_problem
from tools.stop_signals import StopSignal

log = structlog.get_logger("phalanx.serve")

DEMO_TP = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, default=None, help="model directory (default: the tiny demo model)"
    )
    parser.add_argument(
        "--tp", type=int, default=None, help=f"tensor-parallel degree (default: 1; demo: {DEMO_TP})"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--cuda-graph", action="store_true", help="decode from CUDA graphs (cuda only)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument("--port", type=port_number, default=8000, help="port (0: a free one)")
    parser.add_argument(
        "--served-model-name", default=None, help="model id in the API (default: directory name)"
    )
    parser.add_argument("--max-slots", type=int, default=16, help="concurrent decoding requests")
    parser.add_argument(
        "--kv-pages",
        type=int,
        default=None,
        help="KV pages per rank (default: 512 on cpu, all that fit on cuda)",
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens of one prefill step")
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of a chat request that names none (default: the rest of the context)",
    )
    parser.add_argument("--step-timeout", type=float, default=300.0, help="seconds one engine step may take")
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        help="seconds a stop gives clients and then the ranks before they are killed (default: 5)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body; larger ones get 413 (default: {DEFAULT_MAX_BODY_BYTES}, 8 MiB)",
    )
    parser.add_argument("--log-level", default="warning", help="uvicorn's access/error log level")
    add_launch_arguments(parser)


def port_number(text: str) -> int:
    """A TCP port for ``--port``: 0 (a free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535, got {text!r}")
    return port


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def curl_line(base: str, model: str) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello! Who are you?"}],
        "max_tokens": 32,
    }
    return f"curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))}"


def eager_decode_note(device: str, cuda_graph: bool) -> str | None:
    """What serve prints when a replica will decode eagerly where the user might expect otherwise:
    on CUDA without ``--cuda-graph`` (graphs are opt-in: the pre-capture sweep adds seconds to
    startup, and they are what makes small batches fast), and with ``--cuda-graph`` on a device
    that has no CUDA graphs."""
    if device == "cuda" and not cuda_graph:
        return (
            "note: decode runs eagerly; --cuda-graph replays one CUDA graph per batch bucket "
            "(4B geometry, batch 1 on an H200: about 2.4 ms a step, against 6-12 ms eagerly)"
        )
    if device != "cuda" and cuda_graph:
        return (
            f"note: --cuda-graph has no effect on {device}: decode runs the graph runner's static "
            "buffers and pre-capture sweep eagerly"
        )
    return None


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    from executor.engine import Engine, EngineConfig

    if args.model is None:
        from tools.demo_model import demo_model_dir

        tp = DEMO_TP if args.tp is None else args.tp
        model_dir, name = demo_model_dir(), args.served_model_name or "tiny-demo"
    else:
        model_dir, tp, name = args.model, 1 if args.tp is None else args.tp, args.served_model_name
    problem = model_dir_problem(model_dir)
    if problem is not None:
        print(f"phalanx serve: error: {problem}", file=sys.stderr)
        return 2
    kv_pages = args.kv_pages if args.kv_pages is not None else (512 if args.device == "cpu" else 0)
    config = EngineConfig(
        model_dir=model_dir,
        tp=tp,
        device=args.device,
        max_slots=args.max_slots,
        kv_pages=kv_pages,
        page_size=args.page_size,
        max_batch_tokens=args.max_batch_tokens,
        step_timeout=args.step_timeout,
        cuda_graph=args.cuda_graph,
        pipeline=args.pipeline,
        executor_options={"shutdown_timeout": args.shutdown_grace, **executor_options(args)},
    )
    try:
        sock = _listen(args.host, args.port)
    except OSError as e:
        print(f"phalanx serve: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    try:
        engine = Engine.start(config)
    except (ValueError, RuntimeError, OSError, ExecutorError) as e:
        sock.close()
        print(f"phalanx serve: error: the replica did not start: {e}", file=sys.stderr)
        return 1
    with sock:
        try:
            _serve(args, engine, sock, model_dir, name, tp)
        finally:
            clean = engine.shutdown(args.shutdown_grace)
    if not clean:
        print(
            f"phalanx serve: the replica did not shut down cleanly: {engine.poison_reason}", file=sys.stderr
        )
        return 1
    return 0


class _StoppingServer:
    """uvicorn's server, which on the first stop signal also ends every open request at once
    (an error event and ``[DONE]`` on a stream, 503 otherwise), so that draining the connections
    waits for no generation."""

    def __init__(self, server: Any, engine: Any) -> None:
        self.server = server
        self.engine = engine
        self.stopping = False
        self._handle_exit = server.handle_exit
        server.handle_exit = self.handle_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.stopping:
            self.stopping = True
            # on a thread of its own: the signal may have interrupted a holder of the engine's locks
            stop = threading.Thread(
                target=self.engine.stop_admission,
                args=(f"the server is shutting down ({signal.Signals(sig).name})",),
                name="phalanx-stop",
                daemon=True,
            )
            stop.start()
        self._handle_exit(sig, frame)


def _serve(
    args: argparse.Namespace, engine: Any, sock: socket.socket, model_dir: Path, name: str | None, tp: int
) -> None:
    import uvicorn

    from server.app import create_app

    app = create_app(engine, model_dir, name, args.default_max_tokens, args.max_body_bytes)
    model = app.state.phalanx.model_name
    host, port = sock.getsockname()[:2]
    base = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    print(f"phalanx serving {model!r} (tp={tp}, {args.device}) on {base}", flush=True)
    print(f"try: {curl_line(base, model)}", flush=True)
    note = eager_decode_note(args.device, args.cuda_graph)
    if note:
        print(note, flush=True)
    # The app has no lifespan handlers. With them on, the SIGINT that uvicorn re-raises after
    # draining could cancel the lifespan task mid-shutdown, which logged a spurious traceback.
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_grace, lifespan="off"
        )
    )
    _StoppingServer(server, engine)
    try:  # uvicorn drains, then re-raises the signal it stopped on (the CLI's StopSignal)
        server.run(sockets=[sock])
    except (KeyboardInterrupt, StopSignal) as stop:
        stopped_by = "SIGINT" if isinstance(stop, KeyboardInterrupt) else str(stop)
        print(
            f"phalanx serve: stopped by {stopped_by}; shutting the replica down", file=sys.stderr, flush=True
        )
