"""Resumable trainer checkpoints: ``RUN/checkpoints/step_N/`` holds the state after N steps.

    checkpoints/step_N/
      model_optim/               model + AdamW state, torch.distributed.checkpoint (DCP);
                                 with LoRA the adapters and their AdamW state only (the
                                 frozen base is reloaded from trainer.model.name)
      rng_rank_R.safetensors     torch RNG state of rank R (CPU, and CUDA when present)
      trainer.json               step, LR-schedule state, world size, LoRA or not
      STABLE                     marker, written last: only then does the checkpoint exist

DCP writes every rank's shards in parallel and reshards on load, so a checkpoint of N
ranks resumes on M. The folder is filled as ``step_N.tmp``, renamed, and marked last
(``prime_rl.rundir``), so a crash or a failed write mid-save leaves the previous
checkpoint the newest complete one. Only rank 0 creates, marks and prunes folders.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from prime_rl.rundir import (
    MARKER,
    begin_step_dir,
    checkpoint_step_dir,
    checkpoints_dir,
    complete_steps,
    finish_step_dir,
    prune_step_dirs,
    tmp_step_dir,
    write_failed,
    write_json_atomic,
)
from prime_rl.settings import one_line
from trainer.lora import is_lora


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from (missing, incomplete, unreadable)."""


def checkpoint_due(steps_done: int, interval: int, max_steps: int) -> bool:
    """A checkpoint after every ``interval`` steps and after the last one (none for interval 0)."""
    return interval > 0 and (steps_done % interval == 0 or steps_done == max_steps)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns when it runs without a process group; in one process that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def state_dict_options(model: nn.Module) -> StateDictOptions:
    """What a checkpoint holds: every weight, or (LoRA) the trainable adapters only; a load
    then leaves the frozen base as loaded, and DCP still refuses a missing adapter tensor."""
    if is_lora(model):
        return StateDictOptions(ignore_frozen_params=True, strict=False)
    return StateDictOptions()


def scheduler_state(scheduler) -> dict:
    """The LR schedule's numbers (its lambdas are code, rebuilt from the config)."""
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}


def save_checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, run_dir: Path, step: int, keep_last: int
) -> Path:
    """Write ``checkpoints/step_{step}`` (every rank calls this), then prune old ones.

    A failed write (disk full, permission denied) removes the partial folder, leaves every
    complete checkpoint as it was and raises ``WriteFailed`` naming the folder.
    """
    parent = checkpoints_dir(run_dir)
    tmp = tmp_step_dir(parent, step)
    final = checkpoint_step_dir(run_dir, step)
    rank = _rank()
    try:
        if rank == 0:
            begin_step_dir(parent, step)
        _barrier()
        # Each rank's RNG file first: dcp.save is collective, so a rank that failed here
        # stops the others there and the marker is never written.
        save_file(rng_state(), str(tmp / f"rng_rank_{rank}.safetensors"))
        model_state, optim_state = get_state_dict(model, optimizer, options=state_dict_options(model))
        with single_process_quiet():
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp / "model_optim")
        if rank == 0:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
            meta = {"step": step, "world_size": world_size, "lora": is_lora(model), "scheduler": scheduler_state(scheduler)}
            write_json_atomic(tmp / "trainer.json", meta)
            finish_step_dir(tmp, step)
    except (Exception, CheckpointException) as e:  # OSError, or DCP's wrapper of one per rank (a BaseException)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed("checkpoint", final, _root_cause(e)) from e
    if rank == 0:
        prune_step_dirs(parent, keep_last)
    return final


