"""Convert checkpoints between Hugging Face and megatron-core layouts.

    tidal convert [CONFIG.yaml] model.path=HF_DIR trainer.nproc=4 trainer.mesh.tp=2 ... --to megatron --out DIR
    tidal convert --to hf --from MEGATRON_DIR --out DIR

``--to megatron`` shards the Hugging Face directory ``--from`` (default: ``model.path``) for the mesh of
``trainer.mesh`` (tp, pp, vpp, ep, etp; the config validates it against the model and the world size
``trainer.nproc * trainer.nnodes``, so set ``model.path`` and ``trainer.nproc`` with the mesh). The
vocab is padded to a multiple of ``--vocab-divisible-by`` x tp; the default 1 matches tidal's trainer,
which does not pad (it requires tp to divide the vocab); 128 is megatron-LM's usual padding.
``--to hf`` gathers a converted directory back into a Hugging Face directory (config.json and
safetensors), bitwise equal to the tensors it came from.
"""

from __future__ import annotations

import argparse
import math
import sys

from tidal.errors import ConfigError
from tidal.weights_sync import hf_io, megatron_io
from tidal.weights_sync.families import padded_vocab_size


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal convert", add_help=False)
    p.add_argument("--to", choices=["megatron", "hf"], required=True)
    p.add_argument("--from", dest="src", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-divisible-by", type=int, default=1)
    return p


def main(config, args: list[str]) -> int:
    try:
        opts = _parser().parse_args(args)
    except SystemExit as exc:  # argparse already printed what is wrong
        return int(exc.code or 2)
    try:
        if opts.src is None:
            opts.src = config.model.path
        if opts.src is None:
            print("tidal convert: give --from DIR (or model.path=DIR for --to megatron)", file=sys.stderr)
            return 2
        if opts.to == "megatron":
            model = hf_io.load_config(opts.src)
            m = config.trainer.mesh
            mesh = megatron_io.Mesh(tp=m.tp, pp=m.pp, vpp=m.vpp, ep=m.ep, etp=m.etp)
            _check_mesh(m, model)
            padded = padded_vocab_size(model.vocab_size, mesh.tp, opts.vocab_divisible_by)
            megatron_io.save_megatron(
                opts.out, hf_io.load_tensors(opts.src), model, mesh, padded, hf_io.raw_config(opts.src)
            )
            print(f"wrote megatron-core checkpoint for {mesh} to {opts.out}")
        else:
            tensors, hf_config = megatron_io.load_megatron_as_hf(opts.src)
            hf_io.save(opts.out, tensors, hf_config)
            print(f"wrote Hugging Face checkpoint ({len(tensors)} tensors) to {opts.out}")
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"tidal convert: {exc}", file=sys.stderr)
        return 1
    return 0


def _check_mesh(mesh, model) -> None:
    """The mesh's rules on the model (heads by tp, layers by pp*vpp, experts by ep), for its smallest world."""
    from tidal.trainer.mesh import mesh_errors

    world = mesh.pp * math.lcm(mesh.tp * mesh.cp, mesh.ep * mesh.etp)
    errors = mesh_errors(mesh, world, model)
    if errors:
        raise ConfigError("; ".join(errors))
