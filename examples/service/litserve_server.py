"""The same model served by LitServe, the server users pick today for dynamic batching.

``POST /predict`` with ``{"i": k}`` answers ``{"top": [...]}`` as server.py
does; LitServe batches up to ``--max-batch`` requests, waiting at most
``--batch-timeout`` seconds, in a worker process of its own (its HTTP side
runs in another). Run it (needs ``pip install litserve``)::

    python examples/service/litserve_server.py --model resnet50 --port 8081
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # models: next to this file

from models import MODELS, Served, missing

try:
    import litserve as ls
except ImportError as exc:  # one line that says what to install, not a traceback
    # LitServe is the peer compare.py measures cudafut against: no cudafut extra installs it.
    sys.exit(missing("litserve_server.py", "LitServe", exc, "pip install litserve"))


class VisionAPI(ls.LitAPI):  # type: ignore[misc]
    def __init__(self, model: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = model

    def setup(self, device: str) -> None:
        if device.startswith("cuda:"):  # one worker per GPU (--devices)
            import torch

            torch.cuda.set_device(device)
        self.served = Served(self.model)
        self.served.answer([0])

    # No annotation: LitServe reads the request's type from it (a dict
    # annotation would make FastAPI look for a query parameter).
    def decode_request(self, request):  # type: ignore[no-untyped-def]
        return int(request["i"])

    def batch(self, inputs: list[int]) -> list[int]:
        return list(inputs)

    def predict(self, x: Any) -> Any:
        indices = x if isinstance(x, list) else [x]
        out = self.served.answer(indices)
        self.served.torch.cuda.current_stream().synchronize()
        return out

    def unbatch(self, output: Any) -> list[Any]:
        return list(output)

    def encode_response(self, output: Any) -> dict[str, Any]:
        rows = output.tolist()
        return {"top": rows if isinstance(rows[0], float) else rows[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="resnet50")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--batch-timeout", type=float, default=0.002)
    parser.add_argument("--devices", type=int, default=1, help="GPUs, one worker process each")
    parser.add_argument("--api-servers", type=int, default=1, help="HTTP processes (num_api_servers)")
    args = parser.parse_args(argv)
    api = VisionAPI(args.model, max_batch_size=args.max_batch, batch_timeout=args.batch_timeout)
    server = ls.LitServer(api, accelerator="cuda", devices=args.devices, workers_per_device=1)
    print(f"READY {args.port}", flush=True)
    server.run(
        host="127.0.0.1",
        port=args.port,
        generate_client_file=False,
        log_level="warning",
        num_api_servers=args.api_servers,
    )


if __name__ == "__main__":
    main()
