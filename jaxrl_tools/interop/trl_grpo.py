"""TRL's GRPO loss on an interchange batch: ``trl.GRPOTrainer._compute_loss``, run as TRL runs it.

Only the loss is TRL's: the advantages are the batch's estimator's (TRL computes its own while
generating, which needs its sampler), passed per token. verl's ``loss_agg_mode`` maps to TRL's
``loss_type``: ``seq-mean-token-mean`` = ``grpo``, ``token-mean`` = ``bnpo`` (one micro-batch),
``seq-mean-token-sum-norm`` = ``dr_grpo`` with ``max_completion_length`` = the response width.

Where TRL's defaults change the math, the verl setting is chosen and said here: TRL autocasts to
bfloat16 (``bf16=True``; off for a float32 policy) and multiplies its KL by the importance ratio
(``use_bias_correction_kl=True``; off, as verl). What TRL cannot be set to do is reported, not
hidden: its ``dr_grpo`` divides by #sequences x L_max where verl divides by L_max alone
(``VERL_OVER_TRL`` scales TRL's numbers back), it has no dual clip (verl's ``clip_ratio_c``),
and its k3 KL has no clamps. trl is imported only here (``pip install trl``); it is not a
dependency of the package.
"""

from __future__ import annotations

import tempfile
import warnings

import numpy as np

from jaxrl_tools.config import ConfigError
from jaxrl_tools.interop.batch import check_batch
from jaxrl_tools.interop.compare import FP32, Stage, Tolerances, grad_differences
from jaxrl_tools.interop.update import UpdateResult, UpdateSettings

LOSS_TYPES = {
    "seq-mean-token-mean": "grpo",
    "token-mean": "bnpo",
    "seq-mean-token-sum-norm": "dr_grpo",
}


def _imports():
    try:
        import datasets  # noqa: PLC0415  (optional: only this comparison needs them)
        import tokenizers  # noqa: PLC0415
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415
        import trl  # noqa: PLC0415
    except ImportError as e:
        raise ConfigError(f"repro --trl needs trl: pip install trl ({e})") from None
    return datasets, tokenizers, torch, transformers, trl


def check_settings(settings: UpdateSettings) -> str:
    """TRL's ``loss_type`` for these settings, or a ConfigError naming what TRL cannot express."""
    a = settings.algorithm
    if a.loss_agg_mode not in LOSS_TYPES:
        raise ConfigError(
            f"repro --trl: TRL has no loss_agg_mode={a.loss_agg_mode!r}; use one of "
            f"{sorted(LOSS_TYPES)}"
        )
    if a.kl_coef and a.kl_type not in ("low_var_kl", "k3"):
        raise ConfigError(f"repro --trl: TRL's KL is low_var_kl (k3), not kl_type={a.kl_type!r}")
    if a.entropy_coef:
        raise ConfigError("repro --trl: set entropy_coef=0 (TRL aggregates its bonus otherwise)")
    return LOSS_TYPES[a.loss_agg_mode]


def verl_over_trl(settings: UpdateSettings, num_sequences: int) -> float:
    """verl's loss / TRL's on the same batch: B for dr_grpo (see the module doc), else 1."""
    sum_norm = settings.algorithm.loss_agg_mode == "seq-mean-token-sum-norm"
    return float(num_sequences) if sum_norm else 1.0


def _tokenizer(tokenizers, transformers, vocab_size: int):
    # GRPOTrainer wants a processing class; the loss never tokenizes, so any vocabulary will do.
    words = tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(words), pad_token="t0", eos_token="t0"
    )


