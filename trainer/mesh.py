"""Parallel mesh of the trainer and megatron-core's accounting rules.

dense:   world = tp * cp * pp * dp
experts: world = etp * ep * pp * edp
so ``world / pp = tp * cp * dp = etp * ep * edp``. Rules are checked before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from tidal.model_config import ModelConfig


class MeshConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tp: int = Field(1, ge=1, description="tensor parallel")
    pp: int = Field(1, ge=1, description="pipeline parallel")
    vpp: int = Field(1, ge=1, description="virtual pipeline stages per rank (interleaved schedule)")
    cp: int = Field(1, ge=1, description="context parallel")
    ep: int = Field(1, ge=1, description="expert parallel")
    etp: int = Field(1, ge=1, description="expert tensor parallel")
    sequence_parallel: bool | None = Field(
        None, description="default: on when tp > 1 and the model has experts"
    )
    first_stage_layers: int | None = Field(
        None,
        ge=1,
        description="layers on the first pipeline stage (megatron-core num_layers_in_first_pipeline_stage); "
        "None: the even split",
    )
    last_stage_layers: int | None = Field(
        None,
        ge=1,
        description="layers on the last pipeline stage (megatron-core num_layers_in_last_pipeline_stage); "
        "None: the even split",
    )


@dataclass(frozen=True)
class MeshLayout:
    world: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int
    vpp: int

    def describe(self) -> str:
        return (
            f"world={self.world}: world/pp={self.world // self.pp} = tp*cp*dp = {self.tp}*{self.cp}*{self.dp}"
            f" = etp*ep*edp = {self.etp}*{self.ep}*{self.edp}"
        )


def layer_split_errors(mesh: MeshConfig, num_layers: int) -> list[str]:
    """megatron-core's pipeline split: even, or explicit first/last stages with an even middle."""
    stages = mesh.pp * mesh.vpp
    if mesh.first_stage_layers is None and mesh.last_stage_layers is None:
        if num_layers % stages:
            return [
                f"mesh: model.num_hidden_layers={num_layers} is not divisible by pp*vpp={stages} "
                "(or set mesh.first_stage_layers / mesh.last_stage_layers)"
            ]
        return []
    if mesh.pp == 1:
        return ["mesh: first_stage_layers / last_stage_layers need pp > 1"]
    errors: list[str] = []
    middle_layers, middle_stages = num_layers, mesh.pp
    for name, count in (
        ("first_stage_layers", mesh.first_stage_layers),
        ("last_stage_layers", mesh.last_stage_layers),
    ):
        if count is None:
            continue
        if count % mesh.vpp:
            errors.append(f"mesh: {name}={count} is not divisible by vpp={mesh.vpp}")
        middle_layers -= count
        middle_stages -= 1
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
        errors.append(
            f"mesh: {middle_layers} layers are left for {middle_stages} middle stages "
            f"(model.num_hidden_layers={num_layers} minus the first/last stage layers)"
        )
    elif middle_stages and middle_layers % (middle_stages * mesh.vpp):
        errors.append(
            f"mesh: the {middle_layers} middle layers are not divisible by "
            f"middle stages*vpp={middle_stages}*{mesh.vpp}"
        )
    return errors


def mesh_errors(mesh: MeshConfig, world: int, model: ModelConfig | None = None) -> list[str]:
    """Every rule the mesh breaks, each naming the rule; empty when the mesh is legal."""
    errors: list[str] = []
    if world < 1:
        return [f"mesh: world size {world} must be >= 1"]
    dense = mesh.tp * mesh.cp * mesh.pp
    if world % dense:
        errors.append(
            f"mesh: tp*cp*pp={dense} does not divide world size {world} (dense world = tp*cp*pp*dp)"
        )
    expert = mesh.etp * mesh.ep * mesh.pp
    if world % expert:
        errors.append(
            f"mesh: etp*ep*pp={expert} does not divide world size {world} (expert world = etp*ep*pp*edp)"
        )
    if mesh.vpp > 1 and mesh.pp == 1:
        errors.append(f"mesh: vpp={mesh.vpp} needs pp > 1 (virtual stages interleave a real pipeline)")
    if model is not None:
        if model.num_attention_heads % mesh.tp:
            errors.append(
                f"mesh: model.num_attention_heads={model.num_attention_heads} is not divisible by tp={mesh.tp}"
            )
        if (
            model.family != "deepseek_v3"
            and model.num_key_value_heads % mesh.tp
            and mesh.tp % model.num_key_value_heads
        ):
            errors.append(
                f"mesh: model.num_key_value_heads={model.num_key_value_heads} and tp={mesh.tp}: one must divide the other"
            )
        errors.extend(layer_split_errors(mesh, model.num_hidden_layers))
        if model.is_moe and model.num_experts % mesh.ep:
            errors.append(f"mesh: model.num_experts={model.num_experts} is not divisible by ep={mesh.ep}")
        if not model.is_moe and (mesh.ep > 1 or mesh.etp > 1):
            errors.append(
                f"mesh: ep={mesh.ep}, etp={mesh.etp} need a model with experts (model.num_experts=0)"
            )
        if model.is_moe and mesh.tp > 1 and mesh.sequence_parallel is False:
            errors.append(
                "mesh: sequence_parallel must be on when tp > 1 with experts (megatron-core requires it)"
            )
    return errors


def resolve_mesh(mesh: MeshConfig, world: int, model: ModelConfig | None = None) -> MeshLayout:
    from tidal.errors import ConfigError

    errors = mesh_errors(mesh, world, model)
    if errors:
        raise ConfigError("\n".join(errors))
    return MeshLayout(
        world=world,
        tp=mesh.tp,
        pp=mesh.pp,
        cp=mesh.cp,
        dp=world // (mesh.tp * mesh.cp * mesh.pp),
        ep=mesh.ep,
        etp=mesh.etp,
        edp=world // (mesh.etp * mesh.ep * mesh.pp),
        vpp=mesh.vpp,
    )
