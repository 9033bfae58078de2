"""RL trainer process: receive a step's rollouts, take one optimizer step, publish weights.

    python -m trainer.rl --config RUN/configs/trainer.json [--dotted.flags]
    torchrun --nproc-per-node N -m trainer.rl --config ...      (FSDP2, one batch per rank)

Policy versions count optimizer steps: the initial model is version 0, and step n
(numbered from 0) trains version n on step n's batch and publishes ``weights/step_{n+1}``
(version n + 1). A sample's staleness, n - its policy version, is its off-policy gap.
Every ``ckpt.interval`` steps it writes a resumable checkpoint (``trainer.ckpt``); with
``ckpt.resume_step`` N it starts from checkpoint N at step N. The trainer knows only the
wire contract and the run directory layout, never the orchestrator or the inference server.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn

from prime_rl.config import DistillConfig, LossConfig, TrainerConfig
from prime_rl.cores import take_back_cores
from prime_rl.heartbeat import Heartbeat
from prime_rl.metrics import Metrics, make_metrics
from prime_rl.rundir import checkpoint_step_dir
from prime_rl.settings import exit_process, run_process
from prime_rl.wire import TrainBatch
from trainer.ckpt import CheckpointError, checkpoint_due, load_checkpoint, save_checkpoint
from trainer.data import BatchReceiver, MicroTensors, collate, micro_batches
from trainer.head import HeadQuery
from trainer.loss import distill_advantages, policy_loss, reverse_kl_sum
from trainer.model import (
    DTYPES, World, forward_logits, load_model, packing_support, setup_world, shared_prefix_support, teardown_world, uses_varlen,
)
from trainer.optim import build_optimizer, clip_and_step
from trainer.teacher import TeacherError, load_teacher
from trainer.teacher import score as teacher_score
from trainer.traces import sample_traces, write_traces
from trainer.transfer import WeightSender
from trainer.weights import dedupe_tied, full_state_dict, prune_weights, save_weights

CONSOLE_KEYS = (
    "loss/policy", "loss/reverse_kl", "loss/mismatch_kl", "loss/masked_frac", "optim/grad_norm",
    "staleness/max", "perf/tokens_per_s", "time/step",
)
# Per-step sums reduced over micro-batches and ranks, in this order (one all-reduce).
SUM_KEYS = (
    "loss_sum", "loss_tokens", "masked_tokens", "ratio_sum", "mismatch_kl_sum",
    "entropy_sum", "samples", "tokens", "model_tokens", "truncated", "distill_kl_sum", "top_k_kl_sum",
)


def log(msg: str) -> None:
    print(f"[trainer] {msg}", flush=True)


def fit_to_model(cfg: TrainerConfig, model, is_main: bool) -> TrainerConfig:
    """The row layout the loaded model supports: `share_prefix` and `pack` turned off (on a
    copy, decided once; train_step reads the flags) where its attention cannot do them."""
    if cfg.share_prefix and (reason := shared_prefix_support(model)):
        cfg = cfg.model_copy(update={"share_prefix": False})
        if is_main:
            log(f"shared prefixes off: {reason}; every sample gets a row of its own (trainer.share_prefix)")
    if cfg.pack and (reason := packing_support(model)):
        cfg = cfg.model_copy(update={"pack": False})
        if is_main:
            log(f"packing off: {reason}; one row per sample or group, right-padded (trainer.pack)")
    return cfg


def train(cfg: TrainerConfig) -> None:
    # ---- setup: threads, process group, model, optimizer, metrics, transport
    world = setup_world(cfg.num_threads)
    heartbeat = Heartbeat(cfg.output_dir, "trainer", enabled=world.is_main)  # for the launcher's watchdog
    torch.manual_seed(cfg.seed)
    model = load_model(cfg.model, world, cfg.lora)
    cfg = fit_to_model(cfg, model, world.is_main)
    teacher = None
    if cfg.teacher_model is not None:  # `[teacher] placement = "trainer"`: frozen, beside the student
        teacher = load_teacher(cfg.teacher_model, cfg.model, world, model)
        cfg = fit_to_model(cfg, teacher, world.is_main)  # its rows are the student's: both must take them
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.max_steps)
    metrics = (
        make_metrics("trainer", cfg.output_dir, CONSOLE_KEYS, cfg.wandb, cfg.model_dump(mode="json"))
        if world.is_main
        else Metrics("trainer", [])
    )
    # ---- resume: the state after `start` steps (0 = the initial model)
    start, resume_row = 0, {}
    if cfg.ckpt.resume_step is not None:
        t_load = time.perf_counter()
        start = load_checkpoint(model, optimizer, scheduler, cfg.output_dir, cfg.ckpt.resume_step)
        resume_row = {"time/load_ckpt": time.perf_counter() - t_load}
        if world.is_main:
            log(f"resumed from {checkpoint_step_dir(cfg.output_dir, start)} in {resume_row['time/load_ckpt']:.1f} s: next step {start}")
    # ids must index the embedding's rows (which may exceed the tokenizer's vocabulary)
    receiver = BatchReceiver(cfg.transport, world.rank, vocab_size=model.get_input_embeddings().num_embeddings)
    sender = weight_sender(cfg, world)
    log(f"rank {world.rank}/{world.world_size} on {world.device}: {cfg.model.name}; batches from {receiver.address}")
    heartbeat.progress(f"loaded the model, next step {start}")
    take_back_cores("trainer")  # started on one core while vLLM started (deployment.cpu_vllm_first)
    reset_peak_memory()  # perf/peak_memory_mb: the training steps' peak, not loading's transients
    nonfinite = 0  # consecutive steps skipped for a non-finite loss or gradient
    try:
        for step in range(start, cfg.max_steps):
            t_start = time.perf_counter()
            # 0. the resumable checkpoint of the state after `step` steps, every ckpt.interval steps:
            #    written here, after step - 1's metrics row, so a crash can never leave a checkpoint
            #    whose previous step has no row (a resume drops the rows from its step on)
            if step > start and checkpoint_due(step, cfg.ckpt.interval, cfg.max_steps):
                checkpoint(model, optimizer, scheduler, cfg, step, world, heartbeat)
            t_ckpt = time.perf_counter()
            # 1. rollouts for this step (sampled by policy versions in [step - async_level, step]; or
            #    from step - orchestrator.max_off_policy_steps, where that is set)
            with heartbeat.waiting(f"batch of step {step} from {receiver.address}"):
                batch = receiver.receive(step)
            t_batch = time.perf_counter()
            # 2. one optimizer step over all micro-batches (and the traced samples' view of their tokens)
            traced: list[dict] = []
            stats = train_step(model, optimizer, scheduler, batch, cfg, world, traced, teacher)
            write_traces(cfg.output_dir, step, world.rank, traced)
            nonfinite = count_nonfinite(stats, nonfinite, cfg.max_nonfinite_steps, step)
            t_train = time.perf_counter()
            # 3. publish policy version `step + 1` (collective gather, rank 0 writes)
            with heartbeat.waiting(f"writing weights step {step + 1}"):
                writers = publish_weights(model, cfg, step + 1, world, sender)
            t_save = time.perf_counter()
            # 4. metrics (rank 0 only)
            timings = {
                "step": t_save - t_start,
                "save_ckpt": t_ckpt - t_start,  # the checkpoint written before this step (0 when none)
                "wait_batch": t_batch - t_ckpt,
                "train": t_train - t_batch,
                "save_weights": t_save - t_train,
            }
            if teacher is not None:
                timings["teacher"] = stats["teacher_s"]  # inside `train`
            row = {
                **step_metrics(stats, timings, step, distill=cfg.loss.distill),
                "optim/nonfinite_streak": nonfinite, "weights/writers": writers,
            }
            metrics.log(step, {**row, **resume_row})
            resume_row = {}
            heartbeat.progress(f"trained step {step}")
        # the checkpoint after the last step, once its row is written
        if start < cfg.max_steps and checkpoint_due(cfg.max_steps, cfg.ckpt.interval, cfg.max_steps):
            checkpoint(model, optimizer, scheduler, cfg, cfg.max_steps, world, heartbeat)
        if world.is_main:
            log(f"done: {cfg.max_steps} steps, weights in {cfg.output_dir / 'weights'}")
    finally:
        if sender is not None:
            sender.close()
        receiver.close()
        metrics.close()
        teardown_world(world)


def checkpoint(model: nn.Module, optimizer, scheduler, cfg: TrainerConfig, step: int, world: World, heartbeat: Heartbeat) -> None:
    """Write ``checkpoints/step_{step}`` (every rank), pruning old ones, then the weights only a
    pruned checkpoint kept: after the last step no weights save comes to prune them (a 1,000-step
    run ended with `weights/step_960` beside checkpoints 980 and 1000)."""
    with heartbeat.waiting(f"writing checkpoint step {step}"):
        save_checkpoint(model, optimizer, scheduler, cfg.output_dir, step, cfg.ckpt.keep_last)
    if world.is_main:
        prune_weights(cfg.output_dir, cfg.weights.keep_last)


def in_memory(cfg: TrainerConfig) -> bool:
    """Versions go to vLLM from memory (LoRA adapters always go as folders)."""
    return cfg.weight_transfer.mode == "memory" and cfg.lora is None


def weight_sender(cfg: TrainerConfig, world: World) -> WeightSender | None:
    """Memory mode's sender, on rank 0."""
    if not (in_memory(cfg) and world.is_main):
        return None
    return WeightSender(cfg.output_dir, cfg.weight_transfer.workers, cfg.weight_transfer.timeout_s, world.device)


