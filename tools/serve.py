"""``phalanx serve``: the OpenAI-compatible server over one replica.

Without ``--model`` it serves the embedded tiny demo model (built on first use into the user's
cache directory) on 127.0.0.1:8000, at TP 2 on CPU (TP 1 on a GPU), and prints a curl line that
works against it. ``--device`` defaults to cuda where torch sees a GPU; there CUDA graphs are on
unless ``--enforce-eager``, and memory is sized by ``--gpu-memory-utilization``.
The replica is launched before the port is bound, so once the address is printed the server is
ready. ``--port 0`` picks a free port (the printed address names it). Flags that mean what vLLM's
do carry vLLM's names (``--tensor-parallel-size``, ``--max-num-seqs`` …) beside the short ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import structlog
from setproctitle import setproctitle

from phalanx.config import settings
from phalanx.config.replica import ParallelConfig, Timeouts
from phalanx.executor.errors import ExecutorError
from phalanx.server.body_limit import DEFAULT_MAX_BODY_BYTES
from phalanx.tools.launch_options import (
    LaunchChoice,
    add_batch_arguments,
    add_launch_arguments,
    add_log_arguments,
    add_model_arguments,
    checked_number,
    choose_launch,
    model_dir_problem,
    positive_int,
    replica_config,
)
from phalanx.tools.stop_signals import StopSignal

log = structlog.get_logger("phalanx.serve")

DEMO_TP = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, default=None, help="model directory (default: the tiny demo model)"
    )
    parser.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=int,
        default=None,
        help=f"tensor-parallel degree: ranks, one GPU each (default: {ParallelConfig.tp}; demo on cpu: {DEMO_TP})",
    )
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument("--port", type=port_number, default=8000, help="port (0: a free one)")
    parser.add_argument(
        "--served-model-name", default=None, help="model id in the API (default: directory name)"
    )
    add_batch_arguments(parser)
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of a chat request that names none (default: the rest of the context)",
    )
    parser.add_argument(
        "--step-timeout", type=float, default=Timeouts.step_timeout, help="seconds one engine step may take"
    )
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
    parser.add_argument(
        "--api-key",
        default=settings.api_key(),
        help="every route but /health and /metrics wants 'Authorization: Bearer KEY' "
        f"(default: ${settings.API_KEY}; unset: no key is asked for)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a jinja chat template file, or the template itself, in place of the checkpoint's "
        "(default: the checkpoint's tokenizer_config.json or chat_template.jinja)",
    )
    parser.add_argument(
        "--stats-interval",
        type=seconds,
        default=5.0,
        help="seconds between stats lines (throughput, requests, KV use) while busy; 0: none",
    )
    add_log_arguments(parser)
    add_launch_arguments(parser)


def port_number(text: str) -> int:
    """A TCP port for ``--port``: 0 (a free one) to 65535."""
    return checked_number(text, int, lambda port: 0 <= port <= 65535, "a port from 0 to 65535")


def seconds(text: str) -> float:
    """A finite duration of 0 seconds or more."""
    return checked_number(text, float, lambda value: 0 <= value < math.inf, "0 or more seconds")


def curl_line(base: str, model: str, chat: bool = True, with_key: bool = False) -> str:
    """A curl command that works against this server: chat when the model has a chat template,
    else a plain completion. A key is never printed: the line reads it from $PHALANX_API_KEY."""
    if chat:
        route = "chat/completions"
        body = {"model": model, "messages": [{"role": "user", "content": "Hello! Who are you?"}]}
    else:
        route, body = "completions", {"model": model, "prompt": "Hello! My name is"}
    body["max_tokens"] = 32
    auth = f' -H "Authorization: Bearer ${settings.API_KEY}"' if with_key else ""
    return (
        f"curl {base}/v1/{route} -H 'Content-Type: application/json'{auth} -d {shlex.quote(json.dumps(body))}"
    )


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's TCP socket, bound and listening (port 0: a free one), handed to uvicorn."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # The protocol named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # connections whose socket says IPPROTO_TCP, and with it on, a reply's body written after its
    # headers waited for the client's delayed ACK: 40 ms on every non-streamed response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _model_and_name(args: argparse.Namespace) -> tuple[Path, str]:
    """The model directory and served name: the demo's unless ``--model`` is given."""
    if args.model is None:
        from phalanx.tools.demo_model import demo_model_dir

        return demo_model_dir(), args.served_model_name or "tiny-demo"
    return args.model, args.served_model_name or args.model.name


