"""Typed configuration shared by the launcher and the three processes.

One TOML file holds shared fields (``model``, ``max_steps``, ``seq_len``, ...) plus
``[trainer]``, ``[orchestrator]`` and ``[inference]`` sections. Shared fields are copied
into every section that needs them (see ``SHARED_FIELDS``); a section that sets the
same field to another value is an error. The flat hosted-training form (``batch_size``,
``rollouts_per_example``, ``[sampling]``, ``[[env]]``, ``[wandb]`` at top level) is the
same mechanism. Every model forbids unknown keys and documents each field with a
docstring, which is also its ``--help`` text.

This module never imports torch or vLLM: the launcher validates configs before any
process starts.

The schemas live in modules by owner (``shared``, ``trainer``, ``orchestrator``,
``inference``, ``launcher``, ``eval``); import them from here."""

from prime_rl.config.shared import (  # noqa: F401
    CURVE_KEY_FIELDS,
    CheckpointConfig,
    ClientConfig,
    EnvConfig,
    KNOWN_ENVIRONMENTS,
    MAX_TEACHER_TOP_K,
    ModelConfig,
    PSEUDO_FILESYSTEMS,
    SamplingConfig,
    StrictModel,
    TransportConfig,
    WandbConfig,
    WeightTransferConfig,
    _Z85_KEY,
    _is_loopback,
    check_env_args,
    check_env_names,
    check_environment_id,
    check_model_path,
    check_prompt_file,
    environment_module,
    environment_name,
)
from prime_rl.config.trainer import (  # noqa: F401
    DistillConfig,
    LoraConfig,
    LossConfig,
    OptimConfig,
    TrainerConfig,
    VLLM_LORA_RANKS,
    WeightsConfig,
    vllm_lora_rank,
)
from prime_rl.config.orchestrator import (  # noqa: F401
    AdvantageConfig,
    EvalConfig,
    FilterConfig,
    LoadConfig,
    OrchestratorConfig,
    PreflightConfig,
    TeacherClientConfig,
)
from prime_rl.config.inference import (  # noqa: F401
    InferenceConfig,
)
from prime_rl.config.trainer import (  # noqa: F401
    SFTConfig,
    SFTDataConfig,
)
from prime_rl.config.launcher import (  # noqa: F401
    DeploymentConfig,
    LORA_ADAPTER_NAME,
    RLConfig,
    SHARED_FIELDS,
    SlurmConfig,
    StatusConfig,
    TeacherConfig,
    WatchdogConfig,
    _normalized,
    propagate_shared,
)
from prime_rl.config.eval import (  # noqa: F401
    EvalEnvConfig,
    EvalRunConfig,
    EvalSamplingConfig,
    EvalTarget,
    GepaConfig,
    GepaRunConfig,
)
