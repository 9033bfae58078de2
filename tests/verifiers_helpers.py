"""Helpers the verifiers tests share (classic in test_verifiers_classic.py, v1 in
test_verifiers_v1.py, the trio in test_verifiers_trio.py): an orchestrator config and one
batch of it against the fake vLLM, the prompts the fake server saw, responders, and the
checks of sampled tokens."""

from __future__ import annotations

import difflib
import json

import pytest
from prime_rl.wire import sample_arrays

from fake_inference import IM_END, LOGPROB, FakeInferenceServer
from helpers import free_port, mask_spans, orchestrator_process


def orchestrator_config(tmp_path, model, env: dict, server_url: str, **extra) -> dict:
    return {
        "model": str(model),
        "env": [env],
        "sampling": {"max_tokens": 64},
        "transport": {"port": free_port(), "timeout_s": 60},
        "preflight": {"enabled": False},
        "batch_size": 4,
        "rollouts_per_example": 2,
        "max_steps": 1,
        "seq_len": 1024,
        "output_dir": str(tmp_path),
        "client": {"base_url": server_url, "timeout_s": 10},
        **extra,
    }


def one_batch(config: dict, tmp_path, env: dict | None = None):
    with orchestrator_process(config, tmp_path, env=env, receive_timeout_s=90) as receive:
        batch = receive(0)
    return [s for m in batch.micro_batches for s in m.samples]


def metrics_row(run_dir) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r.get("process", "orchestrator") == "orchestrator" and r["step"] == 0)


def completion_prompts(server: FakeInferenceServer) -> list[list[int]]:
    """The token-id prompt of every sampling request the fake server received."""
    return [[int(t) for t in body["prompt"]] for _, path, body in server.calls
            if path.startswith("/v1/completions") and body.get("prompt_logprobs") is None]


def text(ids) -> str:
    return bytes(t for t in ids if t < 256).decode(errors="replace")


def reverse(messages, index):
    return str(messages[-1]["content"])[::-1] if index % 2 == 0 else "nope"


def check_three_turns(sample, prompts: list[list[int]], reply_start: str, env_text: str) -> None:
    """A three-turn sample: three spans of sampled tokens, each starting with ``reply_start``
    and ending with <|im_end|>, each turn's prompt exactly the sequence so far (a request the
    fake server received), and the environment's message after the first turn (holding
    ``env_text``) in the sequence but out of the loss."""
    ids, mask, _ = sample_arrays(sample)
    runs = mask_spans(mask)
    assert len(runs) == 3, "three model turns, each its own span of sampled tokens"
    for k, (start, end) in enumerate(runs):
        assert ids[:start].tolist() in prompts, f"turn {k}"
        assert text(ids[start:end]).startswith(reply_start) and ids[end - 1] == IM_END
    between = text(ids[runs[0][1] : runs[1][0]])
    assert env_text in between and not mask[runs[0][1] : runs[1][0]].any()


def check_reversals(samples, prompts: list[list[int]]) -> None:
    """Single-turn reverse-text samples: each is exactly a prompt the fake server was sent
    (with the environment's system prompt), then what it sampled, with its logprobs, and the
    reward is the difflib ratio of the reply and the reversed text."""
    for sample in samples:
        ids, mask, logprobs = sample_arrays(sample)
        (span,) = mask_spans(mask)
        assert ids[: span[0]].tolist() in prompts
        assert span[1] == len(ids) and ids[-1] == IM_END
        assert logprobs[mask].tolist() == pytest.approx([LOGPROB] * int(mask.sum()))
        question = text(ids[: span[0]]).split("user\n")[-1].split("\n")[0]
        reply = text(ids[span[0] :])  # the sampled text, without <|im_end|>
        assert sample.reward == pytest.approx(difflib.SequenceMatcher(None, reply.strip(), question[::-1]).ratio())
        assert "Reverse the text character by character." in text(ids[: span[0]])


def eval_results(env_id: str, python, tmp_path, responder, n: int, r: int) -> tuple[str, list[dict]]:
    """`prime-rl eval ENV --python PY -m fake -n N -r R -s` against the fake server as a text
    endpoint: (its stdout, the rows of results.jsonl)."""
    from helpers import endpoints_file, eval_cli

    with FakeInferenceServer(responder=responder) as server:
        endpoints = endpoints_file(tmp_path, server.url)
        out = tmp_path / "evals"
        proc = eval_cli([env_id, "--python", str(python), "-m", "fake", "-n", str(n), "-r", str(r), "-s",
                         "--endpoints-path", str(endpoints), "--output-dir", str(out)],
                        env={"FAKE_EVAL_KEY": "k", "COLUMNS": "120"}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (folder,) = (out / f"{env_id}--fake--model-1").iterdir()
    return proc.stdout, [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
