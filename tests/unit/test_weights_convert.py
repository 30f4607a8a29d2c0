"""`tidal convert`: Hugging Face directory -> megatron-core shards for a mesh -> Hugging Face, bitwise."""

from __future__ import annotations

import pytest
import torch

from tidal.cli import main as tidal_main
from tidal.weights_sync import hf_io
from tidal.weights_sync.megatron_io import read_meta
from tidal.weights_sync.tiny_models import TINY, save_random_hf

MESHES = {
    "tp2": ["trainer.nproc=2", "trainer.mesh.tp=2"],
    "pp2_vpp2": ["trainer.nproc=2", "trainer.mesh.pp=2", "trainer.mesh.vpp=2"],
    "tp2_pp2_ep2_etp2": [
        "trainer.nproc=8",
        "trainer.mesh.tp=2",
        "trainer.mesh.pp=2",
        "trainer.mesh.ep=2",
        "trainer.mesh.etp=2",
    ],
}


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("family", list(TINY))
def test_convert_round_trip_is_bitwise(tmp_path, family, mesh):
    overrides = list(MESHES[mesh])
    if not TINY[family].is_moe:
        overrides = [o for o in overrides if ".ep=" not in o and ".etp=" not in o]
    src = save_random_hf(TINY[family], tmp_path / "hf")
    assert (
        tidal_main(
            ["convert", f"model.path={src}", *overrides, "--to", "megatron", "--out", str(tmp_path / "mc")]
        )
        == 0
    )
    assert (
        tidal_main(["convert", "--to", "hf", "--from", str(tmp_path / "mc"), "--out", str(tmp_path / "back")])
        == 0
    )

    original, back = hf_io.load_tensors(src), hf_io.load_tensors(tmp_path / "back")
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert hf_io.raw_config(tmp_path / "back") == hf_io.raw_config(src)
    _, _, padded, _ = read_meta(tmp_path / "mc")
    assert padded == TINY[family].vocab_size  # tidal's trainer does not pad the vocab


def test_convert_names_a_broken_mesh(tmp_path, capsys):
    src = save_random_hf(TINY["qwen3"], tmp_path / "hf")
    code = tidal_main(
        [
            "convert",
            f"model.path={src}",
            "trainer.nproc=3",
            "trainer.mesh.pp=3",
            "--to",
            "megatron",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert code == 2
    assert "not divisible by pp*vpp=3" in capsys.readouterr().err


def test_convert_names_a_missing_directory(tmp_path, capsys):
    code = tidal_main(
        ["convert", "--to", "megatron", "--from", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]
    )
    assert code == 1
    assert "no config.json" in capsys.readouterr().err


def test_hf_io_shards_large_checkpoints(tmp_path):
    tensors = {f"w{i}": torch.randn(64, 64) for i in range(5)}
    hf_io.save(tmp_path, tensors, max_shard_bytes=40_000)
    assert (tmp_path / hf_io.INDEX).exists()
    back = hf_io.load_tensors(tmp_path)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