def publish_weights(model: nn.Module, cfg: TrainerConfig, version: int, world: World, sender: WeightSender | None) -> int:
    """Publish policy version ``version``: ``weights/step_{version}``, or in memory mode (but for
    a checkpoint's version and the last, which a resume and the user read from the folder) a
    copy held for the vLLM workers (``trainer.transfer``). Returns how many ranks wrote or
    offered it, summed over ranks. Logged as ``weights/writers``, it must be 1: every rank
    gathers, exactly one writes (a second writer would race on the same folder and its marker)."""
    dtype = DTYPES[cfg.model.dtype]
    if in_memory(cfg) and version != cfg.max_steps and not checkpoint_due(version, cfg.ckpt.interval, cfg.max_steps):
        state = full_state_dict(model, dtype)  # collective; only rank 0 gets tensors
        if sender is not None:
            sender.offer(version, dedupe_tied(model, state))
        published = sender is not None
    else:
        published = save_weights(model, cfg.output_dir, version, cfg.weights.keep_last, cfg.model.name, dtype) is not None
    return int(all_reduce(scalar(published, world), dist.ReduceOp.SUM))


def count_nonfinite(stats: dict[str, float], streak: int, limit: int, step: int) -> int:
    """The new streak of consecutive non-finite steps; raises once it reaches ``limit``.

    ``clip_and_step`` already skipped the update of such a step, so the weights are intact.
    """
    if math.isfinite(stats["loss_sum"]) and math.isfinite(stats["grad_norm"]):
        return 0
    streak += 1
    log(f"step {step}: non-finite loss ({stats['loss_sum']}) or grad norm ({stats['grad_norm']}); update skipped, {streak} in a row")
    if streak >= limit:
        raise FloatingPointError(
            f"{streak} consecutive steps with a non-finite loss or gradient "
            f"(trainer.max_nonfinite_steps = {limit}); the last good weights are kept"
        )
    return streak


