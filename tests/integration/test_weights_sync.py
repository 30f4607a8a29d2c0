"""Live weight sync from a sender to engine processes over real gloo groups and HTTP.

The engines here are ``tidal.weights_sync.receiver_server``: the weight-update routes of an engine
without a model (the trainer-to-``tidal serve`` test is in test_weights_megatron.py). The sender runs
in this process as a one-rank trainer.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

from tidal.procs import free_port, spawn, stop, tail, wait_for_tcp
from tidal.weights_sync import hf_io
from tidal.weights_sync.config import WeightSyncConfig
from tidal.weights_sync.engine_api import EngineEndpoint
from tidal.weights_sync.sender import WeightSender


@pytest.fixture(scope="module")
def checkpoint() -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors of two dtypes and many sizes (a 2 KB norm to a 1 MB embedding)."""
    g = torch.Generator().manual_seed(3)
    tensors = {"model.embed_tokens.weight": torch.randn(1024, 256, generator=g)}
    for layer in range(4):
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = torch.randn(512, generator=g)
        for e in range(4):
            for proj in ("gate_proj", "up_proj"):
                w = torch.randn(96, 256, generator=g)
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = w.to(torch.bfloat16)
    tensors["model.norm.weight"] = torch.randn(256, generator=g)
    return tensors


