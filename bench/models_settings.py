"""bench/models.py's settings and the two models it measures (their Hugging Face configs).

    Settings          every knob of the bench, each with its unit
    FAMILIES          gpt2 | llama -> the config the bench writes as the model directory
    make_model_dir    that directory: config.json only (random init; no weights, no tokenizer:
                      the roles read the built-in corpus as bytes, ids < 256 of either vocabulary)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("gpt2", "llama")
REPORT = 8  # micro-batches per loss report of a pipeline trainer (node/roles/stats.py REPORT_EVERY)


@dataclass(frozen=True)
class Settings:
    models: str = "gpt2,llama"  # which of FAMILIES, in order
    stages: int = 4  # pipeline stages, the swarm's and torch.distributed.pipelining's
    stage_blocks: str = ""  # decoder layers per stage, e.g. 2,4,4,2 (default: spread evenly, as the coordinator does)
    device: str = "cpu"  # cpu; cuda is refused at start (the roles keep their models on the CPU)
    seq_len: int = 256  # tokens per sequence; the models' context (GPT-2's n_positions, Llama's max_position_embeddings)
    batch_size: int = 2  # sequences per inner step of a replica, and per micro-batch of a pipeline
    steps: int = 4  # optimizer steps each arm times, after its warm-up
    inner_steps: int = 2  # H: a replica's inner steps per outer step (steps must be a multiple)
    step_micro_batches: int = 4  # micro-batches per optimizer step of a pipeline
    stage_clip: str = "global"  # the pipeline's clipping: global (one norm over all stages) | stage (each its own)
    threads: int = 1  # torch threads of every process that trains
    join_timeout_s: float = 30.0  # how long a replicas' averaging round waits for late replicas
    joiner_replicas: int = 2  # replicas training before one more joins (each holds the whole model and its optimizers)
    daemon_window_s: float = 5.0  # how long the model-less daemon is sampled once it is up
    seed: int = 0
    tiny: bool = False  # tiny configs of both families (the smoke test), the same code paths
    timeout_s: float = 900.0  # longest an arm may take

    @property
    def families(self) -> list[str]:
        return [m for m in self.models.split(",") if m]

    @property
    def rounds(self) -> int:
        """Outer steps a replica runs: one to warm up, then those timed."""
        return 1 + self.steps // self.inner_steps

    @property
    def pipeline_micro_batches(self) -> int:
        """Micro-batches a pipeline arm runs: the first report's (warm-up), then those timed."""
        return REPORT + self.steps * self.step_micro_batches

    def problem(self) -> str | None:
        """What is wrong with these settings, in one line; None when they can run."""
        unknown = [m for m in self.families if m not in FAMILIES]
        if unknown or not self.families:
            return f"--models takes a comma-separated list of {', '.join(FAMILIES)}, got {self.models!r}"
        for name in ("stages", "seq_len", "batch_size", "steps", "inner_steps", "step_micro_batches", "threads", "joiner_replicas"):
            if getattr(self, name) < 1:
                return f"--{name.replace('_', '-')} must be at least 1"
        if self.steps % self.inner_steps:
            return "--steps must be a multiple of --inner-steps (a replica's outer steps are timed whole)"
        if REPORT % self.step_micro_batches or (self.steps * self.step_micro_batches) % REPORT:
            return f"--step-micro-batches must divide {REPORT}, and --steps x --step-micro-batches be a multiple of {REPORT} (a trainer reports every {REPORT} micro-batches)"
        if self.stage_clip not in ("global", "stage"):
            return "--stage-clip is global or stage"
        return None


def hf_config(family: str, s: Settings):
    """The transformers config of `family` at the bench's sequence length."""
    import transformers

    if family == "gpt2":
        if s.tiny:
            return transformers.GPT2Config(vocab_size=256, n_positions=s.seq_len, n_embd=32, n_layer=4, n_head=2, bos_token_id=None, eos_token_id=None)
        return transformers.GPT2Config(n_positions=s.seq_len)  # GPT-2 small: its defaults, the context set to seq_len
    if s.tiny:
        return transformers.LlamaConfig(hidden_size=32, num_hidden_layers=4, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                                        vocab_size=256, max_position_embeddings=s.seq_len, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)  # fmt: skip
    return transformers.LlamaConfig(hidden_size=768, num_hidden_layers=10, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=12,
                                    vocab_size=32000, max_position_embeddings=s.seq_len, tie_word_embeddings=True)  # fmt: skip


def make_model_dir(family: str, s: Settings, root: Path) -> Path:
    out = root / f"model-{family}"
    out.mkdir(parents=True)
    hf_config(family, s).save_pretrained(out)
    return out


def child_env(s: Settings) -> dict[str, str]:
    """Every process the bench starts: this checkout's code, one thread for OpenMP's own pools
    (torch's is set by --threads), gloo on loopback."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(s.threads), "MKL_NUM_THREADS": str(s.threads), "GLOO_SOCKET_IFNAME": "lo"}
