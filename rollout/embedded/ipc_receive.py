"""The engine side of colocated weight sync: SGLang's ``/update_weights_from_tensor`` payloads, decoded.

A sender on the same GPU packs a bucket on the device and posts it as ``serialized_named_tensors``: one
base64 string per engine rank (the embedded engine has one), each a ``ForkingPickler`` pickle (SGLang's
``MultiprocessingSerializer``) whose CUDA tensors travel as CUDA IPC handles (``torch.multiprocessing``'s
reductions), not as bytes. With ``load_format="flattened_bucket"`` the pickle is
``{"flattened_tensor": uint8 tensor, "metadata": [entry, ...]}``, each entry naming a tensor by
``name, shape, dtype, start_idx, end_idx, numel`` (SGLang's ``FlattenedTensorMetadata``, or any object
with those attributes); with ``load_format`` null or ``"direct"`` it is a list of ``(name, tensor)``.

Unpickling runs a fixed allow-list of globals (containers, torch dtypes and sizes, the CUDA rebuild
functions), as SGLang's ``SafeUnpickler`` does; SGLang's own names (its metadata class, its
device-UUID-aware rebuild function) map onto local equivalents, so a payload made by SGLang's client
loads without SGLang installed. A rebuilt tensor maps the sender's memory: it must be copied into the
weights, and every reference dropped, before the reply tells the sender it may reuse its buffer.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import collections
import io
import pickle
import types
from dataclasses import dataclass
from multiprocessing import resource_sharer
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict
from torch.multiprocessing import reductions

LOAD_FORMATS = (None, "direct", "auto", "flattened_bucket")


class IpcPayloadError(ValueError):
    """A /update_weights_from_tensor request the engine refuses (HTTP 400 with this message)."""


class UpdateFromTensorBody(BaseModel):
    """SGLang's ``UpdateWeightsFromTensorReqInput`` as its HTTP clients send it."""

    model_config = ConfigDict(extra="ignore")
    rid: str | None = None
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


@dataclass
class BucketEntry:
    """One tensor of a flattened bucket (SGLang's ``FlattenedTensorMetadata``, field for field)."""

    name: str
    shape: Any
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _device_index(device: int | str) -> int:
    """SGLang's senders name the device by its UUID (robust to different CUDA_VISIBLE_DEVICES)."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        for index in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(index).uuid) == device:
                return index
        raise IpcPayloadError(
            f"the payload's tensors live on GPU {device}, which this engine cannot see: CUDA IPC needs "
            "the sender and the engine on the same GPU (use the collective transport otherwise)"
        )
    raise IpcPayloadError(f"the payload names its device as {device!r}: expected an index or a GPU UUID")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    # argument 6 is the storage's device (torch.multiprocessing.reductions.reduce_tensor's layout)
    args = (*args[:6], _device_index(args[6]), *args[7:])
    return reductions.rebuild_cuda_tensor(*args)


def _torch_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch", "Tensor"): torch.Tensor,
        ("torch", "device"): torch.device,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
        ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
        ("torch", "UntypedStorage"): torch.UntypedStorage,
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): BucketEntry,
        ("types", "SimpleNamespace"): types.SimpleNamespace,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    for name in ("dict", "list", "tuple", "int", "float", "str", "bool", "bytes", "slice"):
        allowed[("builtins", name)] = getattr(builtins, name)
    return allowed


_ALLOWED = _torch_globals()
# host tensors travel by shared-memory file descriptors: only tests allow them (the route refuses a CPU engine)
_HOST_SHARING = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"): reductions.rebuild_storage_fd,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): reductions.rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    ("multiprocessing.resource_sharer", "DupFd"): resource_sharer.DupFd,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allow_host: bool):
        super().__init__(io.BytesIO(data))
        self.allowed = {**_ALLOWED, **_HOST_SHARING} if allow_host else _ALLOWED

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            hint = (
                " (host tensors: this route takes CUDA tensors shared by CUDA IPC)"
                if (module, name) in _HOST_SHARING
                else ""
            )
            raise IpcPayloadError(
                f"the payload's pickle refers to {module}.{name}, which the engine does not load{hint}: "
                "send CUDA tensors and plain containers, as SGLang's MultiprocessingSerializer does"
            )
        return found


def decode_payload(payload: str | bytes, *, allow_host: bool = False) -> Any:
    """One entry of ``serialized_named_tensors`` (base64 text) as the object its sender pickled."""
    if isinstance(payload, str):
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise IpcPayloadError(f"serialized_named_tensors[0] is not valid base64: {exc}") from exc
    else:
        data = bytes(payload)
    try:
        return _Unpickler(data, allow_host).load()
    except IpcPayloadError:
        raise
    except RuntimeError as exc:  # e.g. the IPC handle cannot be opened (another GPU, a dead sender)
        raise IpcPayloadError(f"the payload's CUDA tensors could not be opened: {exc}") from exc
    except (pickle.UnpicklingError, EOFError, TypeError, AttributeError, ValueError) as exc:
        raise IpcPayloadError(f"serialized_named_tensors[0] is not a tensor pickle: {exc}") from exc


def _entry_fields(entry: Any, i: int) -> tuple[str, list[int], torch.dtype, int, int]:
    try:
        name, shape, dtype = entry.name, [int(d) for d in entry.shape], entry.dtype
        start, end = int(entry.start_idx), int(entry.end_idx)
    except (AttributeError, TypeError, ValueError) as exc:
        raise IpcPayloadError(
            f"metadata[{i}] must have name, shape, dtype, start_idx, end_idx and numel: {exc}"
        ) from exc
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
        raise IpcPayloadError(f"metadata[{i}]: name must be a string and dtype a torch dtype")
    return name, shape, dtype, start, end


def bucket_tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """Views into a flattened bucket's tensor, one per metadata entry, checked against its bounds."""
    if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
        raise IpcPayloadError(
            "load_format='flattened_bucket' takes a pickled dict with 'flattened_tensor' and 'metadata'"
        )
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise IpcPayloadError("flattened_tensor must be a one-dimensional tensor")
    if not isinstance(metadata, list) or not metadata:
        raise IpcPayloadError("metadata must be a non-empty list")
    flat = flat.view(torch.uint8)
    out = []
    for i, entry in enumerate(metadata):
        name, shape, dtype, start, end = _entry_fields(entry, i)
        n = 1
        for d in shape:
            if d < 0:
                raise IpcPayloadError(f"{name}: negative dimension in shape {shape}")
            n *= d
        nbytes = n * dtype.itemsize
        if end - start != nbytes or not 0 <= start <= end <= flat.numel():
            raise IpcPayloadError(
                f"{name}: bytes [{start}, {end}) do not hold a {dtype} tensor of shape {shape} "
                f"({nbytes} bytes) inside the {flat.numel()}-byte bucket"
            )
        if start % dtype.itemsize:
            raise IpcPayloadError(f"{name}: byte offset {start} is not aligned to {dtype}")
        out.append((name, flat[start:end].view(dtype).view(shape)))
    return out


