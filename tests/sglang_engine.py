"""A real SGLang engine for the tests, on this CPU: ``sgl.Engine`` in a process of its own, or ``launch_server``.

Test support, not a test module. SGLang's scheduler, workers, KV pool, model and
verification run as they are; what a CPU lacks comes from ``tests/sglang_cpu``
(tree attention for the verify forward, through SGLang's plugin hooks) and the
``sgl_kernel`` stand-in in ``tests/sglang_stubs`` (five small torch ops), both
ours, both switched on by ``freespec_sglang_cpu.engine_env()``. On a GPU none of
that is used: SGLang runs its own kernels.

``EngineProcess(kwargs, env)`` starts ``sgl.Engine(**kwargs)`` in a child
process and talks to it over a ``multiprocessing.connection`` on 127.0.0.1:
``generate(input_ids, params, rids)`` sends a whole batch at once (SGLang
schedules it concurrently) and returns, per request, its output ids and
``meta_info``, or the error SGLang raised. ``close()`` always stops it (the child
runs in its own session; its process group is killed if it does not exit).
``ServerProcess`` is the same for ``python -m sglang.launch_server``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from multiprocessing.connection import Client, Listener
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "sglang_cpu"))
from freespec_sglang_cpu import ENGINE_KWARGS, ENV_FAULT, engine_env  # noqa: E402, F401

# a module that starts engines skips where SGLang or the CPU test support is not installed
MISSING = None if importlib.util.find_spec("sglang") and importlib.util.find_spec("freespec_sglang_cpu") else \
    "needs SGLang and the CPU test support: bash scripts/install_sglang.sh"

START_TIMEOUT = 300.0  # engine start is 17-100 s on two cores, more when they are busy


def model_dir() -> str:
    from freespec import models

    return str(models.local_dir("smollm2-135m"))


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir())


def live_requests(stats_path) -> int | None:
    """The plugin's live requests, as it last wrote them to ``FREESPEC_SGLANG_STATS`` (None before it did)."""
    from freespec.integrations.host_serving import read_stats

    stats = read_stats(str(stats_path))
    return None if stats is None else stats["live_requests"]


def _kill(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


class EngineProcess:
    """``sgl.Engine(**kwargs)`` in a child process; always ``close()`` it."""

    def __init__(self, kwargs: dict, env: dict | None = None, log_path: Path | None = None) -> None:
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        child_env = engine_env(env)
        child_env["FREESPEC_TEST_ENGINE_AUTHKEY"] = authkey.hex()
        self.log_path = log_path
        log = open(log_path, "w") if log_path else subprocess.DEVNULL
        address = "%s:%d" % self._listener.address
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), address, json.dumps(kwargs)],
                                     env=child_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        accepted = {}
        waiter = threading.Thread(target=lambda: accepted.update(conn=self._listener.accept()), daemon=True)
        waiter.start()
        waiter.join(60)
        self._conn = accepted.get("conn")
        try:
            ready = self._receive(START_TIMEOUT, "start")
        except RuntimeError:
            self.close()
            raise
        if ready != "ready":
            self.close()
            raise RuntimeError(f"the SGLang engine failed to start: {ready}; its log: {self.log_tail()}")

    def _receive(self, timeout: float, what: str):
        """The child's next message; ``RuntimeError`` with its log if it dies or says nothing in time."""
        deadline = time.monotonic() + timeout
        while self._conn is not None and time.monotonic() < deadline:
            if self._conn.poll(1.0):
                try:
                    return self._conn.recv()
                except EOFError:
                    break
            if self.proc.poll() is not None:
                break
        raise RuntimeError(f"the SGLang engine process gave no {what} reply (exit code {self.proc.poll()}); "
                           f"its log: {self.log_tail()}")

    def generate(self, input_ids: list, params, rids: list | None = None, timeout: float = 900.0) -> list[dict]:
        """One batch, all at once: ``[{"output_ids": [...], "meta_info": {...}} | {"error": str}]``."""
        self._conn.send({"op": "generate", "input_ids": input_ids, "params": params, "rids": rids})
        return self._receive(timeout, "generate")["outputs"]

    def log_tail(self, chars: int = 6000) -> str:
        if self.log_path is None or not Path(self.log_path).exists():
            return "(no log)"
        return Path(self.log_path).read_text(errors="replace")[-chars:]

    def close(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            try:
                conn.send({"op": "shutdown"})
            except (OSError, ValueError):
                pass
        _kill(self.proc, 60)
        self._listener.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(model: str, port: int, *args: str) -> list[str]:
    """``python -m sglang.launch_server`` on 127.0.0.1 with the CPU settings, plus ``args`` (run through this
    file, which stops the server's process group when the test process goes)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--launch-server", "--model-path", model, "--host",
           "127.0.0.1", "--port", str(port)]
    for key, value in ENGINE_KWARGS.items():
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [flag, str(value)]
    return cmd + list(args)


class ServerProcess:
    """``python -m sglang.launch_server`` on 127.0.0.1; always ``close()`` it."""

    def __init__(self, model: str, args: list, env: dict | None = None, log_path: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(server_command(model, self.port, *args), env=engine_env(env), stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"launch_server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(1.0)
        self.close()
        raise RuntimeError(f"launch_server did not answer in {START_TIMEOUT:.0f} s: {self.log_tail()}")

    def post(self, path: str, body: dict, timeout: float = 300.0) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                return exc.code, json.loads(text)
            except ValueError:
                return exc.code, {"text": text}

    def log_tail(self, chars: int = 6000) -> str:
        if self.log_path is None or not Path(self.log_path).exists():
            return "(no log)"
        return Path(self.log_path).read_text(errors="replace")[-chars:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        _kill(self.proc, 60)


def wait_for(predicate, timeout: float, interval: float = 0.5):
    """``predicate()``'s first truthy value within ``timeout`` seconds, else its last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


# ============================================================ child side
def _exit_with_parent(parent_pid: int) -> None:
    """The engine's process group goes when the test process does, even if it was killed (no finalizer ran)."""
    while os.getppid() == parent_pid:
        time.sleep(2.0)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _serve(address: str, kwargs: dict) -> None:
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["FREESPEC_TEST_ENGINE_AUTHKEY"]))
    try:
        import sglang as sgl

        engine = sgl.Engine(**kwargs)
    except BaseException as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
        raise
    conn.send("ready")
    try:
        while True:
            command = conn.recv()
            if command["op"] == "shutdown":
                break
            try:
                out = engine.generate(input_ids=command["input_ids"], sampling_params=command["params"],
                                      rid=command["rids"])
                out = out if isinstance(out, list) else [out]
                conn.send({"outputs": [{"output_ids": o.get("output_ids", []), "text": o.get("text", ""),
                                        "meta_info": _plain(o.get("meta_info", {}))} for o in out]})
            except Exception as exc:  # the request's error, as a caller of sgl.Engine sees it
                conn.send({"outputs": [{"error": f"{type(exc).__name__}: {exc}"}]})
    finally:
        engine.shutdown()


def _plain(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if isinstance(v, (int, float, str, bool, type(None)))}


def _launch_server(args: list) -> None:
    import runpy

    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    sys.argv = ["sglang.launch_server"] + args
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if sys.argv[1] == "--launch-server":
        _launch_server(sys.argv[2:])
    else:
        _serve(sys.argv[1], json.loads(sys.argv[2]))
