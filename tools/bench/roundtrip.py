"""``phalanx bench roundtrip``: the protocol round trip of one Decode with 64 rows to every rank
and back, with no model work.

The coordinator side is the real one (envelope encode, RankLink broadcast over the ROUTER socket,
collection of exactly world_size replies, reply validation). Each rank is a light process that
decodes the command with the real codec and answers as a rank does: rank 0 a DecodeDone with one
TokenResult per row, every other rank an Ack. What it measures is therefore the runtime's fixed
cost per step: serialisation, ZeroMQ, wake-ups and validation.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time

from phalanx.executor.link import RankLink
from phalanx.executor.ranks import RankHandle
from phalanx.executor.replies import StepCollection, validate_decode
from phalanx.protocol import PROTOCOL_VERSION, decode_envelope, encode
from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import (
    Ack,
    Capacity,
    Decode,
    DecodeDone,
    DecodeRow,
    Envelope,
    Ready,
    ReplyEnvelope,
    Shutdown,
    TokenResult,
)
from phalanx.protocol.transport import CoordinatorSocket, RankSocket, RuntimeDir, tcp_address
from phalanx.tools.bench.args import at_least, tp_degrees

EPOCH = 1


def _echo_rank(address: str, rank: int) -> None:
    """A rank that answers like a real one, without a model."""
    sock = RankSocket(address, f"rank-{rank}".encode())
    ready = Ready(Capacity(0, 16, 64, 0), "none", 0, "bench")
    sock.send(encode(ReplyEnvelope(PROTOCOL_VERSION, EPOCH, rank, 0, ready)))
    while True:
        envelope = decode_envelope(sock.recv(None), epoch=EPOCH)
        body = envelope.body
        if isinstance(body, Decode) and rank == 0:
            reply = DecodeDone([TokenResult(r.request_id, r.token + 1) for r in body.rows])
        else:
            reply = Ack()
        sock.send(encode(ReplyEnvelope(PROTOCOL_VERSION, EPOCH, rank, envelope.seq, reply)))
        if isinstance(body, Shutdown):
            sock.close()
            return


def _rows(count: int) -> list[DecodeRow]:
    # A realistic page table: 64 pages per row (1024 positions at page size 16).
    return [DecodeRow(i + 1, i, 1000 + i, 1000, pack_ids(range(i * 64, i * 64 + 64))) for i in range(count)]


def measure(tp: int, iterations: int, warmup: int, rows: int, transport: str) -> dict[str, float]:
    runtime = RuntimeDir() if transport == "ipc" else None
    sock = CoordinatorSocket(runtime.ipc_address() if runtime else tcp_address("127.0.0.1", 0))
    context = multiprocessing.get_context("spawn")
    ranks = []
    for rank in range(tp):
        process = context.Process(target=_echo_rank, args=(sock.address, rank), daemon=True)
        process.start()
        ranks.append(RankHandle(rank, process))
    link = RankLink(sock, ranks, heartbeat_timeout=2.0)
    try:
        joined = 0
        while joined < tp:
            for identity, reply in link.wait(5.0, EPOCH, startup=True):
                ranks[reply.rank].identity = identity
                joined += 1
        decode = Decode(_rows(rows))
        samples: list[float] = []
        for seq in range(1, warmup + iterations + 1):
            started = time.perf_counter_ns()
            link.broadcast(encode(Envelope(PROTOCOL_VERSION, EPOCH, seq, decode)))
            collection = StepCollection("decode", seq, tp)
            while not collection.done:
                for _identity, reply in link.wait(5.0, EPOCH):
                    collection.offer(reply)
            validate_decode(decode, collection.replies, tp)
            if seq > warmup:
                samples.append((time.perf_counter_ns() - started) / 1000)
        link.broadcast(encode(Envelope(PROTOCOL_VERSION, EPOCH, warmup + iterations + 1, Shutdown())))
        link.stop_all(5.0)
    finally:
        link.kill_all()
        sock.close()
        if runtime is not None:
            runtime.remove()
    samples.sort()
    return {
        "tp": tp,
        "rows": rows,
        "iterations": iterations,
        "p50_us": statistics.median(samples),
        "p99_us": samples[min(len(samples) - 1, int(0.99 * len(samples)))],
        "mean_us": statistics.fmean(samples),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tp", type=tp_degrees, default="2,4,8", help="comma-separated TP degrees (default 2,4,8)"
    )
    parser.add_argument(
        "--iterations", type=at_least(1), default=2000, help="timed round trips per TP degree"
    )
    parser.add_argument("--warmup", type=at_least(0), default=200, help="untimed round trips first")
    parser.add_argument("--rows", type=at_least(1), default=64, help="decode rows in each command")
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc", help="control-plane sockets")
    parser.add_argument("--json", action="store_true", help="print one JSON object per TP degree")


def run(args: argparse.Namespace) -> int:
    results = [measure(tp, args.iterations, args.warmup, args.rows, args.transport) for tp in args.tp]
    if args.json:
        for result in results:
            print(json.dumps(result))
        return 0
    print(f"Decode round trip, {args.rows} rows, {args.transport}, {args.iterations} iterations")
    print(f"{'TP':>3} {'p50 us':>9} {'p99 us':>9} {'mean us':>9}")
    for result in results:
        print(
            f"{result['tp']:>3} {result['p50_us']:>9.1f} {result['p99_us']:>9.1f} {result['mean_us']:>9.1f}"
        )
    sys.stdout.flush()
    return 0