@pytest.fixture(scope="module")
def receivers(tmp_path_factory):
    """Two receivers for the module; the last test kills one of them."""
    tmp_path = tmp_path_factory.mktemp("receivers")
    procs, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            log = tmp_path / f"receiver{i}.log"
            cmd = [
                sys.executable,
                "-m",
                "tidal.weights_sync.receiver_server",
                "--port",
                str(port),
                "--timeout-s",
                "10",
            ]
            procs.append(spawn(cmd, log))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, urls, strict=True):
            wait_for_tcp("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout_s=60, proc=proc)
        yield procs, urls
    finally:
        for proc in procs:
            stop(proc, timeout_s=5)


def _engine_tensors(url: str, directory: Path) -> dict[str, torch.Tensor]:
    httpx.post(f"{url}/tidal/save_weights", json={"path": str(directory)}, timeout=30).raise_for_status()
    return hf_io.load_tensors(directory)


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/tidal/stats", timeout=10).json()


@pytest.mark.slow
def test_sync_delivers_every_tensor_bitwise_to_every_engine(receivers, checkpoint, tmp_path):
    _, urls = receivers
    # the 1 MiB embedding goes out on a broadcast of its own (bucket_segments)
    config = WeightSyncConfig(
        bucket_bytes=64 << 10, timeout_s=20, verify_checksums=True, own_broadcast_bytes=512 << 10
    )
    sender = WeightSender(config, [EngineEndpoint(u) for u in urls])
    try:
        report = sender.sync(lambda: iter(checkpoint.items()), version=5)
        assert report.ok and report.attempts == 1 and report.dropped == []
        total = sum(t.numel() * t.element_size() for t in checkpoint.values())
        assert report.bytes == total and report.buckets > 3  # several buckets: the overlap path ran
        assert report.inflight == 2  # the receivers declared ordered_buckets: announcements ran ahead
        for i, url in enumerate(urls):
            got = _engine_tensors(url, tmp_path / f"engine{i}")
            assert sorted(got) == sorted(checkpoint)
            assert all(torch.equal(got[n], t) for n, t in checkpoint.items())
            assert _stats(url)["version"] == "5"
        # a second sync reuses the group; without checksums the receivers take the embedding in place
        sender.config = config.model_copy(update={"verify_checksums": False})
        changed = {n: t + 1 for n, t in checkpoint.items()}
        again = sender.sync(lambda: iter(changed.items()), version=6)
        assert again.ok and all(_stats(u)["version"] == "6" for u in urls)
        assert all(len(_stats(u)["groups"]) == 1 for u in urls)
        assert _stats(urls[0])["bytes"] == 2 * total
        embed = checkpoint["model.embed_tokens.weight"]
        # at least the embedding; small tensors that happen to lie back to back on both sides may join it
        assert all(_stats(u)["in_place_bytes"] >= embed.numel() * embed.element_size() for u in urls)
        got = _engine_tensors(urls[0], tmp_path / "again")
        assert all(torch.equal(got[n], t) for n, t in changed.items())
    finally:
        sender.close()


def test_a_repeated_sync_is_replayed_without_announcements(receivers, checkpoint, tmp_path):
    """After a sync announced in full, the next one of the same tensors is one call per engine, a header, the
    broadcasts and a status all-reduce (replay.py); a source that changed, or an engine without the plan,
    gets an announced sync instead, and every sync lands bitwise."""
    _, urls = receivers
    config = WeightSyncConfig(bucket_bytes=64 << 10, timeout_s=20, own_broadcast_bytes=512 << 10)
    sender = WeightSender(config, [EngineEndpoint(u) for u in urls])
    total = sum(t.numel() * t.element_size() for t in checkpoint.values())
    try:
        first = sender.sync(lambda: iter(checkpoint.items()), version=11)
        assert first.ok and not first.replayed and first.buckets > 3
        before = [_stats(u) for u in urls]
        doubled = {n: t * 2 for n, t in checkpoint.items()}
        again = sender.sync(lambda: iter(doubled.items()), version=12)
        assert again.ok and again.replayed and again.attempts == 1 and again.buckets == first.buckets
        for i, (url, old) in enumerate(zip(urls, before, strict=True)):
            stats = _stats(url)
            assert stats["replays"] == old["replays"] + 1 and stats["version"] == "12"
            assert stats["bytes"] - old["bytes"] == total
            got = _engine_tensors(url, tmp_path / f"replayed{i}")
            assert all(torch.equal(got[n], t) for n, t in doubled.items())

        # another model (a layer fewer): the replay stops at the first tensor that differs from the record;
        # the engines' receives fail with the group, and the next attempt announces the sync
        fewer = {n: t - 1 for n, t in checkpoint.items() if "layers.3." not in n}
        third = sender.sync(lambda: iter(fewer.items()), version=13)
        assert third.ok and third.attempts == 2 and not third.replayed and third.dropped == []
        got = _engine_tensors(urls[1], tmp_path / "fewer")
        assert all(torch.equal(got[n], t) for n, t in fewer.items())
        assert all(_stats(u)["version"] == "13" for u in urls)

        # an engine without the plan refuses it before anything is sent; the next attempt announces it and
        # costs no retry (none allowed here)
        sender._replayable = (sender._group.name, sender._bucketing(), "0" * 32)
        fourth = sender.sync(lambda: iter(fewer.items()), version=14, retries=0)
        assert fourth.ok and fourth.attempts == 2 and not fourth.replayed and fourth.dropped == []
        assert all(_stats(u)["version"] == "14" for u in urls)
        fifth = sender.sync(lambda: iter(fewer.items()), version=15)  # recorded again: replayed
        assert fifth.ok and fifth.replayed and all(_stats(u)["version"] == "15" for u in urls)

        # another membership rebuilds the group: the destroyed groups' plans go with them, also on the engine
        # that leaves (which drops the group at once), and the one that stays keeps only the new group's
        sender.set_engines([EngineEndpoint(urls[0])])
        assert _stats(urls[1])["recorded_plans"] == 0 and _stats(urls[1])["groups"] == []
        sixth = sender.sync(lambda: iter(fewer.items()), version=16)
        assert sixth.ok and not sixth.replayed
        assert _stats(urls[0])["recorded_plans"] == 1
    finally:
        sender.close()


def test_a_replay_with_an_unknown_plan_is_refused_and_the_engine_keeps_serving(receivers):
    _, urls = receivers
    resp = httpx.post(f"{urls[0]}/tidal/replay_weight_update", json={"plan": "nope", "weight_version": "1"})
    assert resp.status_code == 400 and "announce this update" in resp.json()["message"]
    assert httpx.get(f"{urls[0]}/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_a_joining_engine_gets_everything_at_the_next_sync(receivers, checkpoint, tmp_path):
    _, urls = receivers
    # one announcement at a time, as SGLang engines get them
    config = WeightSyncConfig(bucket_bytes=256 << 10, timeout_s=20, inflight_buckets=1)
    sender = WeightSender(config, [EngineEndpoint(urls[0])])
    try:
        changed = {n: t + 1 for n, t in checkpoint.items()}
        assert sender.sync(lambda: iter(changed.items()), version=7).ok
        sender.set_engines([EngineEndpoint(u) for u in urls])  # a node joined
        report = sender.sync(lambda: iter(changed.items()), version=8)
        assert report.ok and report.engines == urls and report.inflight == 1
        for i, url in enumerate(urls):
            got = _engine_tensors(url, tmp_path / f"engine{i}")
            assert all(torch.equal(got[n], t) for n, t in changed.items())
            assert _stats(url)["version"] == "8"
            assert len(_stats(url)["groups"]) == 1  # the old group was replaced, not leaked
    finally:
        sender.close()


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2])
def test_the_update_opens_while_the_first_tensors_are_gathered(receivers, checkpoint, tmp_path, stages):
    """With one sender, /pause_generation and /begin_weight_update are in flight while the source yields its
    first tensors (the first announcement waits for them); with several pipeline stages they are answered
    before any sender gathers, as the other stages' announcements may not wait for them."""
    _, urls = receivers
    version = 20 + stages
    config = WeightSyncConfig(bucket_bytes=256 << 10, timeout_s=20)
    sender = WeightSender(config, [EngineEndpoint(u) for u in urls], stages=stages)
    first_tensor_taken = threading.Event()
    taken_before_begin = []
    for client in sender._clients.values():
        real_begin = client.begin

        def begin(real_begin=real_begin, **kwargs):
            # the real call, held until the first tensor is taken: at once with the overlap, else a second
            # passes (then the source is not read until the update is open)
            taken_before_begin.append(first_tensor_taken.wait(timeout=10 if stages == 1 else 1))
            real_begin(**kwargs)

        client.begin = begin

    def source():
        first_tensor_taken.set()
        yield from ((n, t + version) for n, t in checkpoint.items())

    try:
        report = sender.sync(source, version=version)
        assert report.ok and report.attempts == 1, report
        assert taken_before_begin == [stages == 1] * len(urls)
        assert report.open_s > 0 and report.close_s > 0 and report.open_s < report.wall_s
        got = _engine_tensors(urls[1], tmp_path / "engine")
        assert all(torch.equal(got[n], t + version) for n, t in checkpoint.items())
        assert all(_stats(u)["version"] == str(version) for u in urls)
    finally:
        sender.close()


