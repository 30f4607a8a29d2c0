"""``tidal run``: the whole job on this machine, each actor a separate process.

    tidal run                               # the default job (configs/tiny.yaml)
    tidal run CONFIG key=value ...          # any config
    tidal run --sync                        # the same job synchronously (eta = 0), for comparison
    tidal run --resume RUN_DIR              # continue a stopped job
    flags: --plain (line-per-step output instead of the live view), --no-control (skip the SFT control)

Steps: prepare the task's data and tokenizer, initialise the model (or start from ``model.path``), warm it
up with ``tidal sft`` where there are demonstrations (``tidal/run_plan.py``), start the broker, the rollout
nodes and the trainer (torchrun) as processes, watch them (restart dead rollout nodes; resume a dead
trainer from its checkpoint), then evaluate the model GRPO started from, the GRPO result and (after a
warm-up) an SFT control on held-out problems and print the comparison. Everything goes to the run
directory: resolved config, metrics, TensorBoard events, plots, logs of every process, checkpoints, report.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tidal.config import RunConfig
from tidal.configio import build, dump_config
from tidal.errors import CONFIG_ERROR_EXIT, NO_BATCH_EXIT, ConfigError
from tidal.procs import free_port, port_in_use, python_cmd, wait_for_tcp
from tidal.run_identity import check_run_dir
from tidal.run_plan import RunPlan, plan_run
from tidal.supervisor import ProcessDied, ProcessSpec, Supervisor


@dataclass
class RunOptions:
    sync: bool = False
    resume: str | None = None
    plain: bool = False
    control: bool = True


# NVLink multicast off in every process (the device machines refuse it; docs/gpu.md)
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass
class Placement:
    """Where each process runs: its environment, and the config overrides that follow from it."""

    trainer_env: dict[str, str]
    node_envs: list[dict[str, str]]
    overrides: dict[str, object]
    colocated: bool = False
    summary: str = "CPU"


def _visible_gpus() -> tuple[int, list[str]]:
    import os

    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    return count, (visible[:count] if visible else [str(i) for i in range(count)])


def plan_placement(config: RunConfig, gpus: tuple[int, list[str]] | None = None) -> Placement:
    """GPUs per process for ``config.device``; a combination that cannot run fails here, before anything starts.

    ``device: cpu`` hides the GPUs from every process (the trainer would otherwise take one). ``device: cuda``:
    trainer rank r on ``gpus.trainer[r]``; rollout node i on ``gpus.engines[i % n]``. Engines on the
    trainer's first GPU are colocated with its sender (CUDA IPC, ``weights_sync.transport=cuda_ipc``);
    engines on other GPUs get the weights over NCCL (``collective``).
    """
    engine = config.rollout.engine
    embedded = engine.type == "embedded"
    nodes = config.rollout.nodes
    if config.device == "cpu":
        if embedded and engine.device.startswith("cuda"):
            raise ConfigError(
                f"rollout.engine.device={engine.device!r} with device='cpu': tidal run places processes on "
                "GPUs only with device=cuda; set device=cuda, or rollout.engine.device=cpu"
            )
        hidden = {"CUDA_VISIBLE_DEVICES": ""}
        return Placement(dict(hidden), [dict(hidden) for _ in range(nodes)], {})
    import torch

    count, ids = gpus if gpus is not None else _visible_gpus()
    if count == 0:
        raise ConfigError(
            f"device='cuda' needs a CUDA device, and torch {torch.__version__} sees none on this host: "
            "run on a GPU machine, or set device=cpu"
        )
    nproc = config.trainer.nproc
    trainer = config.gpus.trainer if config.gpus.trainer is not None else list(range(nproc))
    if len(trainer) != nproc:
        raise ConfigError(
            f"gpus.trainer={trainer} lists {len(trainer)} GPU(s) for trainer.nproc={nproc} ranks: one per rank"
        )
    if config.gpus.engines is not None:
        engines = config.gpus.engines
    else:
        engines = [g for g in range(count) if g not in trainer] or [trainer[0]]
    bad = [g for g in [*trainer, *engines] if not 0 <= g < count]
    if bad or len(set(trainer)) != len(trainer) or not engines:
        raise ConfigError(
            f"gpus.trainer={trainer}, gpus.engines={engines}: GPU indices must be distinct per trainer rank, "
            f"non-empty for engines, and in [0, {count}) ({count} visible: {ids})"
        )
    node_gpus = [engines[i % len(engines)] for i in range(nodes)]
    colocated = {g == trainer[0] for g in node_gpus}
    if colocated == {True, False}:
        raise ConfigError(
            f"gpus.engines={engines}: rollout nodes on GPUs {node_gpus} mix the trainer's first GPU "
            f"({trainer[0]}, colocated: CUDA IPC) with others (NCCL): put every node on one kind"
        )
    colocated_mode = colocated == {True}
    transport = config.weights_sync.transport
    wanted = "cuda_ipc" if colocated_mode else "collective"
    if transport not in ("auto", wanted):
        raise ConfigError(
            f"weights_sync.transport={transport!r} with engines on GPUs {node_gpus} and the trainer's sender on "
            f"GPU {trainer[0]}: {'NCCL refuses two ranks on one GPU' if colocated_mode else 'CUDA IPC needs the engines on the sender GPU'}; "
            f"use {wanted!r} or 'auto'"
        )
    per_node = config.rollout.engines_per_node if embedded else 1
    if not colocated_mode and (len(set(node_gpus)) != nodes or per_node > 1):
        raise ConfigError(
            f"rollout.nodes={nodes} x rollout.engines_per_node={per_node} engines on GPUs {node_gpus}: every "
            "engine joins the trainer's NCCL weight group, and NCCL refuses two ranks on one GPU; give each "
            f"engine its own GPU (gpus.engines, {count} visible), or set rollout.nodes={len(set(node_gpus))}, "
            f"or colocate them with gpus.engines=[{trainer[0]}]"
        )
    overrides: dict[str, object] = {"weights_sync.transport": wanted}
    if embedded:
        overrides["rollout.engine.device"] = "cuda"
        if config.trainer.bf16 and engine.dtype == "float32":
            overrides["rollout.engine.dtype"] = "bfloat16"  # sample in the precision the trainer computes in
    env = dict(MULTICAST_OFF)
    trainer_env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(ids[g] for g in trainer)}
    node_envs = [{**env, "CUDA_VISIBLE_DEVICES": ids[g]} for g in node_gpus]
    asleep = ", engines asleep while the trainer steps" if config.weights_sync.colocated_sleep else ""
    mode = f"colocated (CUDA IPC{asleep})" if colocated_mode else "NCCL"
    summary = f"trainer on GPU(s) {[ids[g] for g in trainer]}, rollout nodes on {[ids[g] for g in node_gpus]}, {mode}"
    return Placement(trainer_env, node_envs, overrides, colocated_mode, summary)


def resume_source(
    config_path: str | None, overrides: list[str], flags: list[str]
) -> tuple[str | None, list[str]]:
    """The config file and overrides of ``tidal run``: with ``--resume RUN_DIR``, that run's saved
    ``config.yaml`` and the command line's key=value settings on top of it (its run_dir: RUN_DIR, also
    when the directory was moved)."""
    if "--resume" not in flags:
        return config_path, overrides
    at = flags.index("--resume") + 1
    run_dir = Path(flags[at]) if at < len(flags) and flags[at] else None
    if run_dir is None:
        raise ConfigError("--resume needs a run directory")
    if config_path is not None:
        raise ConfigError(
            f"--resume {run_dir} continues with that run's settings ({run_dir / 'config.yaml'}): give "
            f"key=value settings to change, not {config_path}"
        )
    saved = run_dir / "config.yaml"
    if not saved.exists():
        raise ConfigError(f"--resume {run_dir}: no {saved} (not a tidal run directory)")
    others = [o for o in overrides if o.split("=", 1)[0] == "run_dir"]
    if others:
        raise ConfigError(f"--resume {run_dir} names the run directory; drop {others[0]}")
    return str(saved), [*overrides, f"run_dir={run_dir}"]


def parse_options(args: list[str]) -> RunOptions:
    opts = RunOptions()
    it = iter(args)
    for a in it:
        if a == "--sync":
            opts.sync = True
        elif a == "--resume":
            opts.resume = next(it, None)
            if not opts.resume:
                raise ConfigError("--resume needs a run directory")
        elif a == "--plain":
            opts.plain = True
        elif a == "--no-control":
            opts.control = False
        else:
            raise ConfigError(
                f"tidal run: unknown argument {a!r} (flags: --sync, --resume RUN_DIR, --plain, --no-control)"
            )
    return opts


class RunDir:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.logs = self.root / "logs"
        self.config = self.root / "config.yaml"
        self.init_hf = self.root / "init_hf"
        self.sft = self.root / "sft"
        self.sft_hf = self.root / "sft" / "hf"
        self.train = self.root / "train"
        self.final_hf = self.root / "final_hf"
        self.control = self.root / "control"
        self.metrics = self.root / "metrics.jsonl"
        self.report = self.root / "report.json"
        self.plots = self.root / "plots"

    def make(self) -> None:
        for d in (self.root, self.logs, self.plots):
            d.mkdir(parents=True, exist_ok=True)


def _with(config: RunConfig, overrides: dict) -> RunConfig:
    data = config.model_dump(mode="json")
    for dotted, value in overrides.items():
        node = data
        *parents, last = dotted.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    return build(RunConfig, data)


def torchrun_cmd(nproc: int, master_port: int, *cli_args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tidal.torchrun",  # torchrun passing on its workers' exit codes (tidal/torchrun.py)
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        f"--master-port={master_port}",
        "-m",
        "tidal.cli",
        *cli_args,
    ]


def run_phase(sup: Supervisor, spec: ProcessSpec, poll_s: float = 0.5) -> None:
    """Run one process to completion under the supervisor (raises ProcessDied on failure)."""
    sup.start(spec)
    while True:
        if spec.name in sup.poll():
            return
        time.sleep(poll_s)


def tcp_host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a ZeroMQ ``tcp://HOST:PORT`` address (IPv6 brackets dropped); None for others."""
    if not address.startswith("tcp://"):
        return None
    host, port = address[len("tcp://") :].rsplit(":", 1)
    return host.strip("[]"), int(port)


