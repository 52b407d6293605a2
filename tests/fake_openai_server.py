"""A fake OpenAI-compatible server run as a real process in place of vLLM (`engine = [python, this]`).

It takes vLLM's flags (`--model`, `--host`, `--port`, anything else is ignored), answers /health,
/v1/models, /tokenize, /detokenize and /metrics like vLLM, and serves /v1/completions as a
streaming endpoint. FAKE_MODE (environment) picks how completions misbehave:

  ok          well-formed SSE: one token per chunk, a usage chunk, [DONE]
  http500     every completion answers HTTP 500 with vLLM's error JSON
  drop        the connection is closed after the headers and one chunk
  garbage     the stream carries a `data:` line that is not JSON
  truncated   the stream stops (cleanly) without usage or [DONE]
  hang_health /health accepts the connection and never answers (the server never becomes ready)
  port_taken  the port is bound by someone else first: the bind fails with the real OSError
  port_taken_once   like port_taken on the first launch (FAKE_STATE file marks it), then ok

FAKE_START_DELAY and FAKE_STREAM_DELAY (seconds) widen the launch and load windows.
FAKE_DIE_AFTER=N: the completion after the first N prints vLLM's CUDA OOM traceback and the server
exits 1 (a config that fits at launch and dies under load). FAKE_MAX_MODEL_LEN: a completion whose
prompt + max_tokens exceed it is refused with vLLM's HTTP 400. FAKE_KV_TOKENS: the startup log
states this KV cache size, as vLLM's does.
FAKE_HOLD_DIR holds the server at a phase for as long as a test wants it there, so a fault meant
for that phase cannot miss it on a slow machine: while the file `hold-launch` exists in that folder
the server holds before it binds its port (the tuner is waiting for it to start), while `hold-load`
exists every completion holds before its first byte (the tuner is load-testing). A held server
writes `at-PHASE.PID` there and goes on once the hold file is gone or `go.PID` appears, or after
FAKE_HOLD_MAX_S (600) seconds, so a test that failed midway leaves no server held for ever.
Startup prints vLLM's launch-phase lines (tiny figures) and uvicorn's lines so logs look like vLLM's.
"""

import argparse
import asyncio
import json
import os
import socket
import sys
import time

from aiohttp import web

MODE = os.environ.get("FAKE_MODE", "ok")
START_DELAY_S = float(os.environ.get("FAKE_START_DELAY", "0"))   # before the server answers
TOKEN_DELAY_S = float(os.environ.get("FAKE_STREAM_DELAY", "0.001"))  # between streamed tokens


HOLD_DIR = os.environ.get("FAKE_HOLD_DIR")
HOLD_UNTIL = time.monotonic() + float(os.environ.get("FAKE_HOLD_MAX_S", "600"))


# vLLM's launch-phase lines (wording of 0.32 CPU and 0.24 GPU logs), with this fake's tiny figures:
# weights 0.01 s, compile 0.02 s, graphs 0 s, profile 0.05 - 0.02 - 0 = 0.03 s
PHASE_LINES = (
    "(Worker pid=1) INFO 12-03 14:00:00 [base_loader.py:82] Initializing model took 0.010000 seconds",
    "(EngineCore pid=1) INFO 12-03 14:00:00 [monitor.py:53] torch.compile took 0.02 s in total",
    "(EngineCore pid=1) INFO 12-03 14:00:00 [model_runner.py:726] Graph capturing finished in 0 secs, "
    "took 0.00 GiB",
    "(EngineCore pid=1) INFO 12-03 14:00:00 [core.py:337] init engine (profile, create kv cache, warmup "
    "model) took 0.05 s (compilation: 0.02 s)",
)


def say(text: str) -> None:
    print(text, flush=True)


def held(phase: str) -> bool:
    """Whether to hold at `phase` now; announces the hold once (at-PHASE.PID)."""
    if not HOLD_DIR or time.monotonic() > HOLD_UNTIL or \
            not os.path.exists(os.path.join(HOLD_DIR, f"hold-{phase}")) or \
            os.path.exists(os.path.join(HOLD_DIR, f"go.{os.getpid()}")):
        return False
    marker = os.path.join(HOLD_DIR, f"at-{phase}.{os.getpid()}")
    if not os.path.exists(marker):
        say(f"INFO:     fake server held at {phase}")
        open(marker, "w").close()
    return True


def hold(phase: str) -> None:
    while held(phase):
        time.sleep(0.05)


async def hold_async(phase: str) -> None:
    while held(phase):
        await asyncio.sleep(0.05)


async def health(request):
    if MODE == "hang_health":
        await asyncio.sleep(3600)
    return web.Response(text="")


async def models(request):
    return web.json_response({"object": "list", "data": [{"id": request.app["model"], "object": "model"}]})