@pytest.mark.slow
def test_engine_killed_mid_sync_is_dropped_and_the_sync_completes(receivers, checkpoint, tmp_path, caplog):
    procs, urls = receivers
    config = WeightSyncConfig(bucket_bytes=32 << 10, timeout_s=8)
    sender = WeightSender(config, [EngineEndpoint(u) for u in urls])
    attempts = []

    def source():
        attempts.append(1)
        for i, item in enumerate(checkpoint.items()):
            if len(attempts) == 1 and i == len(checkpoint) // 2:
                procs[1].kill()  # the second engine dies halfway through the first attempt
                procs[1].wait()
            yield item

    try:
        report = sender.sync(source, version=9)
        assert report.ok, f"sync failed: {report}; engine log: {tail(Path(procs[0].args[0]))}"
        assert report.dropped == [urls[1]] and report.attempts == 2
        assert sender.engines == [urls[0]]
        said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
        assert said and all(urls[1] in m for m in said), said  # the log names the engine, and why
        got = _engine_tensors(urls[0], tmp_path / "survivor")
        assert all(torch.equal(got[n], t) for n, t in checkpoint.items())
        assert _stats(urls[0])["version"] == "9"
    finally:
        sender.close()


def test_sync_without_engines_drains_the_source():
    consumed = []
    sender = WeightSender(WeightSyncConfig(), [])
    report = sender.sync(lambda: (consumed.append(n) or (n, torch.zeros(1)) for n in "abc"), version=1)
    assert report.ok and consumed == ["a", "b", "c"] and report.bytes == 0
    sender.close()
