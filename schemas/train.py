"""Training stage: config and manifest."""

from __future__ import annotations

import importlib.util
from typing import Annotated, Literal

from pydantic import Field, model_validator

from tuneline.schemas.base import MAX_BATCH, ConfigPath, Seed, Strict
from tuneline.schemas.families import family_list
from tuneline.schemas.parallel import combination_problem

_FLOW = family_list(lambda f: f.prediction == "flow_matching")
_SINGLE = family_list(lambda f: f.single_file_export and f.released)

# Past these no machine holds the run: more processes than any node has cores, a rank wider than any layer.
MAX_PROCESSES = 1024
MAX_LORA_RANK = 8192
# Learning rates no run can want, per optimizer: each step moves a weight by about the learning rate (Lion by
# exactly that: its update is a sign), so above these training diverges at once.
MAX_LEARNING_RATE = {"adamw": 0.1, "adamw8bit": 0.1, "adamw_schedulefree": 0.1, "adafactor": 0.1, "lion": 0.03}


class EvalConfig(Strict):
    """Held-out evaluation: the same images, timesteps and noise every time, so curves compare across runs."""

    fraction: float | None = Field(
        0.1,
        gt=0,
        lt=1,
        description="share of the scanned images held out of "
        "training, chosen stably per image (a hash of its path); null with `path`",
    )
    path: Annotated[str | None, ConfigPath()] = Field(
        None,
        description="a separate folder of held-out images "
        "(scanned and cached with the dataset, never trained on); "
        "relative paths resolve against the workdir",
    )
    every_steps: int = Field(
        50, ge=1, description="steps between evaluations (shrinks to fit `steps`); the last step is always evaluated"
    )
    timesteps: list[int] = Field(
        [200, 500, 800],
        min_length=1,
        description="fixed timesteps in [0, 1000) each held out image is noised at (flow families: sigma = t / 1000)",
    )

    @model_validator(mode="before")
    @classmethod
    def _fraction_or_path(cls, data):
        if isinstance(data, dict) and data.get("path") is not None:
            if data.get("fraction") is not None:
                raise ValueError(
                    "train.eval.fraction and train.eval.path are exclusive: hold out a share of the "
                    "dataset, or a separate folder"
                )
            return {**data, "fraction": None}
        if isinstance(data, dict) and "fraction" in data and data["fraction"] is None:
            raise ValueError("train.eval needs fraction (a share of the dataset) or path (a folder)")
        return data

    @model_validator(mode="after")
    def _timesteps(self) -> EvalConfig:
        bad = [t for t in self.timesteps if not 0 <= t < 1000]
        if bad:
            raise ValueError(f"train.eval.timesteps {bad} must lie in [0, 1000)")
        return self


