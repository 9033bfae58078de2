"""vLLM alone, driven by a plain load generator: the ceiling for the orchestrator's sampling.

    python -m benchmarks.loadgen MODEL [--rounds N] [--max-num-seqs K] [--vllm-arg=--flag ...]

Starts the inference server exactly as `prime-rl` does (`prime_rl.vllm_command`),
then sends rounds of the quickstart's sampling: every round, 32 reverse-text prompts as
token ids, `n` = 8 completions each, 16 new tokens at temperature 1 with logprobs, all at
once (as one orchestrator step asks). Prints one JSON line: seconds per round (median of
the rounds after the first), generated tokens/s, start-up seconds to a healthy server,
and the CPU seconds per round of each vLLM process. No environment, no rewards, no
trainer: what the engine gives when nothing else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from benchmarks.profile import role


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(model: Path, count: int) -> list[list[int]]:
    """The first ``count`` reverse-text prompts, rendered with the model's template (as the orchestrator does)."""
    from transformers import AutoTokenizer

    from orchestrator.envs import load_env
    from prime_rl.chat import render_ids
    from prime_rl.config import EnvConfig

    tokenizer = AutoTokenizer.from_pretrained(model)
    env = load_env(EnvConfig(id="reverse-text"))
    return [render_ids(tokenizer, ex.prompt, add_generation_prompt=True) for ex in list(env.dataset)[:count]]


def cpu_seconds(root: psutil.Process) -> dict[str, float]:
    """CPU seconds so far of the server and each of its children, by role (``benchmarks.profile.role``)."""
    out: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            name = role(proc) or proc.name()
            out[name] = out.get(name, 0.0) + times.user + times.system
        except psutil.Error:
            pass
    return out


async def one_round(client: httpx.AsyncClient, url: str, model: str, batch: list[list[int]], n: int, max_tokens: int) -> int:
    async def request(ids: list[int]) -> int:
        body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                "logprobs": 0, "return_token_ids": True, "n": n}
        response = await client.post(url, json=body)
        response.raise_for_status()
        return sum(len(c["token_ids"]) for c in response.json()["choices"])

    return sum(await asyncio.gather(*(request(ids) for ids in batch)))


async def drive(port: int, model: str, batch: list[list[int]], rounds: int, n: int, max_tokens: int, server: psutil.Process) -> dict:
    url = f"http://127.0.0.1:{port}/v1/completions"
    times, tokens, cpu = [], [], []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        for _ in range(rounds):
            before, t0 = cpu_seconds(server), time.perf_counter()
            tokens.append(await one_round(client, url, model, batch, n, max_tokens))
            times.append(time.perf_counter() - t0)
            after = cpu_seconds(server)
            cpu.append({k: after[k] - before.get(k, 0.0) for k in after})
    steady = times[1:] or times
    return {
        "s_per_round": statistics.median(steady),
        "first_round_s": times[0],
        "rounds_s": [round(t, 3) for t in times],
        "tokens_per_s": statistics.median(t / s for t, s in zip(tokens[1:] or tokens, steady)),
        "cpu_s_per_round": {k: round(statistics.median(c.get(k, 0.0) for c in cpu[1:] or cpu), 3) for k in cpu[0]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loadgen")
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: inference.max_num_seqs's, as prime-rl runs")
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM flag (repeatable)")
    parser.add_argument("--log", type=Path, default=Path("/dev/null"), help="where the server's output goes")
    parser.add_argument("--env", action="append", default=[], help="extra KEY=VALUE for the server (repeatable)")
    args = parser.parse_args(argv)

    from prime_rl.config import InferenceConfig
    from prime_rl.launch.launcher import die_with_parent, private_tmp_dir, remove_tmp_dir
    from prime_rl.vllm_command import TMP_DIR_ENV, server_env, vllm_command, vllm_env

    port = free_port()
    sizes = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    cfg = InferenceConfig(model=str(args.model), port=port, seq_len=args.seq_len, extra_args=args.vllm_arg, **sizes)
    # as the launcher starts it: its IPC sockets in a directory of its own, removed afterwards
    tmp_dir = private_tmp_dir("loadgen-inference")
    env = (vllm_env(cfg, cpu=True, inherited=os.environ) | server_env() | {TMP_DIR_ENV: tmp_dir}
           | dict(kv.split("=", 1) for kv in args.env))
    batch = prompts(args.model, args.groups)
    t0 = time.time()
    log = args.log.open("w")
    proc = subprocess.Popen(vllm_command(cfg, cpu=True), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=die_with_parent)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited with {proc.returncode} before it was healthy")
            time.sleep(0.25)
        startup = time.time() - t0
        result = asyncio.run(drive(port, str(args.model), batch, args.rounds, args.n, args.max_tokens, psutil.Process(proc.pid)))
    finally:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        remove_tmp_dir("loadgen-inference", tmp_dir)
    print(json.dumps({"startup_s": round(startup, 2), **result, "max_num_seqs": cfg.max_num_seqs,
                      "vllm_args": args.vllm_arg, "env": args.env}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
