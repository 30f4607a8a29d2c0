"""Clients' CURVE keys from their config: both files or neither, and a bad file named by its key."""

import pytest

from tidal.broker.curve import CurveClientKeys, client_keys, create_keys
from tidal.config import RunConfig
from tidal.configio import ConfigError, build


def test_a_client_config_needs_both_key_files_or_neither():
    for section, prefix in ((("trainer",), "trainer"), (("rollout", "agent"), "rollout.agent")):
        data: dict = {}
        leaf = data
        for name in section:
            leaf = leaf.setdefault(name, {})
        leaf["curve_secret_key_file"] = "keys/me.key_secret"
        with pytest.raises(
            ConfigError, match=rf"{prefix}.curve_secret_key_file and {prefix}.curve_server_key_file"
        ):
            build(RunConfig, data)


def test_client_keys_load_the_pair_and_name_the_key_of_a_bad_file(tmp_path):
    broker_public, _ = create_keys(tmp_path, "broker")
    trainer_public, trainer_secret = create_keys(tmp_path, "trainer")
    assert client_keys(None, None, "trainer") is None
    keys = client_keys(str(trainer_secret), str(broker_public), "trainer")
    assert keys == CurveClientKeys.from_files(trainer_secret, broker_public)
    missing = str(tmp_path / "nope.key_secret")
    with pytest.raises(ConfigError, match=rf"trainer.curve_secret_key_file='{missing}': no such file"):
        client_keys(missing, str(broker_public), "trainer")
    with pytest.raises(ConfigError, match=r"trainer.curve_secret_key_file=.*not a secret certificate"):
        client_keys(str(trainer_public), str(broker_public), "trainer")  # the public half only
    junk = tmp_path / "junk.key"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"rollout.agent.curve_secret_key_file / curve_server_key_file"):
        client_keys(str(trainer_secret), str(junk), "rollout.agent")