def trl_loss(
    model_dir: str,
    batch: dict[str, np.ndarray],
    settings: UpdateSettings,
    advantages: np.ndarray,
    dtype: str = "float32",
) -> tuple[float, dict[str, np.ndarray]]:
    """(loss, gradients by HF name) of TRL's GRPO loss on ``batch`` for the checkpoint, as TRL
    computes them (multiply by ``verl_over_trl`` to compare with verl's).

    Args:
      model_dir: the Hugging Face folder of the policy.
      batch: a verl-layout batch (``interop.batch``).
      settings: the update's settings (``check_settings`` says which TRL can run).
      advantages: [B, R] per-token advantages (``interop.advantages_by_uid``).
    """
    datasets, tokenizers, torch, transformers, trl = _imports()
    loss_type = check_settings(settings)
    B, P, R = check_batch(batch)
    attention = torch.tensor(batch["attention_mask"], dtype=torch.long)
    inputs = {
        "prompt_ids": torch.tensor(batch["prompts"], dtype=torch.long),
        "prompt_mask": attention[:, :P],
        "completion_ids": torch.tensor(batch["responses"], dtype=torch.long),
        # TRL attends over completion_mask and scores completion_mask * tool_mask.
        "completion_mask": attention[:, P:],
        "tool_mask": torch.tensor(batch["response_mask"], dtype=torch.long),
        "advantages": torch.tensor(np.asarray(advantages, np.float32)),
    }
    if "old_log_probs" in batch:
        inputs["old_per_token_logps"] = torch.tensor(np.asarray(batch["old_log_probs"], np.float32))
    a = settings.algorithm
    if a.kl_coef:
        inputs["ref_per_token_logps"] = torch.tensor(np.asarray(batch["ref_log_prob"], np.float32))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager"
    )
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        # TRL's config still sets transformers' deprecated gradient_checkpointing argument.
        warnings.simplefilter("ignore", FutureWarning)
        args = trl.GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=B,
            num_generations=B,  # only divides the batch; groups are in the advantages
            max_completion_length=R,
            loss_type=loss_type,
            beta=a.kl_coef,
            epsilon=a.clip_eps_low,
            epsilon_high=a.clip_eps_high,
            temperature=settings.temperature,
            bf16=dtype == "bfloat16",  # TRL's default autocasts to bfloat16
            use_bias_correction_kl=False,  # verl's k3 is not multiplied by the ratio
            report_to=[],
            use_cpu=True,
            save_strategy="no",
        )
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=datasets.Dataset.from_dict({"prompt": ["t1"] * B}),
            processing_class=_tokenizer(tokenizers, transformers, model.config.vocab_size),
        )
        # The reference log-probs come from the batch: drop TRL's copy of the model.
        trainer.ref_model = None
        model = trainer.model.eval()  # eval: no dropout, and no gradient-accumulation divisor
        model.zero_grad()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
    grads = {n: p.grad.detach().float().numpy().copy() for n, p in model.named_parameters()}
    return loss.item(), grads


def compare_with_trl(
    ours: UpdateResult,
    model_dir: str,
    batch: dict[str, np.ndarray],
    settings: UpdateSettings,
    tol: Tolerances = FP32,
    dtype: str = "float32",
) -> list[Stage]:
    """Our loss and gradients against TRL's GRPO loss on the same batch and advantages."""
    loss, grads = trl_loss(model_dir, batch, settings, ours.advantages, dtype)
    scale = verl_over_trl(settings, len(batch["responses"]))
    grads = {n: g * scale for n, g in grads.items()}
    diffs = grad_differences(ours.grads, grads)
    worst = max(diffs, key=lambda n: diffs[n][2])
    scaled = f" (x{scale:g}: TRL's dr_grpo divisor)" if scale != 1 else ""
    return [
        Stage(
            "TRL loss (|Δ| / max(|loss|, 1))",
            abs(ours.loss - loss * scale) / max(abs(loss * scale), 1.0),
            tol.loss,
            f"ours {ours.loss:.6g}, TRL {loss:.6g}{scaled}",
        ),
        Stage("TRL gradients (max rel. ||Δ||)", diffs[worst][2], tol.grad, f"at {worst}"),
    ]