def check_broker_ports(config: RunConfig) -> None:
    """The broker's address and metrics port are free before anything starts. Else the job's nodes and
    trainer would find the broker already there (another job's, e.g. a second ``make run`` at once)."""
    b = config.broker
    tcp = tcp_host_port(b.bind)
    if tcp is not None and tcp[0] != "*" and (why := port_in_use(*tcp)):
        raise ConfigError(
            f"broker.bind={b.bind!r}: {why}: another broker (another tidal run?) may listen there; "
            "stop it, or give this job another address, e.g. broker.bind=tcp://127.0.0.1:5556"
        )
    if b.metrics_port is not None and (why := port_in_use(b.metrics_host, b.metrics_port)):
        raise ConfigError(
            f"broker.metrics_port={b.metrics_port}: {why} on {b.metrics_host}; choose another port, or null to serve none"
        )


def check_curve_keys(config: RunConfig) -> None:
    """The nodes' and the trainer's CURVE key files, where set, before anything starts."""
    from tidal.broker.curve import client_keys

    agent, tc = config.rollout.agent, config.trainer
    client_keys(agent.curve_secret_key_file, agent.curve_server_key_file, "rollout.agent")
    client_keys(tc.curve_secret_key_file, tc.curve_server_key_file, "trainer")


def main(config: RunConfig, args: list[str]) -> int:
    opts = parse_options(args)
    if opts.resume and Path(config.run_dir).resolve() != Path(opts.resume).resolve():
        # the command line loads --resume's config.yaml (resume_source); a caller that did not is told
        raise ConfigError(f"--resume {opts.resume}: the config's run_dir is {config.run_dir}")
    if opts.sync:
        config = _with(config, {"broker.max_staleness": 0})
    placement = plan_placement(config)  # a device combination that cannot run fails before anything starts
    config = _with(config, placement.overrides)
    check_curve_keys(config)
    rd = RunDir(config.run_dir)
    plan = plan_run(config, rd.root, rd.init_hf)
    check_run_dir(config, rd.root)  # before anything is written into it
    check_broker_ports(config)
    from tidal.rollout.tasks import check_prompts, prepare_task

    rd.make()
    dump_config(config, rd.config)
    interactive = sys.stdout.isatty() and not opts.plain
    from tidal.live_view import LiveView

    view = LiveView(config.trainer.steps, f"tidal {config.name}{' (sync)' if opts.sync else ''}", interactive)
    sup = Supervisor(on_event=view.event)

    def _on_signal(signum, frame):  # noqa: ARG001 - SIGTERM (and a closed terminal's SIGHUP) stop like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    try:
        files = prepare_task(config, rd.root)
        check_prompts(files)  # a tokenizer that cannot render the data fails here, not on every node
        data = config.broker.data.path or files.train.parent
        view.event(f"task {config.task.name}: data in {data}, tokenizer {files.tokenizer}")
        view.event(f"placement: {placement.summary}")
        if plan.writes_initial:
            from tidal.bootstrap import init_hf_model

            init_hf_model(config.model, files.tokenizer, rd.init_hf, seed=config.seed)
        view.event(f"initial model {plan.initial}")
        t0 = time.time()
        if plan.warmup and not (rd.sft_hf / "config.json").exists():
            view.event(f"supervised warm-up (tidal sft) on {plan.demonstrations}")
            run_phase(sup, warmup_spec(config, rd, plan, placement.trainer_env))
        elif not plan.warmup:
            view.event("no warm-up: GRPO starts from the initial model")
        sft_wall = time.time() - t0
        start = plan.start(rd.sft_hf)
        with view:
            grpo_wall = run_grpo(config, rd, sup, view, files, start, placement)
        stop_job(sup)
        results = evaluate_all(config, rd, sup, view, plan, grpo_wall, opts.control, placement)
        results["sft_wall_s"] = sft_wall
        results["grpo_wall_s"] = grpo_wall
        results["journal"] = journal_summary(config, rd)
        rd.report.write_text(json.dumps(results, indent=1))
        print_report(results)
        from tidal.plots import write_plots

        write_plots(rd.metrics, rd.plots)
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process (resume with: tidal run --resume " + str(rd.root) + ")")
        return 130
    except ProcessDied as exc:
        print(f"\ntidal run: {exc}", file=sys.stderr)
        print(f"tidal run: once that is fixed, resume with: tidal run --resume {rd.root}", file=sys.stderr)
        return 1
    finally:
        stop_job(sup)


