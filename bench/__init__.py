"""Benchmarks (not tests): each prints JSON with --json, ours side by side with the anchors.

    codecs.py       our tensor codecs vs hivemind compression classes
    allreduce.py    our all-reduce vs hivemind DecentralizedAverager vs torch.distributed gloo
                    (allreduce_peer.py: one peer process, its arms in allreduce_arm.py and
                    allreduce_hivemind.py; netns.py: emulated links; workers.py)
    faults.py       what a crashed, frozen or cut-off peer costs an all-reduce's survivors, ours
                    vs hivemind's (faults_report.py: what a run reports)
    pipeline.py     pipeline training: one process vs torch.distributed.pipelining vs the swarm
    experts.py      MoE layers: one process vs hivemind.moe vs the swarm (experts_layer.py: the
                    settings and timed loop; experts_procs.py: the processes its arms start)
    nat.py          a node behind a NAT against the same node with a public address
    overlap.py      the streaming outer step behind shaped links against today's outer step
    convergence.py  DiLoCo over the swarm vs sync data parallelism vs the one-process simulation
                    (convergence_sync.py, convergence_swarm.py, convergence_settings.py)
    byzantine.py    replicas that lie in every round: the robust aggregator and its bans against
                    the same swarm clean, and against the plain mean
    models.py       GPT-2 small and a Llama-style model in each role vs one process and
                    torch.distributed.pipelining: memory, tokens/s, a joiner, checkpoint, export
                    (models_settings.py, models_local.py, models_swarm.py; memory.py: a process
                    tree's RSS, PSS and CPU time)
"""