async def tokenize(request):
    body = await request.json()
    words = body.get("prompt", "").split()
    ids = [int(w[1:]) if w[1:].isdigit() else 7 for w in words]
    if body.get("add_special_tokens", True):
        ids = [1] + ids
    return web.json_response({"count": len(ids), "tokens": ids, "max_model_len": 4096})


async def detokenize(request):
    body = await request.json()
    return web.json_response({"prompt": " ".join(f"w{i}" for i in body.get("tokens", []) if i < 4096)})


async def metrics(request):
    return web.Response(text='vllm:num_requests_running{engine="0"} 0.0\n')


@web.middleware
async def api_key(request, handler):
    """Like vLLM started with VLLM_API_KEY: /v1/* needs `Authorization: Bearer KEY`."""
    key = os.environ.get("VLLM_API_KEY")
    if key and request.path.startswith("/v1") and \
            request.headers.get("Authorization") != f"Bearer {key}":
        return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


def chunk(payload) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


# what vLLM's engine core prints when a forward pass runs out of memory
OOM_TRACEBACK = """\
(EngineCore_DP0 pid=4242) ERROR 12-03 14:00:00 [core.py:710] EngineCore encountered a fatal error.
(EngineCore_DP0 pid=4242) ERROR 12-03 14:00:00 [core.py:710] Traceback (most recent call last):
(EngineCore_DP0 pid=4242) ERROR 12-03 14:00:00 [core.py:710] torch.OutOfMemoryError: CUDA out of memory. \
Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 15.77 GiB of which 312.00 MiB is free."""
SERVED = [0]


async def completions(request):
    body = await request.json()
    await hold_async("load")
    die_after = os.environ.get("FAKE_DIE_AFTER")
    if die_after is not None and SERVED[0] >= int(die_after):
        say(OOM_TRACEBACK)
        os._exit(1)
    SERVED[0] += 1
    limit = os.environ.get("FAKE_MAX_MODEL_LEN")
    words = len(str(body.get("prompt", "")).split()) + 1
    if limit is not None and words + int(body.get("max_tokens", 8)) > int(limit):
        return web.json_response({"object": "error", "type": "BadRequestError", "code": 400, "message":
                                  f"This model's maximum context length is {limit} tokens. However, "
                                  f"you requested {words + int(body.get('max_tokens', 8))} tokens "
                                  f"({words} in the messages, {body.get('max_tokens')} in the "
                                  "completion). Please reduce the length of the messages or completion."},
                                 status=400)
    say('INFO:     127.0.0.1 - "POST /v1/completions HTTP/1.1" ' + ("500" if MODE == "http500" else "200"))
    if MODE == "http500":
        return web.json_response({"object": "error", "message": "EngineCore encountered an issue",
                                  "type": "InternalServerError", "code": 500}, status=500)
    n = int(body.get("max_tokens", 8))
    prompt_tokens = len(str(body.get("prompt", "")).split()) + 1
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(chunk({"choices": [{"index": 0, "text": " w1"}]}))
    if MODE == "drop":
        await asyncio.sleep(0.01)
        request.transport.close()   # mid-stream: no chunked terminator, no [DONE]
        return resp
    if MODE == "garbage":
        await resp.write(b"data: {this is not json\n\n")
    for _ in range(n - 1):
        await asyncio.sleep(TOKEN_DELAY_S)
        await resp.write(chunk({"choices": [{"index": 0, "text": " w2"}]}))
    if MODE == "truncated":
        await resp.write_eof()
        return resp
    await resp.write(chunk({"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                     "completion_tokens": n}}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="fake")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args, _ = parser.parse_known_args()
    say(f"INFO:     fake OpenAI server mode={MODE} argv={sys.argv[1:]}")
    squatter = None
    mode = MODE
    if mode == "port_taken_once":
        state = os.environ["FAKE_STATE"]
        mode = "ok" if os.path.exists(state) else "port_taken"
        open(state, "a").close()
    if mode == "port_taken":
        squatter = socket.socket()
        squatter.bind((args.host, args.port))
        squatter.listen()
    app = web.Application(middlewares=[api_key])
    app["model"] = args.model
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    hold("launch")
    time.sleep(START_DELAY_S)
    if os.environ.get("FAKE_KV_TOKENS"):
        say(f"(EngineCore pid=1) INFO 12-03 14:00:00 [kv_cache_utils.py:1087] GPU KV cache size: "
            f"{int(os.environ['FAKE_KV_TOKENS']):,} tokens")
    for line in PHASE_LINES:
        say(line)
    say("INFO:     Started server process")
    say("INFO:     Waiting for application startup.")
    say("INFO:     Application startup complete.")
    # a short shutdown: on SIGTERM a completion still held is cancelled after 1 s, not after
    # aiohttp's default 60 s (longer than the tuner's grace before SIGKILL)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=1.0)


if __name__ == "__main__":
    main()