def journal_summary(config: RunConfig, rd: RunDir) -> dict:
    """The broker journal's account of every prompt group (tidal/journal_audit.py)."""
    from tidal.journal_audit import audit_journal

    return audit_journal(config.journal_dir()).as_dict()


# The trainer finishes its batch and saves a checkpoint when signalled (trainer/stop_request.py); torchrun
# kills it 30 s after forwarding the signal, so waiting longer than that gains nothing.
TRAINER_STOP_S = 35.0


def stop_job(sup: Supervisor) -> None:
    """Trainer first (it may be checkpointing), then rollout nodes (they return their leases), broker last."""
    sup.stop_all(
        order=["trainer", *[n for n in sup.states if n.startswith("rollout")], "broker", "sft", "control"],
        timeouts={"trainer": TRAINER_STOP_S},
    )


def warmup_spec(
    config: RunConfig, rd: RunDir, plan: RunPlan, env: dict[str, str] | None = None
) -> ProcessSpec:
    """``tidal sft`` from the initial model with the warm-up's own schedule (annealed to zero)."""
    w = config.warmup
    overrides = [
        f"trainer.optimizer.lr={w.lr}",
        f"trainer.optimizer.schedule={w.schedule}",
        "trainer.optimizer.min_lr=0.0",
        f"trainer.optimizer.warmup_steps={w.warmup_steps}",
    ]
    if w.batch_size is not None:  # tidal sft trains batch_groups * group_size sequences per step
        overrides.append(f"broker.batch_groups={w.batch_size // config.broker.group_size}")
    flags = [
        f"--init={plan.initial}",
        f"--data={plan.demonstrations}",
        f"--out={rd.sft}",
        f"--steps={w.steps}",
    ]
    cmd = torchrun_cmd(config.trainer.nproc, free_port(), "sft", str(rd.config), *overrides, *flags)
    return ProcessSpec(name="sft", cmd=cmd, log=rd.logs / "sft.log", env=env or {}, expect_exit=True)