def train_step(
    model: nn.Module, optimizer, scheduler, batch: TrainBatch, cfg: TrainerConfig, world: World,
    traced: list[dict] | None = None, teacher: nn.Module | None = None,
) -> dict[str, float]:
    """Forward/backward every micro-batch, then clip and step (with an in-trainer ``teacher``,
    its scores of each micro-batch first). Returns step-wide stats; the traced samples' rows
    (``trainer.traces``) go to ``traced``."""
    pad_id = getattr(model.config, "pad_token_id", None) or 0
    varlen = uses_varlen(model) and cfg.pack
    share = cfg.share_prefix and not varlen
    lay_out = lambda m, seq_len: collate(m, seq_len, pad_id, world.device, share, cfg.pack, varlen)  # noqa: E731
    raw = micro_batches(batch, cfg.seq_len, cfg.micro_batch_tokens, share)
    micros = [lay_out(m, cfg.seq_len) for m in raw]  # the teacher's views (context distillation) are laid out alike
    check_teacher(micros, cfg.loss.distill, batch.step, in_trainer=teacher is not None)
    # Step-wide normalisers, identical on every rank. Position 0 is never scored (no prefix).
    local_tokens = sum(loss_token_count(m, cfg.loss.denominator, cfg.loss.distill) for m in micros)
    num_tokens = max(1, int(all_reduce(scalar(local_tokens, world), dist.ReduceOp.SUM)))
    num_micro = int(all_reduce(scalar(len(micros), world), dist.ReduceOp.MAX))

    sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64, device=world.device)  # float64: counts stay exact
    teacher_s = 0.0
    for i in range(num_micro):
        if i < len(micros):
            mt = micros[i]
            if teacher is not None:
                t0 = time.perf_counter()
                mt = teacher_score(teacher, mt, cfg.loss.distill.top_k, raw[i], lay_out)
                teacher_s += time.perf_counter() - t0
            sums += micro_step(model, mt, batch.temperature, cfg.loss, num_tokens, world.world_size, traced)
        else:
            lockstep_step(model, world)  # this rank ran out of micro-batches; FSDP needs equal passes
    grad_norm, lr = clip_and_step(model, optimizer, scheduler, cfg.optim.max_grad_norm)

    sums = all_reduce(sums, dist.ReduceOp.SUM)
    versions = [s.policy_version for m in batch.micro_batches for s in m.samples]
    min_version = all_reduce(scalar(min(versions, default=10**9), world), dist.ReduceOp.MIN)
    return {**dict(zip(SUM_KEYS, sums.tolist())), "grad_norm": grad_norm, "lr": lr, "min_version": float(min_version),
            "micro_batches": float(num_micro), "teacher_s": teacher_s}


