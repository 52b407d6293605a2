"""`llama-server` from PyPI: llama.cpp's own HTTP server, as the xllamacpp wheel embeds it, behind llama-server's flags.

The wheel ships llama.cpp's server (its C++ `server_context` and HTTP routes) as a Python
extension, not the `llama-server` program; this module is that program's command line over it:
    python -m tuner.engines.llamacpp_server -m MODEL.gguf -c 4096 -np 4 --host H --port P
Only the flags the tuner writes are taken; anything else is refused with llama-server's wording.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llama-server (xllamacpp)", allow_abbrev=False)
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-c", "--ctx-size", type=int, default=0)
    p.add_argument("-np", "--parallel", type=int, default=1)
    p.add_argument("-kvu", "--kv-unified", action="store_true")
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=int, default=-1)
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("-t", "--threads", type=int, default=-1)
    p.add_argument("--threads-http", type=int, default=-1)
    p.add_argument("-ctk", "--cache-type-k", default="f16")
    p.add_argument("-ctv", "--cache-type-v", default="f16")
    p.add_argument("-a", "--alias", default="")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--metrics", action="store_true")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--api-key", default="")
    return p


def _cache_type(name: str):
    import xllamacpp as xlc

    try:
        return getattr(xlc.ggml_type, f"GGML_TYPE_{name.upper()}")
    except AttributeError:
        raise SystemExit(f"error: unsupported cache type: {name}") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = args.model
    params.n_ctx = args.ctx_size
    params.n_parallel = args.parallel
    params.kv_unified = args.kv_unified
    params.n_gpu_layers = args.n_gpu_layers
    params.n_batch = args.batch_size
    params.n_ubatch = args.ubatch_size
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    if args.threads_http > 0:
        params.n_threads_http = args.threads_http
    params.cache_type_k = _cache_type(args.cache_type_k)
    params.cache_type_v = _cache_type(args.cache_type_v)
    params.hostnames = [args.host]
    params.port = args.port
    params.endpoint_metrics = args.metrics
    params.warmup = not args.no_warmup
    # llama-server fits -c and -ngl to free memory unless told not to; the tuner measures the
    # value it asked for, so a context that does not fit must fail, not shrink
    params.fit_params = False
    if args.alias:
        params.model_alias = args.alias
    if args.api_key:
        params.api_keys = [args.api_key]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    print(f"llama-server (xllamacpp {getattr(xlc, '__version__', '?')}): loading {args.model}",
          file=sys.stderr, flush=True)
    try:
        server = xlc.Server(params)
    except Exception as e:  # noqa: BLE001 - the message is the log line the tuner classifies
        print(f"error: failed to start the server: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"server is listening on {server.listening_address}", file=sys.stderr, flush=True)
    stop.wait()
    print("llama-server: shutting down", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
