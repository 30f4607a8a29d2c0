"""A real ``tidal serve`` process receives pipelined, ordered buckets from the real ``WeightSender``.

The engine declares ``ordered_buckets`` in its ``/init_weights_update_group`` reply, so the sender
announces each bucket with ``bucket_seq`` ahead of the previous reply (two in flight) and the engine
receives bucket k+1 while it loads bucket k (tidal.weights_sync.receiver, shared with the stand-in).
SGLang-shaped clients (no ``bucket_seq``) are covered by test_engine_server.py.
"""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from tidal.model_config import ModelConfig
from tidal.rollout.embedded.model import build_model
from tidal.rollout.embedded.testing import TINY_QWEN3, served_engine, served_greedy, served_weight
from tidal.weights_sync import bucket
from tidal.weights_sync.config import WeightSyncConfig
from tidal.weights_sync.engine_api import EngineEndpoint
from tidal.weights_sync.families import mapping_for
from tidal.weights_sync.sender import WeightSender

pytestmark = pytest.mark.slow

MODEL = TINY_QWEN3
ENGINE_SEED = 7
PROMPT = [3, 1, 4, 1, 5]
# a fresh `tidal serve` of MODEL: small batch and cache, one thread
ENGINE = (
    MODEL,
    f"seed={ENGINE_SEED}",
    "rollout.engine.max_batch_size=4",
    "rollout.engine.max_seq_len=64",
    "rollout.engine.weight_update_timeout_s=30",
    "rollout.engine.num_threads=1",
)


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    with served_engine(
        *ENGINE,
        log_path=tmp_path_factory.mktemp("serve") / "serve.log",
    ) as proc:
        yield proc.url


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face tensors of MODEL initialised with ``seed`` (not the engine's). q/k/v and gate/up are
    views into one fused tensor each, back to back: the sender sends each such pair or triple as one
    broadcast. The engine receives gate/up into its own fused matrix; q/k/v under their HF names go through
    its receive buffer (its fused Q/K/V rows lie in megatron's grouped order, which a trainer's sync sends
    whole: the last test)."""
    lm = build_model(ModelConfig(**MODEL), seed=seed, device="cpu", dtype="float32", fuse=False)
    tensors = {name: p.detach().clone() for name, p in lm.named_parameters()}
    for layer in range(MODEL["num_hidden_layers"]):
        for prefix, parts in (
            (f"model.layers.{layer}.self_attn.", "qkv"),
            (f"model.layers.{layer}.mlp.", "gu"),
        ):
            names = [prefix + {"q": "q_proj", "k": "k_proj", "v": "v_proj", "g": "gate_proj", "u": "up_proj"}[c]
                     + ".weight" for c in parts]  # fmt: skip
            fused = torch.cat([tensors[n] for n in names])
            for n, view in zip(names, fused.split([tensors[n].shape[0] for n in names]), strict=True):
                tensors[n] = view
    return tensors


QKV = {
    f"model.layers.{layer}.self_attn.{p}_proj.weight"
    for layer in range(MODEL["num_hidden_layers"])
    for p in "qkv"
}


def _served(url: str, name: str) -> torch.Tensor:
    return served_weight(url, name, truncate_size=1 << 20)


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/tidal/stats", timeout=30).json()


def _greedy(url: str) -> list[int]:
    return served_greedy(url, PROMPT, max_new_tokens=8)


def _sync(url: str, weights: dict[str, torch.Tensor], version: int, **config):
    # 16 KiB buckets: ~20 buckets for this ~300 KB model, so many are announced ahead of their replies
    config = WeightSyncConfig(bucket_bytes=16 << 10, segmented_bucket_bytes=16 << 10, timeout_s=30, **config)
    sender = WeightSender(config, [EngineEndpoint(url)])
    try:
        report = sender.sync(lambda: iter(weights.items()), version=version)
        group_name = sender._group.name if sender._group is not None else None
    finally:
        sender.close()
    return report, group_name


def _bucket_body(name: str, tensor: torch.Tensor, group_name: str, seq: int) -> dict:
    _, spec = bucket.pack([(name, tensor)])
    return {
        "names": spec.names,
        "dtypes": spec.dtypes,
        "shapes": spec.shapes,
        "group_name": group_name,
        "load_format": "flattened_bucket",
        "bucket_seq": seq,
    }


def test_serve_receives_pipelined_ordered_buckets_bitwise(engine_url):
    url = engine_url
    new = _weights(seed=11)
    before = _stats(url)

    # tensors of 8 KiB and more go out on their own, straight into the paused engine's weights
    report, _ = _sync(url, new, version=1, own_broadcast_bytes=8 << 10)

    assert report.ok and not report.dropped, report
    assert report.inflight == 2, "the engine did not declare ordered_buckets: one announcement at a time"
    assert report.buckets >= 10
    after = _stats(url)
    assert after["buckets"] - before["buckets"] == report.buckets
    in_place = sum(t.numel() * 4 for n, t in new.items() if t.numel() * 4 >= 8 << 10 and n not in QKV)
    assert after["in_place_bytes"] - before["in_place_bytes"] >= in_place > 0  # (+ any tiny neighbours)
    differ = [n for n, t in new.items() if not torch.equal(_served(url, n), t)]
    assert not differ, f"tensors not equal bitwise after the sync: {differ}"
    assert httpx.get(f"{url}/model_info", timeout=30).json()["weight_version"] == "1"
    reference = build_model(ModelConfig(**MODEL), seed=11, device="cpu", dtype="float32", fuse=False)
    expected = reference.generate(
        torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(PROMPT) :].tolist()
    assert _greedy(url) == expected

    # with checksums every byte lands in the receive buffer first (the checksum covers it): still bitwise
    again = {n: t + 1 for n, t in new.items()}
    report, _ = _sync(url, again, version=2, own_broadcast_bytes=8 << 10, verify_checksums=True)
    assert report.ok and _stats(url)["in_place_bytes"] == after["in_place_bytes"]
    assert all(torch.equal(_served(url, n), t) for n, t in again.items())


def test_a_second_sync_replays_the_recorded_plan_and_leaves_the_engine_generating(engine_url):
    """The same sender twice: the second sync replays the first one's buckets (no planning, no
    announcements: one call per engine, replay.py), both land bitwise, and generation keeps running (the
    first sync opens and closes with one call each, pause_in_update; the replay resumes it itself)."""
    url = engine_url
    config = WeightSyncConfig(
        bucket_bytes=16 << 10, segmented_bucket_bytes=16 << 10, timeout_s=30, own_broadcast_bytes=8 << 10
    )
    sender = WeightSender(config, [EngineEndpoint(url)])
    try:
        for version, seed in [(7, 21), (8, 22)]:
            weights = _weights(seed=seed)
            report = sender.sync(lambda weights=weights: iter(weights.items()), version=version)
            assert report.ok and not report.dropped, report
            assert "pause_in_update" in sender._declared[url]
            assert all(torch.equal(_served(url, n), t) for n, t in weights.items())
            state = httpx.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]
            assert state["paused"] is None, state  # continued by the closing call
        assert sender._plan.replayed == report.buckets > 1 and sender._plan.planned == 0
        # ... and without announcements: the engine recorded the first sync and replayed it (replay.py)
        assert report.replayed, "the engine did not declare replay_updates or refused the recorded plan"
    finally:
        sender.close()
    reference = build_model(ModelConfig(**MODEL), seed=22, device="cpu", dtype="float32", fuse=False)
    expected = reference.generate(
        torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(PROMPT) :].tolist()
    assert _greedy(url) == expected


def test_a_sync_cut_into_other_buckets_is_announced_not_replayed(engine_url):
    """The sender's bucket settings change between syncs (as ``benchmarks/weight_sync.py --variants``
    alternates them): the engine holds the last announced plan, so a sync cut otherwise is announced, and
    replays resume once a plan repeats. Replaying the old plan while broadcasting the new buckets left
    both sides in mismatched broadcasts until the timeout."""
    url = engine_url
    small = WeightSyncConfig(
        bucket_bytes=16 << 10, segmented_bucket_bytes=16 << 10, timeout_s=30, own_broadcast_bytes=8 << 10
    )
    large = small.model_copy(update={"bucket_bytes": 64 << 10, "segmented_bucket_bytes": 64 << 10})
    sender = WeightSender(small, [EngineEndpoint(url)])
    try:
        seen = []
        for version, config in enumerate([small, large, small, small, large], start=30):
            sender.config = config
            weights = _weights(seed=version)
            report = sender.sync(lambda weights=weights: iter(weights.items()), version=version)
            assert report.ok and not report.dropped and report.attempts == 1, report
            assert all(torch.equal(_served(url, n), t) for n, t in weights.items())
            seen.append((report.buckets, report.replayed))
    finally:
        sender.close()
    (small_buckets, _), (large_buckets, _) = seen[:2]
    assert small_buckets > large_buckets
    assert [replayed for _, replayed in seen] == [False, False, False, True, False]


def test_a_reused_or_missing_bucket_seq_is_refused_and_the_engine_keeps_serving(engine_url):
    url = engine_url
    config = WeightSyncConfig(bucket_bytes=16 << 10, timeout_s=30)
    sender = WeightSender(config, [EngineEndpoint(url)])
    name, tensor = "model.norm.weight", torch.ones(MODEL["hidden_size"])
    try:
        assert sender.sync(lambda: iter([(name, tensor)]), version=5).ok  # bucket_seq 0 is used
        group_name = sender._group.name

        reused = httpx.post(
            f"{url}/update_weights_from_distributed",
            json=_bucket_body(name, tensor, group_name, 0),
            timeout=30,
        )
        assert reused.status_code == 400 and "bucket_seq 0 was already received" in reused.text, reused.text

        # bucket 5 waits for buckets 1-4, which never come; destroying the group releases it
        answers: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    f"{url}/update_weights_from_distributed",
                    json=_bucket_body(name, tensor, group_name, 5),
                    timeout=60,
                )
            )
        )
        waiter.start()
        deadline = 30.0
        while httpx.get(f"{url}/tidal/stats", timeout=30).json()["waiting"] != 1 and deadline > 0:
            deadline -= 0.05
            threading.Event().wait(0.05)
        assert deadline > 0, "the out-of-turn bucket never reached the engine's receiver"
        httpx.post(f"{url}/destroy_weights_update_group", json={"group_name": group_name}, timeout=30)
        waiter.join(timeout=60)
        assert answers and answers[0].status_code == 400, answers
        assert "destroyed while bucket 5 waited" in answers[0].text, answers[0].text
    finally:
        sender.close()

    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert len(_greedy(url)) == 8
    again, _ = _sync(url, {name: torch.full_like(tensor, 0.25)}, version=6)  # a fresh group works
    assert again.ok and torch.equal(_served(url, name), torch.full_like(tensor, 0.25))


def test_a_bad_segmented_bucket_is_refused_before_anything_is_written(engine_url):
    """In place or not, a bucket is checked whole first: one unknown name and none of it is loaded."""
    url = engine_url
    sender = WeightSender(WeightSyncConfig(timeout_s=30), [EngineEndpoint(url)])
    embed = "model.embed_tokens.weight"
    kept = _served(url, embed)
    try:
        assert sender.sync(
            lambda: iter([("model.norm.weight", torch.ones(MODEL["hidden_size"]))]), version=7
        ).ok
        group = sender._group
        bogus = torch.zeros(4)
        body = {
            "names": [embed, "model.layers.0.bogus.weight"],
            "dtypes": ["float32", "float32"],
            "shapes": [list(kept.shape), [4]],
            "group_name": group.name,
            "load_format": "flattened_bucket",
            "bucket_seq": 1,
        }
        ragged = httpx.post(
            f"{url}/update_weights_from_distributed", json={**body, "segments": [3]}, timeout=30
        )
        assert ragged.status_code == 400 and "segments=[3]" in ragged.text, ragged.text

        for route, payload in (("/pause_generation", {"mode": "in_place"}), ("/begin_weight_update", {})):
            httpx.post(f"{url}{route}", json=payload, timeout=30).raise_for_status()
        answers: list[httpx.Response] = []
        post = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    f"{url}/update_weights_from_distributed", json={**body, "segments": [1, 1]}, timeout=60
                )
            )
        )
        post.start()
        group.broadcast(torch.full_like(kept, 9.0).view(-1).view(torch.uint8), src=0)  # its own broadcast
        group.broadcast(bogus.view(torch.uint8), src=0)
        post.join(timeout=60)
        for route in ("/end_weight_update", "/continue_generation"):
            httpx.post(f"{url}{route}", json={}, timeout=30).raise_for_status()
    finally:
        sender.close()
    assert answers and answers[0].status_code == 400 and "bogus" in answers[0].text, answers
    assert torch.equal(_served(url, embed), kept)


def _ddp_state(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron tensors of ``hf`` as views into one buffer, the last first, each starting at a multiple of
    64 elements: how megatron's DDP with the distributed optimizer holds the trainer's parameters."""
    full = dict(mapping_for(ModelConfig(**MODEL)).to_megatron(hf))
    sizes = {n: -(-t.numel() // 64) * 64 for n, t in full.items()}
    buffer = torch.zeros(sum(sizes.values()))
    state, end = {}, buffer.numel()
    for name, t in full.items():
        end -= sizes[name]
        state[name] = buffer[end : end + t.numel()].view(t.shape)
        state[name].copy_(t)
    return state


def test_after_the_first_update_the_engine_receives_every_bucket_in_place_from_the_trainers_memory(tmp_path):
    """A trainer-shaped source (megatron tensors in one DDP buffer, q/k/v fused): the first sync is
    announced and the engine then lays its weights out in the order of the broadcasts (arena.py); later
    syncs are replayed, each bucket one broadcast from the trainer's memory straight into the engine's
    weights (no copy on either side), bitwise, and the engine generates as a model with those weights."""
    mapping = mapping_for(ModelConfig(**MODEL))
    with served_engine(
        *ENGINE,
        log_path=tmp_path / "serve.log",
    ) as proc:
        url = proc.url
        config = WeightSyncConfig(timeout_s=30, own_broadcast_bytes=8 << 10)
        sender = WeightSender(config, [EngineEndpoint(url)])
        try:
            for version, seed in [(1, 31), (2, 32), (3, 33)]:
                hf = {n: t.contiguous() for n, t in _weights(seed=seed).items()}
                state = _ddp_state(hf)
                before = _stats(url)

                def source(state=state):
                    for name, t in state.items():
                        yield from mapping.to_hf(name, t, packable=True)

                report = sender.sync(source, version=version)
                assert report.ok and report.replayed == (version > 1), report
                assert all(torch.equal(_served(url, n), t) for n, t in hf.items()), version
                if version > 1:  # the weights were laid out after the first sync: every byte in place
                    moved = _stats(url)["in_place_bytes"] - before["in_place_bytes"]
                    assert moved == report.bytes, (moved, report.bytes)
                    assert report.buckets < 4  # one broadcast per bucket, not one per tensor
        finally:
            sender.close()
        assert "weights laid out for in-place updates" in (tmp_path / "serve.log").read_text()
        reference = build_model(ModelConfig(**MODEL), seed=33, device="cpu", dtype="float32", fuse=False)
        expected = reference.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
        assert _greedy(url) == expected