def check_teacher(micros: list[MicroTensors], distill: DistillConfig | None, step: int, in_trainer: bool = False) -> None:
    """Distillation needs every micro-batch scored by the teacher (a served one's scores in the
    batch, or the trainer's own teacher, never both); say so before any forward."""
    if in_trainer and any(m.teacher_logprobs is not None for m in micros):
        raise ValueError(f"the batch of step {step} carries a served teacher's logprobs and trainer.teacher_model is set: "
                         "one teacher only (teacher.placement)")
    if not in_trainer and distill is not None and any(m.teacher_logprobs is None for m in micros):
        raise no_teacher(f"the batch of step {step}")


def no_teacher(what: str, carries: str = "teacher logprobs") -> ValueError:
    return ValueError(f"trainer.loss.distill is set but {what} carries no {carries} (is [teacher] configured for the orchestrator?)")


def loss_token_count(mt: MicroTensors, denominator: str, distill: DistillConfig | None = None) -> int:
    """Loss tokens of a micro-batch that the step's mean divides by (position 0 is never
    scored): all of them, or (``informative``) those of samples with a nonzero advantage,
    which are the only ones with a gradient. Distilling with ``kl_weight`` > 0 gives every
    token an advantage of its own (its KL to the teacher), so every sample is informative."""
    per_sample = mt.loss_mask[:, 1:].sum(-1)  # [B]
    every_sample_learns = distill is not None and distill.kl_weight > 0
    if denominator == "informative" and not every_sample_learns:
        per_sample = per_sample * (mt.advantages != 0)
    return int(per_sample.sum())


