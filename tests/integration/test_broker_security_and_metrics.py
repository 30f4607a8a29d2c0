"""CURVE: only clients with an allowed key are served. Prometheus endpoint and the log's status lines: the
same figures as stats."""

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tidal.broker.client import AsyncBrokerClient, BrokerClient, BrokerTimeout
from tidal.broker.curve import CurveClientKeys, create_keys
from tidal.broker.testing import fake_group, start_broker
from tidal.procs import free_port, stop

pytestmark = pytest.mark.slow


def test_curve_serves_allowed_keys_and_rejects_a_client_without_one(tmp_path):
    _, server_secret = create_keys(tmp_path / "server", "broker")
    _, allowed_secret = create_keys(tmp_path / "clients", "node")
    _, stranger_secret = create_keys(tmp_path / "strangers", "stranger")
    server_public = tmp_path / "server" / "broker.key"
    proc, address = start_broker(
        tmp_path / "run",
        8,
        group_size=2,
        curve={
            "enabled": True,
            "server_secret_key_file": str(server_secret),
            "allowed_client_keys_dir": str(tmp_path / "clients"),
        },
    )
    try:
        with (
            BrokerClient(address, timeout_s=1.0) as plain,
            pytest.raises(BrokerTimeout, match="allowed keys"),
        ):
            plain.stats()  # no key at all
        stranger = CurveClientKeys.from_files(stranger_secret, server_public)

        async def stranger_tries():
            async with AsyncBrokerClient(address, curve=stranger, timeout_s=1.0) as c:
                with pytest.raises(BrokerTimeout):
                    await c.register("rollout", "intruder")
                with pytest.raises(BrokerTimeout):
                    await c.lease(1)

        asyncio.run(stranger_tries())
        keys = CurveClientKeys.from_files(allowed_secret, server_public)
        with BrokerClient(address, curve=keys, timeout_s=10) as client:
            client.register("rollout", "trusted")
            lease = client.lease(2)
            client.submit(lease.lease_id, [fake_group(pg) for pg in lease.groups])
            stats = client.stats()
            assert stats["counters"]["accepted_groups"] == 2
            assert stats["auth_failures"] >= 2
            assert set(n["name"] for n in stats["nodes"].values()) == {"trusted"}
    finally:
        stop(proc)


def test_curve_misconfiguration_fails_before_serving(tmp_path):
    with pytest.raises(RuntimeError, match="server_secret_key_file"):
        start_broker(tmp_path, 4, curve={"enabled": True}, timeout_s=20)


def _metrics(port):
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_stats_prometheus_and_status_lines_report_queue_flight_staleness_and_throughput(tmp_path):
    metrics_port = free_port()
    proc, address = start_broker(
        tmp_path,
        10,
        group_size=2,
        batch_groups=2,
        max_staleness=1,
        dynamic_sampling=True,
        metrics_port=metrics_port,
        status_every_s=0.3,
    )
    try:
        with BrokerClient(address, timeout_s=10) as node, BrokerClient(address, timeout_s=10) as trainer:
            node.register("rollout", "n", {"gpus": 0})
            trainer.register("trainer", "t")
            lease = node.lease(4)
            groups = [fake_group(pg, version=0) for pg in lease.groups[:3]]
            groups[2] = fake_group(lease.groups[2], rewards=[1.0, 1.0])  # filtered by dynamic sampling
            node.submit(lease.lease_id, groups)
            batch = trainer.get_batch(-1)
            trainer.publish_version(1)
            stats = trainer.stats()
            assert stats["queue_depth"] == 6 and stats["in_flight_groups"] == 1 and stats["leases"] == 1
            assert stats["buffered_groups"] == 0 and stats["batches"]["next"] == 1
            assert stats["counters"]["filtered_groups"] == 1 and stats["counters"]["accepted_groups"] == 2
            assert stats["staleness_histogram"] == {0: 2} and len(batch.groups) == 2
            assert stats["throughput"]["samples_per_s"] > 0 and stats["nodes_alive"] == 2
            assert stats["journal"]["packed_groups"] == 2 and stats["journal"]["packed_bytes_saved"] > 0
            roles = sorted(n["role"] for n in stats["nodes"].values())
            assert roles == ["rollout", "trainer"]
            assert stats["failing_groups"] == 0
            assert node.release(lease.lease_id, error="SampleFailed: prompt too long") == 1
            node.leave()
            after = trainer.stats()
            assert after["in_flight_groups"] == 0 and after["failing_groups"] == 1

        for _ in range(50):  # the endpoint shows the snapshot of the last tick (<= 0.25 s old)
            m = _metrics(metrics_port)
            if m.get("tidal_broker_policy_version") == 1 and m.get("tidal_broker_in_flight_groups") == 0:
                break
            time.sleep(0.1)
        assert m["tidal_broker_policy_version"] == 1
        assert m["tidal_broker_accepted_groups_total"] == 2
        assert m["tidal_broker_filtered_groups_total"] == 1
        assert m["tidal_broker_queue_depth"] == 7 and m["tidal_broker_failing_groups"] == 1
        assert m["tidal_broker_group_staleness_count"] == 2 and m["tidal_broker_group_staleness_sum"] == 0
        assert m["tidal_broker_samples_per_second"] > 0
        assert m["tidal_broker_journal_packed_groups_total"] == 2
        assert m["tidal_broker_journal_packed_bytes_saved_total"] == stats["journal"]["packed_bytes_saved"]
        assert m["tidal_broker_submit_memory_wire_submits_total"] == stats["submit_memory"]["wire_submits"]

        log = tmp_path / "broker.log"
        want = "policy version 1; queue 7 groups, in flight 0"
        for _ in range(50):  # a line every 0.3 s
            lines = [line for line in log.read_text().splitlines() if "status: " in line]
            if lines and want in lines[-1]:
                break
            time.sleep(0.1)
        line = lines[-1]
        assert want in line, line
        assert "nodes alive 1 trainer;" in line and "accepted 2 groups" in line, line
        assert "batches cut 1" in line and "filtered 1," in line and "bad frames 0" in line, line
        assert "failed 0 (1 failing)," in line, line
    finally:
        stop(proc)


def test_tidal_stats_prints_the_status_line_nodes_and_json(tmp_path, capsys):
    from tidal.cli import main as cli_main

    proc, address = start_broker(tmp_path, 10, group_size=2, batch_groups=2)
    try:
        with BrokerClient(address, timeout_s=10) as node:
            node.register("rollout", "n0")
            lease = node.lease(2)
            node.submit(lease.lease_id, [fake_group(pg) for pg in lease.groups])
            assert cli_main(["stats", "--broker", address]) == 0
            status, node_line = capsys.readouterr().out.splitlines()
            assert status.startswith("status: nodes alive 1 rollout; policy version 0; queue 8 groups")
            assert "accepted 2 groups (" in status and "over the last 10 s" in status
            assert (
                node_line.split()[1:4] == ["rollout", "'n0'", "alive,"] and "0 groups in flight" in node_line
            )
            assert cli_main(["stats", f"--broker={address}", "--format", "json"]) == 0
            stats = json.loads(capsys.readouterr().out)
            assert stats["counters"]["accepted_groups"] == 2 and stats["nodes_alive"] == 1
    finally:
        stop(proc)
    assert cli_main(["stats", "--broker", address, "--timeout", "0.5"]) == 1  # nobody answers
    assert "tidal stats:" in capsys.readouterr().err
    assert cli_main(["stats", "--broker", address, "--format", "yaml"]) == 2
    assert "--format='yaml'; use text or json" in capsys.readouterr().err
