"""Pure helpers of the trainer: flags, context-parallel token split, micro-batch padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.broker.types import Sample
from tidal.cli import load_run_config
from tidal.errors import ConfigError
from tidal.trainer.attention import cp_token_positions
from tidal.trainer.config import check_fsdp2_mesh
from tidal.trainer.main import main as train_main
from tidal.trainer.main import parse_options as train_options
from tidal.trainer.packing import SequenceItem, build_micro_batch
from tidal.trainer.sft import parse_options as sft_options
from tidal.trainer.step import cp_local, local_cu_seqlens, pad_micro_batch


def test_train_and_sft_flags_parse_and_reject_unknown_ones():
    opts = train_options(["--init=/a", "--out", "/b", "--resume", "never"])
    assert (opts.init, opts.out, opts.resume) == ("/a", "/b", "never")
    with pytest.raises(ConfigError, match="unknown argument '--bogus'"):
        train_options(["--bogus", "1"])
    with pytest.raises(ConfigError, match="--resume='sometimes'"):
        train_options(["--resume=sometimes"])
    s = sft_options(["--lr", "1e-3", "--steps=4", "--wall-s", "2.5"])
    assert (s.lr, s.steps, s.wall_s) == (1e-3, 4, 2.5)
    with pytest.raises(ConfigError, match="--steps='many' is not a int"):
        sft_options(["--steps", "many"])


def test_train_refuses_losses_the_loop_cannot_feed_before_starting_anything():
    # IS corrections over several minibatches need the batch's proximal logprobs
    config = load_run_config(None, ["trainer.loss.tis=token", "trainer.minibatches_per_batch=2"])
    with pytest.raises(ValueError, match="recompute_proximal_logprobs=true"):
        train_main(config, [])


def test_fsdp2_with_pipeline_parallelism_is_refused_with_the_reason():
    # megatron-core 0.19's Megatron-FSDP lays its mesh out over dp x cp, ep and tp only
    with pytest.raises(ValueError, match="fsdp2 with trainer.mesh.pp=2.*pipeline parallelism"):
        check_fsdp2_mesh("fsdp2", 2)
    check_fsdp2_mesh("fsdp2", 1)
    check_fsdp2_mesh("dist_opt", 2)


def test_cp_positions_are_load_balanced_chunks_covering_every_token_once():
    cu = torch.tensor([0, 8, 16, 20])  # lengths 8, 8, 4: multiples of 2 * cp = 4
    ranks = [cp_token_positions(cu, 2, r).tolist() for r in range(2)]
    # rank r holds chunks r and 2*cp-1-r of each sequence
    assert ranks[0] == [0, 1, 6, 7, 8, 9, 14, 15, 16, 19]
    assert ranks[1] == [2, 3, 4, 5, 10, 11, 12, 13, 17, 18]
    assert sorted(ranks[0] + ranks[1]) == list(range(20))
    with pytest.raises(ValueError, match="not a multiple of 2\\*cp=4"):
        cp_token_positions(torch.tensor([0, 6]), 2, 0)


def _micro_batch(lengths, pad_multiple=1):
    items = []
    for i, n in enumerate(lengths):
        r = n - 2
        items.append(
            SequenceItem(
                Sample(
                    prompt_ids=np.arange(2, dtype=np.int32) + i,
                    response_ids=np.arange(r, dtype=np.int32) + 10 * i,
                    logprobs=np.full(r, -1.0, np.float32),
                    versions=np.zeros(r, np.int32),
                    reward=1.0,
                    finish_reason="stop",
                ),
                advantage=0.5,
            )
        )
    return build_micro_batch(items, list(range(len(items))), pad_multiple=pad_multiple)


def test_cp_local_keeps_each_ranks_tokens_and_local_boundaries():
    mb = _micro_batch([6, 7], pad_multiple=4)  # padded to 8 + 8
    parts = [cp_local(mb, 2, r) for r in range(2)]
    assert [p.tokens.numel() for p in parts] == [8, 8]
    assert torch.equal(local_cu_seqlens(mb, 2), torch.tensor([0, 4, 8], dtype=torch.int32))
    assert float(parts[0].loss_mask.sum() + parts[1].loss_mask.sum()) == float(mb.loss_mask.sum())


def test_padding_adds_one_masked_filler_sequence():
    mb = _micro_batch([5, 4])
    padded = pad_micro_batch(mb, 12)
    assert padded.num_tokens == 12
    assert padded.cu_seqlens.tolist() == [0, 5, 9, 12]
    assert padded.cu_seqlens_padded.tolist() == [0, 5, 9, 12]
    assert float(padded.loss_mask[9:].sum()) == 0.0
    assert torch.equal(padded.tokens[:9], mb.tokens)
    assert pad_micro_batch(mb, 9) is mb
    with pytest.raises(ValueError, match="cannot pad"):
        pad_micro_batch(mb, 3)


def test_model_builder_refuses_meshes_it_cannot_train_correctly():
    from tidal.model_config import ModelConfig
    from tidal.trainer.mesh import MeshConfig
    from tidal.trainer.models import transformer_config

    mla = ModelConfig(
        family="deepseek_v3",
        vocab_size=64,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )
    with pytest.raises(ValueError, match="deepseek_v3 with tp>1 needs Transformer Engine"):
        transformer_config(mla, MeshConfig(tp=2))
    with pytest.raises(ValueError, match="q_lora_rank must be set"):
        transformer_config(mla.model_copy(update={"q_lora_rank": None}), MeshConfig())
    with pytest.raises(ValueError, match="vocab_size=66 is not divisible by tp=4"):
        transformer_config(ModelConfig(vocab_size=66), MeshConfig(tp=4))