def control_spec(
    config: RunConfig, rd: RunDir, wall_s: float, env: dict[str, str] | None = None
) -> ProcessSpec:
    """The control: continued SFT from the warm-up at GRPO's learning rate for GRPO's wall time."""
    flags = [
        f"--init={rd.sft_hf}",
        f"--out={rd.control}",
        f"--lr={config.trainer.optimizer.lr}",
        f"--wall-s={wall_s:.1f}",
        f"--steps={10**9}",
    ]
    cmd = torchrun_cmd(
        config.trainer.nproc,
        free_port(),
        "sft",
        str(rd.config),
        "trainer.optimizer.schedule=constant",
        *flags,
    )
    return ProcessSpec(name="control", cmd=cmd, log=rd.logs / "control.log", env=env or {}, expect_exit=True)


def run_grpo(
    config: RunConfig, rd: RunDir, sup: Supervisor, view, files, start: Path, placement: Placement
) -> float:
    """Broker + rollout nodes + trainer from the model ``start`` until the trainer finishes its steps;
    returns the wall time."""
    from tidal.broker.client import BrokerClient
    from tidal.broker.curve import client_keys
    from tidal.live_view import read_metrics

    # the live view's stats, with the trainer's keys where the broker wants CURVE (checked before starting)
    tc = config.trainer
    curve = client_keys(tc.curve_secret_key_file, tc.curve_server_key_file, "trainer")
    host, port = tcp_host_port(config.broker.bind)  # a tcp address: the nodes reach it over the network
    # the data the task wrote, where the config names none
    data_override = [] if config.broker.data.path else [f"broker.data.path={files.train}"]
    sup.start(
        ProcessSpec(
            "broker",
            python_cmd("broker", str(rd.config), *data_override),
            rd.logs / "broker.log",
            env={"CUDA_VISIBLE_DEVICES": ""},  # the broker computes nothing on a GPU
            # restarted on its journal it loses no acknowledged group; nodes and trainer register again
            restart=True,
            max_restarts=3,
        )
    )
    broker = sup.states["broker"]
    try:
        wait_for_tcp(host, port, 30, broker.proc)
    except RuntimeError:
        if broker.proc.poll() is None:
            raise
        # one that exits before it listens (e.g. refused its journal) is not restarted: it would again
        raise sup.died("broker") from None
    for i in range(config.rollout.nodes):
        cmd = python_cmd(
            "rollout",
            str(rd.config),
            f"model.path={start}",
            "--broker",
            config.broker.bind,
            "--name",
            f"node{i}",
        )
        sup.start(
            ProcessSpec(
                f"rollout{i}",
                cmd,
                rd.logs / f"rollout{i}.log",
                env=placement.node_envs[i],
                restart=True,
                max_restarts=5,
                expect_exit=True,  # exit 0: the data is exhausted (or the node was told to leave)
            )
        )
    train_cmd = torchrun_cmd(
        config.trainer.nproc, free_port(), "train", str(rd.config), f"--init={start}", f"--out={rd.train}"
    )
    trainer = ProcessSpec(
        "trainer",
        train_cmd,
        rd.logs / "trainer.log",
        env=placement.trainer_env,
        restart=True,
        max_restarts=3,
        expect_exit=True,
        # starved of batches for trainer.batch_timeout_s: restarted, it would only wait as long again
        final_exit_codes=(CONFIG_ERROR_EXIT, NO_BATCH_EXIT),
    )
    t0 = time.time()
    sup.start(trainer)
    pos = 0
    client = BrokerClient(config.broker.bind, timeout_s=5.0, curve=curve)
    last_stats = 0.0
    last_step = 0
    try:
        while True:
            done = sup.poll()
            records, pos = read_metrics(rd.metrics, pos)
            last_step = max([last_step, *(r["step"] for r in records)])
            stats = None
            if time.time() - last_stats > 2.0:
                last_stats = time.time()
                try:
                    stats = client.stats()
                except Exception:  # noqa: BLE001 - the broker may be restarting; the view shows the last stats
                    stats = None
            view.update(records, stats, sup.health())
            if "trainer" in done:
                break
            time.sleep(0.5)
        if last_step < config.trainer.steps:
            # the trainer finishes early only when the broker will never have another batch
            epochs = config.broker.data.epochs
            view.event(
                f"GRPO ended after step {last_step} of trainer.steps={config.trainer.steps}: the data is "
                f"exhausted (broker.data.epochs={epochs}); raise it, or give more rows, for more steps"
            )
    finally:
        client.close()
    return time.time() - t0


