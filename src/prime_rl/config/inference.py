"""The inference section (`[inference]`): the vLLM server.

Never imports torch or vLLM (the launcher validates configs before any process starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from prime_rl.config.shared import StrictModel, WeightTransferConfig


class InferenceConfig(StrictModel):
    model: str = "Qwen/Qwen3-0.6B"
    """HF model id or local path to serve."""

    served_model_name: str | None = None
    """Name requests use for the model (vLLM `--served-model-name`); None = `model`. A resumed run serves `weights/step_N` under the original name."""

    host: str = "127.0.0.1"
    """Address the server binds."""

    port: int = Field(8000, ge=1024, le=65535)
    """Port the server binds."""

    api_key: str | None = None
    """Require this bearer key on every request (unset: a run draws one for the servers it
    starts, `prime-rl inference` one for its warm servers)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Weights dtype in vLLM; keep it equal to the trainer's."""

    seq_len: int = Field(512, ge=8)
    """vLLM `--max-model-len`."""

    max_num_seqs: int = Field(256, ge=1)
    """Most sequences batched at once. 256 holds a whole quickstart step (32 prompts x 8),
    which on CPU takes ~0.7 s instead of 1.0-1.5 s in waves of 64 (docs/machine_facts.md)."""

    max_logprobs: int = Field(20, ge=0)
    """Most logprobs a request may ask for a position (vLLM `--max-logprobs`); a distillation teacher gets `trainer.loss.distill.top_k` when that is larger."""

    seed: int | None = None
    """vLLM's sampling seed (`--seed`); filled from the run's `seed`. None = vLLM's default."""

    enforce_eager: bool = True
    """Skip graph capture (faster start; the right choice on CPU)."""

    kv_cache_gb: int = Field(1, ge=1)
    """KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE, GiB)."""

    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of GPU memory vLLM may use (GPU machines)."""

    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs per vLLM replica (`--tensor-parallel-size`); `deployment.inference_gpus` / this = replicas."""

    cpu_threads_bind: str | None = None
    """VLLM_CPU_OMP_THREADS_BIND (e.g. `0` or `0-1`); None leaves vLLM's default."""

    cpu_fork: bool = True
    """On CPU, fork vLLM's engine and worker processes from its API server instead of
    spawning them (`python -m inference.vllm_cpu`): they skip importing torch and vLLM again,
    so a server is healthy after ~10 s instead of ~24 s here, serving the same tokens and
    logprobs (docs/vllm_probe.md, "Fork"). False starts vLLM's module as it is (its engine
    core still joins the worker's core: `cpu_share_core`)."""

    cpu_share_core: bool = True
    """Where vLLM binds its worker to one core (here, 2 cores: it keeps the
    other for its API server and engine core, which the trainer needs too), run the engine core
    on the worker's core as well: the two spin-wait for each other, and on one core the spin
    yields instead of taking the trainer's core (docs/vllm_probe.md, "The engine and the
    worker spin-wait"). False leaves the engine core where vLLM puts it."""

    max_lora_rank: int | None = Field(None, ge=1)
    """Serve LoRA adapters up to this rank, loaded at run time (vLLM `--enable-lora --max-lora-rank`); filled from `[trainer.lora]`. None = no adapters."""

    lora_modules: dict[str, str] = {}
    """LoRA adapters served from the start, name -> PEFT adapter folder (vLLM `--lora-modules`); needs `max_lora_rank`. `prime-rl eval -m RUN/weights/step_N` of a LoRA run fills it."""

    tool_call_parser: str | None = None
    """vLLM's tool-call parser for the model family (`--tool-call-parser`, with `--enable-auto-tool-choice`): `hermes` for Qwen3, Qwen2.5 and the tiny test model. Tool environments need it; None = no tool calls."""

    extra_args: list[str] = []
    """Extra command-line flags passed to the vLLM server as written."""

    weight_transfer: WeightTransferConfig = WeightTransferConfig()
    """How each new policy reaches this server (memory mode: it is started with the transfer engine)."""

    output_dir: Path = Path("outputs/run")
    """Run directory (the server's log lives there)."""

    attach: bool | None = None
    """An RL run only: use the warm servers `prime-rl inference CONFIG` keeps up on this run's ports instead of starting vLLM (the run loads its own weights into them). None = attach when a live warm server holds the ports, else start our own; true = attach or refuse; false = always start our own (a warm server on the ports is refused, as any program holding them)."""

    @model_validator(mode="after")
    def _adapters_need_lora(self) -> InferenceConfig:
        if self.lora_modules and self.max_lora_rank is None:
            raise ValueError("lora_modules: set max_lora_rank too (the largest adapter rank to serve)")
        return self
