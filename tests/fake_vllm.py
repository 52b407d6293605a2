"""A tiny stand-in for a vLLM server, run as a real process: `engine_cmd=(sys.executable, FAKE_VLLM)`.

Behaviour comes from the environment, so one script covers every lifecycle case:
  FAKE_MODE=ready      after FAKE_DELAY s, print capacity lines (GPU wording) and serve
                       /health, /v1/models, /metrics on --host/--port until SIGTERM
  FAKE_MODE=fail       print the file FAKE_LOG line by line; then exit FAKE_EXIT (default 1), or
                       stay alive forever when FAKE_LINGER=1 (an API server whose engine core died)
  FAKE_MODE=stubborn   ignore SIGTERM, fork a worker that ignores it too; both sleep
  FAKE_MODE=orphan     fork a worker that sleeps (in the same process group), then the parent exits
  FAKE_MODE=silent     print nothing and sleep (for timeouts)
The worker pids are written to FAKE_PIDS (one per line) when set.
"""

import http.server
import os
import signal
import sys
import time

CAPACITY_LINES = """\
(Worker pid=1) INFO 12-02 10:00:00 [gpu_model_runner.py:2150] Model loading took 14.9889 GiB memory and 5.2 seconds
(Worker pid=1) INFO 12-02 10:00:05 [gpu_worker.py:298] Available KV cache memory: 52.31 GiB
(EngineCore pid=1) INFO 12-02 10:00:05 [kv_cache_utils.py:1087] GPU KV cache size: 428,512 tokens
(EngineCore pid=1) INFO 12-02 10:00:05 [kv_cache_utils.py:1091] Maximum concurrency for 8,192 tokens per request: 52.31x
"""

METRICS = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
           '# TYPE vllm:cache_config_info gauge\n'
           'vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.9",'
           'num_gpu_blocks="26782",num_cpu_blocks="None"} 1.0\n')


def arg(name: str, default: str) -> str:
    argv = sys.argv[1:]
    return argv[argv.index(name) + 1] if name in argv else default


def say(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def record_pid(pid: int) -> None:
    if os.environ.get("FAKE_PIDS"):
        with open(os.environ["FAKE_PIDS"], "a") as f:
            f.write(f"{pid}\n")


def fork_sleeper(ignore_term: bool) -> int:
    pid = os.fork()
    if pid == 0:
        if ignore_term:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    record_pid(pid)
    return pid


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        bodies = {"/health": "", "/v1/models": '{"object":"list","data":[{"id":"fake"}]}', "/metrics": METRICS}
        if self.path not in bodies:
            self.send_error(404)
            return
        body = bodies[self.path].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def main() -> None:
    mode = os.environ.get("FAKE_MODE", "ready")
    say(f"fake vllm {mode} argv={sys.argv[1:]}\n")
    if mode == "ready":
        time.sleep(float(os.environ.get("FAKE_DELAY", "0")))
        say(CAPACITY_LINES)
        server = http.server.HTTPServer((arg("--host", "127.0.0.1"), int(arg("--port", "0"))), Handler)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        server.serve_forever()
    elif mode == "fail":
        with open(os.environ["FAKE_LOG"]) as f:
            for line in f:
                say(line)
        if os.environ.get("FAKE_LINGER") == "1":
            while True:
                time.sleep(1)
        sys.exit(int(os.environ.get("FAKE_EXIT", "1")))
    elif mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        fork_sleeper(ignore_term=True)
        say("workers started\n")
        while True:
            time.sleep(1)
    elif mode == "orphan":
        fork_sleeper(ignore_term=True)
        say("parent leaving its worker behind\n")
        sys.exit(0)
    elif mode == "silent":
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main()