def token_advantages(
    mt: MicroTensors, inference_lp: torch.Tensor, loss_mask: torch.Tensor, distill: DistillConfig | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages for ``policy_loss``, the reverse-KL sum for ``distill_kl_sum``).

    RL: the samples' own advantages [B] untouched, and a KL of 0. Distillation: per-token
    advantages [B, T-1] from ``distill_advantages``; with ``top_k`` the KL is a loss of its
    own (the head's ``top_k_kl``, ``micro_step``), so the advantages are the weighted group advantages [B] alone.
    inference_lp and loss_mask [B, T-1] are already shifted (position t scores token t+1);
    the teacher's logprobs are shifted alike.
    """
    if distill is None:
        return mt.advantages, torch.zeros((), dtype=torch.float32)
    if mt.teacher_logprobs is None:
        raise no_teacher("a micro-batch")
    teacher_lp = mt.teacher_logprobs[:, 1:]
    kl_sum = reverse_kl_sum(inference_lp, teacher_lp, loss_mask)
    if distill.top_k:
        return distill.reward_weight * mt.advantages, kl_sum
    return distill_advantages(mt.advantages, inference_lp, teacher_lp, loss_mask, distill), kl_sum


def check_top_k(mt: MicroTensors, distill: DistillConfig | None) -> None:
    """Top-k distillation needs the teacher's top-k at every loss token of the micro-batch."""
    if distill is None or not distill.top_k:
        return
    if mt.teacher_top_ids is None or mt.teacher_top_logprobs is None:
        raise no_teacher("a micro-batch", f"top-{distill.top_k} tokens of the teacher")
    n = int(mt.loss_mask[:, 1:].sum())
    if mt.teacher_top_ids.shape != (n, distill.top_k):
        raise ValueError(
            f"the teacher's top-k rows {tuple(mt.teacher_top_ids.shape)} do not match the micro-batch's "
            f"{n} loss tokens x trainer.loss.distill.top_k {distill.top_k}"
        )


def micro_step(
    model: nn.Module, mt: MicroTensors, temperature: float, loss_cfg: LossConfig, num_tokens: int, world_size: int,
    traced: list[dict] | None = None,
) -> torch.Tensor:
    """Forward + backward one micro-batch; returns its SUM_KEYS vector (detached), and adds the
    rows of its traced samples to ``traced``."""
    check_top_k(mt, loss_cfg.distill)
    # The head scores the N loss tokens only (trainer.head): logprobs [N] with gradient,
    # entropy [N] without, the top-k KL [N] when distilling with top_k.
    scores = forward_logits(model, mt.model_ids, mt.model_mask, mt.model_positions, mt.cu_seqlens, mt.max_seqlen,
                            query=mt.head_query(temperature))
    # Position t of these scores token t+1 of each sample, on the inference side too.
    inference_lp, loss_mask = mt.inference_logprobs[:, 1:], mt.loss_mask[:, 1:]
    trainer_lp = torch.zeros(loss_mask.shape, dtype=torch.float32, device=loss_mask.device).masked_scatter(
        loss_mask, scores["logprobs"])  # [B, T-1], 0 off the mask
    advantages, kl_sum = token_advantages(mt, inference_lp, loss_mask, loss_cfg.distill)
    loss, stats = policy_loss(trainer_lp, inference_lp, advantages, loss_mask, loss_cfg, num_tokens)
    top_kl = scores.get("top_k_kl") if loss_cfg.distill is not None and loss_cfg.distill.top_k else None
    if top_kl is not None:  # the step's token mean, like the policy loss
        loss = loss + loss_cfg.distill.kl_weight * top_kl.sum() / num_tokens
    # FSDP averages gradients over ranks; the loss is already a global token mean, so undo it.
    (loss * world_size).backward()
    if traced is not None and mt.traces:
        teacher_lp = None if mt.teacher_logprobs is None else mt.teacher_logprobs[:, 1:]
        traced += sample_traces(mt.traces, trainer_lp, inference_lp, loss_mask, scores["entropy"], loss_cfg, teacher_lp)
    values = {
        **stats,
        "loss_sum": loss.detach(),
        "entropy_sum": scores["entropy"].sum(),  # already of logits / temperature
        "samples": torch.tensor(float(mt.input_ids.shape[0])),
        "tokens": torch.tensor(float(mt.num_real_tokens)),
        "model_tokens": torch.tensor(float(mt.num_model_tokens)),
        "truncated": torch.tensor(float(mt.num_truncated)),
        "distill_kl_sum": kl_sum,
        "top_k_kl_sum": torch.zeros(()) if top_kl is None else top_kl.detach().sum(),
    }
    return torch.stack([values[k].double().to(mt.input_ids.device) for k in SUM_KEYS])


def lockstep_step(model: nn.Module, world: World) -> None:
    """A zero-gradient pass so this rank joins the FSDP collectives of a pass it has no data for."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=world.device)
    query = HeadQuery(positions=ids[0, :1], targets=ids[0, :1], temperature=1.0)
    scores = forward_logits(model, ids, torch.ones_like(ids), query=query)
    (scores["logprobs"].sum() * 0.0).backward()


def scalar(value: float, world: World) -> torch.Tensor:
    """A float64 0-d tensor on the rank's device (nccl reduces only device tensors)."""
    return torch.tensor(float(value), dtype=torch.float64, device=world.device)


def all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    """In-place all-reduce over ranks; identity in a single process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t


def step_metrics(
    s: dict[str, float], timings: dict[str, float], step: int, distill: DistillConfig | None = None
) -> dict[str, float]:
    """Prefixed metric row from the reduced step sums; ``loss/reverse_kl`` only when
    distilling (``distill``, and ``loss/reverse_kl_top_k`` with its top_k), so RL rows keep their keys."""
    n = max(s["loss_tokens"], 1.0)
    row = {
        "loss/policy": s["loss_sum"],
        "loss/mismatch_kl": s["mismatch_kl_sum"] / n,
        "loss/masked_frac": s["masked_tokens"] / n,
        "loss/ratio": s["ratio_sum"] / n,
        "loss/entropy": s["entropy_sum"] / n,
        "optim/grad_norm": s["grad_norm"],
        "optim/lr": s["lr"],
        "perf/tokens_per_s": s["tokens"] / max(timings["train"], 1e-9),
        "perf/model_tokens": int(s["model_tokens"]),
        "perf/micro_batches": int(s["micro_batches"]),  # the most any rank ran (trainer.micro_batch_tokens)
        "perf/samples": int(s["samples"]),
        "perf/loss_tokens": int(s["loss_tokens"]),
        "perf/truncated": int(s["truncated"]),
        "perf/peak_memory_mb": peak_memory_mb(),
        **{f"time/{k}": v for k, v in timings.items()},
    }
    if distill is not None:
        row["loss/reverse_kl"] = s["distill_kl_sum"] / n  # per loss token, nats: the sampled estimate
        if distill.top_k:
            row["loss/reverse_kl_top_k"] = s["top_k_kl_sum"] / n  # what the top-k loss minimises
    if s["samples"] > 0:
        row["staleness/max"] = step - int(s["min_version"])
    return row


def peak_memory_mb() -> float:
    """Peak memory of this rank since ``reset_peak_memory``: tensors allocated on the GPU, or on
    CPU the process's peak resident set (VmHWM; it includes the libraries, ~0.5 GB of torch
    and transformers, and the resident model)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**10  # KiB
    except (OSError, StopIteration, ValueError, IndexError):  # not Linux: the peak since the start
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def reset_peak_memory() -> None:
    """Start the peak over from what is allocated now. On CPU the start-up's peak (loading the
    weights passes through copies of them) depends on the machine's state: measured in a full
    test suite it rose by ~190 MB against the same run alone, and hid what training holds."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set (Linux >= 4.0)
            f.write("5")
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    # a damaged checkpoint, a teacher that cannot score the student's tokens: one line
    return run_process("trainer", TrainerConfig, train, argv, expected=(CheckpointError, TeacherError))


if __name__ == "__main__":
    exit_process(main())
