"""The work a node does for the swarm.

Files:
    runner.py     the role interface (start, run, stop(planned)) and the runner that switches roles
    replica.py    the replica role: DiLoCo rounds, catch-up, state serving, checkpoints
    pipeline.py   the stage server and trainer roles of a pipeline run
    experts.py    the expert host and trainer roles of an experts run
    pause.py      PauseWatch: notices this process was frozen (a jump of the clocks between ticks)
"""
