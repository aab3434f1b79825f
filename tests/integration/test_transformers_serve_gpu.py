"""``transformers serve`` on gpumemd (``python -m gpumem.integrations.transformers_serve``):
two servers on one GPU, one completion each, the tokens plain transformers generates;
and the refusals before a model loads, on the host backend. Skipped where transformers
serve's packages are missing (pip install 'transformers[serving]'). Models: random
weights, built offline by tests/integration/serve_kit.py (a word tokenizer: the
completion's text names its token ids)."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from conftest import child_env
from gpumemd_testkit import status

KIT = Path(__file__).resolve().parent / "serve_kit.py"
SERVE = [sys.executable, "-m", "gpumem.integrations.transformers_serve"]
MISSING = [m for m in ("transformers", "typer", "fastapi", "uvicorn", "openai", "pydantic") if importlib.util.find_spec(m) is None]
needs_serve = pytest.mark.skipif(bool(MISSING), reason=f"needs transformers serve's packages (pip install 'transformers[serving]'): {MISSING}")

PROMPT = "t5 t17 t300 t42 t99 t512 t7 t1000"
TOKENS = 8
CB = ["--cb-num-blocks", "64", "--cb-max-batch-tokens", "256"]  # the same for the plain manager
ARCHS = ("qwen3", "mistral")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until_serving(proc: subprocess.Popen[bytes], log: Path, timeout: float = 240.0) -> None:
    """Until uvicorn says it listens (the model loaded, gpumem's checks passed), in its log
    file: a pipe read by lines_until keeps lines read ahead in its buffer (uvicorn's start
    lines come together), where the selector never sees them."""
    deadline = time.monotonic() + timeout
    while "Uvicorn running on" not in (text := log.read_text(errors="replace")):
        assert proc.poll() is None and time.monotonic() < deadline, f"the server did not serve (exit {proc.poll()}):\n{text[-6000:]}"
        time.sleep(0.2)


def _stop(servers: dict[str, tuple[subprocess.Popen[bytes], Path]]) -> dict[str, str]:
    """Stop the servers (SIGTERM: uvicorn shuts down; kill after 30 s: serve's shutdown stops
    no manager, whose generation thread keeps a process alive) and return what each printed."""
    for proc, _ in servers.values():
        proc.terminate()
    deadline = time.monotonic() + 30
    for proc, _ in servers.values():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {arch: log.read_text(errors="replace") for arch, (_, log) in servers.items()}


def _complete(port: int, prompt: str, tokens: int) -> dict[str, Any]:
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=280) as reply:
        result: dict[str, Any] = json.loads(reply.read())
    return result


@pytest.mark.gpu
@needs_serve
def test_two_transformers_servers_share_one_gpu_on_gpumemd(daemon_factory, runtime_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two servers (a Qwen3 and a sliding-window Mistral) on one gpumemd, one KV round
    (``--gpumem-expect 2``): each answers its completion with the tokens transformers'
    manager generates for it without gpumemd, and the daemon's books hold both engines:
    their sessions, their model arenas and their committed KV pools."""
    env = child_env(runtime_dir)
    plain: dict[str, list[int]] = {}
    for arch in ARCHS:
        subprocess.run([sys.executable, str(KIT), "build", str(tmp_path / arch), "--arch", arch], check=True, timeout=200, env=env)
        out = tmp_path / f"plain-{arch}.json"
        done = subprocess.run([sys.executable, str(KIT), "plain", str(tmp_path / arch), "--prompt", PROMPT, "--tokens", str(TOKENS),
                               "--num-blocks", "64", "--max-batch-tokens", "256", "--out", str(out)],
                              capture_output=True, text=True, timeout=280, env=env)
        assert done.returncode == 0, f"plain {arch}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        plain[arch] = json.loads(out.read_text())
    daemon = daemon_factory("cuda")
    ports = {arch: _free_port() for arch in ARCHS}
    servers: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    for arch in ARCHS:
        log = tmp_path / f"serve-{arch}.log"
        argv = [*SERVE, "--gpumem-name", f"serve-{arch}", "--gpumem-expect", "2", str(tmp_path / arch),
                "--continuous-batching", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(ports[arch]), *CB]
        with log.open("wb") as out:  # a file, not a pipe: nothing reads a pipe once the server serves, and it may fill
            servers[arch] = (subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env), log)
    error: BaseException | None = None
    try:
        for proc, log in servers.values():
            _until_serving(proc, log)
        # Each engine is made at its server's first request and the round waits for both: send them together.
        with concurrent.futures.ThreadPoolExecutor(len(ARCHS)) as pool:
            replies = dict(zip(ARCHS, pool.map(lambda a: _complete(ports[a], PROMPT, TOKENS), ARCHS)))
        books = status(runtime_dir)
    except Exception as e:  # the servers' own words go with it, once they stopped
        error = e
    finally:
        logs = _stop(servers)
    assert error is None, f"{error!r}\n" + "\n".join(f"--- serve-{a}:\n{log[-5000:]}" for a, log in logs.items()) + daemon.log()[-3000:]
    for arch in ARCHS:
        choice, usage = replies[arch]["choices"][0], replies[arch]["usage"]
        # The text skips special tokens (<unk> 0, <eos> 1); every other token i reads "t<i>".
        assert choice["text"].split() == [f"t{i}" for i in plain[arch] if i > 1], (arch, choice["text"], plain[arch])
        assert usage["completion_tokens"] == len(plain[arch]), (arch, usage, plain[arch])
    names = {c["name"] for c in books["clients"]}
    assert {"serve-qwen3", "serve-mistral"} <= names, (names, daemon.log()[-3000:])
    for arch in ARCHS:
        owner = f"serve-{arch}"
        assert any(a["owner"] == owner and a["committed"] > 0 for a in books["arenas"]), (owner, books["arenas"])
        assert any(k["owner"] == owner and k["tokens"] > 0 for k in books["kv"]), (owner, books["kv"])


@needs_serve
@pytest.mark.parametrize("with_daemon", [False, True], ids=["no-daemon", "host-daemon"])
def test_transformers_serve_refuses_before_a_model_loads(with_daemon: bool, daemon_factory, runtime_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """Without a daemon, and on a host-backend daemon (no CUDA), the server refuses in one
    line (exit status 2) before it loads its model: the model named does not exist."""
    if with_daemon:
        daemon_factory("host")
    done = subprocess.run([*SERVE, "/no/such/model", "--continuous-batching"], capture_output=True, text=True, timeout=120,
                          env=child_env(runtime_dir))
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-4000:])
    expected = "runs the host backend" if with_daemon else "no gpumemd serves device 0"
    assert expected in done.stderr and "Traceback" not in done.stderr, done.stderr[-4000:]
    assert "/no/such/model" not in done.stdout + done.stderr  # nothing tried to load it
