"""Save and resume the trainer with megatron-core's dist_checkpointing.

A checkpoint directory ``<run_dir>/checkpoints/step_<N>`` holds the model (sharded tensors, so any rank
layout of the same mesh reloads it), the distributed optimizer's state, the learning-rate schedule, every
rank's RNG states, and the loop's progress: optimizer steps taken (the policy version) and the last broker
batch consumed, so that a killed trainer resumes without losing or repeating a batch.
``<run_dir>/checkpoints/latest`` names the newest complete one; it is written last, after every rank has
finished saving, so a trainer killed mid-save resumes from the previous checkpoint.

Under ``trainer.optimizer.kind=fsdp2`` (Megatron-FSDP) megatron 0.19's distributed optimizer only offers its
``fsdp_dtensor`` format, which Megatron-LM's training loop completes with its own torch-DCP glue for uneven
DTensor shards. tidal saves instead each rank's own shards -- the fp32 main weights (the model is rebuilt
from them), Adam's moments and step, and the model's persistent buffers (the router's expert bias) -- in
``fsdp2_rank<R>.pt`` beside the same schedule, RNG and progress.
Such a checkpoint resumes on the same world size and mesh only (checked, with an error naming both).
"""

from __future__ import annotations

import json
import queue
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tidal.trainer.models import unwrap

_FORMAT = 1


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken == the policy version
    last_batch_id: int = -1  # the last broker batch fully trained on
    samples: int = 0


def _model_keys(chunks) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return dict(
        python=random.getstate(),
        numpy=np.random.get_state(),
        torch=torch.get_rng_state(),
        cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        tracker=get_cuda_rng_tracker().get_states(),
    )


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state_dict(state, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd: dict = {}
    model_sd: dict = {}
    for key, chunk in zip(_model_keys(state.chunks), state.chunks, strict=True):
        sd[key] = unwrap(chunk).sharded_state_dict()
        model_sd.update(sd[key])
    sd["optimizer"] = state.optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    sd["rng"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return sd


def _inner_optimizers(state) -> list:
    return [opt.optimizer for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer])]


def _adam_steps(state) -> list[float | None]:
    steps = []
    for inner in _inner_optimizers(state):
        values = {float(st["step"]) for st in inner.state.values() if "step" in st}
        steps.append(values.pop() if len(values) == 1 else None)
    return steps


def _restore_adam_steps(state, steps: list[float | None]) -> None:
    # megatron 0.19's distributed optimizer, without Apex or TE, reloads torch Adam's per-parameter step
    # count from the placeholder states it loads into, so the bias correction would restart; set it back.
    # The count goes where torch's own load would put it: on the parameter's device for the fused (or
    # capturable) kernel, which refuses a count on the CPU (every resume on a GPU failed so), else the CPU.
    for inner, step in zip(_inner_optimizers(state), steps, strict=True):
        for group in inner.param_groups:
            on_param = bool(group.get("fused") or group.get("capturable"))
            for param in group["params"]:
                st = inner.state.get(param)
                if not st or "step" not in st:
                    continue
                old = st["step"]
                value = float(old) if step is None else step
                if torch.is_tensor(old) or on_param:
                    dtype = old.dtype if torch.is_tensor(old) else torch.float32
                    device = param.device if on_param else torch.device("cpu")
                    st["step"] = torch.tensor(value, dtype=dtype, device=device)
                else:
                    st["step"] = value


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _is_fsdp(state) -> bool:
    from tidal.trainer.optimizer import is_fsdp

    return is_fsdp(state.chunks[0])


def _fsdp_file(path: Path, rank: int) -> Path:
    return path / f"fsdp2_rank{rank:05d}.pt"


