"""The models a swarm trains, how each is cut for the roles, and the data. No network code.

Files:
    gpt.py       the built-in GPT (presets tiny, small)
    moe.py       the built-in mixture-of-experts GPT (tiny-moe, small-moe): router, experts, combine
    stages.py    the GPT cut into pipeline stages (plan_stages, Stage): each holds only its blocks
    mixtral.py   a Hugging Face Mixtral cut for the experts role: per-expert shards of its fused
                 experts, the dense parts calling them with Mixtral's routing, the shards fused back
    hf.py        Hugging Face models: a local model directory checked (open_model_dir), which roles
                 train which model types (FAMILIES), CausalLM: a transformers model used like GPT
    hf_stages.py a Hugging Face GPT-2 or Llama-family model cut into stages by decoder layers (HFStage)
    tokens.py    tokenizers: bytes (the built-in models) or a model directory's tokenizer.json
    sources.py   where documents come from: text files, JSON lines, parquet, a saved `datasets` set
    adamw.py     the run's AdamW: torch's fused kernel without torch.optim's start-up cost
    data.py      the corpus (built-in: Python's stdlib sources; or --data) as token ids, shards, evaluation
    diloco.py    inner/outer optimizers, the state hash, a one-process DiLoCo simulation
    sim_allreduce.py  the averager's all-reduce (scatter, owner's mean, gather) as arithmetic, for it
    export.py    the GPT as a Hugging Face GPT-2 (weights, config, byte tokenizer), sampling, its loss
    stage_merge.py  a pipeline's stages (built-in or Hugging Face) put back together as one model's state
    export_experts.py  an experts run's shards and dense parts as one Hugging Face Mixtral
"""