def named_tensors(obj: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs a decoded payload carries, for ``load_format``."""
    if load_format == "flattened_bucket":
        return bucket_tensors(obj)
    if load_format not in LOAD_FORMATS:
        raise IpcPayloadError(
            f"load_format={load_format!r} is not supported: use 'flattened_bucket', 'direct' or null"
        )
    if isinstance(obj, dict):
        obj = list(obj.items())
    if not isinstance(obj, list) or not obj:
        raise IpcPayloadError("the payload must be a non-empty list of (name, tensor) pairs")
    out = []
    for i, item in enumerate(obj):
        if (
            not isinstance(item, tuple | list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], torch.Tensor)
        ):
            raise IpcPayloadError(f"entry {i} of the payload is not a (name, tensor) pair")
        out.append((item[0], item[1]))
    return out


def parse_request(body: UpdateFromTensorBody, *, allow_host: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one request (views of the sender's memory: copy them, then drop them)."""
    if body.selector == "draft":
        raise IpcPayloadError("selector='draft': the embedded engine has no draft model")
    if len(body.serialized_named_tensors) != 1:
        raise IpcPayloadError(
            f"serialized_named_tensors has {len(body.serialized_named_tensors)} entries: the embedded engine "
            "is one rank (tp_size 1), send exactly one"
        )
    if body.load_format not in LOAD_FORMATS:
        raise IpcPayloadError(
            f"load_format={body.load_format!r} is not supported: use 'flattened_bucket', 'direct' or null"
        )
    return named_tensors(
        decode_payload(body.serialized_named_tensors[0], allow_host=allow_host), body.load_format
    )


def check_engine_device(device: torch.device) -> None:
    """CUDA IPC maps GPU memory between processes: a CPU engine cannot take it."""
    if device.type != "cuda":
        raise IpcPayloadError(
            f"/update_weights_from_tensor passes CUDA tensors by CUDA IPC handles, which needs a CUDA engine; "
            f"this engine runs on {device}: use /update_weights_from_distributed "
            "(weights_sync.transport='collective')"
        )
