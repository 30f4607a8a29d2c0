import pytest

from tidal.config import RunConfig
from tidal.configio import build, load_config
from tidal.errors import ConfigError
from tidal.procs import free_port
from tidal.rollout.main import build_pool, parse_args
from tidal.rollout.main import main as rollout_main


def _config(*overrides):
    return load_config(RunConfig, "configs/tiny.yaml", list(overrides))


def test_flags_default_to_the_config_and_repeat_for_engines():
    ns = parse_args(
        _config("broker.bind=tcp://10.1.2.3:5555"), ["--engine", "http://a:1", "--engine=http://b:2"]
    )
    assert ns.broker == "tcp://10.1.2.3:5555"
    assert ns.engine == ["http://a:1", "http://b:2"]


def test_a_bind_address_is_not_a_broker_address():
    with pytest.raises(ConfigError, match=r"--broker tcp://\*:5555: that is a bind address"):
        parse_args(_config(), ["--broker", "tcp://*:5555"])


def test_unknown_flags_are_named():
    with pytest.raises(ConfigError, match=r"unknown flag\(s\) \['--engines'"):
        parse_args(_config(), ["--engines", "x"])


def test_given_engine_urls_make_a_pool_of_external_engines(tmp_path):
    pool = build_pool(
        _config("rollout.concurrency=3"), ["http://127.0.0.1:9/", "http://127.0.0.1:10"], tmp_path
    )
    assert pool.urls == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    assert pool.launch is None and pool.capacity == 6


def test_embedded_engines_get_their_own_ports_and_logs(tmp_path):
    pool = build_pool(_config("rollout.engines_per_node=2", "rollout.engine.port=31000"), [], tmp_path)
    assert pool.urls == ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    assert pool.launch is not None
    assert (tmp_path / "config.yaml").exists()  # the config each `tidal serve` child reads
    assert pool.slots[1].log_path == str(tmp_path / "engine-1.log")


def test_an_sglang_engine_needs_a_checkpoint_to_launch(tmp_path):
    with pytest.raises(ConfigError, match="rollout.engine.type=sglang needs model.path"):
        build_pool(_config("rollout.engine={type: sglang}"), [], tmp_path)


def test_curve_needs_both_key_files():
    with pytest.raises(ConfigError, match="CURVE needs both"):
        build(RunConfig, {"rollout": {"agent": {"curve_secret_key_file": "node.key_secret"}}})


def test_an_engine_that_never_answers_stops_the_node_with_a_clear_error(tmp_path, caplog):
    port = free_port()
    config = _config(f"run_dir={tmp_path}", "rollout.agent.engine_start_timeout_s=1")
    code = rollout_main(config, ["--broker", "tcp://127.0.0.1:9", "--engine", f"http://127.0.0.1:{port}"])
    assert code == 1
    assert f"engine 0 at http://127.0.0.1:{port} did not answer within 1s" in caplog.text
