"""A CPU stand-in for an SGLang server, for the tests of examples/sglang/gpu_check.{py,sh}.

It answers the endpoints ``gpu_check.py`` uses (``/health_generate``,
``/generate`` plain and streamed, ``/abort_request``, ``/flush_cache``) in
the shapes SGLang 0.5.21 gives them, and runs a child process titled
``sglang::scheduler`` (what the memory check samples). "Decoding" is
deterministic: the output repeats the prompt's token ids from a fixed stride.
With ``--freespec-drafter``/``--freespec-config`` it builds freespec's real
``DraftServer`` from the flags and drafts every step through ``batch_get``,
accepting the first path's tokens as far as they are the true output, so
accept lengths and the corpus's log lines are real. Not a model: nothing here
says how fast or how well SGLang serves.

``python -m sglang.launch_server ARGS`` runs it when a test puts a shim
package first on ``PYTHONPATH`` (test_sglang_gpu_check.py does).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = 5000


def token_ids(text: str) -> list[int]:
    return [sum(map(ord, word)) * 31 % VOCAB + 1 for word in text.split()]


def continuation(prompt: list[int], num_tokens: int) -> list[int]:
    """The "model's" greedy output: the prompt read from a stride, so it repeats and can be drafted."""
    return [prompt[(7 * i + 3) % len(prompt)] for i in range(num_tokens)]


class Engine:
    """One decode loop at a time (SGLang's scheduler thread), optionally drafting with freespec."""

    def __init__(self, draft_server=None, speculative: bool = False, num_draft_tokens: int = 16):
        self.lock = threading.Lock()
        self.draft_server, self.speculative, self.d = draft_server, speculative, num_draft_tokens
        self.aborted: set[str] = set()
        self.next_rid = 0

    def generate(self, body: dict, on_chunk=None) -> dict:
        params = body.get("sampling_params") or {}
        rid = body.get("rid") or f"fake-{self.next_rid}"
        self.next_rid += 1
        prompt = token_ids(body["text"]) or [1]
        output = continuation(prompt, int(params.get("max_new_tokens", 16)))
        done, verify_ct, finish = 0, 0, {"type": "length", "length": len(output)}
        while done < len(output):
            if rid in self.aborted:
                finish = {"type": "abort", "message": "Abort in waiting queue"}
                break
            done += self._step(rid, prompt, output, done)
            verify_ct += 1
            if on_chunk is not None and not on_chunk(self._response(output[:done], verify_ct, finish, body)):
                break
            if body.get("rid"):
                time.sleep(0.01)  # a named request runs slowly enough to be aborted
        with self.lock:
            if self.draft_server is not None:
                self.draft_server.erase_match_state([rid])
        return self._response(output[:done], verify_ct, finish, body)

    def _step(self, rid: str, prompt: list[int], output: list[int], done: int) -> int:
        """Tokens committed by one decode step: 1 plus the drafted tokens that are the true output."""
        if not self.speculative or done == 0:
            return 1
        if self.draft_server is None:
            return min(2, len(output) - done)  # SGLang's own NGRAM: say it accepts one draft each step
        with self.lock:
            context = prompt + output[:done]
            self.draft_server.offer_contexts([(rid, prompt, output[:done])])
            tokens, mask = self.draft_server.batch_get([rid], [context[-18:]], [len(context)])
        mask = mask.reshape(self.d, self.d)
        node, accepted = 0, 0  # greedy verification: descend while a child holds the true next token
        while done + accepted + 1 < len(output):
            children = [i for i in range(node + 1, self.d) if mask[i, node] and mask[i].sum() == mask[node].sum() + 1]
            match = [i for i in children if tokens[i] == output[done + accepted]]
            if not match:
                break
            node, accepted = match[0], accepted + 1
        return 1 + accepted

    def _response(self, output: list[int], verify_ct: int, finish: dict, body: dict) -> dict:
        meta = {"completion_tokens": len(output), "finish_reason": finish}
        if self.speculative:
            meta["spec_verify_ct"] = verify_ct
        if body.get("return_logprob"):
            meta["output_top_logprobs"] = [[[-0.1, token, None], [-2.5, token + 1, None]] for token in output]
        return {"text": " ".join(map(str, output)), "output_ids": output, "meta_info": meta}


class HTTPServer(ThreadingHTTPServer):
    request_queue_size = 128  # 32 clients connect at once
    daemon_threads = True


def make_handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep the log for the scheduler's lines
            pass

        def _send(self, status: int, payload: bytes, content_type: str = "application/json"):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self._send(200, b"") if self.path == "/health_generate" else self._send(404, b"")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/generate" and body.get("stream"):
                return self._stream(body)
            if self.path == "/generate":
                return self._send(200, json.dumps(engine.generate(body)).encode())
            if self.path == "/abort_request":
                engine.aborted.add(body.get("rid", ""))
                return self._send(200, b"")
            if self.path == "/flush_cache":
                with engine.lock:
                    if engine.draft_server is not None:
                        engine.draft_server.reset()
                return self._send(200, b"Cache flushed.\n", "text/plain")
            self._send(404, b"")

        def _stream(self, body: dict):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()

            def chunk(out: dict) -> bool:
                try:
                    self.wfile.write(b"data: " + json.dumps(out).encode() + b"\n\n")
                    self.wfile.flush()
                    time.sleep(0.005)
                    return True
                except (BrokenPipeError, ConnectionResetError):  # the client hung up: an abort
                    return False

            engine.generate(body, on_chunk=chunk)
            chunk("[DONE]")
            self.close_connection = True

    return Handler


def build_engine(argv: list[str]) -> tuple[Engine, int]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--speculative-algorithm", default=None)
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=16)
    parser.add_argument("--freespec-drafter", default=None)
    parser.add_argument("--freespec-config", default=None)
    args, _ = parser.parse_known_args(argv)
    draft_server = None
    if args.freespec_drafter or args.freespec_config:
        from freespec.integrations.sglang import DraftServer, options

        resolved = options.resolve(args.freespec_drafter, args.freespec_config)
        draft_server = DraftServer(draft_token_num=args.speculative_num_draft_tokens, drafter=resolved.drafter,
                                   drafter_options=resolved.drafter_options)
    return Engine(draft_server, args.speculative_algorithm == "NGRAM", args.speculative_num_draft_tokens), args.port


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="[fake sglang] %(message)s", stream=sys.stderr)
    if os.environ.get("FAKE_SGLANG_FAIL") and os.environ["FAKE_SGLANG_FAIL"] in " ".join(sys.argv):
        sys.exit("fake sglang: asked to fail at start")
    engine, port = build_engine(sys.argv[1:] if argv is None else argv)
    scheduler = subprocess.Popen(["bash", "-c", 'exec -a "sglang::scheduler" sleep 100000'])
    server = HTTPServer(("127.0.0.1", port), make_handler(engine))
    signal.signal(signal.SIGTERM, lambda *_: (scheduler.kill(), os._exit(0)))
    server.serve_forever()


if __name__ == "__main__":
    main()