def evaluate_all(
    config: RunConfig,
    rd: RunDir,
    sup: Supervisor,
    view,
    plan: RunPlan,
    grpo_wall: float,
    control: bool,
    placement: Placement,
) -> dict:
    """Held-out accuracy of the model GRPO started from, of GRPO's result and, after a warm-up, of the SFT
    control; nothing to evaluate without held-out rows."""
    from tidal.evaluate import evaluate_dir
    from tidal.rollout.tasks import build_task
    from tidal.rollout.tasks.data import read_rows

    if plan.eval_rows is None:
        view.event("no held-out rows (task.eval_path): nothing evaluated")
        return {"eval_problems": 0}
    task = build_task(config, rd.root)
    rows = list(read_rows(plan.eval_rows))
    max_new = config.rollout.sampling.max_new_tokens
    results: dict = {"eval_problems": len(rows), "start": plan.start_name}
    results[plan.start_name] = evaluate_dir(plan.start(rd.sft_hf), task, rows, max_new).as_dict()
    results["grpo"] = evaluate_dir(rd.final_hf, task, rows, max_new).as_dict()
    if control and plan.warmup:
        view.event(f"control: continued SFT at GRPO's lr for {grpo_wall:.0f}s")
        run_phase(sup, control_spec(config, rd, grpo_wall, placement.trainer_env))
        results["control_sft"] = evaluate_dir(rd.control / "hf", task, rows, max_new).as_dict()
    return results