def _mesh_signature() -> dict:
    from megatron.core import parallel_state as ps

    return dict(
        world=dist.get_world_size(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
    )


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _persistent_buffers(chunks) -> list[dict[str, torch.Tensor]]:
    """Each chunk's buffers that belong to the model's state (e.g. the router's expert bias)."""
    out = []
    for chunk in chunks:
        buffers = {}
        for prefix, module in unwrap(chunk).named_modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    buffers[f"{prefix}.{name}" if prefix else name] = buffer
        out.append(buffers)
    return out


def _save_fsdp(state, path: Path, progress: Progress) -> None:
    shards = []
    for inner in _inner_optimizers(state):
        for group in inner.param_groups:
            for param in group["params"]:
                moments = inner.state.get(param, {})
                shards.append(
                    dict(
                        shape=tuple(param.shape),
                        main=_local(param).detach().clone(),
                        adam={k: _local(v).detach().clone() for k, v in moments.items()},
                    )
                )
    torch.save(
        dict(
            format=_FORMAT,
            mesh=_mesh_signature(),
            shards=shards,
            buffers=[
                {k: v.detach().clone() for k, v in b.items()} for b in _persistent_buffers(state.chunks)
            ],
            scheduler=state.scheduler.state_dict(),
            progress=asdict(progress),
            rng=_rng_state(),
        ),
        _fsdp_file(path, dist.get_rank()),
    )


@torch.no_grad()
def _load_fsdp(state, path: Path) -> Progress:
    file = _fsdp_file(path, dist.get_rank())
    if not file.exists():
        raise FileNotFoundError(
            f"{file} is missing: {path} is not an fsdp2 checkpoint of this world size; resume with the "
            "optimizer kind, world size and mesh it was saved with"
        )
    saved = torch.load(file, weights_only=False)
    if saved["format"] != _FORMAT or saved["mesh"] != _mesh_signature():
        raise ValueError(
            f"{path}: an fsdp2 checkpoint holds each rank's own shards and resumes on the mesh it was saved "
            f"with only: saved {saved['mesh']}, now {_mesh_signature()}"
        )
    shards = iter(saved["shards"])
    for inner in _inner_optimizers(state):
        for group in inner.param_groups:
            for param in group["params"]:
                shard = next(shards)
                if tuple(param.shape) != shard["shape"]:
                    raise ValueError(
                        f"{path}: parameter of shape {tuple(param.shape)} saved as {shard['shape']}"
                    )
                _local(param).copy_(shard["main"])
                moments = {}
                for key, value in shard["adam"].items():
                    if key == "step":
                        moments[key] = value.clone()
                    else:
                        moments[key] = torch.zeros_like(param)
                        _local(moments[key]).copy_(value)
                inner.state[param] = moments
    for buffers, saved_buffers in zip(_persistent_buffers(state.chunks), saved["buffers"], strict=True):
        if buffers.keys() != saved_buffers.keys():
            raise ValueError(f"{path}: model buffers {sorted(saved_buffers)} do not match {sorted(buffers)}")
        for name, buffer in buffers.items():
            buffer.copy_(saved_buffers[name])
    # the model's (sharded) compute weights from the restored main weights
    for chunk in state.chunks:
        chunk.module.install_optimized_model_weights()
    state.scheduler.load_state_dict(saved["scheduler"])
    _set_rng_state(saved["rng"])
    return Progress(**saved["progress"])


def save(state, run_dir: str | Path, progress: Progress) -> Path:
    """Save on every rank (collective); returns the checkpoint's directory."""
    from megatron.core import dist_checkpointing

    root = checkpoint_dir(run_dir)
    path = root / f"step_{progress.step}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if _is_fsdp(state):
        _save_fsdp(state, path, progress)
    else:
        sd = _sharded_state_dict(state, is_loading=False)
        sd["scheduler"] = state.scheduler.state_dict()
        sd["progress"] = asdict(progress)
        sd["adam_steps"] = _adam_steps(state)
        sd["format"] = _FORMAT
        _write_results_in_process()
        dist_checkpointing.save(sd, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = root / "latest.tmp"
        tmp.write_text(json.dumps({"path": path.name, **asdict(progress)}))
        tmp.replace(root / "latest")
    dist.barrier()
    return path


def _write_results_in_process() -> None:
    """Give megatron's checkpoint writer an in-process results queue before its first save.

    Its default is a ``multiprocessing`` Manager queue: a server process of its own (~700 MB resident, it
    imports the trainer's modules) that outlives a trainer killed with SIGKILL, one orphan per crash and
    rank. Our saves are synchronous: the writer's threads put their results and the same process takes
    them, so a plain queue carries them.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def latest(run_dir: str | Path) -> Path | None:
    marker = checkpoint_dir(run_dir) / "latest"
    if not marker.exists():
        return None
    return checkpoint_dir(run_dir) / json.loads(marker.read_text())["path"]


def load(state, path: str | Path) -> Progress:
    """Restore model, optimizer, schedule and RNG from ``path`` (collective); returns the progress."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if _is_fsdp(state):
        return _load_fsdp(state, path)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(
            f"{path} is not a dist_checkpointing checkpoint (no metadata.json); "
            "pass a directory written by tidal's trainer, e.g. <run_dir>/checkpoints/step_N"
        )
    for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        if not opt.optimizer.state:
            # the sharded state dict is built from existing Adam states; the load overwrites these
            opt._init_optimizer_states_with_dummy_values()
    sd = _sharded_state_dict(state, is_loading=True)
    sd["scheduler"] = None
    sd["progress"] = None
    sd["adam_steps"] = None
    sd["format"] = None
    loaded = dist_checkpointing.load(sd, str(path))
    if loaded.get("format") != _FORMAT:
        raise ValueError(f"{path}: checkpoint format {loaded.get('format')} is not {_FORMAT}")
    with torch.no_grad():  # the optimizer copies into views of its fp32 main parameters
        for key, chunk in zip(_model_keys(state.chunks), state.chunks, strict=True):
            unwrap(chunk).load_state_dict(loaded[key])
        state.optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(state, loaded["adam_steps"])
    state.scheduler.load_state_dict(loaded["scheduler"])
    _set_rng_state(loaded["rng"])
    return Progress(**loaded["progress"])
