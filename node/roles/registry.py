"""Which role object an assignment makes: one entry per role, and the one lookup the daemon does.

An entry (`RoleSpec`) names the role as assignments name it, the class that does it (imported
when first made: the CLI's checks stay light), which runs it serves, and what a node says when it
is assigned the role in a run it does not serve. A role name may have several entries: the
trainer of a pipeline run is not the trainer of an experts run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from protocol import RoleAssignment

from ..runconfig import RunConfig, RunConfigError
from .role import Role, RoleContext, RoleError


def _any(run: RunConfig) -> bool:
    return True


def _pipeline(run: RunConfig) -> bool:
    return not run.is_moe and (not run.is_hf or run.num_stages > 0)  # (a Hugging Face model's run is cut when it names stages)


def _moe(run: RunConfig) -> bool:
    # a Hugging Face model's experts: the coordinator splits them into shards in experts mode only
    # (whether its type has experts the role checks once its files are here)
    return run.is_moe or (run.is_hf and run.expert_shards > 0)


@dataclass(frozen=True)
class RoleSpec:
    name: str  # the role, as the coordinator's assignments name it
    cls: str  # "module:Class", a module of node/roles or a dotted path; built as Class(ctx, run, assignment)
    serves: Callable[[RunConfig], bool] = _any  # the runs it serves
    refusal: str = ""  # what a node says when assigned this role in another run ({model}: the run's model)

    def make(self, ctx: RoleContext, run: RunConfig, assignment: RoleAssignment) -> Role:
        module, _, name = self.cls.partition(":")
        return getattr(importlib.import_module(module if "." in module else f"{__package__}.{module}"), name)(ctx, run, assignment)


ROLES: tuple[RoleSpec, ...] = (
    RoleSpec("replica", "replica:Replica"),
    RoleSpec("stage", "stage_server:StageServer", _pipeline, "a run of {model} has no stage role (it is not cut into pipeline stages)"),
    RoleSpec("expert", "expert_host:ExpertHost", _moe, "the model {model} has no experts"),
    RoleSpec("trainer", "pipeline_trainer:PipelineTrainer", _pipeline),
    RoleSpec("trainer", "expert_trainer:ExpertTrainer", _moe),
)


def make_role(ctx: RoleContext, assignment: RoleAssignment, roles: tuple[RoleSpec, ...] = ROLES) -> Role:
    """The role object for an assignment; RoleError (its message says why) if this node cannot take it."""
    specs = [s for s in roles if s.name == assignment.role]
    if not specs:
        raise RoleError(f"this node does not serve the {assignment.role} role")
    try:
        run = RunConfig.from_json(assignment.config)
    except RunConfigError as e:
        raise RoleError(str(e)) from None
    for spec in specs:
        if spec.serves(run):
            return spec.make(ctx, run, assignment)
    raise RoleError(specs[0].refusal.format(model=run.model))
