"""Compare the four ways of writing the service: start each, load it, print one table.

For each ``--mode`` of server.py it starts the server in a subprocess on a
free loopback port, waits until ``/health`` answers, runs load.py against it
(another subprocess, so that client and server do not share a loop or a
GIL), stops the server with SIGTERM (aiohttp shuts down cleanly) and prints,
for every mode: requests/s, p50/p99 latency, ``/health`` latency under load,
the mean batch size, and the count of wrong answers. From the repository
root, on a machine with a GPU::

    python examples/service/compare.py            # about 1 minute
    python examples/service/compare.py --quick    # about 30 s
    python examples/service/compare.py --json     # one JSON object per mode

It exits with 1 if a server failed or any answer was wrong.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from load import table  # noqa: E402

MODES = ("batched", "unbatched", "sync", "executor")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_ready(server: subprocess.Popen[bytes], url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    raise RuntimeError(f"the server for {url} was not ready after {timeout} s")


def stop(server: subprocess.Popen[bytes]) -> int:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            return server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            return -9
    return server.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs: the whole comparison in about 30 s")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--clients", type=int, default=None, help="concurrent clients (default 64, quick 32)")
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds of load per mode (default 8, quick 2)"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON lines")
    parser.add_argument("server_args", nargs="*", help="passed on to server.py, after --")
    args = parser.parse_args()
    clients = args.clients or (32 if args.quick else 64)
    duration = args.duration or (2.0 if args.quick else 8.0)
    requests = 10_000 if args.quick else 100_000

    # Start every server at once (each imports CuPy, creates a context and warms
    # the model: seconds), then load them one at a time.
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    rows: list[dict[str, Any]] = []
    failed = False
    try:
        for mode in args.modes:
            port = free_port()
            cmd = [
                sys.executable,
                str(HERE / "server.py"),
                "--mode",
                mode,
                "--port",
                str(port),
                *args.server_args,
            ]
            servers[mode] = (subprocess.Popen(cmd), f"http://127.0.0.1:{port}")
        for mode in args.modes:
            server, url = servers[mode]
            wait_ready(server, url, timeout=120)
            print(f"loading {mode} ({clients} clients, {duration:g} s) ...", file=sys.stderr, flush=True)
            load = subprocess.run(
                [
                    sys.executable,
                    str(HERE / "load.py"),
                    "--url",
                    url,
                    "--json",
                    "--clients",
                    str(clients),
                    "--duration",
                    str(duration),
                    "--requests",
                    str(requests),
                ],
                capture_output=True,
                text=True,
                timeout=duration + 120,
                check=False,
            )
            code = stop(server)
            if load.stdout.strip():
                rows.append(json.loads(load.stdout.strip().splitlines()[-1]))
            if load.returncode != 0 or code != 0:
                failed = True
                print(
                    f"{mode}: load exited with {load.returncode}, server with {code}\n{load.stderr}",
                    file=sys.stderr,
                )
    finally:
        for server, _ in servers.values():
            stop(server)

    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(table(rows))
    total = sum(row["requests"] for row in rows)
    if failed or len(rows) != len(args.modes) or any(row["wrong"] or row["errors"] for row in rows):
        print("FAILED: a server or a load run failed, or an answer was wrong", file=sys.stderr)
        sys.exit(1)
    checked = f"results checked: all {total} responses matched the model's NumPy reference"
    print(checked, file=sys.stderr if args.json else sys.stdout)


if __name__ == "__main__":
    main()
