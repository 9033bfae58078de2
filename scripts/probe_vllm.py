"""Dev tool: probe a real vLLM OpenAI server on a tiny local model (findings: docs/vllm_probe.md).

Checks:
  1. JSON shape of /v1/chat/completions with logprobs + n + return_token_ids (raw HTTP and the
     `openai` client), EOS handling, finish_reason.
  2. prompt_token_ids == tokenizer.apply_chat_template(..., add_generation_prompt=True).
  3. vLLM's sampled-token logprobs vs transformers float32 log_softmax(logits / T), T=1.0, 0.7.
  4. Hot weight reload (/pause, /collective_rpc reload_weights, /reset_prefix_cache, /resume),
     with a full HF folder, model.safetensors + config.json, and model.safetensors alone.

    .venv/bin/python scripts/probe_vllm.py [--model DIR] [--base-url http://127.0.0.1:8011]

Without --base-url it starts its own server (own process group, killed at the end) and reports
startup time and RSS. Without --model it builds the tiny model (scripts/build_tiny_model.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MESSAGES = [{"role": "user", "content": "abc"}]


def start_server(model: Path, port: int, log_path: Path, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "512", "--logprobs-mode", "processed_logprobs", *extra]  # fmt: skip
    log = open(log_path, "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def group_rss_mib(pgid: int) -> dict[str, float]:
    """RSS (MiB) of every process in process group `pgid`, by command name."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) != pgid:  # field 5 = pgrp
                continue
            comm = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()[-40:]
            rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20  # field 24 = rss pages
            out[f"{pid}:{comm}"] = round(rss, 1)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return out


def wait_healthy(base: str, timeout: float, proc: subprocess.Popen | None = None) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server not healthy")


def chat(client: httpx.Client, model: str, temperature: float, n: int = 4, max_tokens: int = 16) -> dict:
    body = {"model": model, "messages": MESSAGES, "logprobs": True, "n": n, "return_token_ids": True,
            "max_tokens": max_tokens, "temperature": temperature}  # fmt: skip
    r = client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()


def hf_logprob_diff(hf_model, resp: dict, temperature: float) -> float:
    """Max |vLLM logprob - log_softmax(HF logits / T)| over all sampled tokens of all choices."""
    import torch

    prompt = resp["prompt_token_ids"]
    worst = 0.0
    for ch in resp["choices"]:
        ids = ch["token_ids"]
        lps = [c["logprob"] for c in ch["logprobs"]["content"]]
        assert len(ids) == len(lps), (len(ids), len(lps))
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + ids])).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
        ref = ref.gather(1, torch.tensor(ids)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(lps)).abs().max().item())
    return worst


def summarize(resp: dict, eos_id: int) -> dict:
    return {
        "finish_reasons": [c["finish_reason"] for c in resp["choices"]],
        "stop_reasons": [c["stop_reason"] for c in resp["choices"]],
        "len_token_ids": [len(c["token_ids"]) for c in resp["choices"]],
        "len_logprobs": [len(c["logprobs"]["content"]) for c in resp["choices"]],
        "eos_in_token_ids": [eos_id in c["token_ids"] for c in resp["choices"]],
        "last_ids": [c["token_ids"][-3:] for c in resp["choices"]],
        "last_logprob_tokens": [[x["token"] for x in c["logprobs"]["content"][-2:]] for c in resp["choices"]],
        "usage": resp["usage"],
    }


def post(client: httpx.Client, path: str, **kw) -> tuple[int | str, float, str]:
    t = time.perf_counter()
    try:
        r = client.post(path, **kw)
        return r.status_code, round(time.perf_counter() - t, 4), r.text[:200]
    except httpx.HTTPError as e:
        return type(e).__name__, round(time.perf_counter() - t, 4), str(e)[:200]


