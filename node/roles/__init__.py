"""The work a node does for the swarm: its role, and the parts every role is built from.

A role is one object with `start()`, `run()` and `stop(planned)` (role.py). The daemon hands each
assignment from the coordinator to the runner, which stops the old role before it starts the new
one; the registry says which class an assignment makes. The roles and the parts they share:

    replica         DiLoCo: inner steps, then the all-reduce of the pseudo-gradient (or of its
                    fragments, each while the inner steps go on); catch-up
    stage server    one stage of a pipeline cut, served to trainers; synced with its stage's peers
    expert host     one shard of a MoE model's experts, served to trainers; synced with its shard's
    trainers        hold the data: push micro-batches through the stages, or call the experts

                    replica  stage server  expert host  trainers
    SwarmView          x          x             x           x      who is a member, in what role
    SlotState          x          x             x                  a slot's states: disk, peers, coordinator
    SlotServer                    x             x                  a slot's server: the parts below, start/serve/stop
      SlotWeights                 x             x                  a slot's module and outer state
      SlotSync                    x             x                  periodic sync, catch-up, hand-over
      CallQueue                   x             x                  calls served in batches
    StepSchedule                  x             x                  when a step is due and taken
    PeerCaller                                              x      calls with deadlines and backoff
    Auditor                                                 x      calls checked on a second peer
    micro_batch_loop                                        x      the trainers' one loop
    stats                x        x             x           x      stats files, rates, losses

Files:
    role.py              `Role`, `RoleError`, `RoleContext` (what the daemon gives every role)
    runner.py            `RoleRunner`: at most one role at a time, each switch awaiting the old one's stop;
                         a role that fails is reported (one line) and no role is taken until restart
    registry.py          `RoleSpec` entries, one per role; `make_role(ctx, assignment)`
    view.py              `SwarmView`: one DHT read path, one timeout, one freshness rule, reasons for skips
    caller.py            `SlotPeers` (pure: pick, deadlines, backoff) and `PeerCaller` (checked calls)
    slot_state.py        `SlotState`: a slot's states on disk, served, offered, fetched, uploaded;
                         `choose_state`, the pure choice of which state to take
    weights.py           `SlotWeights` (module, optimizer, outer state, version, lock) and `ComputeThread`
    slot_sync.py         `SlotSync`: take the slot's state, sync every period, catch up, hand over
    serving.py           `CallQueue` and `Pending`: the calls waiting for a server's compute, the serve loop
    slot_server.py       `SlotServer`: what a stage server and an expert host are made of and do around
                         their calls: take the state, serve, step, sync, report, hand over
    stage_core.py        sans-IO decisions with reasons, clock passed in: `take_batch`, `KeptGraphs`,
                         `StepSchedule` (step due, the global clip's waiting), `NormBook` (a trainer's)
    stage_compute.py     a stage's arithmetic: batches, kept graphs with stashed weights, `clipped_step`
    stage_calls.py       the checks on stage calls and through answers, before any compute
    stage_server.py      `StageServer`, composed of the parts above
    expert_host.py       `ExpertHost` and `ExpertCompute`: forward and backward per expert, held
                         gradients until the trainer's commit
    activations.py       the codec activations travel with; decoding with checks
    trainer_loop.py      the trainers' data and `micro_batch_loop`
    pipeline_trainer.py  `PipelineTrainer`: through and relay routing, retries, the global clip's norms
    expert_client.py     `ExpertClient`, `remote_moe`, `forward_loss`, `clip_and_commit`: a trainer's
                         side of remote experts
    expert_trainer.py    `ExpertTrainer`: the dense parts here, the experts remote; dense syncs;
                         `DenseCheckpoints`: the dense parts as states the coordinator keeps
    expert_model.py      `ExpertModel`: an experts run's model as its roles make it (a MoE preset, or a
                         Hugging Face Mixtral fetched by pin): layout, shards, dense parts, forward
    replica.py           `Replica`: the DiLoCo round, state taken from peers or the coordinator
    replica_peers.py     `ReplicaPeers`: the other replicas, as a replica sees them, and their states
    check_batch.py       `CheckBatch`: a judge of the parts a replica aggregates, by the loss of each
                         sender's own data with its part applied alone (bench/byzantine_judge.py;
                         not yet a replica's: its bans must first agree, see its docstring)
    attacks.py           `Attack`: what a Byzantine replica sends in place of its pseudo-gradient;
                         `AnswerAttack`: what a Byzantine stage server or expert host answers with
                         (node settings fault_attack, fault_attack_scale: tests, drills, benches)
    audit.py             `Auditor`: a trainer's checks of a fraction of its calls on a second peer of
                         the slot; `judge` (pure): who lied in a dispute, and why; bans
    budget.py            the inner phase under inner_phase "time": `median_ready`, `keep_stepping` (pure) and `MedianWatch`
    streaming.py         `Streaming`: a replica's outer step in fragments, each round overlapped with
                         inner steps and applied a fragment period later (run setting `fragments`)
    fragments.py         pure: the fragments (`split`), their `Schedule`, `when_to_apply`, `after_cycle`
    run_model.py         `RunModel`: the run's model as a role makes it (a preset, or a Hugging Face
                         model whose files are fetched from the coordinator by pin) and its data
    stats.py             `StatsFile`, `ComputeRate`, `LossLog`
    pause.py             `PauseWatch`: notices this process was frozen (a jump of the clocks)
"""
