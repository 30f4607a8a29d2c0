"""The ``tidal`` command line: one entry point, one subcommand per actor.

Every subcommand takes an optional YAML config followed by dotted ``key=value`` overrides, e.g.
``tidal run configs/tiny.yaml trainer.optimizer.lr=5e-5``. The config is validated before anything starts.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import sys
from pathlib import Path

from tidal.errors import ConfigError

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"

# subcommand -> (module with a `main(config, args)` entry, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "tidal.launcher",
        "run the whole job locally: broker, rollout nodes, trainer (default job: tiny CPU GRPO)",
    ),
    "broker": ("tidal.broker.main", "run the sample broker"),
    "rollout": ("tidal.rollout.main", "run a rollout node agent against a broker"),
    "serve": ("tidal.rollout.serve", "serve the embedded engine over SGLang's HTTP protocol"),
    "train": ("tidal.trainer.main", "run the trainer (launch under torchrun)"),
    "sft": ("tidal.trainer.sft", "supervised fine-tuning with the same trainer"),
    "convert": ("tidal.weights_sync.convert", "convert Hugging Face <-> megatron-core checkpoints"),
    "plan": ("tidal.plan", "check a mesh and estimate memory per GPU"),
    "keys": ("tidal.keys", "create ZeroMQ CURVE key pairs: tidal keys DIR NAME [NAME ...]"),
    "stats": (
        "tidal.broker_stats",
        "print a running broker's stats: tidal stats --broker ADDR [--format json]",
    ),
    "journal": (
        "tidal.journal_command",
        "audit a broker journal offline: tidal journal [DIR] [--format json]",
    ),
    "config": ("tidal.cli", "print the resolved config"),
}


# Flags of subcommands that take a value as the next token (e.g. ``--broker tcp://h:5555``).
VALUE_FLAGS = {
    "--engine",
    "--init",
    "--wall-s",
    "--lr",
    "--measured",
    "--reserve",
    "--suggest",
    "--broker",
    "--resume",
    "--gpus",
    "--gpu-mem",
    "--name",
    "--port",
    "--host",
    "--out",
    "--mode",
    "--from",
    "--to",
    "--format",
    "--watch",
    "--timeout",
}


def split_args(rest: list[str]) -> tuple[str | None, list[str], list[str]]:
    """Split into (config path, key=value overrides, flags with their values)."""
    config, overrides, flags = None, [], []
    it = iter(rest)
    for tok in it:
        if tok.startswith("--"):
            flags.append(tok)
            if tok in VALUE_FLAGS:
                flags.append(next(it, ""))
        elif tok.startswith("-"):
            flags.append(tok)
        elif "=" in tok:
            overrides.append(tok)
        elif config is None and tok.endswith((".yaml", ".yml")):
            config = tok
        else:
            flags.append(tok)
    return config, overrides, flags


def load_run_config(config_path: str | None, overrides: list[str]):
    from tidal.config import RunConfig
    from tidal.configio import load_config

    return load_config(RunConfig, config_path or DEFAULT_CONFIG, overrides)


def config_main(config, args: list[str]) -> int:
    import yaml

    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    # A native crash (SIGSEGV, an abort from the allocator) then leaves every thread's Python stack in the
    # process's log, where the launcher keeps it. The process's own stderr: sys.stderr may be replaced by
    # an object without a descriptor (an embedding program's, pytest's capture).
    if sys.__stderr__ is not None:
        faulthandler.enable(file=sys.__stderr__)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="tidal",
        description="Asynchronous actor-model RL post-training. Each subcommand takes [CONFIG.yaml] [key=value ...].",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        parser.error(f"unknown command {command!r}; choose one of {', '.join(COMMANDS)}")
    config_path, overrides, extra = split_args(rest)
    if "-h" in extra or "--help" in extra:
        print(f"usage: tidal {command} [CONFIG.yaml] [key=value ...] [flags]\n\n{COMMANDS[command][1]}")
        module = importlib.import_module(COMMANDS[command][0])
        if getattr(module, "__doc__", None):
            print("\n" + module.__doc__.strip())
        return 0
    try:
        if command == "run":
            from tidal.launcher import resume_source

            config_path, overrides = resume_source(config_path, overrides, extra)
        config = load_run_config(config_path, overrides)
    except ConfigError as exc:
        print(f"tidal {command}: {exc}", file=sys.stderr)
        return 2
    if command == "config":
        return config_main(config, extra)
    module = importlib.import_module(COMMANDS[command][0])
    try:
        return int(module.main(config, extra) or 0)
    except ConfigError as exc:
        print(f"tidal {command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
