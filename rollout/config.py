"""Configuration of rollout nodes, their engines and the task."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tidal.broker.config import check_curve_pair


class SamplingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.7, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1: off")
    max_new_tokens: int = Field(16, ge=1)


class EmbeddedEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["embedded"] = "embedded"
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, description="0: pick a free port")
    device: str = "cpu"
    max_batch_size: int = Field(64, ge=1)
    max_seq_len: int = Field(512, ge=8)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_prefill_tokens: int = Field(
        4096, ge=1, description="prompt tokens admitted per prefill step (at least one request always)"
    )
    weight_update_timeout_s: float = Field(
        120.0, gt=0, description="collective timeout of weight-update groups joined by the engine"
    )
    served_model_name: str | None = Field(None, description="name reported by /model_info; None: the path")
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads of the engine process (CPU); None: torch's default"
    )
    fuse_projections: bool = Field(
        True, description="run Q/K/V and gate/up as one matmul each (weights stay shared with the model's)"
    )
    relayout_weights: bool | Literal["auto"] = Field(
        "auto",
        description="after the first weight update announced in full, move the weights into one arena per dtype "
        "in the order the sender's broadcasts carry them, so later updates are received in place, one "
        "broadcast per bucket (arena.py; costs one more copy of the weights' memory, once); auto: true for CPU "
        "engines, false on CUDA (not yet measured there)",
    )
    decode: Literal["auto", "lean", "cuda_graphs", "transformers"] = Field(
        "auto",
        description="decode step: tidal's lean forward (qwen3, qwen3_moe), as CUDA graphs per batch/length "
        "bucket, or transformers' modules; auto: cuda_graphs on CUDA, lean on CPU, transformers for other "
        "families (docs/engine.md)",
    )
    decode_burst: int = Field(
        8,
        ge=1,
        description="lean decode steps run back to back (tokens stay on the device, read once per burst) "
        "while no request waits to join and none reaches its length limit; a call (pause, weight update, "
        "abort) waits at most one burst; 1: look at the requests after every step",
    )
    cpu_attention: Literal["auto", "native", "torch"] = Field(
        "auto",
        description="attention of the lean decode on CPU (fp32): a small AVX2 C kernel compiled once with the "
        "system C compiler (native), or PyTorch's matmuls (torch); auto: native where it builds, else torch "
        "(/server_info says which and why)",
    )
    cpu_step: Literal["auto", "native", "torch"] = Field(
        "auto",
        description="how the lean decode and prefill run on CPU (fp32): each step as one call into a C kernel "
        "compiled once with the system C compiler (native: every layer's GEMMs, norms, rotary, attention and "
        "MoE routing; single-threaded, AVX-512 or AVX2 build), or PyTorch ops (torch); auto: native where it "
        "builds and the engine runs one intra-op thread (num_threads=1), else torch (/server_info says which "
        "and why)",
    )


class SGLangEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["sglang"] = "sglang"
    url: str | None = Field(None, description="an SGLang server already running; None: launch one")
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=1)
    tp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    mem_fraction_static: float = Field(0.8, gt=0, le=1)
    extra_args: list[str] = Field(default_factory=list)


EngineConfig = Annotated[EmbeddedEngineConfig | SGLangEngineConfig, Field(discriminator="type")]


class TaskConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["arithmetic", "gsm8k", "custom"] = Field(
        "arithmetic",
        description="arithmetic: synthetic addition generated into the run directory; gsm8k: verl rows "
        "(broker.data.path) scored with math-verify; custom: verl rows scored by `reward`",
    )
    reward: str | None = Field(
        None,
        description="module:function or file.py:function with verl's signature (data_source, solution_str, "
        "ground_truth, extra_info), sync or async; replaces the task's own reward; required for custom",
    )
    tokenizer: str | None = Field(
        None,
        description="Hugging Face tokenizer directory, read only; None: model.path's, or for the arithmetic task "
        "without one the character-level tokenizer it writes to <run_dir>/tokenizer",
    )
    eval_path: str | None = Field(None, description="eval rows (verl JSONL/parquet); None: the task's own")
    num_train: int = Field(20000, ge=1)
    num_eval: int = Field(500, ge=1)
    num_sft: int | None = Field(
        1000,
        ge=1,
        description="arithmetic: demonstrations in the SFT set (warm-up and control), the first num_sft train "
        "rows; None: every train row. RL needs only prompts and a verifier, demonstrations are scarce",
    )
    digits: int = Field(2, ge=1, le=9, description="arithmetic: digits of each (zero-padded) operand")
    overlong_buffer: int = Field(0, ge=0, description="DAPO overlong penalty buffer length; 0: off")
    overlong_penalty: float = Field(1.0, ge=0)
    reward_workers: int = Field(
        0,
        ge=0,
        description="processes scoring sync rewards; 0: score on the agent's event loop (cheap rewards)",
    )

    @model_validator(mode="after")
    def _check_custom(self) -> TaskConfig:
        if self.name == "custom" and not self.reward:
            raise ValueError("task.name=custom needs task.reward=module:function (or file.py:function)")
        return self


class AgentConfig(BaseModel):
    """The node agent's knobs: how much it leases, how it retries, how it stops."""

    model_config = ConfigDict(extra="forbid")

    max_groups_per_lease: int = Field(4, ge=1, description="prompt groups asked for in one lease")
    max_inflight_groups: int | None = Field(
        None,
        ge=1,
        description="groups being sampled at once; None: enough to keep every engine at its concurrency "
        "(ceil(concurrency * engines / group size) + 1)",
    )
    lease_poll_s: float = Field(
        0.2,
        gt=0,
        description="how often a node waiting for its engines' weights asks them again, and the wait before "
        "asking the broker again after a failed lease request (leases themselves are pushed, not polled)",
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="on SIGTERM: time to finish in-flight groups before releasing the rest"
    )
    max_retries: int = Field(3, ge=0, description="engine failures one sample survives (each resumes it)")
    max_resumes: int = Field(64, ge=0, description="aborted segments one sample may resume (weight updates)")
    resume_backoff_s: float = Field(0.05, gt=0, description="first wait after an abort that produced nothing")
    group_request_max_new_tokens: int = Field(
        64,
        ge=0,
        description="a group whose sampling.max_new_tokens is at most this starts as one /generate with "
        "sampling_params.n (one HTTP request and one prefill for its n samples; the group holds its n "
        "places on the engine until its last sample ends); longer ones send a request per sample, so each "
        "place is reused as soon as its sample ends (long-tailed lengths); 0: always a request per sample",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="one /generate call")
    engine_start_timeout_s: float = Field(300.0, gt=0, description="an engine must answer within this")
    engine_max_restarts: int = Field(5, ge=0, description="restarts of one crashed child engine")
    max_failed_groups: int = Field(
        20, ge=1, description="groups failing in a row (each released) before the node gives up, exit 1"
    )
    broker_timeout_s: float = Field(30.0, gt=0, description="one broker call")
    broker_wait_s: float = Field(
        600.0,
        ge=0,
        description="how long to wait at start for a broker that does not answer yet (started after the "
        "node, or restarting), asking again and logging it every broker_timeout_s; 0: fail at once",
    )
    curve_secret_key_file: str | None = Field(
        None, description="this node's ZeroMQ CURVE secret certificate (.key_secret); None: no CURVE"
    )
    curve_server_key_file: str | None = Field(None, description="the broker's public certificate (.key)")

    @model_validator(mode="after")
    def _check_curve(self) -> AgentConfig:
        check_curve_pair(self.curve_secret_key_file, self.curve_server_key_file, "rollout.agent")
        return self


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nodes: int = Field(2, ge=1, description="rollout nodes that `tidal run` starts locally")
    engines_per_node: int = Field(1, ge=1)
    engine: EngineConfig = EmbeddedEngineConfig()
    concurrency: int = Field(64, ge=1, description="requests in flight per engine")
    update_mode: Literal["in_place", "abort"] = "in_place"
    heartbeat_s: float = Field(2.0, gt=0)
    sampling: SamplingConfig = SamplingConfig()
    engine_urls: list[str] = Field(
        default_factory=list,
        description="engines already serving SGLang's HTTP protocol; empty: the node starts "
        "engines_per_node engines of `engine` itself",
    )
    agent: AgentConfig = AgentConfig()
