"""The models a swarm trains, how each is cut for the roles, and the data. No network code.

Files:
    gpt.py       the built-in GPT (presets tiny, small)
    moe.py       the built-in mixture-of-experts GPT (tiny-moe, small-moe): router, experts, combine
    stages.py    the GPT cut into pipeline stages (plan_stages, Stage): each holds only its blocks
    data.py      the built-in corpus (Python's stdlib sources) or --data, shards, evaluation
    diloco.py    inner/outer optimizers, the state hash, a one-process DiLoCo simulation
    export.py    the GPT as a Hugging Face GPT-2 (weights, config, byte tokenizer), sampling, its loss
"""