class TrainConfig(Strict):
    steps: int = Field(300, ge=1, description="optimizer steps for this run")
    batch_size: int = Field(8, ge=1, le=MAX_BATCH, description="samples per process per micro-batch")
    grad_accumulation: int = Field(
        1, ge=1, le=MAX_BATCH, description="micro-batches per optimizer step (each from one bucket)"
    )
    learning_rate: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after warmup: keep the rate, or decay it to 0 at the last step"
    )
    warmup_steps: int = Field(0, ge=0, description="linear warmup from 0 (shrinks to a quarter of `steps`)")
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the global gradient norm; null = no clipping")
    mode: Literal["full", "lora"] = "full"
    lora_rank: int = Field(8, ge=1, le=MAX_LORA_RANK, description="LoRA rank (at most the widest layer any family has)")
    lora_alpha: float | None = Field(None, gt=0, description="LoRA scale numerator; null = lora_rank (scale 1)")
    adapter: Literal["lora", "lokr", "loha", "dora"] = Field(
        "lora",
        description="train.mode lora: the adapter peft trains; lokr (Kronecker product, train.lokr_factor), "
        "loha (Hadamard product), dora (LoRA with weight decomposition). lokr/loha/dora files "
        "use the LyCORIS key layout ComfyUI, A1111 and Forge read",
    )
    lokr_factor: int = Field(
        -1,
        ge=-1,
        description="train.adapter lokr: split each dimension into factor x rest "
        "(kohya/LyCORIS `factor`); -1 = the most square split",
    )
    text_encoder_lora: bool = Field(
        False,
        description="train.mode lora, a CLIP-conditioned UNet family (another family is refused, the "
        "refusal names them): also train a LoRA on its CLIP text encoder(s) (q/k/v/out projections); "
        "captions and validation prompts are then encoded live with the trained encoders (the text cache "
        "is not read) and the files carry lora_te keys",
    )
    text_encoder_lr: float | None = Field(
        None, gt=0, description="train.text_encoder_lora: the text encoders' learning rate; null = learning_rate"
    )
    lora_format: Literal["diffusers", "kohya", "both"] = Field(
        "both",
        description="LoRA files written to final/: diffusers (pytorch_lora_weights.safetensors, for "
        "diffusers' load_lora_weights), kohya (lora_kohya.safetensors, for ComfyUI, A1111, "
        "Forge), or both",
    )
    export_single_file: bool = Field(
        False,
        description="full fine-tune: also write final/model.safetensors, the "
        "whole model as one file in the original (LDM) layout A1111/ComfyUI "
        f"checkpoint loaders read ({_SINGLE})",
    )
    metadata_captions: bool = Field(
        False,
        description="put the training captions' tag frequencies "
        "(ss_tag_frequency) into the LoRA files' metadata; off: no captions or "
        "dataset paths leave the run in a shared file",
    )
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto",
        description="autocast on CUDA (fp16 adds a gradient scaler); auto = bf16 where the GPU supports it, "
        "else fp16; CPU always trains in float32 (auto/no only)",
    )
    gradient_checkpointing: bool | Literal["offload"] = Field(
        False,
        description="recompute activations in backward to save memory; offload: also keep the activations "
        "saved for backward in CPU memory (same numbers as true, less GPU memory, slower)",
    )
    compile: bool = Field(
        False,
        description="torch.compile each of the denoiser's transformer blocks (and a UNet's resnet blocks) in place: "
        "the same weights and checkpoints, faster steps after a first slower one that compiles",
    )
    memory_check: Literal["refuse", "warn", "off"] = Field(
        "refuse",
        description="the memory plan before training on a GPU: refuse a run whose planned peak does not fit, "
        "warn and train anyway, or off (no plan; a stop then gets the least grace, 120 s)",
    )
    blocks_to_swap: int = Field(
        0,
        ge=0,
        description="keep this many of the denoiser's transformer blocks in pinned "
        "CPU memory and bring each to the device just before its forward and backward "
        "(same numbers, less GPU memory, slower); `tuneline plan` prints the largest value",
    )
    parallelism: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: every process holds the whole model; fsdp: sharded over the N processes (FSDP2), each "
        "holds 1/N of the weights, gradients and optimizer state (docs/scale-out-fsdp.md)",
    )
    fsdp_cpu_offload: bool = Field(
        False,
        description="train.parallelism fsdp: keep the sharded parameters, gradients and optimizer state in CPU "
        "memory and step there (FSDP's CPUOffloadPolicy); the least GPU memory, slower",
    )
    optimizer: Literal["adamw", "adamw8bit", "prodigy", "adafactor", "adamw_schedulefree", "lion"] = Field(
        "adamw",
        description="adamw: torch's AdamW; adamw8bit: torchao's AdamW with 8-bit state (a quarter of the "
        "memory); prodigy: Prodigy (prodigyopt), which estimates the step size itself "
        "(learning_rate 1.0); adafactor: transformers' Adafactor (factored second moments, "
        "least memory); adamw_schedulefree: schedule-free AdamW (schedulefree; no decay "
        "schedule, exports its averaged weights); lion: Lion (lion-pytorch; use a learning "
        "rate 3-10x below AdamW's). The third-party ones: pip install 'tuneline[optimizers]'",
    )
    optimizer_betas: list[float] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="the optimizer's "
        "(beta1, beta2); null = its own default (Lion (0.9, 0.99), the "
        "Adam kinds (0.9, 0.999)); unused by adafactor",
    )
    prodigy_d_coef: float = Field(
        1.0, gt=0, description="train.optimizer prodigy: multiplies its step-size estimate (below 1 for smaller steps)"
    )
    ema: bool = Field(False, description="keep an exponential moving average of the trained weights; final/ holds it")
    ema_decay: float = Field(0.999, gt=0, lt=1)
    loss_weighting: Literal["auto", "none", "min_snr"] = Field(
        "auto",
        description="min_snr: Min-SNR-gamma weights (epsilon/v families); auto = min_snr for epsilon/v "
        f"families, none for flow-matching ones ({_FLOW})",
    )
    min_snr_gamma: float = Field(5.0, gt=0)
    timestep_sampling: Literal["uniform", "logit_normal", "sigmoid", "mode"] = Field(
        "uniform",
        description=f"flow-matching families ({_FLOW}): how sigma is drawn; logit_normal "
        "(logit_mean, logit_std), sigmoid (sigmoid_scale), mode (mode_scale), or uniform",
    )
    logit_mean: float = Field(0.0, description="timestep_sampling logit_normal: mean of logit(sigma)")
    logit_std: float = Field(1.0, gt=0, description="timestep_sampling logit_normal: std of logit(sigma)")
    sigmoid_scale: float = Field(1.0, gt=0, description="timestep_sampling sigmoid: sigma = sigmoid(scale * N(0,1))")
    mode_scale: float = Field(
        1.29, ge=-1, le=1.5, description="timestep_sampling mode: SD3's mode sampling scale s (0 = uniform)"
    )
    timestep_shift: float | Literal["auto"] = Field(
        "auto",
        description="flow-matching families: shift sigma towards noise, s*sigma / (1 + (s-1)*sigma); auto = "
        "the model's scheduler config (SD3's fixed shift; Flux's shift from the image's token "
        "count); 1 = none",
    )
    noise_offset: float = Field(0.0, ge=0, description="add offset * N(0,1) per sample and channel to the noise")
    latent_sampling: Literal["sample", "mean"] = Field(
        "sample",
        description="sample: a fresh draw from each image's cached VAE distribution every step; mean: "
        "its mean (deterministic; for VAEs whose posterior noise would drown the image)",
    )
    flip: bool = Field(
        True, description="with a cache holding flipped variants (latents.flip), train on a random half of them"
    )
    seed: Seed = 0
    caption_dropout: float = Field(0.1, ge=0, lt=1, description="probability of training on the empty caption")
    checkpoint_every: int = Field(
        100,
        ge=1,
        description="steps between checkpoints (shrinks to fit `steps`); the last step is always checkpointed",
    )
    checkpoint_minutes: float | None = Field(
        None,
        gt=0,
        description="also checkpoint when this many minutes "
        "passed since the last checkpoint (null = by steps only); SIGTERM "
        "or a cancelled run always checkpoints before stopping",
    )
    keep_checkpoints: int = Field(2, ge=1, description="keep the last K checkpoints")
    resume: Annotated[str | None, ConfigPath(keywords=("auto", "latest"))] = Field(
        "auto",
        description="auto = continue this run's newest checkpoint if an interrupted "
        "attempt left one, else start from the base model; latest = the newest checkpoint "
        "of this run (an error if there is none); a path = that checkpoint directory; "
        "null = start from the base model",
    )
    init_from: Literal["base", "previous"] = Field(
        "base",
        description="base = start from the model's weights; "
        "previous = from the newest train version trained on other data "
        "(scheduled retraining continues the last model; full mode)",
    )
    validate_every: int = Field(
        0,
        ge=0,
        description="render the validation prompts every N steps during training "
        "(rank 0; shrinks to fit `steps`); 0 = off",
    )
    processes: int = Field(
        2, ge=1, le=MAX_PROCESSES, description="training processes per node (torchrun --nproc_per_node)"
    )
    threads_per_process: int = Field(1, ge=1, le=MAX_PROCESSES, description="OMP_NUM_THREADS for each training process")
    nodes: int = Field(1, ge=1, description="torchrun --nnodes; >1 needs rdzv_endpoint")
    node_rank: int = Field(0, ge=0)
    rdzv_endpoint: str = Field("", description="host:port of the c10d rendezvous for multi-node runs")
    rdzv_id: str = "tuneline"
    masked_loss: bool = Field(
        False,
        description="weight each latent position's loss by the image's mask "
        "(dataset.masks), cached at the latent grid by the latents stage",
    )
    eval: EvalConfig | None = Field(None, description="held-out eval loss at fixed timesteps and noise; null = off")

    @model_validator(mode="after")
    def _multi_node(self) -> TrainConfig:
        if self.nodes > 1 and not self.rdzv_endpoint:
            raise ValueError("train.nodes > 1 needs train.rdzv_endpoint (host:port reachable from every node)")
        if self.node_rank >= self.nodes:
            raise ValueError(f"train.node_rank {self.node_rank} must be < train.nodes {self.nodes}")
        if self.resume is not None and not self.resume.strip():
            raise ValueError("train.resume: use auto, latest, a checkpoint directory, or null")
        if self.timestep_shift != "auto" and self.timestep_shift <= 0:
            raise ValueError(f"train.timestep_shift must be auto or a number > 0, not {self.timestep_shift}")
        if self.export_single_file and self.mode != "full":
            raise ValueError(
                "train.export_single_file exports a full fine-tune's model; with train.mode lora the "
                "LoRA files are the export (train.lora_format): set train.export_single_file false"
            )
        if self.adapter != "lora" and self.mode != "lora":
            raise ValueError(
                f"train.adapter {self.adapter} trains on top of a frozen base: it needs train.mode lora "
                f"(train.mode is {self.mode}); set train.mode: lora or train.adapter: lora"
            )
        if self.lokr_factor != -1 and (self.adapter != "lokr" or self.lokr_factor in (0, 1)):
            raise ValueError(
                f"train.lokr_factor {self.lokr_factor}: it applies to train.adapter lokr (now "
                f"{self.adapter}) and is -1 or a factor >= 2"
            )
        if self.text_encoder_lora and (self.mode != "lora" or self.adapter != "lora"):
            raise ValueError(
                f"train.text_encoder_lora trains a plain LoRA beside the denoiser's: it needs train.mode lora "
                f"and train.adapter lora (now {self.mode}, {self.adapter}); set those or "
                f"train.text_encoder_lora false"
            )
        if self.text_encoder_lr is not None and not self.text_encoder_lora:
            raise ValueError(
                "train.text_encoder_lr applies to train.text_encoder_lora true; set it null or turn "
                "train.text_encoder_lora on"
            )
        if self.init_from == "previous" and self.mode == "lora":
            raise ValueError(
                "train.init_from previous continues a full fine-tune's pipeline folder; with "
                "train.mode lora use init_from base"
            )
        return self

    @model_validator(mode="after")
    def _optimizer_settings(self) -> TrainConfig:
        o = self.optimizer
        if self.optimizer_betas is not None:
            if o == "adafactor":
                raise ValueError(
                    "train.optimizer_betas: train.optimizer adafactor takes no betas; set train.optimizer_betas: null"
                )
            if not all(0 <= b < 1 for b in self.optimizer_betas):
                raise ValueError(f"train.optimizer_betas {list(self.optimizer_betas)} must each lie in [0, 1)")
        if o == "prodigy" and not 0.1 <= self.learning_rate <= 10:
            raise ValueError(
                f"train.learning_rate {self.learning_rate} with train.optimizer prodigy: Prodigy "
                f"estimates the step size and the learning rate multiplies it; set "
                f"train.learning_rate: 1.0 (train.prodigy_d_coef scales the estimate)"
            )
        top = MAX_LEARNING_RATE.get(o)  # prodigy: its own range, above
        for name, lr in (("learning_rate", self.learning_rate), ("text_encoder_lr", self.text_encoder_lr)):
            if top is not None and lr is not None and lr > top:
                raise ValueError(
                    f"train.{name} {lr} with train.optimizer {o}: above {top} every step moves each weight by "
                    f"about the learning rate and training diverges (typical: 1e-4 for LoRA, 1e-5 to 1e-6 for a "
                    f"full fine-tune); set train.{name} to at most {top}"
                )
        if o != "prodigy" and self.prodigy_d_coef != 1.0:
            raise ValueError(f"train.prodigy_d_coef applies to train.optimizer prodigy, not {o}; remove it")
        if o == "adamw_schedulefree" and self.lr_schedule != "constant":
            raise ValueError(
                f"train.lr_schedule {self.lr_schedule} with train.optimizer adamw_schedulefree: "
                f"schedule-free AdamW replaces the decay schedule; set train.lr_schedule: constant "
                f"(warmup_steps still applies)"
            )
        module = {"prodigy": "prodigyopt", "adamw_schedulefree": "schedulefree", "lion": "lion_pytorch"}.get(o)
        if module and importlib.util.find_spec(module) is None:
            raise ValueError(
                f"train.optimizer {o} needs the {module} package, which is not installed: "
                f"pip install 'tuneline[optimizers]'"
            )
        if o == "adamw_schedulefree" and self.ema:
            raise ValueError(
                "train.ema with train.optimizer adamw_schedulefree: schedule-free AdamW already "
                "exports the average of its iterates; set train.ema: false"
            )
        return self

    @model_validator(mode="after")
    def _swap_full_one_process(self) -> TrainConfig:
        # A swapped block's full-fine-tune weights live on the CPU between steps, which DDP's buckets cannot follow.
        if self.blocks_to_swap and self.mode == "full" and self.processes * self.nodes > 1:
            raise ValueError(
                f"train.blocks_to_swap {self.blocks_to_swap} with train.mode full trains in one process: "
                f"set train.processes: 1 (and train.nodes: 1), or train.mode: lora, or "
                f"train.blocks_to_swap: 0"
            )
        return self

    @model_validator(mode="after")
    def _combinations(self) -> TrainConfig:
        problem = combination_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    # Intervals shrink to fit a small `steps` (docs/design.md: derived values stay valid under edits).
    def effective_checkpoint_every(self) -> int:
        return min(self.checkpoint_every, self.steps)

    def effective_warmup(self) -> int:
        return min(self.warmup_steps, self.steps // 4)

    def effective_validate_every(self) -> int:
        return min(self.validate_every, self.steps)

    def effective_eval_every(self) -> int:
        return min(self.eval.every_steps, self.steps) if self.eval else 0

    def global_batch(self, world: int | None = None, *, per_step: bool = False) -> int:
        """The global batch, the one place it is computed (the scan's bucket plan, the trainer's result).

        By default the samples of one global micro-batch: every rank's batch_size, all from one bucket, so the
        number a bucket must hold to form a batch. `world` is the number of ranks, processes x nodes unless given
        (a running trainer passes its actual world size). `per_step`: times grad_accumulation, the samples one
        optimizer step takes (its micro-batches may come from different buckets)."""
        batch = self.batch_size * (self.processes * self.nodes if world is None else world)
        return batch * self.grad_accumulation if per_step else batch