def reload(client: httpx.Client, weights_dir: Path) -> list:
    steps = [
        post(client, "/pause", params={"mode": "wait"}),
        post(client, "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}}),
        post(client, "/reset_prefix_cache"),
        post(client, "/resume"),
    ]
    return steps


async def openai_client_check(base: str, model: str) -> dict:
    from openai import AsyncOpenAI

    oc = AsyncOpenAI(base_url=f"{base}/v1", api_key="x")
    r = await oc.chat.completions.create(
        model=model, messages=MESSAGES, logprobs=True, n=4, max_tokens=16, temperature=1.0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    ch = r.choices[0]
    return {
        "response.model_extra keys": sorted((r.model_extra or {}).keys()),
        "response.prompt_token_ids (attr)": getattr(r, "prompt_token_ids", None),
        "choice.model_extra keys": sorted((ch.model_extra or {}).keys()),
        "choice.token_ids (attr)": getattr(ch, "token_ids", None),
        "choice.logprobs.content[0]": ch.logprobs.content[0].model_dump(),
        "type(choice.token_ids)": type(getattr(ch, "token_ids", None)).__name__,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--base-url")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.mkdtemp(prefix="probe_vllm_")))
    ap.add_argument(
        "--destructive",
        choices=["missing", "partial"],
        help="finally reload from a missing dir (kills the engine); 'partial' first reloads a checkpoint lacking lm_head.weight",
    )
    ap.add_argument("--extra-args", default="", help="extra server flags, space separated")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT / "scripts"))
    from build_tiny_model import build_tiny_model

    args.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = args.model or build_tiny_model(args.workdir / "tiny")
    proc = None
    base = args.base_url
    try:
        if base is None:
            base = f"http://127.0.0.1:{args.port}"
            proc = start_server(model_dir, args.port, args.workdir / "server.log", args.extra_args.split())
            print(f"[5] server log {args.workdir / 'server.log'}")
            print(f"[5] healthy after {wait_healthy(base, 600, proc):.1f} s")
            print(f"[5] RSS MiB: {json.dumps(group_rss_mib(proc.pid))}")
        rss = (lambda: print(f"[5] RSS MiB after checks 1-4: {json.dumps(group_rss_mib(proc.pid))}")) if proc else None
        run_checks(base, model_dir, args.workdir, args.destructive, rss)
        if proc is not None:
            print(f"[5] server process exit code at the end (None = alive): {proc.poll()}")
    finally:
        if proc is not None:
            stop_server(proc)


def run_checks(base: str, model_dir: Path, workdir: Path, destructive: str | None = None, after=None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = httpx.Client(base_url=base, timeout=120)
    served = client.get("/v1/models").json()["data"][0]["id"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    # 1. shape
    resp = chat(client, served, 1.0)
    short = json.loads(json.dumps(resp))
    for c in short["choices"]:
        c["logprobs"]["content"] = c["logprobs"]["content"][:1] + ["..."]
        c["token_ids"] = c["token_ids"][:3] + ["..."]
    short["choices"] = short["choices"][:1] + ["..."]
    print("[1] raw response (truncated):", json.dumps(short, indent=1))
    print("[1] summary:", json.dumps(summarize(resp, eos_id)))
    print("[1] openai client:", json.dumps(asyncio.run(openai_client_check(base, served)), default=str))

    # 2. prompt ids
    ref = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    print(f"[2] prompt_token_ids == apply_chat_template: {resp['prompt_token_ids'] == ref}")

    # 3. logprobs vs HF
    for t in (1.0, 0.7):
        r = chat(client, served, t)
        print(f"[3] T={t}: max |vLLM - HF| logprob = {hf_logprob_diff(hf, r, t):.3e}")

    # 4. reload: perturbed weights, EOS-biased so that choices end with <|im_end|>
    torch.manual_seed(123)
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.02 * torch.randn_like(p))
        # Residual dim 0 ~constant 1.0 (others ~0.02) -> after the final RMSNorm it is ~sqrt(64);
        # an lm_head row reading only dim 0 then gives EOS a logit ~4: p(EOS) ~ 0.15 per token.
        new.model.embed_tokens.weight[:, 0] = 1.0
        new.lm_head.weight[eos_id] = 0.0
        new.lm_head.weight[eos_id, 0] = 0.5
    variants = {
        "full": ["*"],
        "safetensors+config": ["model.safetensors", "config.json"],
        "safetensors_only": ["model.safetensors"],
    }
    full = workdir / "new_full"
    new.save_pretrained(full, safe_serialization=True)
    tok.save_pretrained(full)
    for name, files in variants.items():
        d = full if files == ["*"] else workdir / f"new_{name}"
        if d != full:
            d.mkdir(exist_ok=True)
            for f in files:
                shutil.copy(full / f, d / f)
        steps = reload(client, d)
        print(f"[4] reload {name} ({sorted(os.listdir(d))}): [status, seconds, body] = {steps}")
        if any(s[0] != 200 for s in steps):
            continue
        r = chat(client, served, 1.0)
        print(f"[4]   vs NEW weights: {hf_logprob_diff(new, r, 1.0):.3e}  vs OLD: {hf_logprob_diff(hf, r, 1.0):.3e}")
        print(f"[4]   summary: {json.dumps(summarize(r, eos_id))}")
        # back to the original weights before the next variant
        steps = reload(client, model_dir)
        r = chat(client, served, 1.0)
        print(f"[4]   back to original: steps {[s[:2] for s in steps]}, vs OLD {hf_logprob_diff(hf, r, 1.0):.3e}")
    # pause semantics with a request in flight (400 new tokens ~ a few seconds on CPU)
    import threading

    for mode in ("wait", "abort"):
        box = {}

        def long_request():
            body = {"model": served, "messages": MESSAGES, "max_tokens": 400, "temperature": 1.0,
                    "return_token_ids": True, "logprobs": True, "ignore_eos": True}  # fmt: skip
            t = time.perf_counter()
            r = client.post("/v1/chat/completions", json=body)
            box["dt"] = time.perf_counter() - t
            box["status"] = r.status_code
            j = r.json()
            box["result"] = (
                {"finish_reason": j["choices"][0]["finish_reason"], "n_tokens": len(j["choices"][0]["token_ids"])}
                if r.status_code == 200
                else r.text[:200]
            )

        th = threading.Thread(target=long_request)
        th.start()
        time.sleep(1.0)
        p = post(client, "/pause", params={"mode": mode})
        paused = client.get("/is_paused").text
        th.join()
        print(f"[4] pause mode={mode} with 1 request in flight: pause -> {p}, is_paused -> {paused}, "
              f"request -> status {box['status']} after {box['dt']:.2f} s: {box['result']}")  # fmt: skip
        print(f"[4]   resume -> {post(client, '/resume')}")

    if after is not None:
        after()
    if destructive:
        # A failing reload leaves the engine unusable; the next request kills the server.
        bad = workdir / "does_not_exist"
        if destructive == "partial":  # a checkpoint missing one tensor
            from safetensors.torch import load_file, save_file

            bad = workdir / "new_partial"
            bad.mkdir(exist_ok=True)
            sd = load_file(full / "model.safetensors")
            sd.pop("lm_head.weight")
            save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
        if destructive == "partial":
            print(f"[4] reload partial (no lm_head.weight): {reload(client, bad)}")
            hybrid = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32).eval()
            with torch.no_grad():
                hybrid.lm_head.weight.copy_(hf.lm_head.weight)
            r = chat(client, served, 1.0)
            print(f"[4]   vs new+OLD lm_head: {hf_logprob_diff(hybrid, r, 1.0):.3e}  vs NEW: {hf_logprob_diff(new, r, 1.0):.3e}")
            bad = workdir / "does_not_exist"
        print(f"[4] reload missing dir ({bad.name}): {reload(client, bad)}")
        body = {"model": served, "messages": MESSAGES, "max_tokens": 4}
        print(f"[4]   chat while still paused: {post(client, '/v1/chat/completions', json=body, timeout=10)}")
        print(f"[4]   resume: {post(client, '/resume')}")
        print(f"[4]   chat after resume: {post(client, '/v1/chat/completions', json=body, timeout=30)}")
        time.sleep(5)
        try:
            print(f"[4]   health 5 s later: {client.get('/health').status_code}")
        except httpx.HTTPError as e:
            print(f"[4]   health 5 s later: {type(e).__name__} {e}")


if __name__ == "__main__":
    main()