def _tp(args: argparse.Namespace, choice: LaunchChoice) -> int:
    """``--tp``, else 1; the CPU demo runs at TP 2 to show tensor parallelism on any laptop."""
    if args.tp is not None:
        return args.tp
    return DEMO_TP if args.model is None and choice.device == "cpu" else ParallelConfig.tp


def _model_problem(model_dir: Path, chat_template: str | None) -> str | None:
    """What keeps the model from being served, checked before any rank starts (None: nothing)."""
    from phalanx.server.chat_template import ChatTemplate, ChatTemplateError

    problem = model_dir_problem(model_dir)
    if problem is None and chat_template is not None:
        try:
            ChatTemplate.from_model_dir(model_dir, chat_template)
        except ChatTemplateError as e:
            problem = f"--chat-template: {e}"
    return problem


def run(args: argparse.Namespace) -> int:
    from phalanx.engine.engine import Engine
    from phalanx.protocol.logs import configure_logging

    configure_logging(args.log_level, args.log_format)
    model_dir, name = _model_and_name(args)
    problem = _model_problem(model_dir, args.chat_template)
    if problem is None:
        try:
            choice = choose_launch(args, model_dir, args.max_slots)
        except ValueError as exc:
            problem = str(exc)
    if problem is not None:
        print(f"phalanx serve: error: {problem}", file=sys.stderr)
        return 2
    setproctitle(f"phalanx serve ({name})")
    tp = _tp(args, choice)
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as e:
        print(f"phalanx serve: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    try:
        config = replica_config(
            args,
            model_dir,
            tp,
            choice,
            page_size=args.page_size,
            max_batch_tokens=args.max_batch_tokens,
            step_timeout=args.step_timeout,
            shutdown_timeout=args.shutdown_grace,
        )
        engine = Engine.start(config)
    except (ValueError, RuntimeError, OSError, ExecutorError) as e:
        sock.close()
        print(f"phalanx serve: error: the replica did not start: {e}", file=sys.stderr)
        return 1
    with sock:
        try:
            _serve(args, engine, sock, model_dir, name, tp, choice)
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
    args: argparse.Namespace,
    engine: Any,
    sock: socket.socket,
    model_dir: Path,
    name: str,
    tp: int,
    choice: LaunchChoice,
) -> None:
    import uvicorn

    from phalanx.server.app import create_app
    from phalanx.server.stats_log import StatsLog

    app = create_app(
        engine,
        model_dir,
        name,
        args.default_max_tokens,
        api_key=args.api_key,
        chat_template=args.chat_template,
        max_body_bytes=args.max_body_bytes,
    )
    state = app.state.phalanx
    host, port = sock.getsockname()[:2]
    base = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    decode = "CUDA graphs" if choice.cuda_graph else "eager"
    print(
        f"phalanx serving {name!r} (tp={tp}, {choice.device}, {choice.dtype}, {decode} decode) on {base}",
        flush=True,
    )
    print(f"try: {curl_line(base, name, state.template is not None, bool(args.api_key))}", flush=True)
    # The app has no lifespan handlers. With them on, the SIGINT that uvicorn re-raises after
    # draining could cancel the lifespan task mid-shutdown, which logged a spurious traceback.
    # log_config=None: uvicorn's records go through our log pipeline; the access log is ours.
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=args.shutdown_grace,
            lifespan="off",
        )
    )
    _StoppingServer(server, engine)
    stats = StatsLog(engine.stats, state.metrics.totals, args.stats_interval) if args.stats_interval else None
    try:  # uvicorn drains, then re-raises the signal it stopped on (the CLI's StopSignal)
        with stats or contextlib.nullcontext():
            server.run(sockets=[sock])
    except (KeyboardInterrupt, StopSignal) as stop:
        stopped_by = "SIGINT" if isinstance(stop, KeyboardInterrupt) else str(stop)
        print(
            f"phalanx serve: stopped by {stopped_by}; shutting the replica down", file=sys.stderr, flush=True
        )
