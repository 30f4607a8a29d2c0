"""One side of a weight-update group broadcast: the trainer's sender or the engine's receiver; prints JSON.

    python child_broadcast.py send|receive PORT BACKEND DEVICE

The sender hosts the group with ``tidal.weights_sync.transport.create_group`` (rank 0), packs buckets with
``tidal.weights_sync.bucket`` and broadcasts them; the receiver joins through the embedded engine's
``WeightReceiver`` (rank 1) with ``load_format="flattened_bucket"``, as ``/update_weights_from_distributed``
does, and compares every received tensor bit for bit with the same seeded tensors built locally.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from tidal.weights_sync import bucket

GROUP = "tidal-gpu-suite"
BUCKET_BYTES = 8 << 20


def named_tensors(device: str) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    out = []
    for layer in range(4):
        for proj, shape in (("q_proj", (512, 1024)), ("down_proj", (1024, 1536)), ("norm", (1024,))):
            dtype = torch.float32 if proj == "norm" else torch.bfloat16
            out.append(
                (f"model.layers.{layer}.{proj}.weight", torch.randn(shape, generator=gen).to(device, dtype))
            )
    return out


def main() -> None:
    role, port, backend, device = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if device == "cuda":
        torch.cuda.set_device(0)
    tensors = named_tensors(device)
    buckets = bucket.plan_buckets(tensors, BUCKET_BYTES)
    result: dict = {
        "role": role,
        "buckets": len(buckets),
        "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
    }
    if role == "send":
        from tidal.weights_sync.transport import create_group

        group = create_group(
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            group_name=GROUP,
            backend=backend,
        )
        group.barrier()
        started = time.perf_counter()
        for items in buckets:
            buf, _ = bucket.pack(items)
            group.broadcast(buf, src=0)
        if device == "cuda":
            torch.cuda.synchronize()
        result["seconds"] = time.perf_counter() - started
        group.barrier()
        group.destroy()
    else:
        from tidal.rollout.embedded.weights import WeightReceiver

        receiver = WeightReceiver(device, timeout_s=60)
        receiver.init_group(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
            group_name=GROUP,
            backend=backend,
        )
        group = receiver.groups[GROUP]
        group.barrier()
        expected = dict(tensors)
        received: dict[str, torch.Tensor] = {}
        for items in buckets:
            spec = bucket.pack(items)[1]
            got = receiver.receive(
                names=spec.names,
                dtypes=spec.dtypes,
                shapes=spec.shapes,
                group_name=GROUP,
                load_format="flattened_bucket",
            )
            received.update((n, t.clone()) for n, t in got)
        group.barrier()
        result["devices"] = sorted({t.device.type for t in received.values()})
        result["names_equal"] = sorted(received) == sorted(expected)
        result["differ"] = [
            n
            for n, t in expected.items()
            if not (t.dtype == received[n].dtype and torch.equal(t, received[n]))
        ]
        receiver.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
