"""Configuration of the weight sync from trainer to engines."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WeightSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every_steps: int = Field(1, ge=1, description="sync after every k optimizer steps")
    bucket_bytes: int = Field(512 << 20, gt=0)
    master_port: int = Field(0, ge=0, description="0: pick a free port")
    timeout_s: float = Field(60.0, gt=0, description="a node that does not answer in time is dropped")
    verify_checksums: bool = False