def _root_cause(error: BaseException) -> BaseException:
    """The OSError behind DCP's wrapper exceptions, when there is one."""
    if isinstance(error, CheckpointException):  # {rank: (exception, stack summary)}
        for failure, _ in error.failures.values():
            return _root_cause(failure)
    seen = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return error


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, run_dir: Path, step: int) -> int:
    """Restore the state after ``step`` steps from ``checkpoints/step_{step}``; returns ``step``.

    Only a folder with its marker is read: a half-written one is refused.
    """
    folder = checkpoint_step_dir(run_dir, step)
    if not (folder / MARKER).is_file():
        complete = complete_steps(checkpoints_dir(run_dir))
        raise CheckpointError(
            f"{folder} is not a complete checkpoint (no {MARKER} marker); complete ones: {complete or 'none'}"
        )
    meta = read_meta(folder, step)
    try:
        check_same_mode(meta, model, folder)
        options = state_dict_options(model)
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        state = {"model": model_state, "optim": optim_state}
        with single_process_quiet():
            dcp.load(state, storage_reader=SafeFileSystemReader(folder / "model_optim"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
        scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None] * len(optimizer.param_groups)})
        rng_file = folder / f"rng_rank_{_rank()}.safetensors"
        if rng_file.is_file():  # a run resumed on more ranks than it had keeps the new ranks' seeds
            load_rng_state(rng_file)
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError, pickle.UnpicklingError, CheckpointException) as e:
        raise CheckpointError(f"cannot load checkpoint {folder}: {one_line(_root_cause(e))}") from e
    return step


def read_meta(folder: Path, step: int) -> dict:
    """``trainer.json``, checked for what a load reads from it; one line naming the file and
    the field otherwise (a damaged or hand-edited file must not end in an AttributeError)."""
    path = folder / "trainer.json"
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON, not UTF-8
        raise CheckpointError(f"cannot read {path}: {one_line(e)}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} holds a JSON {type(meta).__name__}, expected an object with step, lora and scheduler")
    if type(meta.get("step")) is not int:
        raise CheckpointError(f"{path}: step is {meta.get('step')!r:.40}, expected a whole number")
    if meta["step"] != step:
        raise CheckpointError(f"{path} says step {meta['step']}, expected {step}")
    if not isinstance(meta.get("lora", False), bool):
        raise CheckpointError(f"{path}: lora is {meta['lora']!r:.40}, expected true or false")
    scheduler = meta.get("scheduler")
    if not isinstance(scheduler, dict) or type(scheduler.get("last_epoch")) is not int:
        raise CheckpointError(f"{path}: scheduler is {scheduler!r:.60}, expected the LR schedule's state (an object with last_epoch)")
    for key in ("base_lrs", "_last_lr"):  # the schedule multiplies these: a string would fail mid-training
        lrs = scheduler.get(key, [])
        if not isinstance(lrs, list) or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in lrs):
            raise CheckpointError(f"{path}: scheduler.{key} is {lrs!r:.60}, expected a list of learning rates")
    return meta


def load_rng_state(path: Path) -> None:
    """Restore this rank's RNG from ``path``; one line naming the file when it is not what
    ``save_checkpoint`` wrote (safetensors raises its own error type, with no file name)."""
    try:
        state = load_file(str(path))
        if not isinstance(state.get("cpu"), torch.Tensor) or state["cpu"].dtype != torch.uint8:
            raise ValueError("no uint8 tensor `cpu` (the CPU generator's state)")
        set_rng_state(state)
    except Exception as e:  # noqa: BLE001 - SafetensorError, or torch refusing a wrong-sized state
        raise CheckpointError(f"cannot load checkpoint {path.parent}: {path.name} is not an RNG state file: {one_line(e)}") from e


def check_same_mode(meta: dict, model: nn.Module, folder: Path) -> None:
    """A LoRA checkpoint holds adapters only, a full one no adapters: neither resumes as the other."""
    saved, now = bool(meta.get("lora", False)), is_lora(model)
    if saved != now:
        kinds = {True: "LoRA adapters (`[trainer.lora]`)", False: "full fine-tuning (no `[trainer.lora]`)"}
        raise CheckpointError(f"{folder} was written by {kinds[saved]}, but this run is configured for {kinds[now]}")


# --------------------------------------------------------------------------- metadata without pickle


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, but its ``.metadata`` file may only build DCP's own metadata classes.

    Stock DCP reads that file with a plain ``pickle.load``, which runs whatever a tampered
    file asks for. Here every global it names must be on an allowlist (the metadata
    dataclasses, ``torch.Size``, dtypes, paths), so nothing else can be constructed.
    Tensor payloads are raw bytes and non-tensor values are read by DCP with
    ``torch.load(weights_only=True)``, so no part of a checkpoint is unpickled freely.
    """

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    *((_DCP_METADATA, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "Path"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _ALLOWED_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which is not a DCP metadata type")