REPORT_ROWS = (
    ("initial", "initial model"),
    ("sft", "SFT warm-up"),
    ("grpo", "async GRPO"),
    ("control_sft", "SFT control (same wall time)"),
)


def print_report(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    if not results["eval_problems"]:
        print("held-out accuracy: no eval rows (set task.eval_path to verl rows to evaluate)")
    else:
        start = results.get("start", "sft")
        table = Table(title=f"held-out greedy accuracy ({results['eval_problems']} problems)")
        table.add_column("checkpoint")
        table.add_column("accuracy", justify="right")
        table.add_column("vs SFT" if start == "sft" else "vs initial", justify="right")
        base = results[start]["accuracy"]
        for key, label in REPORT_ROWS:
            if key in results:
                acc = results[key]["accuracy"]
                table.add_row(label, f"{100 * acc:.1f}%", f"{100 * (acc - base):+.1f} pts")
        Console().print(table)
    j = results.get("journal")
    if j:
        verdict = "; ".join(j["problems"]) or "no group lost or trained twice"
        r = j["run"]  # the whole run's figures, also where compaction replaced the early records
        print(
            f"journal: {r['taken']} groups taken, {r['accepted']} accepted, {r['batched']} in "
            f"{r['batches']} batches, {r['dropped_stale']} dropped stale, {r['filtered']} filtered "
            f"(dynamic sampling), {r['failed']} failed, {j['outstanding']} in flight at the end: {verdict}"
        )
